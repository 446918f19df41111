"""How many bytes a training run or a server holds per device, from the config alone.

Nothing is allocated: shapes come from the parameter declarations and their per-device shards
from the same logical-axis rules the trainer shards with (:func:`hypertron.parallel.rules.spec_for`),
over a mesh given by its axis sizes only, so a 64-GPU layout is planned on a laptop.

Exact (``tests/test_memory.py`` compares them with the trainer's real arrays):

* **parameters**: every declared tensor's shard, in ``model.param_dtype``;
* **gradients**: one copy of the parameters' shards (the step's gradient tree has their
  shardings and dtype; with ``grad_accum`` the accumulator is that copy);
* **optimiser state**: AdamW's two moments per parameter, sharded like it (Optax keeps them in
  the parameter's dtype), plus its step counters;
* **fp8 histories** (``model.quantization=fp8``, delayed scaling): replicated.

Serving: the paged KV cache's bytes for a number of tokens (:func:`kv_cache_bytes`).

Estimated: the activations of a training step under each remat policy (:func:`step_bytes`),
from coefficients fitted to XLA's memory analysis (below). The hardware a plan is checked
against is :mod:`hypertron.hardware`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hypertron.config import Config, ModelConfig, dtype_on
from hypertron.models import params as param_lib
from hypertron.models.attention import flash_on
from hypertron.models.decoder import declare
from hypertron.models.kv_pages import bytes_per_token
from hypertron.parallel.rules import DEFAULT_RULES, mesh_axes, spec_for

# AdamW (hypertron.train.optimizer): first and second moments per parameter, and two int32 step
# counts (Adam's and the learning-rate schedule's), replicated.
OPTIMIZER_MOMENTS = 2
OPTIMIZER_SCALARS = 2 * 4

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}


class _Sizes:
    """A mesh as the rules read it: axis sizes only, no devices."""

    def __init__(self, shape: dict[str, int]):
        self.shape = dict(shape)


def shard_shape(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh_shape: dict[str, int],
                rules: dict = DEFAULT_RULES) -> tuple[int, ...]:
    """The per-device shape of an array with these logical axes under ``rules`` on such a mesh."""
    spec = spec_for(axes, rules, _Sizes(mesh_shape), shape)
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = mesh_axes(entry)
        out.append(dim // math.prod(mesh_shape[a] for a in names))
    return tuple(out)


def param_dtype(model: ModelConfig, accelerator: bool) -> str:
    return dtype_on(model.param_dtype, accelerator)


def compute_dtype(model: ModelConfig, accelerator: bool) -> str:
    return dtype_on(model.dtype, accelerator)


@dataclass
class StateBytes:
    """Per-device bytes of the train state, by part."""

    params: int
    grads: int
    optimizer: int
    fp8_histories: int
    reference: int = 0  # task: dpo's frozen reference, a second copy of the parameters
    base: int = 0  # with LoRA: the frozen base (params, grads and optimizer are then the adapters')

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.fp8_histories + self.reference + self.base


def state_bytes(cfg: Config, mesh_shape: dict[str, int], accelerator: bool = False,
                rules: dict = DEFAULT_RULES) -> StateBytes:
    """Parameters, gradients, optimiser state and fp8 histories (and ``task: dpo``'s reference) per
    device on a mesh of these sizes. With LoRA (``lora.rank``) the first three are the adapters'
    and ``base`` the frozen base's."""
    size = DTYPE_BYTES[param_dtype(cfg.model, accelerator)]
    specs = declare(cfg.model)
    params = sum(math.prod(shard_shape(s.shape, s.axes, mesh_shape, rules)) * size
                 for _, s in param_lib.leaves_with_paths(specs))
    histories = 0
    if cfg.model.quantization == "fp8" and cfg.model.fp8_scaling == "delayed":
        import jax

        from hypertron.models import fp8_histories

        histories = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                        for x in jax.tree.leaves(jax.eval_shape(lambda: fp8_histories(cfg.model))))
    if cfg.lora.rank:  # the adapters train (float32, as initialised); the base is held, frozen
        from hypertron.models.lora import LoraSettings, adapter_axes, init_adapters

        settings = LoraSettings.of(cfg.lora)
        import jax

        shapes = jax.eval_shape(lambda: init_adapters(cfg.model, settings, jax.random.key(0)))
        axes = jax.tree.leaves(adapter_axes(cfg.model, settings), is_leaf=lambda x: isinstance(x, tuple))
        adapters = sum(math.prod(shard_shape(x.shape, a, mesh_shape, rules)) * x.dtype.itemsize
                       for x, a in zip(jax.tree.leaves(shapes), axes, strict=True))
        return StateBytes(params=adapters, grads=adapters, optimizer=OPTIMIZER_MOMENTS * adapters + OPTIMIZER_SCALARS,
                          fp8_histories=histories, base=_held_base_bytes(cfg, specs, mesh_shape, rules, accelerator))
    held = cfg.task == "dpo" and cfg.dpo.reference != "precomputed"  # a reference in the state
    return StateBytes(params=params, grads=params, optimizer=OPTIMIZER_MOMENTS * params + OPTIMIZER_SCALARS,
                      fp8_histories=histories, reference=params if held else 0)


def _held_base_bytes(cfg: Config, specs, mesh_shape: dict[str, int], rules: dict, accelerator: bool) -> int:
    """Per-device bytes of LoRA's frozen base as ``lora.base_dtype`` holds it (an int8 weight's
    values and scales each sharded by their own shape)."""
    import jax

    from hypertron.models.lora import held_base

    abstract = param_lib.abstract(specs, param_dtype(cfg.model, accelerator))
    held = jax.eval_shape(lambda p: held_base(cfg.model, p, cfg.lora.base_dtype), abstract)
    return held_bytes(specs, held, mesh_shape, rules)


def held_arrays(value) -> tuple:
    """The arrays one held weight is: an int8 :class:`~hypertron.quant.int8.QArray`'s values and
    scales, else the array itself."""
    return (value.values, value.scales) if hasattr(value, "scales") else (value,)


def held_bytes(specs, held, mesh_shape: dict[str, int], rules: dict = DEFAULT_RULES) -> int:
    """Per-device bytes of ``held`` (arrays or abstract ones, in ``specs``' tree), each array of a
    weight sharded by its own shape as the rules shard the weight's axes."""
    import jax

    def one(spec, value) -> int:
        return sum(math.prod(shard_shape(tuple(a.shape), spec.axes, mesh_shape, rules)) * a.dtype.itemsize
                   for a in held_arrays(value))

    return sum(jax.tree.leaves(jax.tree.map(one, specs, held, is_leaf=param_lib.is_spec)))


# Activation coefficients, fitted to XLA's own accounting (``compiled.memory_analysis()``'s
# temporaries) of hypertron's train step on CPU, float32, XLA attention, for 14 configurations
# (seq 512-4096, width 512-1024, 1-3 layers, MHA and GQA, vocab 259-64,000; within 7% of each).
# S is one layer's attention scores, b x heads x t x t in float32, when attention materialises
# them; flash attention (cuDNN) keeps b x heads x t instead. A, M, Q are one layer's residual
# stream (b t d), MLP hidden (b t f) and q/k/v projections (b t (n + 2k) h) in the compute dtype.
ONE_LAYER = {"S": 3.7, "A": 4, "M": 3, "Q": 2}  # a layer's forward and backward, live at once
SAVED = {  # kept per layer for the backward pass, by remat policy
    "none": {"S": 4.6, "A": 6, "M": 3, "Q": 2},
    "dots": {"S": 0.3, "A": 3, "M": 2, "Q": 1},
    "full": {"S": 0.0, "A": 1, "M": 0, "Q": 0},
}
# The loss and the unembedding's backward: x the logits (b t v, float32) and x one vocabulary
# table (v d, param dtype). That phase and a layer's backward are not live at once: the peak is
# the larger of the two.
LOGITS, VOCAB_GRADS = 1.45, 1.96
# A pipeline (mesh.stage = S, M pieces, R repeats: I = M R + S - 1 iterations, each stage L / (S R)
# layers), in S and A of the device's rows: (S, A) x I L / (S R M), the layer-iterations' share of
# those rows kept; A x I / M for each iteration's hand-off; A once; and x **one layer** / M, the
# live layer of a piece (the logits phase, as above, when larger). Fitted the same way, to 24
# configurations a policy (widths 512 and 768, MHA and GQA, seq 1024-2048, S 2-4, M 2-8, R 1-2,
# data and fsdp beside stage: ``python bench/memory.py --pipeline``): within 4 % (none), 10 %
# (dots), 16 % (full; 8 % but one). The terms stand for what XLA keeps of a scan over iterations
# of a vmap over stages of a scan over layers, not each for one buffer (an iteration term < 0).
STAGED = {  # remat: kept S, kept A, iterations A, once A, one layer / M
    "none": (1.89, 64.78, -31.55, 5.63, 0.70),
    "dots": (0.0, 18.79, -4.40, 5.65, 0.85),
    "full": (0.03, 5.07, -0.78, 5.60, 0.84),
}


@dataclass
class StepBytes:
    """Per-device bytes of one training step: the state (exact) and its activations (an estimate)."""

    state: StateBytes
    activations: int
    micro_batch: int  # rows per device per micro-batch
    flash: bool       # whether attention is flash (no t x t scores)

    @property
    def total(self) -> int:
        return self.state.total + self.activations


def flash_attention(model: ModelConfig, compute_dtype: str, gpu: bool, seq_len: int, hopper: bool = True,
                    tpu: bool = False) -> bool:
    """Whether the step's attention keeps no t x t scores: cuDNN's flash kernel, which ``auto``
    picks on NVIDIA GPUs where cuDNN takes the shape, or the splash kernel, which it picks on TPUs
    where that takes it (the same rule: :func:`hypertron.models.attention.flash_on`)."""
    return flash_on(model, "gpu" if gpu else "tpu" if tpu else "cpu", compute_dtype, seq_len, hopper)


def step_bytes(cfg: Config, mesh_shape: dict[str, int], accelerator: bool = False, gpu: bool = False,
               rules: dict = DEFAULT_RULES, hopper: bool = True, tpu: bool = False) -> StepBytes:
    """The state per device (exact) and the activations of a training step (an estimate, see the
    coefficients above; XLA counts the gradients among its temporaries too). ``hopper``: the GPU
    is a Hopper or later (cuDNN's flash attention takes head dims up to 256 there); ``tpu``: the
    devices are TPUs (the splash kernel)."""
    m, tr = cfg.model, cfg.train
    state = state_bytes(cfg, mesh_shape, accelerator, rules)
    compute = compute_dtype(m, accelerator)
    c = DTYPE_BYTES[compute]
    t = tr.seq_len
    # Each activation dimension's share of this device, by the rules the step shards its activations with.
    b, n, k, f, v, s = (shard_shape((size,), (axis,), mesh_shape, rules)[0] for size, axis in (
        (tr.global_batch // tr.grad_accum, "batch"), (m.num_heads, "act_heads"), (m.num_kv_heads, "act_kv_heads"),
        (m.mlp_dim, "act_mlp"), (m.vocab_size, "act_vocab"), (t, "seq")))
    if m.moe is not None:  # the routed copies go through top_k experts' MLPs (and shared ones)
        f = f * (m.moe.top_k + m.moe.shared_experts)
    flash = flash_attention(m, compute, gpu, t, hopper, tpu)
    if flash and not gpu and s != t:  # a row split over context: its attention is XLA's, not splash
        flash = False
    # s: this device's tokens of a row (all of them unless mesh.context splits the rows); its
    # queries score every key, and with context its layer holds the row's keys and values gathered.
    terms = {"S": b * n * s * (1 if flash else t) * 4, "A": b * s * m.embed_dim * c, "M": b * s * f * c,
             "Q": b * s * (n + 2 * k) * m.head_dim * c}
    gathered = 0 if s == t else 2 * b * t * k * m.head_dim * c
    one = sum(ONE_LAYER[x] * terms[x] for x in terms) + gathered
    saved = sum(SAVED[m.remat][x] * terms[x] for x in terms)
    p = DTYPE_BYTES[param_dtype(m, accelerator)]
    vocab = LOGITS * b * s * v * 4 + VOCAB_GRADS * v * m.embed_dim * p
    stages = mesh_shape.get("stage", 1)
    if stages > 1:  # STAGED's terms
        pieces, repeats = tr.pipeline_microbatches or stages, tr.pipeline_repeats
        iterations = (pieces * repeats + stages - 1) / pieces
        kept = m.num_layers // (stages * repeats) * iterations
        k_s, k_a, i_a, once, live = STAGED[m.remat]
        held = kept * (k_s * terms["S"] + k_a * terms["A"]) + (iterations * i_a + once) * terms["A"]
        return StepBytes(state, int(held + max(live * one / pieces, vocab)), b, flash)
    return StepBytes(state, int((m.num_layers - 1) * saved + max(one, vocab)), b, flash)


def kv_cache_bytes(model: ModelConfig, tokens: int, kv_dtype: str = "bfloat16", tensor: int = 1) -> int:
    """Bytes per device of a paged KV cache holding ``tokens`` tokens (all sequences together):
    keys and values of every layer, with int8 pages' scales (:func:`~hypertron.models.kv_pages.bytes_per_token`),
    split over ``tensor`` by KV head when it divides them (as the rules split ``kv_heads``)."""
    split = tensor if model.num_kv_heads % tensor == 0 else 1
    return tokens * bytes_per_token(model, kv_dtype) // split
