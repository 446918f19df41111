"""Hostile input to the CLI (issue 48, points 4-6): every flag, config field, run file, YAML file and
launch script refuses what it cannot hold in one ``error:`` line and a non-zero exit (or, in a run
file, a counted skip), never a traceback; ``plan`` refuses what ``train`` refuses. The server's
half: ``test_hostile_inputs.py``."""

from __future__ import annotations

import copy
import json
import shlex

import jax
import pytest
from support import processes  # tests/support
from support.cli import one_error_line, run_cli

from hypertron.errors import UserError
from hypertron.launch import k8s, local, machines, recipes, slurm, validate
from hypertron.train import checks

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


# train's refusals: (overrides, plan's --hardware and --devices for the same devices in processes (8
# v5p chips are 2 VMs of 4; launch.slices=2 makes each its own slice, what the dcn axes span, as
# train's granule is each of its 2 processes),
# whether train runs them as 2 processes x 4 devices rather than one of 8)
TRAIN_REFUSES = {
    "batch over data shards": (["model=tiny", "train.global_batch=3"], ["--hardware", "h100", "--devices", "8"], False),
    "experts over the expert axis": (["model=tiny-moe", "mesh.expert=8", "mesh.fsdp=1"],
                                     ["--hardware", "h100", "--devices", "8"], False),
    "mesh vs devices": (["model=tiny", "mesh.tensor=3"], ["--hardware", "h100", "--devices", "8"], False),
    "dcn over one process": (["model=tiny", "mesh.dcn.tensor=2"], ["--hardware", "h100", "--devices", "8"], False),
    "cudnn off a GPU": (["model=tiny", "model.attention=cudnn"], ["--hardware", "cpu", "--devices", "8"], False),
    "tensor across nodes": (["model=tiny", "mesh.dcn.tensor=2", "mesh.tensor=1"],
                            ["--hardware", "tpu-v5p", "--devices", "8", "launch.slices=2"], True),
    "rows not one block": (["model=tiny", "mesh.data=2", "mesh.fsdp=2", "mesh.dcn.fsdp=-1"],
                           ["--hardware", "tpu-v5p", "--devices", "8", "launch.slices=2"], True),
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


def test_plan_takes_no_device_count_of_zero_and_no_dlrm_placements_but_one_per_table():
    one_error_line(run_cli(["plan", "model=tiny", "--devices", "0"]), "--devices=0", "at least 1")
    one_error_line(run_cli(["plan", "task=dlrm", "dlrm=dlrm-v2-tiny", "dlrm.placements=[row,table]", "--devices", "16"]),
                   "dlrm.placements has 2 entries and dlrm.table_rows 8", "one per table")


# --- readers and flags ---

_JOB = {"time": 1.7e9, "event": "job_start", "pid": 1, "host": "elsewhere", "process_count": 1}
_STEP = {"time": 1.7e9 + 1, "event": "step", "step": 1, "step_time": 1.0, "data_wait": 0.0}
_HUGE = 99999999999999999999999  # past int64


def _run_dir(tmp_path, **files: str):
    """A run directory of one short job, ``files`` (name: text) written over it."""
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (_JOB, _STEP)))
    for name, text in files.items():
        (tmp_path / name.replace("_0", ".0")).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, name", [
    ({"events.jsonl": json.dumps(_JOB) + "\n" + json.dumps({**_STEP, "step": _HUGE}) + "\n"}, "events.jsonl"),
    ({"metrics.jsonl": '{"step": 1, "loss": 2.0}\n' + json.dumps({"step": _HUGE, "loss": 1.0}) + "\n"},
     "metrics.jsonl"),
    ({"host_metrics_0.jsonl": '{"time": 1700000001.0, "step": 1}\n' + json.dumps({"time": 1.7e9, "step": _HUGE})
      + "\n"}, "host_metrics.0.jsonl"),
    ({"events.jsonl": json.dumps(_JOB) + "\n" + json.dumps({**_STEP, "time": 1e308}) + "\n"}, "events.jsonl"),
    ({"events.jsonl": json.dumps(_JOB) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"}, "events.jsonl"),
])
def test_a_run_file_line_it_cannot_hold_is_skipped_and_counted_in_text_and_json(tmp_path, files, name):
    run = _run_dir(tmp_path, **files)
    text, as_json = run_cli(["monitor", str(run)]), run_cli(["monitor", "--json", str(run)])
    for r in (text, as_json):
        assert r.rc in (0, 1) and "Traceback" not in r.stderr and r.stderr == "", r.describe()
    assert json.loads(as_json.stdout)["bad_lines"] == {name: 1}
    assert f"{name}: 1 unreadable line skipped" in text.stdout, text.describe()


@pytest.mark.parametrize("name, text", [
    *((name, "\x00\x01\xff garbage\n" + json.dumps({"time": _HUGE}) + "\n")
      for name in ("events.jsonl", "metrics.jsonl", "host_metrics_0.jsonl")),
    ("events.jsonl", "null\nnull"),  # pyarrow's JSON reader crashed the process on a line `null`
])
def test_a_run_file_with_no_readable_line_is_one_line_and_exit_1(tmp_path, name, text):
    run = _run_dir(tmp_path, **{name: text})
    for argv in (["monitor", str(run)], ["monitor", "--json", str(run)]):
        r = run_cli(argv)
        assert r.rc == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.describe()
        assert r.stderr.splitlines() == [
            f"error: {run / name.replace('_0', '.0')}: no line could be read (2 lines skipped: not JSON objects "
            "holding a run's fields)"], r.describe()


def test_a_torn_first_line_is_counted_but_not_unreadable(tmp_path):
    """A file whose writer is mid-way through its first line is a run starting, not a broken file."""
    run = _run_dir(tmp_path, **{"metrics.jsonl": '{"step": 1, "lo'})
    r = run_cli(["monitor", "--json", str(run)])
    assert r.rc == 0 and json.loads(r.stdout)["bad_lines"] == {"metrics.jsonl": 1}, r.describe()


@pytest.mark.parametrize("argv, needles", [
    (["--follow", "-1"], ["--follow", "-1 must be above 0"]),
    (["--follow", "nan"], ["--follow", "nan is not a finite number"]),
    (["--since", "nan"], ["--since='nan'", "not a finite number"]),
    (["--since", "1e308"], ["--since='1e308'", "above"]),
    (["--window", "1e300d"], ["--window='1e300d'", "at most"]),
    (["--hang-factor", "nan"], ["--hang-factor", "nan is not a finite number"]),
    (["--hang-min", "inf"], ["--hang-min", "inf is not a finite number"]),
    (["--top", str(_HUGE)], ["--top", "is above 9223372036854775807"]),
])
def test_monitor_refuses_numbers_it_cannot_hold(tmp_path, argv, needles):
    one_error_line(run_cli(["monitor", str(_run_dir(tmp_path)), *argv]), *needles)


_SPEC = "batch: 4\ntables: [{name: t, rows: 100, dim: 8}]\nfeatures: [{name: f, table: t, ids_per_sample: %s}]\n"


@pytest.mark.parametrize("text, needles", [
    (_SPEC % "abc", ["feature 'f': ids_per_sample='abc'"]),
    (_SPEC % ".nan", ["feature 'f': ids_per_sample=nan"]),
    (_SPEC % "[1, 2]", ["feature 'f': ids_per_sample=[1, 2]"]),
    (_SPEC % "1.0e+300", ["feature 'f': ids_per_sample=1e+300"]),
    ("tables: [{name: [1, 2], rows: 100, dim: 8}]", ["table [1, 2]: name must be a string"]),
    ("tables: [{name: t, rows: 100, dim: 8, init_scale: .inf}]", ["table 't': init_scale=inf"]),
    ("tables: [{name: t, rows: 100, dim: 8, optimizer: [sgd]}]", ["table 't': optimizer must be a string"]),
    ("tables: [{name: t, rows: 1e999, dim: 8}]", ["table 't': rows and dim must be whole numbers"]),
    ("tables: [{name: t, rows: 100, dim: 8}]\nfeatures: 3", ["needs a mapping with a list of tables"]),
    ("batch: .inf\ntables: [{name: t, rows: 100, dim: 8}]", ["batch=inf: must be a positive whole number"]),
])
def test_embed_plan_checks_each_field_s_type(tmp_path, text, needles):
    (tmp_path / "spec.yaml").write_text(text)
    one_error_line(run_cli(["embed", "plan", str(tmp_path / "spec.yaml")]), *needles)


@pytest.mark.parametrize("argv, needles", [
    (["embed", "plan", "SPEC", "--device-memory", "inf"], ["--device-memory", "inf is not a finite number"]),
    (["embed", "plan", "SPEC", "--device-memory", "1e300TB"], ["--device-memory", "is above"]),
    (["embed", "plan", "SPEC", "--batch", "0"], ["--batch", "0 is below 1"]),
    (["bench", "serve", "--base-url", "http://127.0.0.1:99999"], ["--base-url=http://127.0.0.1:99999",
                                                                  "Port out of range"]),
    (["bench", "serve", "--base-url", "http://[::1"], ["--base-url=http://[::1", "not a URL"]),
    (["bench", "serve", "--base-url", "http://:8000"], ["names no host"]),
    (["generate", "--checkpoint", "x", "--prompt", "a", "--top-k", str(_HUGE)], ["--top-k", "is above"]),
    (["generate", "--checkpoint", "x", "--prompt", "a", "--temperature", "nan"], ["--temperature", "not a finite"]),
    (["plan", "train.steps=.nan"], ["train.steps: nan is not a finite number"]),
    (["plan", f"train.steps={_HUGE}"], ["train.steps", "is above 9223372036854775807"]),
    (["plan", "train.lr=inf"], ["train.lr: inf is not a finite number"]),
    (["plan", "train.lr=[1, 2]"], ["train.lr: expected a number, got [1, 2]"]),
    (["plan", "task=dlrm", "dlrm.ids_per_sample=abc"], ["dlrm.ids_per_sample: expected an integer, got 'abc'"]),
])
def test_flags_and_config_fields_refuse_what_they_cannot_hold(tmp_path, argv, needles):
    (tmp_path / "spec.yaml").write_text("tables: [{name: t, rows: 100, dim: 8}]")
    one_error_line(run_cli([str(tmp_path / "spec.yaml") if a == "SPEC" else a for a in argv]), *needles)


def test_a_recipe_s_wrong_types_are_one_line(tmp_path):
    (tmp_path / "r.yaml").write_text("train: {steps: .nan}\n")
    one_error_line(run_cli(["plan", str(tmp_path / "r.yaml")]), "train.steps: nan is not a finite number")
    (tmp_path / "r.yaml").write_text("model: {num_layers: [1, 2]}\n")
    one_error_line(run_cli(["plan", str(tmp_path / "r.yaml")]), "model.num_layers: expected an integer, got [1, 2]")
    (tmp_path / "r.yaml").write_text("launch: {nodes: abc}\n")
    one_error_line(run_cli(["recipes", str(tmp_path / "r.yaml")]), "launch.nodes: expected an integer, got 'abc'")
    (tmp_path / "r.yaml").write_text("launch: {xla_flags: [{}]}\n")  # a TypeError before (bench/fuzz.py)
    one_error_line(run_cli(["recipes", str(tmp_path / "r.yaml")]), "launch.xla_flags.value: required")


@pytest.mark.parametrize("where", ["file", "file/run"])
def test_a_run_dir_that_is_or_is_under_a_file_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("x")
    one_error_line(run_cli(["train", f"run_dir={tmp_path / where}", "train.steps=1"]),
                   f"{tmp_path / 'file'} is a file, not a directory")
