"""Issue 48: hostile input. Every case gives its 4xx with ``param`` or its one ``error:`` line and a
non-zero exit, never a traceback."""

from __future__ import annotations

import copy
import shlex

import jax
import pytest

from hypertron.launch import k8s, local, machines, recipes, slurm, validate
from hypertron.errors import UserError
from hypertron.train import checks
from support import processes  # tests/support
from support.cli import one_error_line, run_cli

# --- launch safety (points 5 and 6: launch scripts, Kubernetes names and counts, plan = train) ---

NASTY = "/shared/my runs/it's #1 \"q\" 50%"


def _sbatch_argument(line: str) -> str:
    """One ``#SBATCH`` value as sbatch reads it: Slurm's ``_get_argument`` (src/sbatch/opt.c),
    transcribed: white space outside quotes ends it, ' or " open and close a quote, a backslash
    takes the next character as it is, and an unescaped # outside quotes ends the line."""
    out, quote, escape = [], "", False
    for c in line:
        if escape:
            escape = False
        elif c == "\\":
            escape = True
            continue
        elif quote:
            if c == quote:
                quote = ""
                continue
        elif c in "\"'":
            quote = c
            continue
        elif c == "#" or c.isspace():
            break
        out.append(c)
    assert not quote, f"unmatched quote in {line!r}"
    return "".join(out)


def test_sbatch_values_are_quoted_for_what_reads_them_and_a_newline_is_refused(tmp_path):
    storage = tmp_path / "a b"
    r = run_cli(["workload", "create", "w", "--scheduler", "slurm", "--recipe", "cpu/tiny", "--storage", storage,
                 "--dry-run"])
    assert r.rc == 0, r.describe()
    text = r.stdout
    assert f'#SBATCH --chdir="{storage}/w"' in text
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert shlex.split(srun)[-1] == f"{storage}/w/recipe.yaml"
    # Quotes, '#' and '%' read back as themselves, on the directive lines and in the commands.
    job = slurm.Job("w", recipes.load("cpu/tiny"), storage=NASTY)
    lines = slurm.script(job).splitlines()
    directives = {_sbatch_argument(line.removeprefix("#SBATCH ")).split("=")[0]:
                  _sbatch_argument(line.removeprefix("#SBATCH ")) for line in lines if line.startswith("#SBATCH ")}
    assert directives["--chdir"] == f"--chdir={NASTY}/w"
    assert directives["--output"] == f"--output={NASTY.replace('%', '%%')}/w/slurm-%j.out"
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert shlex.split(srun)[-1] == f"{NASTY}/w/recipe.yaml"
    for value in ("/a\nscancel --user=$USER", "/a\rb", "/a\x00b"):
        one_error_line(run_cli(["workload", "create", "w", "--scheduler", "slurm", "--recipe", "cpu/tiny",
                                "--storage", value, "--dry-run"]), "--storage", "control character")
    one_error_line(run_cli(["workload", "create", "w", "--scheduler", "slurm", "--recipe", "cpu/tiny",
                            "--storage", "/a\\b", "--dry-run"]), "--storage", "backslash")


def test_the_sbatch_script_of_every_recipe_is_valid_shell():
    scripts = [slurm.script(slurm.Job("w", recipes.load(name), storage=NASTY)) for name in recipes.names()]
    bash = processes.run(["bash", "-n"], input="\n".join(scripts), capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr


@pytest.mark.parametrize("flags,needles", [
    (["--namespace", "Bad_NS"], ["--namespace='Bad_NS'", "DNS label"]),
    (["--namespace", "n" * 64], ["--namespace=", "at most 63"]),
    (["--max-restarts", "1e20"], ["--max-restarts"]),
    (["--max-restarts", "3000000000"], ["--max-restarts=3000000000", "2147483647"]),
    (["--queue", "Q"], ["--queue='Q'"]),
])
def test_kubernetes_names_and_counts_are_one_line(flags, needles):
    one_error_line(run_cli(["workload", "create", "w", "--recipe", "cpu/tiny", "--storage", "pvc:runs", "--image",
                            "img", *flags, "--dry-run"]), *needles)


def test_other_commands_check_the_namespace_and_the_quota_too():
    one_error_line(run_cli(["workload", "list", "--namespace", "Bad_NS"]), "--namespace='Bad_NS'")
    one_error_line(run_cli(["cluster", "setup", "--nodes", "4", "--namespace", "Bad_NS", "--dry-run"]),
                   "--namespace='Bad_NS'")
    one_error_line(run_cli(["cluster", "setup", "--nodes", str(2**31), "--dry-run"]), "--nodes=2147483648")


def test_strict_validation_checks_names_labels_and_integer_ranges_of_rendered_objects():
    _, jobset = k8s.workload_objects(k8s.Workload("w", recipes.load("cpu/tiny"), image="img", storage="pvc:runs"))
    for path, value, needle in (
            (("metadata", "namespace"), "Bad_NS", "metadata.namespace='Bad_NS'"),
            (("metadata", "name"), "x" * 254, "metadata.name="),
            (("metadata", "labels", "bad key!"), "v", "'bad key!': not a label key"),
            (("metadata", "labels", "app"), "-v", "metadata.labels.app='-v'"),
            (("spec", "failurePolicy", "maxRestarts"), 2**31, "maxRestarts=2147483648")):
        bad = copy.deepcopy(jobset)
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(UserError, match=needle.replace("(", r"\(").replace("[", r"\[")):
            validate.check([bad])
    # kubernetes-validate leaves formats unchecked: an int32 of the schema past its range is caught.
    (priority, *_) = [o for o in k8s.cluster_objects(machines.machine("cpu"), 1) if o["kind"] == "PriorityClass"]
    with pytest.raises(UserError, match=r"value=2147483648: out of the range of its schema's int32"):
        validate.check([{**priority, "value": 2**31}])


def test_launch_local_caps_its_processes():
    one_error_line(run_cli(["launch", "local", "--processes", str(local.MAX_PROCESSES + 1), "--", "train"]),
                   f"--processes={local.MAX_PROCESSES + 1}", f"from 1 to {local.MAX_PROCESSES}")
    one_error_line(run_cli(["launch", "local", "--processes", "2", "--gpus", "100000000000", "--", "train"]),
                   "--gpus=100000000000")
    one_error_line(run_cli(["launch", "local", "--recipe", "cpu/tiny", "launch.nodes=300", "train.global_batch=1200"]),
                   "recipe cpu/tiny: 300 processes", f"the {local.MAX_PROCESSES} launch local runs")


class _TwoProcesses:
    """What ``jax`` tells each process of a job of 2 processes x 4 devices (train's checks ask it)."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def process_count() -> int:
        return 2

    @staticmethod
    def local_device_count() -> int:
        return 4


# train's refusals: (overrides, plan's --hardware and --devices for the same devices in processes,
# whether train runs them as 2 processes x 4 devices rather than one of 8)
TRAIN_REFUSES = {
    "batch over data shards": (["model=tiny", "train.global_batch=3"], ["--hardware", "h100", "--devices", "8"], False),
    "experts over the expert axis": (["model=tiny-moe", "mesh.expert=8", "mesh.fsdp=1"],
                                     ["--hardware", "h100", "--devices", "8"], False),
    "mesh vs devices": (["model=tiny", "mesh.tensor=3"], ["--hardware", "h100", "--devices", "8"], False),
    "dcn over one process": (["model=tiny", "mesh.dcn.tensor=2"], ["--hardware", "h100", "--devices", "8"], False),
    "cudnn off a GPU": (["model=tiny", "model.attention=cudnn"], ["--hardware", "cpu", "--devices", "8"], False),
    "tensor across nodes": (["model=tiny", "mesh.dcn.tensor=2", "mesh.tensor=1"],
                            ["--hardware", "tpu-v5p", "--devices", "8"], True),
    "rows not one block": (["model=tiny", "mesh.data=2", "mesh.fsdp=2", "mesh.dcn.fsdp=-1"],
                           ["--hardware", "tpu-v5p", "--devices", "8"], True),
    "dlrm batch over devices": (["task=dlrm", "dlrm=dlrm-v2-tiny", "train.global_batch=100"],
                                ["--hardware", "h100", "--devices", "8"], False),
    "batch over processes": (["model=tiny", "mesh.fsdp=1", "mesh.tensor=8"], ["--hardware", "tpu-v5p", "--devices", "8"],
                             True),
}


@pytest.mark.parametrize("case", sorted(TRAIN_REFUSES))
def test_plan_refuses_what_train_refuses_in_the_same_words(case, tmp_path, monkeypatch):
    overrides, where, two_processes = TRAIN_REFUSES[case]
    if two_processes:
        monkeypatch.setattr(checks, "jax", _TwoProcesses())
    trained = one_error_line(run_cli(["train", *overrides, f"run_dir={tmp_path / 'run'}"], cwd=tmp_path))
    monkeypatch.undo()
    assert not (tmp_path / "run").exists()
    assert one_error_line(run_cli(["plan", *overrides, *where])) == trained


def test_plan_takes_no_device_count_of_zero_and_no_dlrm_over_nodes():
    one_error_line(run_cli(["plan", "model=tiny", "--devices", "0"]), "--devices=0", "at least 1")
    one_error_line(run_cli(["plan", "task=dlrm", "dlrm=dlrm-v2-tiny", "--devices", "16"]),
                   "task=dlrm runs in one process", "this job has 2")
