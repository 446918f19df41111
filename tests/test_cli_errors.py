"""User mistakes through the ``hypertron`` command: one line, exit 2, nothing written.

Every case runs the command's ``main`` in this process (``support.cli.run_cli``) with 8 simulated
CPU devices and checks what a user sees: exit code 2, stderr is exactly one line starting with
``error:`` that names the offending key or path, no traceback, and nothing lowered by JAX (its
monitoring events count every program). Nothing may be created in a run directory that did not
exist, nor in the working directory, nor in the inputs. One case runs as a real process: the exit
code and the single line are what a shell sees.

The last part saves a tiny run and checks that nothing saved is ever overwritten: training a
different model into it, importing a Hugging Face model into it, or importing twice into the same
directory all refuse and leave the files byte for byte (and mtime for mtime) as they were. The run
is written by the library (its config and a checkpoint, as ``checkpoint.save_params`` writes them),
not trained: a refusal reads nothing else, and training a tiny run through the command is
``test_cli.py``'s subject.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.cli import Result, one_error_line, run_cli  # tests/support
from support.processes import run_hypertron
from support.shared import once
from support.snapshots import assert_unchanged, snapshot
from support.tiny import TINY_CLI as TINY

from hypertron.config import Config

# Shapes for the error cases (they must never get far enough to use them).
SMALL = ["model=tiny", "train.steps=2", "train.global_batch=8", "train.seq_len=16"]


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
    line = one_error_line(r, *needles)
    if check_keys:
        assert not _bad_keys_mentioned(line), (
            f"the error mentions config keys that do not exist: {_bad_keys_mentioned(line)}\n"
            + r.describe()
        )
    return line


# ---------------------------------------------------------------------------
# Mistakes that need nothing but the command line and a few input files


@dataclass
class Case:
    args: list[str]
    needles: tuple[str, ...]
    check_keys: bool = True  # False where the message must quote the user's unknown key


class _Inputs:
    """The files and directories the cases point at, and how a case names its run directory."""

    def __init__(self, inputs: Path, runs: Path):
        self.root, self.runs = inputs, runs
        self.empty_dir = inputs / "empty_corpus"
        self.empty_dir.mkdir()
        (self.empty_dir / "not_text.bin").write_bytes(b"\0\1\2")  # no *.txt / *.md / *.py inside
        self.empty_file = inputs / "empty.txt"
        self.empty_file.write_text("")
        self.blank_jsonl = inputs / "blank.jsonl"
        self.blank_jsonl.write_text("\n  \n\n")
        self.not_a_run = inputs / "not_a_run"
        self.not_a_run.mkdir()
        (self.not_a_run / "notes.txt").write_text("hello\n")
        self.no_hf = inputs / "no_hf_config"
        self.no_hf.mkdir()
        (self.no_hf / "model.safetensors").write_bytes(b"")

    def recipe(self, name: str, text: str) -> str:
        path = self.root / f"{name}.yaml"
        path.write_text(text.format(run_dir=self.runs / name))
        return str(path)

    def train(self, name: str, *args: str) -> list[str]:
        return ["train", *args, f"run_dir={self.runs / name}"]


def _config_cases(i: _Inputs) -> dict[str, Case]:
    """Mistakes in keys, types and shapes."""
    recipe, train = i.recipe, i.train
    return {
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
        # context parallelism: rows that do not split evenly, a MoE capacity counted per row
        "seq_len_not_divisible_by_context": Case(
            train("seq_len_not_divisible_by_context", "model=tiny", "train.seq_len=20", "data.source=synthetic",
                  "mesh.fsdp=1", "mesh.context=8"), ("train.seq_len=20", "mesh.context=8")),
        "seq_len_not_divisible_by_balanced_chunks": Case(
            train("seq_len_not_divisible_by_balanced_chunks", "model=tiny", "train.seq_len=24",
                  "data.source=synthetic", "mesh.fsdp=1", "mesh.context=8"),
            ("train.seq_len=24", "2 x mesh.context=16", "model.context_load_balance=false")),
        # pipeline stages: layers, pieces and models they cannot split
        "stages_not_dividing_layers": Case(
            train("stages_not_dividing_layers", *SMALL, "data.source=synthetic", "mesh.fsdp=1", "mesh.stage=8"),
            ("mesh.stage=8", "model.num_layers=4")),
        # fewer rows than data shards: the refusal names the context split that gives each a part of a row
        "rows_fewer_than_shards": Case(
            train("rows_fewer_than_shards", *SMALL, "data.source=synthetic", "train.global_batch=4"),
            ("train.global_batch=4", "8 data shards", "mesh.context=2 splits each row over 2 devices")),
        "repeats_not_dividing_layers": Case(
            train("repeats_not_dividing_layers", *SMALL, "data.source=synthetic", "mesh.fsdp=4", "mesh.stage=2",
                  "train.pipeline_repeats=4"), ("mesh.stage=2 x train.pipeline_repeats=4", "model.num_layers=4")),
        "pieces_below_stages": Case(
            train("pieces_below_stages", *SMALL, "data.source=synthetic", "mesh.fsdp=4", "mesh.stage=2",
                  "train.pipeline_microbatches=1"), ("train.pipeline_microbatches=1", "mesh.stage=2")),
        "pieces_not_dividing_rows": Case(
            train("pieces_not_dividing_rows", *SMALL, "data.source=synthetic", "mesh.fsdp=4", "mesh.stage=2",
                  "train.pipeline_microbatches=3"), ("train.pipeline_microbatches=3", "2 rows")),
        "stages_unscanned": Case(
            train("stages_unscanned", *SMALL, "data.source=synthetic", "mesh.fsdp=4", "mesh.stage=2",
                  "model.scan_layers=false"), ("mesh.stage=2", "model.scan_layers=false")),
        "stages_with_fp8": Case(
            train("stages_with_fp8", *SMALL, "data.source=synthetic", "mesh.fsdp=4", "mesh.stage=2",
                  "model.quantization=fp8"), ("mesh.stage=2", "model.quantization=fp8")),
        "stages_with_moe": Case(
            train("stages_with_moe", "model=tiny-moe", "train.seq_len=16", "data.source=synthetic", "mesh.fsdp=4",
                  "mesh.stage=2"), ("mesh.stage=2", "MoE")),
        "context_with_capped_moe": Case(
            train("context_with_capped_moe", "model=tiny-moe", "train.seq_len=16", "data.source=synthetic",
                  "model.moe.mode=capped", "mesh.fsdp=1", "mesh.context=8"), ("mesh.context=8", "capped")),
        # an impossible combination found without devices
        "seq_len_too_long": Case(train("seq_len_too_long", "model=tiny", "train.seq_len=4096"),
                                 ("train.seq_len=4096", "model.max_seq_len")),
    }


def _path_and_command_cases(i: _Inputs) -> dict[str, Case]:
    """Missing or unusable files and directories, and commands missing what they need."""
    inputs, runs, train, recipe = i.root, i.runs, i.train, i.recipe
    empty_dir, empty_file, blank_jsonl = i.empty_dir, i.empty_file, i.blank_jsonl
    not_a_run, no_hf = i.not_a_run, i.no_hf
    return {
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


def _error_cases(inputs: Path, runs: Path) -> dict[str, Case]:
    """Each case trains (if it got that far) into runs/<name>, which must never appear."""
    i = _Inputs(inputs, runs)
    return {**_config_cases(i), **_path_and_command_cases(i)}


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("cli_errors")
    inputs, runs = base / "inputs", base / "runs"
    inputs.mkdir()
    runs.mkdir()
    return dict(cases=_error_cases(inputs, runs), inputs=inputs, runs=runs, cwd=base / "cwd")


# The case names, for test ids; test_case_list_is_complete keeps them in step with _error_cases.
_CASE_NAMES = [
    "unknown_train_key", "unknown_top_level_key", "unknown_model_key", "unknown_key_in_recipe",
    "unknown_model_key_in_recipe",
    "steps_not_int", "bool_not_bool", "wrong_type_in_recipe",
    "mesh_product", "mesh_two_free_axes", "batch_not_divisible", "seq_len_too_long",
    "seq_len_not_divisible_by_context", "seq_len_not_divisible_by_balanced_chunks", "context_with_capped_moe",
    "rows_fewer_than_shards", "stages_not_dividing_layers", "repeats_not_dividing_layers", "pieces_below_stages", "pieces_not_dividing_rows",
    "stages_unscanned", "stages_with_moe", "stages_with_fp8",
    "missing_data_path", "empty_corpus_dir", "empty_corpus_file", "empty_jsonl",
    "unknown_preset", "missing_recipe", "invalid_yaml_recipe", "override_without_equals",
    "first_word_without_equals",
    "missing_tokenizer", "tokenizer_not_a_tokenizer", "process_id_out_of_range",
    "processes_without_coordinator", "coordinator_without_port", "monitor_interval_zero", "launch_zero_processes",
    "launch_without_command",
    "generate_not_a_run", "generate_missing_dir",
    "convert_from_hf_without_config", "convert_from_hf_without_out",
    "convert_to_hf_not_a_run",
]


def test_case_list_is_complete(mistakes):
    assert sorted(mistakes["cases"]) == sorted(_CASE_NAMES)


@pytest.mark.parametrize("name", _CASE_NAMES)
def test_user_mistake_is_one_line_exit_2(mistakes, name):
    case = mistakes["cases"][name]
    inputs_before = snapshot(mistakes["inputs"])
    cwd = mistakes["cwd"] / name
    r = run_cli(case.args, cwd=cwd)
    _assert_one_error_line(r, *case.needles, check_keys=case.check_keys)
    # Nothing was created: not the run directory, nothing in the working directory
    # (where the default run_dir would go), nothing among the inputs.
    assert not (mistakes["runs"] / name).exists(), r.describe()
    assert os.listdir(cwd) == [], r.describe()
    assert_unchanged(mistakes["inputs"], inputs_before, r.describe())


def test_a_mistake_is_one_line_and_exit_2_in_a_shell(tmp_path):
    """The real command, as a process: what a shell sees."""
    r = run_hypertron("train", "model=llama9", f"run_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error:") and "llama9" in r.stderr
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# Nothing already saved is overwritten


def _save_run_and_write_hf(base: Path) -> dict:
    """The tiny model's run R (``config.yaml`` and a checkpoint at step 0) and two Hugging Face Llama
    checkpoints of it, max_position_embeddings 256 and 64 (below the default train.seq_len), all
    written through the library from zero-valued parameters: nothing is compiled, and neither torch
    nor transformers is imported (``test_hf.py`` reads what they write)."""
    import jax
    import numpy as np

    from hypertron.checkpoint import save_params
    from hypertron.config import load_config
    from hypertron.models import declare
    from hypertron.models.hf import save_hf
    from hypertron.models.params import abstract

    cfg = load_config(None, [*TINY, f"run_dir={base / 'R'}"])
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract(declare(cfg.model), np.float32))
    save_params(cfg.run_dir, cfg, params)
    for name, positions in (("hf", 256), ("hf64", 64)):
        save_hf(base / name, dataclasses.replace(cfg.model, max_seq_len=positions), params)
    return dict(base=str(base))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A saved tiny run R and the HF checkpoints, made once for every worker and only read; each
    test writes its own directories."""
    base = Path(once(tmp_path_factory, "cli_saved", _save_run_and_write_hf)["base"])
    run = base / "R"
    assert (run / "config.yaml").is_file() and any((run / "checkpoints").iterdir())
    return dict(base=base, run=run)


def test_train_different_model_into_existing_run_refuses(saved, tmp_path):
    run = saved["run"]
    before = snapshot(run)
    args = [a for a in TINY if not a.startswith("model.embed_dim=")] + ["model.embed_dim=64"]
    for argv in (["train", *args, f"run_dir={run}"], ["train", *TINY, "model=tiny-gemma", f"run_dir={run}"]):
        r = run_cli(argv, cwd=tmp_path / "cwd")
        # The model check refuses (R holds parameters only: past it, resuming would refuse too).
        _assert_one_error_line(r, "run_dir", str(run), "a different model")
        assert_unchanged(run, before, r.describe())


@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory):
    """Import the HF checkpoints into fresh run directories C and C64 (this worker's own)."""
    hf, hf64 = saved["base"] / "hf", saved["base"] / "hf64"
    base = tmp_path_factory.mktemp("cli_converted")
    for source, out in ((hf, base / "C"), (hf64, base / "C64")):
        r = run_cli(["convert", "--from-hf", source, "--out", out], cwd=base / "cwd")
        assert r.rc == 0, r.describe()
    return dict(C=base / "C", C64=base / "C64", hf=hf, hf64=hf64, base=base)


def test_convert_into_existing_dirs_refuses(saved, converted):
    run = saved["run"]
    base, c, hf = converted["base"], converted["C"], converted["hf"]
    before_run, before_c, before_hf = snapshot(run), snapshot(c), snapshot(hf)
    # Into a saved run, and into a directory that an earlier convert wrote.
    into_run = run_cli(["convert", "--from-hf", hf, "--out", run], cwd=base / "cwd_into_run")
    into_converted = run_cli(["convert", "--from-hf", hf, "--out", c], cwd=base / "cwd_into_converted")
    _assert_one_error_line(into_run, str(run))
    _assert_one_error_line(into_converted, str(c))
    assert_unchanged(run, before_run, into_run.describe())
    assert_unchanged(c, before_c, into_converted.describe())
    assert_unchanged(hf, before_hf, into_converted.describe())


def test_train_different_model_into_converted_dir_refuses(converted):
    c = converted["C"]
    before = snapshot(c)
    r = run_cli(["train", *TINY, f"run_dir={c}"], cwd=converted["base"] / "cwd_train_c")
    _assert_one_error_line(r, "run_dir", str(c))
    assert_unchanged(c, before, r.describe())


def test_train_same_model_into_converted_dir_refuses(converted):
    """A converted model is a bundle, not a run: training into it is refused in one line that says
    how to start from it instead."""
    c = converted["C"]
    before = snapshot(c)
    r = run_cli(["train", f"model={c}", f"run_dir={c}", "train.steps=2", "train.global_batch=8",
                 "train.seq_len=16", "data.source=synthetic"], cwd=converted["base"] / "cwd_resume_c")
    _assert_one_error_line(r, str(c), f"train.init_from={c}")
    assert_unchanged(c, before, r.describe())


def test_converted_checkpoints_are_usable(converted):
    """A converted model (a bundle) is served as it is: generate reads it, also when the HF
    model's max_position_embeddings (64) is below the default train.seq_len (128)."""
    r = run_cli(["generate", "--checkpoint", converted["C64"], "--prompt", "hi", "--max-new-tokens", "4"],
                cwd=converted["base"] / "cwd_gen_C64")
    assert r.rc == 0, r.describe()
    assert r.stdout.startswith("hi"), r.describe()
    # The compile counter counts, so every mistake's zero means something (no other test generates
    # from this model: its programs are new to the process).
    assert r.compiles > 0, r.describe()
