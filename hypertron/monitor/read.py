"""Reading a run directory's JSON-lines files fast, and safely when they are torn.

Event and metrics files grow by a line per step: a long run holds millions of
lines per process. They are parsed with ``pyarrow.json`` (columnar, multi-threaded:
about 0.6 s per million lines on two cores) into numpy columns, not line by line.

A writer killed mid-line leaves a line without its newline (the event file starts the
next job on a fresh line), and a file being written may end mid-line. Such lines
are skipped and counted, never fatal: when pyarrow refuses a file (a torn line, or the
NaN that ``json.dumps`` writes for a diverged loss), its lines are read one by one. A line
the monitor cannot hold is skipped and counted the same way: not a JSON object, nested too deep to
parse, a column of the wrong type, an integer past int64, a ``time`` outside
:data:`~hypertron.runfiles.TIME_RANGE`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from hypertron.config.numbers import INT64
from hypertron.runfiles import EVENT_FIELDS, TIME_RANGE, sampled_metrics

_ARROW = {float: pa.float64(), int: pa.int64(), str: pa.string()}


def _event_columns(*names: str) -> dict[str, pa.DataType]:
    return {k: _ARROW[EVENT_FIELDS[k]] for k in names}


# The columns the monitor reads from events files (their types: runfiles.EVENT_FIELDS); other fields are ignored.
EVENT_COLUMNS = _event_columns("time", "event", "step", "step_time", "data_wait", "seconds", "blocking_seconds",
                               "status", "pid", "host", "reason", "loss", "process_count")
# What a process other than 0 is read for: its progress, step times, data waits and job ends (its job_start lines are
# picked out whole, for their pid and host: few strings make pyarrow faster).
PROGRESS_COLUMNS = _event_columns("time", "event", "step", "step_time", "data_wait", "status")
JOB_START = b'"event": "job_start"'
METRICS_COLUMNS = {"step": pa.int64(), "loss": pa.float64(), "eval_loss": pa.float64(), "time": pa.float64(),
                   "mfu": pa.float64(), "tokens_per_sec_per_device": pa.float64()}


def host_columns() -> dict[str, pa.DataType]:
    """The columns of host_metrics.<i>.jsonl (:data:`hypertron.runfiles.HOST_METRICS`): every
    figure is a number, or null."""
    return {"time": pa.float64(), "step": pa.int64(), **{m.key: pa.float64() for m in sampled_metrics()}}


@dataclass
class Columns:
    """One file as numpy columns (floats with NaN, ints with -1, strings as object arrays, for
    missing values), and how many lines could not be read."""

    data: dict[str, np.ndarray] = field(default_factory=dict)
    rows: int = 0
    bad_lines: int = 0
    torn: bool = False  # the file ends mid-line (counted in bad_lines)
    picked: list[dict] = field(default_factory=list)  # the lines holding ``pick``, whole

    def __getitem__(self, name: str) -> np.ndarray:
        return self.data[name]

    @property
    def unreadable(self) -> bool:
        """Whether the file has complete lines and none of them could be read."""
        return self.rows == 0 and self.bad_lines > int(self.torn)


def read_jsonl(path: str | Path, columns: dict[str, pa.DataType], pick: bytes | None = None) -> Columns:
    """The named columns of a JSON-lines file; torn or malformed lines are skipped and counted.
    With ``pick``, the readable lines that contain it are also returned whole, parsed."""
    raw = Path(path).read_bytes()
    bad = 0
    if raw and not raw.endswith(b"\n"):  # being written, or its writer was killed mid-line
        cut = raw.rfind(b"\n") + 1
        bad += 1 if raw[cut:].strip() else 0
        raw = raw[:cut]
    torn = bad == 1
    schema = pa.schema(list(columns.items()))
    table = None
    if raw and not raw.isspace():
        try:
            if _NOT_AN_OBJECT.search(raw):  # pyarrow's reader crashes the process on a line `null`
                raise pa.ArrowInvalid("a line that is not a JSON object")
            table = _parse(raw, schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            rows, skipped = _readable_rows(raw, columns)
            bad += skipped
            table = pa.Table.from_pylist(rows, schema=schema)
    out = _in_range(_to_numpy(table, columns, bad))
    out.torn = torn
    if pick is not None:
        out.picked = _pick(raw, pick)
    return out


def _pick(raw: bytes, needle: bytes) -> list[dict]:
    found, at = [], raw.find(needle)
    while at >= 0:
        lo, hi = raw.rfind(b"\n", 0, at) + 1, raw.find(b"\n", at)
        try:
            row = json.loads(raw[lo:hi])
            if isinstance(row, dict) and all(_holds(t, row.get(k)) for k, t in EVENT_COLUMNS.items()):
                found.append(row)
        except (ValueError, RecursionError):
            pass
        at = raw.find(needle, hi)
    return found


_NOT_AN_OBJECT = re.compile(rb"^[ \t\r]*[^{\s]", re.MULTILINE)


def _parse(raw: bytes, schema: pa.Schema) -> pa.Table:
    return pj.read_json(
        pa.BufferReader(raw),
        read_options=pj.ReadOptions(block_size=4 << 20),
        parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore",
                                      newlines_in_values=False),
    )


_CHECKS = {pa.float64(): (int, float), pa.int64(): (int,), pa.string(): (str,)}


def _holds(kind: pa.DataType, value: object) -> bool:
    """Whether a column of ``kind`` holds ``value``: its JSON type, an int within int64, an int a
    float64 can take."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, _CHECKS[kind]):
        return False
    if isinstance(value, int):
        return INT64[0] <= value <= INT64[1]
    return True


def _readable_rows(raw: bytes, columns: dict[str, pa.DataType]) -> tuple[list[dict], int]:
    """The lines that are JSON objects whose read columns have the right types, parsed (Python's
    reader also takes the NaN and Infinity that ``json.dumps`` writes for a diverged loss), and how
    many lines were not."""
    good, bad = [], 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested past Python's stack
            bad += 1
            continue
        ok = isinstance(row, dict) and all(_holds(t, row.get(k)) for k, t in columns.items())
        if ok:
            good.append({k: row.get(k) for k in columns})
        else:
            bad += 1
    return good, bad


def _to_numpy(table: pa.Table | None, columns: dict[str, pa.DataType], bad: int) -> Columns:
    n = 0 if table is None else table.num_rows
    out = Columns(rows=n, bad_lines=bad)
    for name, kind in columns.items():
        col = None if table is None else table.column(name)
        if kind == pa.float64():
            out.data[name] = np.full(n, np.nan) if col is None else col.to_numpy(zero_copy_only=False).astype(float)
        elif kind == pa.int64():
            out.data[name] = np.full(n, -1, np.int64) if col is None else col.fill_null(-1).to_numpy()
        else:
            out.data[name] = np.full(n, None, object) if col is None else _strings(col)
    return out


def _in_range(out: Columns) -> Columns:
    """``out`` without the rows whose ``time`` lies outside :data:`TIME_RANGE` (counted as bad)."""
    if "time" not in out.data:
        return out
    t = out.data["time"]
    with np.errstate(invalid="ignore"):
        outside = ~np.isnan(t) & ((t < TIME_RANGE[0]) | (t > TIME_RANGE[1]))
    if outside.any():
        keep = ~outside
        out.data = {k: v[keep] for k, v in out.data.items()}
        out.rows, out.bad_lines = int(keep.sum()), out.bad_lines + int(outside.sum())
    return out


def _strings(col: pa.ChunkedArray) -> np.ndarray:
    """A string column as an object array, through its dictionary (few distinct values: fast)."""
    encoded = pc.dictionary_encode(col).combine_chunks()
    values = np.asarray(encoded.dictionary.to_pylist() + [None], dtype=object)
    indices = encoded.indices.fill_null(len(values) - 1).to_numpy(zero_copy_only=False)
    return values[indices]
