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

Activations (an estimate under each remat policy) and the fit check come next; the hardware
they are checked against is :mod:`hypertron.models.hardware`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hypertron.config import Config, ModelConfig
from hypertron.models import params as param_lib
from hypertron.models.decoder import declare
from hypertron.models.kv_pages import bytes_per_token
from hypertron.parallel.rules import DEFAULT_RULES, spec_for

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
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(dim // math.prod(mesh_shape[a] for a in names))
    return tuple(out)


def param_dtype(model: ModelConfig, accelerator: bool) -> str:
    """``model.param_dtype`` resolved as the trainer would on that kind of device."""
    if model.param_dtype == "auto":
        return "bfloat16" if accelerator else "float32"
    return model.param_dtype


@dataclass
class StateBytes:
    """Per-device bytes of the train state, by part."""

    params: int
    grads: int
    optimizer: int
    fp8_histories: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.fp8_histories


def state_bytes(cfg: Config, mesh_shape: dict[str, int], accelerator: bool = False,
                rules: dict = DEFAULT_RULES) -> StateBytes:
    """Parameters, gradients, optimiser state and fp8 histories per device on a mesh of these sizes."""
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
    return StateBytes(params=params, grads=params, optimizer=OPTIMIZER_MOMENTS * params + OPTIMIZER_SCALARS,
                      fp8_histories=histories)


def kv_cache_bytes(model: ModelConfig, tokens: int, kv_dtype: str = "bfloat16", tensor: int = 1) -> int:
    """Bytes per device of a paged KV cache holding ``tokens`` tokens (all sequences together):
    keys and values of every layer, with int8 pages' scales (:func:`~hypertron.models.kv_pages.bytes_per_token`),
    split over ``tensor`` by KV head when it divides them (as the rules split ``kv_heads``)."""
    split = tensor if model.num_kv_heads % tensor == 0 else 1
    return tokens * bytes_per_token(model, kv_dtype) // split


def describe(n: float) -> str:
    """Bytes for people: 1.5 GiB, 312.0 MiB."""
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {name}"
    return f"{n:.0f} B"
