"""Hostile input for the CLI's readers, as hypothesis strategies, and the driver that runs them.

Four targets, each a strategy of one input and a check of what the CLI made of it (in process,
:func:`support.cli.run_cli`):

- ``config``: ``hypertron plan`` with ``key=value`` overrides (real keys, hostile values);
- ``recipe``: ``hypertron plan FILE`` and ``hypertron recipes FILE``, a shipped recipe with one
  field replaced by a hostile YAML value;
- ``embed``: ``hypertron embed plan FILE`` on a hostile embedding-tables file;
- ``runfiles``: ``hypertron monitor --json`` on a run directory of hostile events, metrics and
  host-metric lines.

Whatever the input, no traceback: a refusal is one ``error:`` line and exit 2 (or, for a run file
none of whose lines could be read, exit 1 and one line); otherwise the command answers (exit 0, or 1
for an alarm or a plan that does not fit) and every line it could not hold is counted.

``tests/test_fuzz_cli.py`` runs each with a few dozen examples; a bench can call :func:`fuzz`
with thousands (``fuzz("runfiles", 2000)``) and print the counts.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypertron.config import Config, to_dict
from hypertron.runfiles import EVENTS
from support.cli import Result, run_cli

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "a3mega-h100" / "llama3.1-8b.yaml"

# Numbers as a person or a damaged file might write them: past int32, int64 and float64, not finite.
HOSTILE_TEXT = ("nan", "NaN", ".nan", "inf", "-inf", ".inf", "1e308", "1e400", "-1", "0", "-0", "1.5",
                str(2**31), str(2**63), str(2**64), "99999999999999999999999", "0x10", "1_000", "", " ", "[1, 2]",
                "{a: 1}", "null", "true", "abc", "\x00", "\ud7ff", "1e-400")
HOSTILE_NUMBERS = (2**31, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, float("nan"), float("inf"), float("-inf"),
                   -1, 0, 5e-324)


def scalars() -> st.SearchStrategy[Any]:
    """One hostile scalar: any int, float (NaN and infinities included), short text, bool or null."""
    return st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.integers(), st.floats(), st.booleans(), st.none(),
                     st.sampled_from(HOSTILE_TEXT), st.text(max_size=12))


def values() -> st.SearchStrategy[Any]:
    """A hostile YAML/JSON value: a scalar, or small lists and mappings of them."""
    return st.recursive(scalars(), lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        out += _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


CONFIG_KEYS = tuple(_keys(to_dict(Config())))


def overrides() -> st.SearchStrategy[list[str]]:
    """One to three ``key=value`` overrides: real config keys (now and then a made-up one), hostile values."""
    key = st.one_of(st.sampled_from(CONFIG_KEYS), st.sampled_from(CONFIG_KEYS).map(lambda k: k + ".x"),
                    st.text(min_size=1, max_size=8))
    value = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=12), scalars().map(str))
    return st.lists(st.tuples(key, value).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=3)


def recipes() -> st.SearchStrategy[str]:
    """A shipped recipe's YAML with one key (one of its own, at any depth) set to a hostile value."""
    tree = yaml.safe_load(RECIPE.read_text())
    paths = [tuple(k.split(".")) for k in _keys(tree)]

    def replace(path: tuple[str, ...], value: Any) -> str:
        doc = yaml.safe_load(RECIPE.read_text())
        node = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        return yaml.safe_dump(doc, allow_unicode=True)

    return st.builds(replace, st.sampled_from(paths), values())


def mostly(good: Any) -> st.SearchStrategy[Any]:
    """``good`` three times in four, else a hostile value: a file damaged in one place more often
    than in all, so that the checks past the first are reached too."""
    return st.one_of(st.just(good), st.just(good), st.just(good), values())


def embed_specs() -> st.SearchStrategy[str]:
    """An embedding-tables file (``embed plan``): the right shape, with hostile values in any field."""
    table = st.fixed_dictionaries({"name": mostly("t"), "rows": mostly(1000), "dim": mostly(8)},
                                  optional={"placement": mostly("row"), "optimizer": mostly("adagrad"),
                                            "init_scale": mostly(0.1)})
    feature = st.fixed_dictionaries({"name": mostly("f"), "table": mostly("t")},
                                    optional={"combiner": mostly("mean"), "ids_per_sample": mostly(3)})
    doc = st.fixed_dictionaries({"tables": st.one_of(st.lists(table, min_size=1, max_size=2), values())},
                                optional={"features": st.one_of(st.lists(feature, max_size=2), values()),
                                          "batch": mostly(64)})
    return st.one_of(doc, values()).map(lambda d: yaml.safe_dump(d, allow_unicode=True))


def _event(name: str) -> st.SearchStrategy[dict]:
    fields = ("time", "event", "process", "step", *EVENTS[name])
    plausible = {"time": st.floats(1e9, 1.1e9), "step": st.integers(0, 100), "step_time": st.floats(0.01, 2)}
    return st.fixed_dictionaries({"event": st.just(name)}, optional={
        k: st.one_of(plausible.get(k, scalars()), values()) for k in fields if k != "event"})


def _line(record: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """A run file's line: a JSON record (NaN as json.dumps writes it), or garbage, or a line nested too deep."""
    return st.one_of(record.map(lambda r: json.dumps(r).encode()), record.map(lambda r: json.dumps(r).encode()),
                     st.binary(max_size=24).map(lambda b: b.replace(b"\n", b"")),
                     st.sampled_from([b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000]),
                     values().map(lambda v: json.dumps(v).encode()))


def run_files() -> st.SearchStrategy[dict[str, bytes]]:
    """A run directory's hostile files by name: events.jsonl (a job_start first, or not), and maybe
    metrics.jsonl and host_metrics.0.jsonl; each may end mid-line."""
    event = st.sampled_from(sorted(EVENTS)).flatmap(_event)
    metric = st.dictionaries(st.sampled_from(["step", "loss", "eval_loss", "time", "mfu"]), values(), max_size=4)
    host = st.dictionaries(st.sampled_from(["time", "step", "cpu_utilization_mean", "host_memory_used"]),
                           values(), max_size=4)

    def file(lines: st.SearchStrategy[bytes], first: st.SearchStrategy[list[bytes]] = st.just([])):
        return st.builds(lambda a, b, end: b"\n".join(a + b) + end, first, st.lists(lines, max_size=6),
                         st.sampled_from([b"\n", b"", b'\n{"time": 1e9, "ev']))

    return st.fixed_dictionaries(
        {"events.jsonl": file(_line(event), st.lists(_line(_event("job_start")), max_size=1))},
        optional={"metrics.jsonl": file(_line(metric)), "host_metrics.0.jsonl": file(_line(host))})


def refused_or_answered(r: Result, answers: tuple[int, ...] = (0, 1)) -> str:
    """What the CLI made of a hostile input, checked: ``refused`` (exit 2 and one ``error:`` line),
    ``unreadable`` (exit 1 and one ``error:`` line, nothing on stdout) or ``answered`` (an exit code
    in ``answers``); never a traceback, never anything else."""
    assert "Traceback" not in r.stdout + r.stderr, r.describe()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    if r.rc == 2:
        assert r.stdout == "" and len(errors) == 1 and r.stderr.count("\n") == 1, r.describe()
        return "refused"
    assert r.rc in answers, r.describe()
    if errors:
        assert r.rc == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r.describe()
        return "unreadable"
    return "answered"


def _check_config(args: list[str], where: Path) -> str:
    return refused_or_answered(run_cli(["plan", "--json", f"run_dir={where / 'run'}", *args], cwd=where))


def _check_recipe(text: str, where: Path) -> str:
    (where / "recipe.yaml").write_text(text)
    first = refused_or_answered(run_cli(["plan", "--json", "recipe.yaml"], cwd=where))
    refused_or_answered(run_cli(["recipes", "--json", "recipe.yaml"], cwd=where))
    return first


def _check_embed(text: str, where: Path) -> str:
    (where / "spec.yaml").write_text(text)
    return refused_or_answered(run_cli(["embed", "plan", "--json", "--devices", "4", "spec.yaml"], cwd=where))


def _check_runfiles(files: dict[str, bytes], where: Path) -> str:
    for name, data in files.items():
        (where / name).write_bytes(data)
    r = run_cli(["monitor", "--json", str(where)])
    outcome = refused_or_answered(r)
    assert outcome != "refused", r.describe()  # a run directory is never a usage error
    if outcome == "answered":
        lines = sum(len([x for x in data.split(b"\n") if x.strip()]) for data in files.values())
        assert sum(json.loads(r.stdout)["bad_lines"].values()) <= lines, r.describe()
    return outcome


TARGETS: dict[str, tuple[Callable[[], st.SearchStrategy], Callable[[Any, Path], str]]] = {
    "config": (overrides, _check_config),
    "recipe": (recipes, _check_recipe),
    "embed": (embed_specs, _check_embed),
    "runfiles": (run_files, _check_runfiles),
}


def fuzz(target: str, max_examples: int, derandomize: bool = True) -> Counter:
    """Run ``target`` (a key of :data:`TARGETS`) on ``max_examples`` hostile inputs; the outcomes
    counted (``refused``, ``unreadable``, ``answered``), beside ``slowest_s``, the slowest example's
    seconds. An input the CLI mishandles fails with hypothesis's shrunk example."""
    strategy, check = TARGETS[target]
    counts: Counter = Counter()

    @settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy())
    def run(case: Any) -> None:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as where:
            counts[check(case, Path(where))] += 1
        counts["slowest_s"] = max(counts["slowest_s"], time.perf_counter() - t0)

    run()
    return counts
