"""User mistakes through the real ``hypertron`` command: one line, exit 2, nothing written.

Every case runs ``python -m hypertron.cli ...`` as a subprocess with 8 simulated
CPU devices and checks what a user sees: exit code 2, stderr is exactly one
line starting with ``error:`` that names the offending key or path, no
traceback, and no compilation (``JAX_LOG_COMPILES=1`` makes JAX log every
compile to stderr, so a compile would show up as an extra line). Nothing may be
created in a run directory that did not exist, nor in the working directory.

The last part trains a tiny run for real and checks that nothing saved is ever
overwritten: training a different model into it, importing a Hugging Face
model into it, or importing twice into the same directory all refuse and leave
the files byte for byte (and mtime for mtime) as they were.

Each subprocess pays about a second of imports, so the independent ones are
started all at once (``_launch_everything``), once per session even under
pytest-xdist (``_once``), and the tests only read their results.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli_harness import Result, Spec, assert_unchanged, run_all, snapshot, start_all, wait_all  # tests/

from hypertron.config import Config

# Generous: an error path costs ~1 s of CPU (imports); compiling and running a
# train step costs several more. The compile log is the precise check.
MAX_ERROR_CPU_S = 10.0

# A tiny model that trains 2 steps in a few seconds on CPU.
TINY = [
    "model=tiny", "model.num_layers=1", "model.embed_dim=32", "model.num_heads=2",
    "model.num_kv_heads=1", "model.head_dim=16", "model.mlp_dim=64",
    "train.steps=2", "train.global_batch=8", "train.seq_len=16", "train.log_every=1",
    "data.source=synthetic",
]
# Shapes for the error cases (they must never get far enough to use them).
SMALL = ["model=tiny", "train.steps=2", "train.global_batch=8", "train.seq_len=16"]

HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))

# Writes tiny random Llama checkpoints with transformers: argv[1] with
# max_position_embeddings=256, argv[2] with 64 (below the default train.seq_len).
MAKE_HF = r"""
import sys
import torch, transformers
torch.manual_seed(0)
for path, max_pos in ((sys.argv[1], 256), (sys.argv[2], 64)):
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=max_pos,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
"""


# ---------------------------------------------------------------------------
# Checks


_SECTIONS = {
    f.name: {g.name for g in dataclasses.fields(f.default_factory)}
    for f in dataclasses.fields(Config)
    if f.default_factory is not dataclasses.MISSING
}
_KEY_RE = re.compile(r"(?<![\w/.\-])(" + "|".join(_SECTIONS) + r")\.(\w+)")


def _bad_keys_mentioned(message: str) -> list[str]:
    """Dotted config keys in ``message`` that do not exist (an error must not point at one)."""
    return [f"{s}.{k}" for s, k in _KEY_RE.findall(message) if k not in _SECTIONS[s]]


def _assert_one_error_line(r: Result, *needles: str, check_keys: bool = True) -> str:
    assert r.rc == 2, r.describe()
    for stream in (r.stdout, r.stderr):
        assert "Traceback" not in stream, r.describe()
    lines = r.stderr.splitlines()
    assert len(lines) == 1, "stderr must be exactly one line\n" + r.describe()
    line = lines[0]
    assert line.startswith("error:"), r.describe()
    assert r.stdout == "", r.describe()
    for needle in needles:
        assert needle in line, f"the error should name {needle!r}\n" + r.describe()
    if check_keys:
        assert not _bad_keys_mentioned(line), (
            f"the error mentions config keys that do not exist: {_bad_keys_mentioned(line)}\n"
            + r.describe()
        )
    return line


def _assert_no_compile(r: Result) -> None:
    assert "Compiling" not in r.stderr, "failed only after compiling\n" + r.describe()
    assert r.cpu_s < MAX_ERROR_CPU_S, f"took {r.cpu_s:.1f}s of CPU to fail\n" + r.describe()


# ---------------------------------------------------------------------------
# Mistakes that need nothing but the command line and a few input files


@dataclass
class Case:
    args: list[str]
    needles: tuple[str, ...]
    check_keys: bool = True  # False where the message must quote the user's unknown key


def _error_cases(inputs: Path, runs: Path) -> dict[str, Case]:
    """Each case trains (if it got that far) into runs/<name>, which must never appear."""
    empty_dir = inputs / "empty_corpus"
    empty_dir.mkdir()
    (empty_dir / "not_text.bin").write_bytes(b"\0\1\2")  # no *.txt / *.md / *.py inside
    empty_file = inputs / "empty.txt"
    empty_file.write_text("")
    blank_jsonl = inputs / "blank.jsonl"
    blank_jsonl.write_text("\n  \n\n")
    not_a_run = inputs / "not_a_run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("hello\n")
    no_hf = inputs / "no_hf_config"
    no_hf.mkdir()
    (no_hf / "model.safetensors").write_bytes(b"")

    def recipe(name: str, text: str) -> str:
        path = inputs / f"{name}.yaml"
        path.write_text(text.format(run_dir=runs / name))
        return str(path)

    def train(name: str, *args: str) -> list[str]:
        return ["train", *args, f"run_dir={runs / name}"]

    cases = {
        # 1. unknown keys
        "unknown_train_key": Case(train("unknown_train_key", *SMALL, "train.stepz=3"),
                                  ("train.stepz",), check_keys=False),
        "unknown_top_level_key": Case(train("unknown_top_level_key", *SMALL, "foo=1"), ("'foo'",)),
        "unknown_model_key": Case(train("unknown_model_key", *SMALL, "model.num_layerz=1"),
                                  ("model.num_layerz",), check_keys=False),
        "unknown_key_in_recipe": Case(
            ["train", recipe("unknown_key_in_recipe",
                             "run_dir: {run_dir}\nmodel: tiny\ndata:\n  source: synthetic\n"
                             "train:\n  steps: 2\n  stepz: 3\n")],
            ("train.stepz",), check_keys=False),
        "unknown_model_key_in_recipe": Case(
            ["train", recipe("unknown_model_key_in_recipe",
                             "run_dir: {run_dir}\nmodel:\n  preset: tiny\n  num_layerz: 1\n")],
            ("model.num_layerz",), check_keys=False),
        # 2. wrong types
        "steps_not_int": Case(train("steps_not_int", *SMALL, "train.steps=abc"), ("train.steps", "abc")),
        "bool_not_bool": Case(train("bool_not_bool", *SMALL, "model.tie_embeddings=maybe"),
                              ("model.tie_embeddings", "maybe")),
        "wrong_type_in_recipe": Case(
            ["train", recipe("wrong_type_in_recipe",
                             "run_dir: {run_dir}\nmodel: tiny\ntrain:\n  global_batch: eight\n")],
            ("train.global_batch", "eight")),
        # 3. meshes that do not fit 8 devices
        "mesh_product": Case(train("mesh_product", *SMALL, "data.source=synthetic",
                                   "mesh.data=3", "mesh.fsdp=1"), ("mesh", "3", "8")),
        "mesh_two_free_axes": Case(train("mesh_two_free_axes", *SMALL, "data.source=synthetic",
                                         "mesh.data=-1", "mesh.fsdp=-1"), ("mesh", "-1", "data", "fsdp")),
        # 4. batch not divisible across data shards
        "batch_not_divisible": Case(
            train("batch_not_divisible", "model=tiny", "train.steps=2", "train.seq_len=16",
                  "data.source=synthetic", "train.global_batch=6", "mesh.data=8", "mesh.fsdp=1"),
            ("train.global_batch=6", "8")),
        # an impossible combination found without devices
        "seq_len_too_long": Case(train("seq_len_too_long", "model=tiny", "train.seq_len=4096"),
                                 ("train.seq_len=4096", "model.max_seq_len")),
        # 5. a missing data path
        "missing_data_path": Case(train("missing_data_path", *SMALL, "data.source=text",
                                        "data.paths=/nonexistent/x.txt"), ("/nonexistent/x.txt",)),
        # 6. empty corpora
        "empty_corpus_dir": Case(train("empty_corpus_dir", *SMALL, "data.source=text",
                                       f"data.paths={empty_dir}"), ("empty", str(empty_dir))),
        "empty_corpus_file": Case(train("empty_corpus_file", *SMALL, "data.source=text",
                                        f"data.paths={empty_file}"), ("empty", str(empty_file))),
        "empty_jsonl": Case(train("empty_jsonl", *SMALL, "data.source=jsonl",
                                  f"data.paths={blank_jsonl}"), ("empty", str(blank_jsonl))),
        # 7. unknown preset, missing recipe, overrides without "="
        "unknown_preset": Case(train("unknown_preset", "model=llama9"), ("llama9",)),
        "missing_recipe": Case(["train", str(inputs / "missing.yaml"), f"run_dir={runs / 'missing_recipe'}"],
                               (str(inputs / "missing.yaml"),)),
        "invalid_yaml_recipe": Case(
            ["train", recipe("invalid_yaml_recipe", "run_dir: {run_dir}\ntrain: [steps: 2\n")],
            (str(inputs / "invalid_yaml_recipe.yaml"),)),
        "override_without_equals": Case(
            ["train", "model=tiny", "train.steps", f"run_dir={runs / 'override_without_equals'}"],
            ("train.steps",)),
        # The first bare word is taken as the recipe; the error still names it.
        "first_word_without_equals": Case(
            ["train", "stepz", f"run_dir={runs / 'first_word_without_equals'}"], ("stepz",)),
        # tokenisers and multi-process settings
        "missing_tokenizer": Case(train("missing_tokenizer", *SMALL, "data.tokenizer=/nonexistent/tok.json"),
                                  ("data.tokenizer", "/nonexistent/tok.json")),
        "tokenizer_not_a_tokenizer": Case(train("tokenizer_not_a_tokenizer", *SMALL,
                                                f"data.tokenizer={empty_file}"), ("data.tokenizer", str(empty_file))),
        "process_id_out_of_range": Case(
            train("process_id_out_of_range", *SMALL, "distributed.num_processes=2", "distributed.process_id=2"),
            ("distributed.process_id=2",)),
        "processes_without_coordinator": Case(
            train("processes_without_coordinator", *SMALL, "distributed.num_processes=2",
                  "distributed.process_id=0"), ("coordinator",)),
        "coordinator_without_port": Case(
            train("coordinator_without_port", *SMALL, "distributed.num_processes=2", "distributed.process_id=0",
                  "distributed.coordinator=localhost"), ("localhost", "host:port")),
        "monitor_interval_zero": Case(train("monitor_interval_zero", *SMALL, "monitor.interval=0"),
                                      ("monitor.interval",)),
        "launch_zero_processes": Case(["launch", "local", "--processes", "0", "--", "train", "model=tiny"],
                                      ("--processes=0",)),
        "launch_without_command": Case(["launch", "local", "--processes", "2"], ("launch local",)),
        # 8. generate / convert pointed at the wrong directory
        "generate_not_a_run": Case(["generate", "--checkpoint", str(not_a_run), "--prompt", "hi"],
                                   (str(not_a_run),)),
        "generate_missing_dir": Case(
            ["generate", "--checkpoint", str(runs / "generate_missing_dir"), "--prompt", "hi"],
            (str(runs / "generate_missing_dir"),)),
        "convert_from_hf_without_config": Case(
            ["convert", "--from-hf", str(no_hf), "--out", str(runs / "convert_from_hf_without_config")],
            ("config.json", str(no_hf))),
        "convert_from_hf_without_out": Case(["convert", "--from-hf", str(no_hf)], ("--out",)),
        "convert_to_hf_not_a_run": Case(
            ["convert", "--to-hf", str(runs / "convert_to_hf_not_a_run"), "--checkpoint", str(not_a_run)],
            (str(not_a_run),)),
    }
    return cases


def _once(tmp_path_factory, key: str, produce) -> dict:
    """``produce(directory)`` once per test session, shared by all pytest-xdist workers
    (``make test`` runs ``-n 2``): the first worker to get here runs it under a file
    lock and leaves its JSON result; the others read that."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    done = root / f"{key}.json"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            directory = root / key
            directory.mkdir()
            done.write_text(json.dumps(produce(directory)))
    return json.loads(done.read_text())


def _launch_everything(base: Path) -> dict:
    """Run all independent subprocesses at once: the error cases, the tiny training
    run R and (when transformers is installed) the HF checkpoints the refusals need."""
    inputs, runs, cwds = base / "inputs", base / "runs", base / "cwd"
    inputs.mkdir()
    runs.mkdir()
    cases = _error_cases(inputs, runs)
    inputs_before = snapshot(inputs)

    run = base / "R"
    specs = {"train": Spec(["train", *TINY, f"run_dir={run}"], base / "cwd_train")}
    if HAVE_HF:
        specs["make_hf"] = Spec([sys.executable, "-c", MAKE_HF, str(base / "hf"), str(base / "hf64")],
                                base / "cwd_hf", log_compiles=False, raw=True)
    # The training run first and at normal priority: later tests wait for it.
    saving = start_all(specs, base / "logs_saved")
    errors = start_all({name: Spec(c.args, cwds / name, nice=10) for name, c in cases.items()},
                        base / "logs_errors")
    error_results, saved_results = wait_all(errors), wait_all(saving)

    inputs_after = snapshot(inputs)
    return {
        "cases": {name: dataclasses.asdict(c) for name, c in cases.items()},
        "errors": {name: dataclasses.asdict(r) for name, r in error_results.items()},
        # What each case left behind: its run directory, files in its working directory.
        "left": {
            name: {"run_dir_exists": (runs / name).exists(),
                   "cwd_entries": sorted(os.listdir(cwds / name))}
            for name in cases
        },
        "inputs_changed": sorted(k for k in set(inputs_before) | set(inputs_after)
                                 if inputs_before.get(k) != inputs_after.get(k)),
        "runs_entries": sorted(os.listdir(runs)),
        "saved": {name: dataclasses.asdict(r) for name, r in saved_results.items()},
        "base": str(base),
        "run": str(run),
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    return _once(tmp_path_factory, "cli_errors", _launch_everything)


@pytest.fixture(scope="module")
def error_results(launched) -> dict:
    return dict(
        cases={name: Case(**c) for name, c in launched["cases"].items()},
        results={name: Result(**r) for name, r in launched["errors"].items()},
        left=launched["left"],
    )


# The case names, for test ids; test_case_list_is_complete keeps them in step with _error_cases.
_CASE_NAMES = [
    "unknown_train_key", "unknown_top_level_key", "unknown_model_key", "unknown_key_in_recipe",
    "unknown_model_key_in_recipe",
    "steps_not_int", "bool_not_bool", "wrong_type_in_recipe",
    "mesh_product", "mesh_two_free_axes", "batch_not_divisible", "seq_len_too_long",
    "missing_data_path", "empty_corpus_dir", "empty_corpus_file", "empty_jsonl",
    "unknown_preset", "missing_recipe", "invalid_yaml_recipe", "override_without_equals",
    "first_word_without_equals",
    "missing_tokenizer", "tokenizer_not_a_tokenizer", "process_id_out_of_range",
    "processes_without_coordinator", "coordinator_without_port", "monitor_interval_zero", "launch_zero_processes", "launch_without_command",
    "generate_not_a_run", "generate_missing_dir",
    "convert_from_hf_without_config", "convert_from_hf_without_out",
    "convert_to_hf_not_a_run",
]


def test_case_list_is_complete(error_results):
    assert sorted(error_results["cases"]) == sorted(_CASE_NAMES)


@pytest.mark.parametrize("name", _CASE_NAMES)
def test_user_mistake_is_one_line_exit_2(error_results, name):
    case = error_results["cases"][name]
    r = error_results["results"][name]
    _assert_one_error_line(r, *case.needles, check_keys=case.check_keys)
    _assert_no_compile(r)
    # Nothing was created: not the run directory, nothing in the working directory
    # (where the default run_dir would go).
    left = error_results["left"][name]
    assert not left["run_dir_exists"], r.describe()
    assert left["cwd_entries"] == [], r.describe()


def test_inputs_untouched(launched):
    assert launched["inputs_changed"] == []
    assert launched["runs_entries"] == []


# ---------------------------------------------------------------------------
# Nothing already saved is overwritten


@pytest.fixture(scope="module")
def saved(launched) -> dict:
    """A trained tiny run R, and (when transformers is installed) two tiny HF Llama checkpoints.
    Shared by all workers and only read; each test writes its own directories."""
    return dict(
        base=Path(launched["base"]), run=Path(launched["run"]),
        results={name: Result(**r) for name, r in launched["saved"].items()},
    )


def _need_run(saved) -> Path:
    r = saved["results"]["train"]
    assert r.rc == 0, "the tiny training run failed\n" + r.describe()
    assert (saved["run"] / "config.yaml").is_file()
    assert any((saved["run"] / "checkpoints").iterdir())
    return saved["run"]


def _need_hf(saved) -> tuple[Path, Path]:
    if not HAVE_HF:
        pytest.skip("torch and transformers are needed to write a Hugging Face checkpoint")
    r = saved["results"]["make_hf"]
    assert r.rc == 0, "writing the HF checkpoints failed\n" + r.describe()
    return saved["base"] / "hf", saved["base"] / "hf64"


def test_tiny_run_trains_and_compile_log_is_visible(saved):
    """The real run works, and JAX_LOG_COMPILES really shows compiles (so their absence means something)."""
    _need_run(saved)
    assert "Compiling" in saved["results"]["train"].stderr


def test_train_different_model_into_existing_run_refuses(saved, tmp_path):
    run = _need_run(saved)
    before = snapshot(run)
    base = tmp_path
    args = [a for a in TINY if not a.startswith("model.embed_dim=")] + ["model.embed_dim=64"]
    specs = {
        "other_model": Spec(["train", *args, f"run_dir={run}"], base / "cwd_other_model"),
        "other_preset": Spec(["train", *TINY, "model=tiny-gemma", f"run_dir={run}"],
                             base / "cwd_other_preset"),
    }
    results = run_all(specs, base / "logs_refuse_train")
    for r in results.values():
        _assert_one_error_line(r, "run_dir", str(run))
        _assert_no_compile(r)
        assert_unchanged(run, before, r)


@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory):
    """Import the HF checkpoints into fresh run directories C and C64 (this worker's own)."""
    hf, hf64 = _need_hf(saved)
    base = tmp_path_factory.mktemp("cli_converted")
    specs = {
        "C": Spec(["convert", "--from-hf", str(hf), "--out", str(base / "C")], base / "cwd_C"),
        "C64": Spec(["convert", "--from-hf", str(hf64), "--out", str(base / "C64")], base / "cwd_C64"),
    }
    results = run_all(specs, base / "logs_convert")
    for r in results.values():
        assert r.rc == 0, r.describe()
    return dict(C=base / "C", C64=base / "C64", hf=hf, hf64=hf64, base=base)


def test_convert_into_existing_dirs_refuses(saved, converted):
    run = _need_run(saved)
    base, c = converted["base"], converted["C"]
    before_run, before_c, before_hf = snapshot(run), snapshot(c), snapshot(converted["hf"])
    specs = {
        # Into a trained run.
        "into_run": Spec(["convert", "--from-hf", str(converted["hf"]), "--out", str(run)],
                         base / "cwd_into_run"),
        # Into a directory that an earlier convert wrote.
        "into_converted": Spec(["convert", "--from-hf", str(converted["hf"]), "--out", str(c)],
                               base / "cwd_into_converted"),
    }
    results = run_all(specs, base / "logs_refuse_convert")
    _assert_one_error_line(results["into_run"], str(run))
    _assert_one_error_line(results["into_converted"], str(c))
    for r in results.values():
        _assert_no_compile(r)
    assert_unchanged(run, before_run, results["into_run"])
    assert_unchanged(c, before_c, results["into_converted"])
    assert_unchanged(converted["hf"], before_hf, results["into_converted"])


def test_train_different_model_into_converted_dir_refuses(converted):
    c, base = converted["C"], converted["base"]
    before = snapshot(c)
    r = run_all({"t": Spec(["train", *TINY, f"run_dir={c}"], base / "cwd_train_c")},
                 base / "logs_train_c")["t"]
    _assert_one_error_line(r, "run_dir", str(c))
    _assert_no_compile(r)
    assert_unchanged(c, before, r)


def test_train_same_model_into_converted_dir_refuses(converted):
    """A converted model is a bundle, not a run: training into it is refused in one line that says
    how to start from it instead."""
    c, base = converted["C"], converted["base"]
    before = snapshot(c)
    r = run_all(
        {"t": Spec(["train", f"model={c}", f"run_dir={c}", "train.steps=2", "train.global_batch=8",
                    "train.seq_len=16", "data.source=synthetic"], base / "cwd_resume_c")},
        base / "logs_resume_c",
    )["t"]
    _assert_one_error_line(r, str(c), f"train.init_from={c}")
    _assert_no_compile(r)
    assert_unchanged(c, before, r)


def test_converted_checkpoints_are_usable(converted):
    """A converted model (a bundle) is served as it is: generate reads it, also when the HF
    model's max_position_embeddings (64) is below the default train.seq_len (128)."""
    base = converted["base"]
    spec = Spec(["generate", "--checkpoint", str(converted["C64"]), "--prompt", "hi",
                 "--max-new-tokens", "4"], base / "cwd_gen_C64", log_compiles=False)
    r = run_all({"gen": spec}, base / "logs_generate")["gen"]
    assert r.rc == 0, r.describe()
    assert r.stdout.startswith("hi"), r.describe()
