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

* **bounds**: the step between compute + communication at peak rates (nothing overlaps) and the
  larger of the two (everything overlaps);
* **predicted step time**, MFU and tokens/s: the matmuls at the hardware's fitted share of its peak
  (``Hardware.efficiency``), plus what the remat policy runs again, over ``1 - bubble``; each
  axis's bytes at its link kind's fitted share of the bandwidth (``LINK_EFFICIENCY``); the
  collectives of fsdp, context, stage and tensor hidden behind the compute as far as it lasts,
  those of data (after the last backward) and expert (the layer waits for its tokens) not
  (:data:`EXPOSED`). The factors are fitted on published results and checked against the others
  (:mod:`hypertron.models.published`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypertron.config import Config, ConfigError
from hypertron.config.validation import check_devices
from hypertron.models.flops import RECOMPUTED, recompute_flops_per_token, train_flops_per_token
from hypertron.hardware import LINK_EFFICIENCY, Hardware, host_memory_per_device, lookup
from hypertron.models.memory import DTYPE_BYTES, StepBytes, compute_dtype, param_dtype, step_bytes
from hypertron.units import describe_bytes

GPUS = ("h100", "dgx-h100", "h100-pcie", "h100-nvl", "h200", "a100")
# Axes whose collectives the step waits for: expert's all-to-all (the experts need its tokens),
# data's gradient all-reduce after the last backward. The rest overlap the compute: fsdp's and
# context's gathers run ahead of their layers, and tensor's all-reduces are overlapped with the
# matmuls around them in the published runs the prediction is held to (MaxText's async collective
# fusion flags, Megatron's TP communication overlap).
EXPOSED = ("expert", "data")


@dataclass
class Axis:
    name: str
    size: int
    across: bool         # whether its collectives cross nodes (TPU: slices)
    bytes: float         # sent per device per step
    seconds: float | None  # at the link's full bandwidth
    link: str = "nvlink"   # the link kind (hardware.LINK_EFFICIENCY)

    @property
    def predicted(self) -> float | None:
        """Seconds at the link kind's fitted share of its bandwidth (None when either is unknown)."""
        share = LINK_EFFICIENCY.get(self.link)
        return None if self.seconds is None or not share else self.seconds / share


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
    recompute: float = 1.0  # the step's matmul FLOPs over the model's (remat's recomputation)
    format: str = "bf16"    # the peak the matmuls run at (bf16, fp8, int8)
    tokens: int = 0         # per step, all devices

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

    def terms(self) -> tuple[float, float, float] | None:
        """The prediction's seconds: (compute at the fitted efficiency with the recomputation and
        the bubble, the hidden axes' communication, the exposed axes'); None where a factor or
        figure is missing (``notes`` says which)."""
        share = self.hardware.achieved(self.format)
        if self.compute is None or not share:
            return None
        times = {a.name: a.predicted for a in self.axes}
        if any(t is None for t in times.values()):
            return None
        busy = self.compute * self.recompute / share / (1 - self.bubble)
        return (busy, sum(t for a, t in times.items() if a not in EXPOSED),
                sum(t for a, t in times.items() if a in EXPOSED))

    def predict(self) -> float | None:
        """The predicted step in seconds (module docstring): the compute or the hidden
        communication, whichever is longer, plus the exposed; None as :meth:`terms`."""
        terms = self.terms()
        if terms is None:
            return None
        busy, hidden, exposed = terms
        return max(busy, hidden) + exposed

    def predicted_mfu(self) -> float | None:
        step = self.predict()
        return None if step is None else self.compute / step


def peak_format(model) -> str:
    """The peak a model's training matmuls run at: fp8's or int8's when quantised, else bf16's."""
    return {"fp8": "fp8", "int8": "int8"}.get(model.quantization, "bf16")


def tpu_slice_devices(cfg: Config, hw: Hardware, devices: int) -> int:
    """A TPU's chips a slice, ``devices`` over ``launch.slices`` slices (the default 1: as few as
    hold them, each at most the generation's largest)."""
    if devices < 1:
        raise ConfigError(f"--devices={devices}: must be at least 1")
    slices = cfg.launch.slices if cfg.launch.slices > 1 else -(-devices // hw.slice_max)
    if devices % slices:
        raise ConfigError(f"--devices={devices}: does not split evenly over {slices} {hw.name} slices (launch.slices)")
    if devices // slices > hw.slice_max:
        raise ConfigError(f"launch.slices={slices}: {devices // slices} chips a slice, more than a {hw.name} slice "
                          f"holds ({hw.slice_max})")
    return devices // slices


def plan(cfg: Config, hardware: str, devices: int | None = None, per_node: int | None = None,
         recompute: tuple[str, ...] | None = None, checked: bool = True) -> Plan:
    """The plan of ``cfg`` on ``devices`` devices of ``hardware`` (default: one node's), in nodes
    (processes) of ``per_node`` devices (default: the hardware's; for a TPU, the slice: every
    device in one, up to the largest slice there is). ``recompute``: the groups of the layers'
    forward matmuls the backward runs again (default: ``model.remat``'s, :data:`~hypertron.models.flops.RECOMPUTED`).
    ``checked=False`` skips ``train``'s checks of the devices (a published run of another framework,
    with what hypertron does not run yet)."""
    hw = lookup(hardware)
    devices = (per_node or hw.per_node) if devices is None else devices
    if devices < 1:
        raise ConfigError(f"--devices={devices}: must be at least 1")
    if per_node is None:
        per_node = tpu_slice_devices(cfg, hw, devices) if hw.slice_max else hw.per_node
    nodes = -(-devices // per_node)  # the fast-link domains: nodes, or TPU slices
    if devices % nodes:
        raise ConfigError(f"--devices={devices}: does not fill {nodes} nodes of {per_node} evenly")
    accelerator, gpu = hw.name != "cpu", hw.name in GPUS
    # train's own checks of its devices, on these: a plan that fits is a run that starts. A process
    # per node; on a TPU, per VM (hw.per_node chips), the slices being what the dcn axes span.
    if hw.slice_max and per_node > hw.per_node and per_node % hw.per_node:
        raise ConfigError(f"--devices={devices}: a {hw.name} slice of {per_node} chips is no whole number of "
                          f"{hw.per_node}-chip VMs")
    processes, granules = (nodes * max(1, per_node // hw.per_node), nodes) if hw.slice_max else (nodes, None)
    mesh = check_devices(cfg, devices, processes, devices // processes, "gpu" if gpu else hw.name.split("-")[0],
                         granules) if checked else cfg.mesh.shape(devices, nodes)
    ici, dcn = cfg.mesh.split(devices, nodes)
    mem = step_bytes(cfg, mesh, accelerator=accelerator, gpu=gpu, hopper=hw.name.startswith(("h100", "h200", "dgx-h100")),
                     tpu=bool(hw.slice_max))
    device_memory = hw.memory
    if device_memory is None and hw.name == "cpu":
        device_memory = host_memory_per_device(devices)
    m, t = cfg.model, cfg.train
    fmt = peak_format(m)
    peak = hw.peak(fmt)
    per_token = train_flops_per_token(m, t.seq_len)
    again = recompute_flops_per_token(m, t.seq_len, RECOMPUTED[m.remat] if recompute is None else recompute)
    tokens = t.global_batch * t.seq_len
    out = Plan(hw, devices, nodes, mesh, mem, device_memory, per_token * tokens / devices / peak if peak else None,
               recompute=(per_token + again) / per_token, tokens=tokens, format=fmt)
    if peak is None:
        out.notes.append(f"{hw.name} has no {fmt} peak in the table: no compute time or MFU")
    elif not hw.achieved(fmt):
        out.notes.append(f"{hw.name}: no fitted {fmt} efficiency (docs/memory.md, \"Held to published results\"): "
                         "bounds only, no predicted step")
    if mesh["stage"] > 1:
        pieces = t.pipeline_microbatches or mesh["stage"]
        out.bubble = (mesh["stage"] - 1) / (pieces * t.pipeline_repeats + mesh["stage"] - 1)
    _communication(out, cfg, dcn, per_node, accelerator)
    return out


def _communication(out: Plan, cfg: Config, dcn: dict[str, int], per_node: int, accelerator: bool) -> None:
    """Each mesh axis's bytes sent per device per step and their time (the module docstring)."""
    m, t, mesh, mem, hw, nodes = cfg.model, cfg.train, out.mesh, out.memory, out.hardware, out.nodes
    c = DTYPE_BYTES[compute_dtype(m, accelerator)]
    p = DTYPE_BYTES[param_dtype(m, accelerator)]
    params_per_device = mem.state.params / p  # elements
    # A device's residual stream per step: its rows' tokens (a part of each row with context), and
    # the layers it runs (its stage's).
    act = mem.micro_batch * (t.seq_len // mesh["context"]) * m.embed_dim * c * t.grad_accum
    layers = m.num_layers / mesh["stage"]
    inner = 1
    for a in ("stage", "tensor", "context", "expert", "fsdp", "data"):  # fastest-varying first: inside-node axes
        size = mesh[a]
        if size == 1:
            continue
        # An axis crosses nodes when mesh.dcn splits it, or when it is longer than what is left
        # of a node after the faster axes.
        across = dcn[a] > 1 or (nodes > 1 and not cfg.mesh.dcn.hybrid and inner * size > per_node)
        inner *= size
        frac = (size - 1) / size
        # Each micro-batch gathers the weights again and scatters its gradients (the accumulator
        # is sharded as the parameters are).
        weights = (2 * params_per_device * size * c + params_per_device * size * p) * t.grad_accum
        if a == "fsdp":
            sent = weights * frac
        elif a == "context":  # each layer's keys and values gathered, their gradients scattered back;
            # the weights gathered and their gradients scattered as over fsdp (embed is split over both)
            kv = mem.micro_batch * t.seq_len * m.num_kv_heads * m.head_dim * c * t.grad_accum
            sent = (2 * layers * 2 * kv + weights) * frac
        elif a == "data":
            sent = 2 * mem.state.grads * frac
        elif a == "stage":  # a piece's activations handed on each iteration, forward and backward
            pieces = t.pipeline_microbatches or size
            sent = 2 * (pieces * t.pipeline_repeats + size - 1) / pieces * act
        elif a == "tensor":
            sent = 4 * layers * 2 * act * frac
        else:
            top_k = m.moe.top_k if m.moe is not None else 1
            sent = 4 * layers * act * top_k * frac
        bandwidth = hw.across if across else hw.inside
        link = hw.links[across]
        out.axes.append(Axis(a, size, across, sent, sent / bandwidth if bandwidth else None, link))
        if bandwidth is None:
            out.notes.append(f"{hw.name}: no {link} bandwidth in the table: no time for the {a} axis")


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
        "axes": [{**vars(a), "predicted_seconds": a.predicted} for a in p.axes],
        "step_seconds": list(rng) if rng else None,
        "mfu": [p.compute / rng[1], p.compute / rng[0]] if rng else None,
        "predicted": predicted_json(p),
        "notes": p.notes,
    }


def predicted_json(p: Plan) -> dict[str, float] | None:
    step = p.predict()
    if step is None:
        return None
    return {"step_seconds": step, "mfu": p.compute / step, "tokens_per_second_per_device": p.tokens / step / p.devices,
            "recompute": p.recompute}


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
        for col in ("axis", "size", "links", "sent per device", "at peak", "predicted"):
            comm.add_column(col, justify="left" if col in ("axis", "links") else "right")
        where = ("across slices (DCN)", "inside a slice (ICI)") if p.hardware.slice_max else ("across nodes", "inside a node")
        for a in p.axes:
            comm.add_row(a.name, str(a.size), f"{where[not a.across]}, {a.link}", describe_bytes(a.bytes),
                         *("-" if x is None else f"{1e3 * x:.1f} ms" for x in (a.seconds, a.predicted)))
        parts.append(comm)
    rng = p.step_range()
    if rng:
        lo, hi = rng
        parts.append(Text(f"bounds at peak rates: {1e3 * lo:.1f} ms (communication hidden) to {1e3 * hi:.1f} ms "
                          f"(none hidden); MFU {100 * p.compute / hi:.0f}% to {100 * p.compute / lo:.0f}%"))
    step = p.predict()
    if step is not None:
        parts.append(Text(f"predicted step: {1e3 * step:.1f} ms, MFU {100 * p.compute / step:.1f}%, "
                          f"{p.tokens / step / p.devices:,.0f} tokens/s per device (fitted factors: "
                          f"{p.hardware.name} matmuls at {100 * p.hardware.achieved(p.format):.0f}% of the {p.format} peak"
                          f"{', recompute x%.2f' % p.recompute if p.recompute > 1 else ''})", style="bold"))
    for n in p.notes:
        parts.append(Text(n, style="dim"))
    return Group(*parts)
