"""Issue 48: hostile input. Each case the issue lists gives its one ``error:`` line and a non-zero
exit (or, in a run file, a counted skip), never a traceback."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import one_error_line, run_cli

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


@pytest.mark.parametrize("name", ["events.jsonl", "metrics.jsonl", "host_metrics_0.jsonl"])
def test_a_run_file_with_no_readable_line_is_one_line_and_exit_1(tmp_path, name):
    run = _run_dir(tmp_path, **{name: "\x00\x01\xff garbage\n" + json.dumps({"time": _HUGE}) + "\n"})
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


@pytest.mark.parametrize("where", ["file", "file/run"])
def test_a_run_dir_that_is_or_is_under_a_file_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("x")
    one_error_line(run_cli(["train", f"run_dir={tmp_path / where}", "train.steps=1"]),
                   f"{tmp_path / 'file'} is a file, not a directory")
