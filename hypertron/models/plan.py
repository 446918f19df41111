"""``hypertron plan``: before launching, what a run needs per device and how fast it should go.

From the config, a hardware entry (:mod:`hypertron.hardware`) and a device count:

* **memory** per device (:mod:`hypertron.models.memory`: the state exact, activations estimated)
  against the device's;
* **compute time** per step: the model's training FLOPs (:mod:`hypertron.models.flops`) over
  the devices at their peak (fp8's peak for ``model.quantization=fp8``, int8's for int8);
* **communication** per mesh axis, bytes each device sends per step over the links the axis
  uses (inside a node, or across nodes when ``mesh.dcn`` puts the axis there, or when the axis
  is longer than a node), as ring collectives send them:

  - fsdp ``F``: all-gather of the parameters in the forward and again in the backward, and a
    reduce-scatter of the gradients: ``(2 P_c + P_p) (F - 1) / F`` with ``P`` the parameters
    each fsdp group holds (compute and parameter dtype);
  - data ``D``: all-reduce of each device's gradient shard: ``2 G (D - 1) / D``;
  - tensor ``T``: two all-reduces of the residual stream per layer forward and two backward:
    ``4 L x 2 A (T - 1) / T`` with ``A = b t d c``;
  - expert ``E``: the routed copies' all-to-all there and back, forward and backward:
    ``4 L b t top_k d c (E - 1) / E``;

* **predicted step time**: between compute + communication (nothing overlaps) and the larger of
  the two (everything overlaps), and the MFU that gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypertron.config import Config, ConfigError
from hypertron.config.validation import check_devices
from hypertron.models.flops import train_flops_per_token
from hypertron.hardware import Hardware, host_memory_per_device, lookup
from hypertron.models.memory import DTYPE_BYTES, StepBytes, compute_dtype, param_dtype, step_bytes
from hypertron.units import describe_bytes

GPUS = ("h100", "h100-pcie", "h100-nvl", "h200", "a100")


@dataclass
class Axis:
    name: str
    size: int
    across: bool         # whether its collectives cross nodes
    bytes: float         # sent per device per step
    seconds: float | None


@dataclass
class Plan:
    hardware: Hardware
    devices: int
    nodes: int
    mesh: dict[str, int]
    memory: StepBytes
    device_memory: float | None
    compute: float | None           # seconds per step at peak
    axes: list[Axis] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bubble: float = 0.0  # the pipeline's idle share of a step, (stage - 1) / (pieces x repeats + stage - 1)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.memory.total <= self.device_memory

    @property
    def comm(self) -> float | None:
        times = [a.seconds for a in self.axes]
        return None if any(t is None for t in times) else sum(times)

    def step_range(self) -> tuple[float, float] | None:
        if self.compute is None or self.comm is None:
            return None
        busy = self.compute / (1 - self.bubble)  # the stages' idle iterations added
        return max(busy, self.comm), busy + self.comm


def plan(cfg: Config, hardware: str, devices: int | None = None, per_node: int | None = None) -> Plan:
    """The plan of ``cfg`` on ``devices`` devices of ``hardware`` (default: one node's), in nodes
    (processes) of ``per_node`` devices (default: the hardware's)."""
    hw = lookup(hardware)
    per_node = per_node or hw.per_node
    devices = per_node if devices is None else devices
    if devices < 1:
        raise ConfigError(f"--devices={devices}: must be at least 1")
    nodes = -(-devices // per_node)
    if devices % nodes:
        raise ConfigError(f"--devices={devices}: does not fill {nodes} nodes of {per_node} evenly")
    accelerator, gpu = hw.name != "cpu", hw.name in GPUS
    # train's own checks of its devices, on these (a process per node): a plan that fits is a run that starts
    mesh = check_devices(cfg, devices, nodes, devices // nodes, "gpu" if gpu else hw.name.split("-")[0])
    ici, dcn = cfg.mesh.split(devices, nodes)
    mem = step_bytes(cfg, mesh, accelerator=accelerator, gpu=gpu, hopper=hw.name.startswith(("h100", "h200")))
    device_memory = hw.memory
    if device_memory is None and hw.name == "cpu":
        device_memory = host_memory_per_device(devices)
    m, t = cfg.model, cfg.train
    fmt = {"fp8": "fp8", "int8": "int8"}.get(m.quantization, "bf16")
    peak = hw.peak(fmt)
    flops = train_flops_per_token(m, t.seq_len) * t.global_batch * t.seq_len
    out = Plan(hw, devices, nodes, mesh, mem, device_memory, flops / devices / peak if peak else None)
    if peak is None:
        out.notes.append(f"{hw.name} has no {fmt} peak in the table: no compute time or MFU")

    c = DTYPE_BYTES[compute_dtype(m, accelerator)]
    p = DTYPE_BYTES[param_dtype(m, accelerator)]
    params_per_device = mem.state.params / p  # elements
    act = mem.micro_batch * t.seq_len * m.embed_dim * c * t.grad_accum
    inner = 1
    if mesh["stage"] > 1:
        pieces = t.pipeline_microbatches or mesh["stage"]
        out.bubble = (mesh["stage"] - 1) / (pieces * t.pipeline_repeats + mesh["stage"] - 1)
    for a in ("stage", "tensor", "context", "expert", "fsdp", "data"):  # fastest-varying first: inside-node axes
        size = mesh[a]
        if size == 1:
            continue
        # An axis crosses nodes when mesh.dcn splits it, or when it is longer than what is left
        # of a node after the faster axes.
        across = dcn[a] > 1 or (nodes > 1 and not cfg.mesh.dcn.hybrid and inner * size > per_node)
        inner *= size
        frac = (size - 1) / size
        if a == "fsdp":
            sent = (2 * params_per_device * size * c + params_per_device * size * p) * frac
        elif a == "context":  # each layer's keys and values gathered, their gradients scattered back;
            # the weights gathered and their gradients scattered as over fsdp (embed is split over both)
            kv = mem.micro_batch * t.seq_len * m.num_kv_heads * m.head_dim * c * t.grad_accum
            sent = (2 * m.num_layers * 2 * kv + 2 * params_per_device * size * c + params_per_device * size * p) * frac
        elif a == "data":
            sent = 2 * mem.state.grads * frac
        elif a == "stage":  # a piece's activations handed on each iteration, forward and backward
            pieces = t.pipeline_microbatches or size
            sent = 2 * (pieces * t.pipeline_repeats + size - 1) / pieces * act
        elif a == "tensor":
            sent = 4 * m.num_layers * 2 * act * frac
        else:
            top_k = m.moe.top_k if m.moe is not None else 1
            sent = 4 * m.num_layers * act * top_k * frac
        bandwidth = (hw.across / hw.per_node if hw.across else None) if across else hw.inside
        out.axes.append(Axis(a, size, across, sent, sent / bandwidth if bandwidth else None))
        if bandwidth is None:
            out.notes.append(f"{hw.name}: no {'across-node' if across else 'inside-node'} bandwidth in the "
                             f"table: no time for the {a} axis")
    return out


def to_json(p: Plan) -> dict[str, Any]:
    s = p.memory.state
    rng = p.step_range()
    return {
        "hardware": p.hardware.name, "devices": p.devices, "nodes": p.nodes, "mesh": p.mesh,
        "memory": {"params": s.params, "grads": s.grads, "optimizer": s.optimizer, "fp8_histories": s.fp8_histories,
                   "reference": s.reference, "frozen_base": s.base,
                   "activations": p.memory.activations, "total": p.memory.total, "device": p.device_memory,
                   "fits": p.fits},
        "compute_seconds": p.compute,
        "bubble": p.bubble,
        "axes": [vars(a) for a in p.axes],
        "step_seconds": list(rng) if rng else None,
        "mfu": [p.compute / rng[1], p.compute / rng[0]] if rng else None,
        "notes": p.notes,
    }


def render(p: Plan):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = p.memory.state
    head = Text(f"{p.hardware.name} x {p.devices} ({p.nodes} node{'s' * (p.nodes > 1)})  ·  mesh "
                + " x ".join(f"{a} {n}" for a, n in p.mesh.items() if n > 1 or a == "fsdp"), style="bold")
    mem = Table(title="memory per device", title_justify="left", show_edge=False)
    mem.add_column("part")
    mem.add_column("bytes", justify="right")
    for name, v in (("parameters", s.params), ("gradients", s.grads), ("optimiser state", s.optimizer),
                    ("fp8 histories", s.fp8_histories), ("DPO reference", s.reference), ("frozen base (LoRA)", s.base),
                    (f"activations (estimate: {p.memory.micro_batch} row{'s' * (p.memory.micro_batch != 1)} per "
                     f"device{', flash attention' if p.memory.flash else ''})", p.memory.activations)):
        if v or name not in ("fp8 histories", "DPO reference", "frozen base (LoRA)"):
            mem.add_row(name, describe_bytes(v))
    mem.add_row("total", describe_bytes(p.memory.total), style="bold")
    parts: list[Any] = [head, mem]
    if p.device_memory is not None:
        share = p.memory.total / p.device_memory
        parts.append(Text(f"{'fits' if p.fits else 'does not fit'}: {describe_bytes(p.memory.total)} of "
                          f"{describe_bytes(p.device_memory)} per device ({100 * share:.0f}%)",
                          style="green" if p.fits else "bold red"))
    if p.compute is not None:
        parts.append(Text(f"compute: {1e3 * p.compute:.1f} ms per step at peak"))
    if p.bubble:
        parts.append(Text(f"pipeline bubble: {100 * p.bubble:.0f}% of a step idle (stages - 1 of pieces x repeats + stages - 1)"))
    if p.axes:
        comm = Table(title="communication per step (ring collectives)", title_justify="left", show_edge=False)
        for col in ("axis", "size", "links", "sent per device", "time"):
            comm.add_column(col, justify="right" if col in ("size", "sent per device", "time") else "left")
        for a in p.axes:
            comm.add_row(a.name, str(a.size), "across nodes" if a.across else "inside a node", describe_bytes(a.bytes),
                         "-" if a.seconds is None else f"{1e3 * a.seconds:.1f} ms")
        parts.append(comm)
    rng = p.step_range()
    if rng:
        lo, hi = rng
        parts.append(Text(f"predicted step: {1e3 * lo:.1f} ms (communication hidden) to {1e3 * hi:.1f} ms "
                          f"(none hidden); MFU {100 * p.compute / hi:.0f}% to {100 * p.compute / lo:.0f}%",
                          style="bold"))
    for n in p.notes:
        parts.append(Text(n, style="dim"))
    return Group(*parts)
