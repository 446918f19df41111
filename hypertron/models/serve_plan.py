"""``hypertron plan --serve``: whether one serving engine of a model fits some devices, and how many
tokens of KV cache the memory left holds, before anything loads. Nothing is allocated.

Per device, on a mesh of ``tensor`` x ``expert`` devices:

* **weights**, exact: every declared parameter as the engine holds it
  (:func:`hypertron.models.serving_params`, as serving loads them): matmul and embedding weights in the compute dtype, or
  with ``quantize="int8"`` int8 values with float32 scales per output channel; norms and the MoE
  router in float32. Each is sharded as training's rules shard its axes
  (:data:`~hypertron.parallel.rules.DEFAULT_RULES`, as ``hypertron.serve.placement`` places them:
  heads, KV heads, MLP width and vocabulary over ``tensor``, experts over ``expert``).
  ``tests/test_serve_parallel.py`` compares this with a tiny engine's real shards.
* **workspace**, estimated: a step of ``max_num_batched_tokens`` tokens' activations (the residual
  stream four times, the split projections and MLP) and the sampled rows' float32 logits twice
  (with the vocabulary split, each rank looks up the ids in its slice of the embedding table: no
  table is gathered).
* **KV cache**: what is left of ``memory_fraction`` of the device's memory (``--kv-cache-memory-fraction``), in tokens
  (:func:`~hypertron.models.memory.kv_cache_bytes`, split by KV head over ``tensor``) and in pages
  (``hypertron serve --num-pages``).

It fits when the KV cache holds at least one step's tokens (``max_num_batched_tokens``); a pool
shorter than ``max_seq_len`` is said (a request longer than the pool is refused, not served).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hypertron.config import ConfigError, ModelConfig, dtype_on
from hypertron.config.serving import KV_CACHE_MEMORY_FRACTION
from hypertron.models import params as param_lib
from hypertron.models.decoder import declare
from hypertron.hardware import Hardware
from hypertron.models.memory import DTYPE_BYTES, held_bytes, kv_cache_bytes

# The share of a device's memory an engine plans for (vLLM's gpu_memory_utilization default): the
# rest is the runtime's and the compiler's. JAX on a GPU preallocates 75 % unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says more (docs/serving.md).
MESH_AXES = ("data", "fsdp", "stage", "context", "expert", "tensor")


@dataclass
class ServePlan:
    hardware: Hardware
    model: str
    mesh: dict[str, int]          # tensor and expert
    quantize: str
    kv_dtype: str
    device_memory: float | None   # bytes per device
    weights: int                  # bytes per device, exact
    workspace: int                # bytes per device, estimated
    kv_token_bytes: int           # a token's KV bytes, every layer and KV head (bytes_per_token)
    kv_split: int                 # the KV heads split over this many devices
    page_size: int
    max_seq_len: int
    min_tokens: int               # the KV tokens it needs to fit (a step's)
    notes: list[str] = field(default_factory=list)
    memory_fraction: float = KV_CACHE_MEMORY_FRACTION  # of device_memory, for weights, workspace and KV

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def usable(self) -> float | None:
        return None if self.device_memory is None else self.memory_fraction * self.device_memory

    @property
    def kv_room(self) -> int | None:
        """Bytes per device left for the KV cache (negative: the weights and workspace do not fit)."""
        return None if self.usable is None else int(self.usable) - self.weights - self.workspace

    @property
    def kv_tokens(self) -> int | None:
        """The most tokens whose KV cache (:func:`kv_cache_bytes`) fits in :attr:`kv_room`."""
        room = self.kv_room
        if room is None:
            return None
        # kv_cache_bytes(t) = t * kv_token_bytes // kv_split <= room
        return max(((room + 1) * self.kv_split - 1) // self.kv_token_bytes, 0)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_token_bytes / self.kv_split

    @property
    def fits(self) -> bool | None:
        tokens = self.kv_tokens
        return None if tokens is None else tokens >= self.min_tokens


def weight_bytes(model: ModelConfig, quantize: str, accelerator: bool, mesh: dict[str, int]) -> int:
    """Bytes per device of the weights as the engine holds them (:func:`~hypertron.models.serving_params`,
    abstract), each array sharded by the rules over ``mesh``."""
    import jax

    from hypertron.models import serving_params

    specs = declare(model)
    master = param_lib.abstract(specs, dtype_on(model.param_dtype, accelerator))
    compute = dtype_on(model.dtype, accelerator)
    held = jax.eval_shape(lambda p: serving_params(p, model, quantize, compute), master)
    return held_bytes(specs, held, {a: mesh.get(a, 1) for a in MESH_AXES})


def plan_serving(model: ModelConfig, hw: Hardware, *, tensor: int = 1, expert: int = 1, quantize: str = "none",
                 kv_cache_dtype: str = "auto", max_num_batched_tokens: int = 512, max_slots: int = 8,
                 page_size: int = 16, device_memory: float | None = None,
                 accelerator: bool | None = None, memory_fraction: float = KV_CACHE_MEMORY_FRACTION,
                 draft: ModelConfig | None = None) -> ServePlan:
    """The plan of one engine of ``model`` over ``tensor`` x ``expert`` devices of ``hw`` (its
    memory, or ``device_memory``; an accelerator unless ``hw`` is the CPU, or as ``accelerator``
    says). ``draft``: a draft model served beside it (speculative decoding), its weights and a KV
    pool of as many tokens counted in. Raises :class:`ConfigError` for a split the model cannot take."""
    check_split(model, tensor, expert)
    accelerator = hw.name != "cpu" if accelerator is None else accelerator
    kv = dtype_on(model.dtype, accelerator) if kv_cache_dtype == "auto" else kv_cache_dtype
    mesh = {"tensor": tensor, "expert": expert}
    weights = weight_bytes(model, quantize, accelerator, mesh)
    c = DTYPE_BYTES[dtype_on(model.dtype, accelerator)]
    mlp = model.mlp_dim * (model.moe.top_k if model.moe is not None else 1)
    per_token = (4 * model.embed_dim + (model.num_heads + 2 * model.num_kv_heads) * model.head_dim // tensor
                 + 3 * mlp // tensor) * c
    # (the embedding table split by vocabulary is looked up in place: each rank its ids, one
    # all-reduce; tests/test_serve_parallel.py checks the compiled step gathers no weight)
    workspace = max_num_batched_tokens * per_token + 2 * max_slots * model.vocab_size * 4
    memory = hw.memory if device_memory is None else device_memory
    whole = kv_cache_bytes(model, 1, kv)
    split = whole // kv_cache_bytes(model, 1, kv, tensor)
    if draft is not None:  # its weights, and its pool's bytes a token added to the model's (d / s_d + w / s)
        weights += weight_bytes(draft, quantize, accelerator, {"tensor": tensor, "expert": expert if draft.moe else 1})
        d = kv_cache_bytes(draft, 1, kv)
        d_split = d // kv_cache_bytes(draft, 1, kv, tensor)
        whole, split = whole * d_split + d * split, split * d_split
    p = ServePlan(hw, model.name, mesh, quantize, kv, memory, weights, workspace, whole, split, page_size,
                  model.max_seq_len, max_num_batched_tokens, memory_fraction=memory_fraction)
    tokens = p.kv_tokens
    if tokens is not None and p.fits and tokens < model.max_seq_len:
        p.notes.append(f"the KV cache holds {tokens:,} tokens, fewer than one {model.max_seq_len:,}-token sequence: "
                       "a longer request is refused (model.max_seq_len=N plans a shorter one)")
    if p.fits is False:
        p.notes.append(advice(model, hw, p, memory, draft))
    return p


def check_split(model: ModelConfig, tensor: int, expert: int) -> None:
    """One line for a split the model cannot take."""
    if tensor < 1 or expert < 1:
        raise ConfigError(f"--tensor={tensor} --expert={expert}: each must be at least 1")
    if model.num_heads % tensor:
        raise ConfigError(f"--tensor={tensor} does not divide the model's {model.num_heads} attention heads")
    per, group = model.num_heads // tensor, model.num_heads // model.num_kv_heads
    if model.num_kv_heads % tensor and per % group and group % per:  # KV heads whole on each rank: nest
        raise ConfigError(f"--tensor={tensor}: a rank's {per} query heads would straddle the model's groups of "
                          f"{group} per KV head")
    if expert > 1 and model.moe is None:
        raise ConfigError(f"--expert={expert}: {model.name} has no experts (a dense model: --tensor splits it)")
    if expert > 1 and model.moe.num_experts % expert:
        raise ConfigError(f"--expert={expert} does not divide the model's {model.moe.num_experts} experts")


def advice(model: ModelConfig, hw: Hardware, p: ServePlan, memory: float | None, draft: ModelConfig | None) -> str:
    """What would fit instead: int8 weights on as many devices, or the fewest devices (doubling
    ``tensor``) at these settings."""
    ways = []
    if p.quantize == "none":
        int8 = plan_serving(model, hw, tensor=p.mesh["tensor"], expert=p.mesh["expert"], quantize="int8",
                            kv_cache_dtype=p.kv_dtype, max_num_batched_tokens=p.min_tokens, page_size=p.page_size,
                            device_memory=memory, draft=draft)
        if int8.fits:
            ways.append(f"--quantize int8 on {p.devices} devices ({int8.kv_tokens:,} KV tokens)")
    tensor = p.mesh["tensor"] * 2
    while tensor <= model.num_heads and not model.num_heads % tensor and not (draft and draft.num_heads % tensor):
        more = plan_serving(model, hw, tensor=tensor, expert=p.mesh["expert"], quantize=p.quantize,
                            kv_cache_dtype=p.kv_dtype, max_num_batched_tokens=p.min_tokens, page_size=p.page_size,
                            device_memory=memory, draft=draft)
        if more.fits:
            ways.append(f"--tensor {tensor}: {more.devices} devices ({more.kv_tokens:,} KV tokens)")
            break
        tensor *= 2
    return "would fit: " + "; or ".join(ways) if ways else "no int8 or wider split of this model fits these devices"


def to_json(p: ServePlan) -> dict[str, Any]:
    return {"hardware": p.hardware.name, "model": p.model, "devices": p.devices, "mesh": p.mesh,
            "quantize": p.quantize, "kv_cache_dtype": p.kv_dtype,
            "memory": {"device": p.device_memory, "usable": p.usable, "weights": p.weights, "workspace": p.workspace,
                       "kv_cache": p.kv_room},
            "kv_bytes_per_token": p.kv_bytes_per_token, "kv_tokens": p.kv_tokens,
            "num_pages": p.kv_tokens // p.page_size + 1 if p.fits else None,  # page 0 is the null page
            "fits": p.fits, "notes": p.notes}


def render(p: ServePlan):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from hypertron.units import describe_bytes

    head = Text(f"serving {p.model} on {p.hardware.name} x {p.devices}  ·  "
                + " x ".join(f"{a} {n}" for a, n in p.mesh.items()) + f"  ·  weights {p.quantize}, KV {p.kv_dtype}",
                style="bold")
    mem = Table(title="memory per device", title_justify="left", show_edge=False)
    mem.add_column("part")
    mem.add_column("bytes", justify="right")
    mem.add_row("weights", describe_bytes(p.weights))
    mem.add_row(f"workspace (estimate: a step of {p.min_tokens} tokens)", describe_bytes(p.workspace))
    parts: list[Any] = [head, mem]
    if p.usable is not None:
        mem.add_row("KV cache (the rest)", describe_bytes(max(p.kv_room, 0)))
        mem.add_row(f"usable ({100 * p.memory_fraction:.0f}% of {describe_bytes(p.device_memory)})",
                    describe_bytes(p.usable), style="bold")
        tokens = p.kv_tokens
        pages = f"; hypertron serve --num-pages {tokens // p.page_size + 1} at --page-size {p.page_size}" if p.fits else ""
        parts.append(Text(f"{'fits' if p.fits else 'does not fit'}: KV cache for {tokens:,} tokens "
                          f"({p.kv_bytes_per_token:,.0f} bytes a token per device{pages})",
                          style="green" if p.fits else "bold red"))
    for n in p.notes:
        parts.append(Text(n, style="dim"))
    return Group(*parts)
