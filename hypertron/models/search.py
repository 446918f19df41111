"""``hypertron plan --search``: the meshes, remat policies and micro-batch counts a run could use,
ranked by the planner's predicted step (:func:`hypertron.models.plan.plan`).

The run's model, global batch and sequence stay as given; what varies:

* the **mesh**: every way of writing the devices of one fast-link domain (a node's GPUs, a TPU
  slice's chips) as data x fsdp x context x tensor x stage (x expert for an MoE), and the domains
  (nodes, slices) as data x fsdp x stage over the network (``mesh.dcn``); tensor, context and
  expert stay inside a domain, where their per-layer collectives belong;
* ``model.remat``: none, dots, full;
* ``train.grad_accum``: every divisor of the global batch that leaves each data shard rows; with stages,
  ``train.pipeline_microbatches``: the stages times 1, 2, 4, ... up to the rows.

Each candidate is planned exactly as ``hypertron plan`` plans it: what ``train`` would refuse is
skipped, and so is what does not fit the device's memory. The rest are ranked by predicted step
time (the fastest first). Hardware without a fitted efficiency is refused in one line; a
candidate over a link with no bandwidth in the table is not ranked (and when no candidate has a
prediction, the search says why).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypertron.config import Config, ConfigError
from hypertron.config.schema import DcnConfig
from hypertron.hardware import lookup
from hypertron.models.plan import Plan, peak_format, plan, tpu_slice_devices

REMATS = ("none", "dots", "full")
INSIDE_ONLY = ("tensor", "context", "expert")  # never split across domains


@dataclass
class Candidate:
    overrides: tuple[str, ...]  # key=value settings that make the run this candidate
    plan: Plan
    step: float                 # predicted seconds

    @property
    def mfu(self) -> float:
        return self.plan.compute / self.step


def splits(n: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every way of writing ``n`` as a product of one factor per axis, in order."""
    if not axes:
        return [{}] if n == 1 else []
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out.extend({axes[0]: d, **rest} for rest in splits(n // d, axes[1:]))
    return out


def _settings(ici: dict[str, int], dcn: dict[str, int]) -> tuple[str, ...]:
    out = [f"mesh.{a}={ici.get(a, 1)}" for a in ("data", "fsdp", "expert", "context", "tensor", "stage")]
    out += [f"mesh.dcn.{a}={n}" for a, n in dcn.items() if n > 1]
    return tuple(out)


def search(cfg: Config, hardware: str, devices: int, per_node: int | None = None, top: int = 5,
           ) -> tuple[list[Candidate], int]:
    """The ``top`` fastest candidates that fit, and how many were planned (module docstring)."""
    hw = lookup(hardware)
    if devices < 1:
        raise ConfigError(f"--devices={devices}: must be at least 1")
    fmt = peak_format(cfg.model)
    if not hw.achieved(fmt):
        raise ConfigError(f"--hardware={hardware}: no fitted {fmt} efficiency, so no predicted step to rank by "
                          "(docs/memory.md, \"Held to published results\"); hypertron plan without --search gives "
                          "one mesh's memory and bounds")
    domain = per_node or (tpu_slice_devices(cfg, hw, devices) if hw.slice_max else hw.per_node)
    domain = min(domain, devices)
    if devices % domain:
        raise ConfigError(f"--devices={devices}: does not fill domains of {domain} devices evenly")
    domains = devices // domain
    axes = ("data", "fsdp", "context", "tensor", "stage") + (("expert",) if cfg.model.moe is not None else ())
    across = tuple(a for a in axes if a not in INSIDE_ONLY)
    found: list[Candidate] = []
    planned = unpredicted = 0
    accums = divisors(cfg.train.global_batch)
    for dcn in splits(domains, across):
        for ici in splits(domain, axes):
            mesh = replace(cfg.mesh, **{a: ici.get(a, 1) for a in cfg.mesh.AXES},
                           dcn=DcnConfig(**{a: dcn.get(a, 1) for a in cfg.mesh.AXES}) if domains > 1 else DcnConfig())
            for remat in REMATS:
                base = replace(cfg, mesh=mesh, model=replace(cfg.model, remat=remat),
                               train=replace(cfg.train, grad_accum=1))
                for run, extra in _batch_splits(base, ici.get("stage", 1) * dcn.get("stage", 1), accums):
                    try:
                        p = plan(run, hardware, devices, domain)
                    except ConfigError:
                        continue
                    planned += 1
                    step = p.predict()
                    if p.fits is False:
                        continue
                    if step is None:  # a link without a bandwidth or factor (the plan's notes say which)
                        unpredicted += 1
                        continue
                    found.append(Candidate(_settings(ici, dcn) + (f"model.remat={remat}",) + extra, p, step))
    # Ties (the compute hides every collective) go to the least communication, then the least memory.
    found.sort(key=lambda c: (round(c.step, 6), sum(a.bytes for a in c.plan.axes), c.plan.memory.total))
    if not found and unpredicted:
        raise ConfigError(f"{unpredicted} of the {planned} candidates fit but none has a predicted step: "
                          f"{hardware} has no bandwidth or fitted factor for a link they use (hypertron plan with "
                          "one of them names it)")
    return found[:top], planned


def divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _batch_splits(cfg: Config, stages: int, accums: list[int]):
    """(config, its settings) for each micro-batch count: ``grad_accum`` each of ``accums`` (the
    global batch's divisors; the checks refuse what leaves a data shard no row); with stages,
    pieces instead (the pipeline splits the batch): the stage count times a power of 2, up to the
    batch (the checks refuse what a data shard's rows cannot give)."""
    batch = cfg.train.global_batch
    if stages > 1:
        pieces = stages
        while pieces <= batch:
            if batch % pieces == 0:
                yield (replace(cfg, train=replace(cfg.train, pipeline_microbatches=pieces)),
                       (f"train.pipeline_microbatches={pieces}",))
            pieces *= 2
        return
    for accum in accums:
        yield replace(cfg, train=replace(cfg.train, grad_accum=accum)), (f"train.grad_accum={accum}",)


def render(found: list[Candidate], planned: int, baseline: Candidate | None = None):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"the fastest that fit, of {planned} planned (predicted; docs/memory.md)",
                  title_justify="left", show_edge=False)
    for col in ("#", "mesh", "remat", "micro-batches", "memory", "step", "MFU", "tokens/s/device",
                "compute", "hidden comm", "exposed comm"):
        table.add_column(col, justify="left" if col in ("mesh", "remat") else "right")
    for i, c in enumerate(found, 1):
        p = c.plan
        busy, hidden, exposed = p.terms()
        mesh = " x ".join(f"{a} {n}" for a, n in p.mesh.items() if n > 1) or "one device"
        settings = dict(s.split("=", 1) for s in c.overrides)
        micro = settings.get("train.pipeline_microbatches", settings.get("train.grad_accum", "1"))
        table.add_row(str(i), mesh, settings["model.remat"], micro, f"{p.memory.total / 2**30:.1f} GiB",
                      f"{1e3 * c.step:.0f} ms", f"{100 * c.mfu:.1f}%", f"{p.tokens / c.step / p.devices:,.0f}",
                      f"{1e3 * busy:.0f} ms", f"{1e3 * hidden:.0f} ms", f"{1e3 * exposed:.0f} ms")
    parts: list = [table]
    if found:
        parts.append(Text("the first: " + " ".join(found[0].overrides)))
    else:
        parts.append(Text("nothing fits: fewer rows per device (train.global_batch), a shorter train.seq_len or "
                          "more devices", style="bold red"))
    return Group(*parts)
