"""``hypertron cluster create | delete | list`` against XPK 1.16.0: for the same arguments, the
``clusters create``, ``node-pools create``, ``clusters delete`` and ``clusters list`` commands equal
those of XPK's ``--dry-run`` (recorded in ``tests/golden/launch/xpk/``, each file's first line the
command that made it), flag by flag after ``shlex.split``, their order aside and the GKE versions
aside (XPK asks the server for them; a dry run prints 0). With fake ``gcloud`` and ``kubectl`` on
PATH, ``cluster create`` runs exactly the commands it prints, in order, and stops at the first that
fails; bad input is one line.
"""

from __future__ import annotations

import collections
import os
import shlex
import stat
from pathlib import Path

import pytest
import yaml

from support.cli import one_error_line, run_cli  # tests/support

GOLDEN = Path(__file__).parent / "golden" / "launch" / "xpk"
WHERE = ["--project", "my-proj"]
CASES = {  # golden file: hypertron's arguments for XPK's
    "v5p-16-x2-spot": ["create", "demo", "--tpu-type=v5p-16", "--num-slices=2", "--spot", "--zone", "us-east5-a"],
    "v5litepod-16-x2-reservation": ["create", "demo", "--tpu-type=v5litepod-16", "--num-slices=2", "--reservation",
                                    "my-res", "--zone", "us-west4-a"],
    "v6e-8-x1-on-demand": ["create", "demo", "--tpu-type=v6e-8", "--num-slices=1", "--on-demand", "--zone",
                           "us-east1-d"],
    "delete": ["delete", "demo", "--zone", "us-east5-a"],
    "list": ["list", "--zone", "us-east5-a"],
}
# The commands compared, by their first words after ``gcloud``, for each kind of case.
KINDS = {"create": [("beta", "container", "clusters", "create"), ("beta", "container", "node-pools", "create")],
         "delete": [("beta", "container", "clusters", "delete")],
         "list": [("container", "clusters", "list")]}
VERSIONS = ("--cluster-version=", "--node-version=")


def _compared(lines, kinds) -> dict[tuple, list[collections.Counter]]:
    """The ``gcloud`` commands of ``lines`` of ``kinds``: each a multiset of its words (the GKE
    version flags left out), in the order they came. XPK prints some as they are, others inside a
    sentence ("... we are executing gcloud ...")."""
    out = collections.defaultdict(list)
    for line in lines:
        at = line.find("gcloud ")
        if at < 0 or line.startswith("#") or (at > 0 and "executing gcloud" not in line):
            continue
        words = [w for w in shlex.split(line[at:]) if not w.startswith(VERSIONS)]
        kind = next((k for k in kinds if tuple(words[1:1 + len(k)]) == k), None)
        if kind is not None:
            out[kind].append(collections.Counter(words))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_gcloud_commands_are_xpks(case):
    xpk = (GOLDEN / f"{case}.txt").read_text().splitlines()
    assert xpk[0].startswith("# xpk 1.16.0: xpk cluster ")
    r = run_cli(["cluster", *CASES[case], *WHERE, "--dry-run"])
    assert r.rc == 0, r.describe()
    kinds = KINDS[CASES[case][0]]
    want, got = _compared(xpk[1:], kinds), _compared(r.stdout.splitlines(), kinds)
    assert sorted(want) == sorted(got) == sorted(kinds), (sorted(got), sorted(want))
    for kind in kinds:
        assert got[kind] == want[kind], kind
    if case.startswith("v5litepod"):  # each slice's pool takes the reservation
        assert all(c["--reservation=my-res"] == 1 for c in got[kinds[1]])


def _fake_tools(tmp_path: Path, fail_on: str = "", existing: str = "") -> Path:
    """``gcloud`` and ``kubectl`` scripts that log their arguments (and how many bytes they read on
    stdin) to ``calls.log``, listings apart in ``lists.log``; a listing prints ``existing``; a call
    containing ``fail_on`` exits 3 with an error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("gcloud", "kubectl"):
        script = bin_dir / tool
        script.write_text(f"""#!/bin/sh
args="{tool} $*"
case "$args" in *" list "*"--format=value(name)"*) echo "$args" >> "{tmp_path}/lists.log"; echo "{existing}"; exit 0;; esac
if [ "$4" = "-" ] || [ "$5" = "-" ]; then args="$args [stdin $(wc -c | tr -d ' ')]"; fi
echo "$args" >> "{tmp_path}/calls.log"
case "$args" in *"{fail_on or '@@never@@'}"*) echo "ERROR: (gcloud) quota exceeded for TPUS" >&2; exit 3;; esac
""")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_create_runs_the_printed_commands_in_order_and_stops_at_the_first_failure(tmp_path, monkeypatch):
    args = ["cluster", *CASES["v5p-16-x2-spot"], *WHERE]
    printed = run_cli([*args, "--dry-run"]).stdout.splitlines()
    monkeypatch.setenv("PATH", f"{_fake_tools(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    r = run_cli(args)
    assert r.rc == 0, r.describe()
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == len(printed) == 8  # the cluster, 2 pools, credentials, JobSet, Kueue, its wait, setup
    for call, line in zip(calls, printed):
        command = line.split("  # stdin:")[0]
        assert call.split(" [stdin ")[0] == " ".join(shlex.split(command)), (call, line)
    # The last reads cluster setup's objects: a queue of the 2 slices' 4 VMs' 16 chips.
    setup = run_cli(["cluster", "setup", "--machine", "tpu-v5p", "--nodes", "4", "--dry-run"])
    assert calls[-1].endswith(f"[stdin {len(setup.stdout.encode())}]")
    queue = next(o for o in yaml.safe_load_all(setup.stdout) if o["kind"] == "ClusterQueue")
    assert queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"] == [
        {"name": "google.com/tpu", "nominalQuota": 16}]

    (tmp_path / "calls.log").unlink()
    (tmp_path / "bin").rename(tmp_path / "ok-bin")
    monkeypatch.setenv("PATH", f"{_fake_tools(tmp_path, fail_on='node-pools create demo-np-0')}{os.pathsep}"
                               f"{os.environ['PATH']}")
    failed = run_cli(args)
    assert failed.rc == 2 and "Traceback" not in failed.stderr, failed.describe()
    shown, line = failed.stderr.splitlines()  # the tool's own stderr passed through, then one line
    assert shown == "ERROR: (gcloud) quota exceeded for TPUS"
    assert line.startswith("error: cluster create: `gcloud beta container node-pools create demo-np-0")
    assert line.endswith("failed (exit 3): ERROR: (gcloud) quota exceeded for TPUS")
    assert len((tmp_path / "calls.log").read_text().splitlines()) == 2  # the cluster, then the failed pool

    # Run again once the quota is there: the cluster and pool 0 exist now, and are not made again.
    (tmp_path / "calls.log").unlink()
    (tmp_path / "bin").rename(tmp_path / "failed-bin")
    monkeypatch.setenv("PATH", f"{_fake_tools(tmp_path, existing='demo demo-np-0')}{os.pathsep}{os.environ['PATH']}")
    again = run_cli(args)
    assert again.rc == 0, again.describe()
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0].startswith("gcloud beta container node-pools create demo-np-1") and len(calls) == 6
    assert "demo exists already; not made again" in again.stderr and "demo-np-0 exists already" in again.stderr


def test_without_gcloud_on_path_it_is_one_line(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    one_error_line(run_cli(["cluster", *CASES["delete"], *WHERE]), "gcloud is not on PATH", "--dry-run")


@pytest.mark.parametrize("argv, needles", [
    (["--tpu-type=v9-8"], ["--tpu-type=v9-8: not a TPU type", "v5p-16", "v6e-256"]),
    (["--tpu-type=v5p-16", "--num-slices", "0"], ["--num-slices=0: must be at least 1"]),
    (["--tpu-type=v5p-16", "--spot", "--reservation", "r"], ["--reservation", "not allowed with", "--spot"]),
    (["--tpu-type=h100-mega-80gb-8"], ["is a GPU", "Cluster Toolkit"]),
    (["--tpu-type=v5p-16", "--zone="], ["--zone is required"]),
    (["--tpu-type=v5p-16", "--zone=us-east5"], ["--zone=us-east5: a zone (us-east5-a), not a region"]),
    (["--tpu-type=v5p-16", "--reservation="], ["--reservation: name the reservation"]),
])
def test_bad_arguments_are_one_line(argv, needles):
    one_error_line(run_cli(["cluster", "create", "demo", "--zone", "us-east5-a", *WHERE, *argv, "--dry-run"]),
                   *needles)
