"""Where each embedding table goes: a small planner that says why (``hypertron embed plan``).

For each table it weighs the bytes a device holds (the table and its optimiser state, float32)
against the bytes a device exchanges per step, with the batch's ids spread over the ``S``
devices by samples (as a data-parallel model holds them). Per table, with ``N`` ids and ``P``
pooled rows of ``dim`` per step (all features reading it), an id costs 12 bytes (its row, its
sample, its weight) and a pooled value 4:

- ``table``: one device holds it all. Its owner receives the ids of the other devices and sends
  them their pooled rows: ``(12 N + 4 P dim) (S - 1) / S`` on the owner, nothing elsewhere.
- ``row``: every device holds ``1 / S`` of the rows. Each sends its ids to their owners and
  takes part in the reduce-scatter of the partial poolings: ``(12 N / S + 4 P dim) (S - 1) / S``
  on every device.
- ``column``: every device holds ``1 / S`` of the columns of every row. Each receives every id
  and sends its columns of the other devices' samples: ``(12 N + 4 P dim / S) (S - 1) / S``.
- ``data``: every device holds it all and pools its own samples; the gradient of the whole table
  is summed over the devices (an all-reduce): ``8 rows dim (S - 1) / S`` on every device.

The rule: a table that takes at most ``1 / S`` of a device whole goes table-wise (no partial sums,
``S`` times less traffic than splitting it), largest tables first, each onto the device that
exchanges the fewest bytes so far among those it fits on (then the one holding fewest); a larger one
is split, row-wise or column-wise, whichever exchanges fewer bytes (column-wise only when ``S``
divides its dimension). A placement given by hand is kept. With no table to go whole on one device
(``split_all``: a job of several processes, where a table-wise table is asked by hand), a table that
could have gone whole goes data-parallel instead where that exchanges fewer bytes than splitting it
(TorchRec's planner keeps small tables so). On one device a table with no more rows than the step's
ids goes data-parallel too: a model's step pools it from the batch's own ids, with no routing, and
the gradient of the whole table is no larger than the ids' rows would be. The plan fits when every
device's total is within its memory.

The exchange figures are this model's, for the input pipeline the module is built for; they are
not measured (``bench/embed.py`` measures lookups).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence

from hypertron.config.numbers import INT32, check_number
from hypertron.embed.spec import PLACEMENTS, EmbedError, FeatureSpec, TableSpec, check_specs
from hypertron.units import describe_bytes

ID_BYTES = 12
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Choice:
    table: TableSpec           # with the chosen placement
    owner: int | None          # table-wise: the device
    held: int                  # bytes on each device that holds part of it (table-wise: the owner)
    ids: int                   # ids looked up per step
    exchanged: int             # bytes through the busiest device per step (modelled)
    reason: str
    by_hand: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    shards: int
    batch: int
    device_bytes: int
    choices: list[Choice]
    per_device: list[int]      # bytes held per device
    exchanged: list[int]       # bytes exchanged per device per step (modelled)

    @property
    def fits(self) -> bool:
        return max(self.per_device) <= self.device_bytes


def exchanged(spec: TableSpec, placement: str, shards: int, ids: int, pooled: int) -> int:
    """Bytes one device (the busiest) exchanges per step for ``spec`` under ``placement``."""
    s, d = shards, spec.dim
    per = {"table": ID_BYTES * ids + 4 * pooled * d,
           "row": ID_BYTES * ids / s + 4 * pooled * d,
           "column": ID_BYTES * ids + 4 * pooled * d / s,
           "data": 8 * spec.rows * d}[placement]
    return int(per * (s - 1) / s)


def plan(tables: Sequence[TableSpec], features: Sequence[FeatureSpec], ids_per_sample: Mapping[str, float], *,
         shards: int, batch: int, device_bytes: int, split_all: bool = False) -> Plan:
    """A placement for every table whose ``placement`` is ``auto`` (the others are kept), with
    bytes held and exchanged per device and the reason. ``ids_per_sample``: by feature, the mean.
    ``split_all``: no table whole on one device (a job of several processes, where a table-wise
    table takes grouping, :mod:`hypertron.embed.batched`, asked by hand)."""
    if shards < 1 or batch < 1 or device_bytes < 1:
        raise EmbedError(f"devices={shards}, batch={batch}, device memory={device_bytes}: all must be positive")
    by_hand = {t.name for t in tables if t.placement != AUTO}
    check_specs([t if t.placement != AUTO else dataclasses.replace(t, placement="row") for t in tables],
                features, shards)
    for f in features:
        if ids_per_sample.get(f.name, 1.0) < 0:
            raise EmbedError(f"feature {f.name!r}: ids_per_sample={ids_per_sample[f.name]}: must not be negative")
    ids = {t.name: 0.0 for t in tables}
    pooled = {t.name: 0 for t in tables}
    for f in features:
        ids[f.table] += batch * ids_per_sample.get(f.name, 1.0)
        pooled[f.table] += batch
    held = [0] * shards
    choices: dict[str, Choice] = {}
    share = device_bytes / shards

    def cost(t: TableSpec, placement: str) -> int:
        return exchanged(t, placement, shards, int(ids[t.name]), pooled[t.name])

    whole = []
    for t in sorted(tables, key=lambda t: -t.device_bytes(1, "table")):
        n, size = int(ids[t.name]), t.device_bytes(1, "table")
        if t.name in by_hand:
            if t.placement != "table":
                choices[t.name] = Choice(t, None, t.device_bytes(shards), n, cost(t, t.placement), "set by hand", True)
            else:
                whole.append((t, "set by hand"))
            continue
        if shards == 1 and t.rows <= n:
            choices[t.name] = Choice(dataclasses.replace(t, placement="data"), None, size, n, 0,
                                     f"one device, no more rows than ids a step ({n:,}): pooled in the step from "
                                     f"the batch's ids, no routing, its gradient no larger than theirs", False)
            continue
        if shards == 1 or (size <= share and not split_all):
            whole.append((t, "one device" if shards == 1 else
                          f"{describe_bytes(size)} whole, at most 1/{shards} of a device: "
                          f"no partial sums, and {shards} times less traffic than split"))
            continue
        row, column, data = cost(t, "row"), cost(t, "column"), cost(t, "data")
        split = (f"{describe_bytes(size)} whole, more than 1/{shards} of a device" if size > share else
                 "no table whole on one device on several processes")
        if size <= share and data < min(row, column if t.dim % shards == 0 else row):
            placement = "data"
            why = (f"{describe_bytes(size)} whole on every device: its gradient's all-reduce exchanges "
                   f"{describe_bytes(data)} a step, row-wise {describe_bytes(row)}")
        elif t.dim % shards == 0 and column < row:
            placement = "column"
            why = f"{split}; column-wise exchanges {describe_bytes(column)} a step, row-wise {describe_bytes(row)}"
        else:
            placement = "row"
            why = f"{split}; row-wise exchanges {describe_bytes(row)} a step" + (
                f", column-wise {describe_bytes(column)}" if t.dim % shards == 0 else
                f" (column-wise needs {shards} to divide dim={t.dim})")
        t = dataclasses.replace(t, placement=placement)
        choices[t.name] = Choice(t, None, t.device_bytes(shards), n, cost(t, placement), why, False)
    sent = [0] * shards
    for c in choices.values():
        held = [h + c.held for h in held]
        sent = [x + c.exchanged for x in sent]
    for t, why in whole:  # largest first, each onto the least busy device it fits on (then the emptiest)
        t = dataclasses.replace(t, placement="table")
        size = t.device_bytes(shards)
        room = [d for d in range(shards) if held[d] + size <= device_bytes] or list(range(shards))
        owner = min(room, key=lambda d: (sent[d], held[d]))
        held[owner] += size
        sent[owner] += cost(t, "table")
        choices[t.name] = Choice(t, owner, size, int(ids[t.name]), cost(t, "table"), why, t.name in by_hand)
    return Plan(shards, batch, device_bytes, [choices[t.name] for t in tables], held, sent)


def load(doc: object, where: str = "the plan's file") -> tuple[list[TableSpec], list[FeatureSpec], dict, int]:
    """Tables, features, ids per sample and batch from a parsed YAML/JSON document::

        batch: 4096
        tables: [{name: items, rows: 40000000, dim: 128, optimizer: rowwise_adagrad, placement: auto}]
        features: [{name: clicked, table: items, combiner: sum, ids_per_sample: 20}]
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), list) \
            or not isinstance(doc.get("features") or [], list):
        raise EmbedError(f"{where}: needs a mapping with a list of tables (and features, batch)")
    unknown = set(doc) - {"batch", "tables", "features"}
    if unknown:
        raise EmbedError(f"{where}: unknown key {sorted(unknown, key=str)[0]!r} (batch, tables, features)")

    def build(cls, item: object, extra: tuple[str, ...], kind: str):
        if not isinstance(item, dict):
            raise EmbedError(f"{where}: a {kind} must be a mapping, not {item!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        label = f"{where}: {kind} {item.get('name', '?')!r}"
        bad = set(item) - fields - set(extra)
        if bad:
            raise EmbedError(f"{label}: unknown key {sorted(bad, key=str)[0]!r} "
                             f"({', '.join(sorted(fields | set(extra)))})")
        try:
            return cls(**{k: _field(cls, k, v, label) for k, v in item.items() if k in fields})
        except TypeError as e:
            raise EmbedError(f"{label}: {e}") from None

    tables = [build(TableSpec, dict({"placement": AUTO}, **t) if isinstance(t, dict) else t, (), "table")
              for t in doc["tables"]]
    for t in tables:
        if t.placement not in (*PLACEMENTS, AUTO):
            raise EmbedError(f"table {t.name!r}: placement={t.placement!r}: must be one of "
                             f"{', '.join((*PLACEMENTS, AUTO))}")
    features = [build(FeatureSpec, f, ("ids_per_sample",), "feature") for f in doc.get("features") or []]
    per = {f.name: _ids_per_sample(item.get("ids_per_sample", 1), f"{where}: feature {f.name!r}")
           for f, item in zip(features, doc.get("features") or [])}
    batch = doc.get("batch", 1)
    if _number(batch, int, low=1, high=MAX_COUNT) is None:
        raise EmbedError(f"{where}: batch={batch!r}: must be a positive whole number (at most {MAX_COUNT})")
    return tables, features, per, batch


# The most samples per step, ids per sample, rows or columns a spec may ask for: a count int32 holds.
MAX_COUNT = INT32[1]


def _number(value: object, kind: type, **bounds: float) -> int | float | None:
    """A YAML number (never a string) of ``kind`` within ``bounds``, or None."""
    return None if isinstance(value, str) else check_number(value, kind, **bounds)[0]


def _ids_per_sample(value: object, label: str) -> float:
    number = _number(value, float, low=0, high=MAX_COUNT)
    if number is None:
        raise EmbedError(f"{label}: ids_per_sample={value!r}: must be a number from 0 to {MAX_COUNT}")
    return number


def _field(cls: type, key: str, value: object, label: str) -> object:
    """A spec file's ``value`` for the field ``key`` of ``cls``, checked against the field's type:
    a string, a whole number from 1 to :data:`MAX_COUNT` (rows, dim), or a finite number (or null,
    where the field may be None)."""
    hint = typing.get_type_hints(cls)[key]
    if value is None and type(None) in typing.get_args(hint):
        return None
    kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if kind is str and not isinstance(value, str):
        raise EmbedError(f"{label}: {key} must be a string, not {value!r}")
    if kind is str:
        return value
    number = _number(value, kind, **({"low": 1, "high": MAX_COUNT} if kind is int else {}))
    if number is None and kind is int:
        raise EmbedError(f"{label}: rows and dim must be whole numbers from 1 to {MAX_COUNT} ({key}={value!r})")
    if number is None:
        raise EmbedError(f"{label}: {key}={value!r}: must be a finite number")
    return number


def to_json(p: Plan) -> dict:
    return {"devices": p.shards, "batch": p.batch, "device_bytes": p.device_bytes, "fits": p.fits,
            "bytes_per_device": p.per_device, "bytes_exchanged_per_device": p.exchanged,
            "tables": [{"table": c.table.name, "rows": c.table.rows, "dim": c.table.dim,
                        "optimizer": c.table.optimizer, "placement": c.table.placement, "owner": c.owner,
                        "bytes_held": c.held, "ids_per_step": c.ids, "bytes_exchanged_per_step": c.exchanged,
                        "reason": c.reason, "by_hand": c.by_hand} for c in p.choices]}


def render(p: Plan):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"{len(p.choices)} tables over {p.shards} devices of {describe_bytes(p.device_bytes)}, batch {p.batch}",
                style="bold")
    t = Table(show_edge=False)
    for col in ("table", "rows x dim", "placement", "held / device", "ids / step", "exchanged / step"):
        t.add_column(col, justify="left" if col in ("table", "placement") else "right")
    why = []
    for c in p.choices:
        where = c.table.placement + (f" (device {c.owner})" if c.owner is not None else "")
        t.add_row(c.table.name, f"{c.table.rows:,} x {c.table.dim}", where, describe_bytes(c.held), f"{c.ids:,}",
                  describe_bytes(c.exchanged))
        why.append(Text(f"{c.table.name}: {c.reason}"))
    most = max(range(p.shards), key=lambda d: p.per_device[d])
    verdict = Text(f"{'fits' if p.fits else 'does not fit'}: the fullest device (device {most}) holds "
                   f"{describe_bytes(p.per_device[most])} of {describe_bytes(p.device_bytes)}; the emptiest "
                   f"{describe_bytes(min(p.per_device))}", style="green" if p.fits else "bold red")
    busiest = max(range(p.shards), key=lambda d: p.exchanged[d])
    traffic = Text(f"the busiest device (device {busiest}) exchanges {describe_bytes(p.exchanged[busiest])} a step; "
                   f"the quietest {describe_bytes(min(p.exchanged))}")
    note = Text("exchanged: bytes per step, modelled (docs/embeddings.md); a table's figure is its busiest "
                "device's", style="dim")
    return Group(head, t, *why, verdict, traffic, note)
