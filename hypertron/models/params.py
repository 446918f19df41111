"""Parameter declarations: every parameter is declared once, everything else is derived.

A model declares a nested dict of :class:`ParamSpec` (shape, logical axes,
initializer). From that one tree come abstract shapes (for counting and
sharding without allocating), logical-axis trees (for the sharding rules) and
the random initialisation. Parameters themselves are nested dicts of arrays
with the same structure: plain pytrees that Orbax, Optax and the Hugging Face
converter handle without adapters, and that let a family add or drop a tensor
(tied embeddings, experts) without a new class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, the logical name of each axis, and how to initialise it.

    ``init`` is ``"normal"`` (std ``scale``), ``"zeros"`` or ``"ones"``.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    scale: float = 1.0

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def fan_in_normal(shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int) -> ParamSpec:
    """A weight with variance 1 / fan_in (LeCun normal)."""
    return ParamSpec(shape, axes, "normal", 1.0 / math.sqrt(fan_in))


def stack(spec: ParamSpec, n: int, axis_name: str = "layers") -> ParamSpec:
    """The same parameter repeated ``n`` times along a new leading axis (scanned layers)."""
    return ParamSpec((n, *spec.shape), (axis_name, *spec.axes), spec.init, spec.scale)


def abstract(specs: Any, dtype: Any) -> Any:
    """``jax.ShapeDtypeStruct`` tree of the declared parameters; allocates nothing."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), specs, is_leaf=is_spec)


def logical_axes(specs: Any) -> Any:
    """Tree of logical axis-name tuples, same structure as the parameters."""
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=is_spec)


def count(specs: Any) -> int:
    """Number of scalar parameters, computed from shapes only."""
    leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    return int(sum(int(np.prod(s.shape, dtype=np.int64)) for s in leaves))


def initialize(specs: Any, key: jax.Array, dtype: Any) -> Any:
    """Random parameters as declared. Jit it with ``out_shardings`` to create them sharded.

    Each leaf gets its own key folded from its position in the tree, so adding a
    parameter does not change the others' values.
    """
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    out = []
    for i, s in enumerate(leaves):
        k = jax.random.fold_in(key, i)
        if s.init == "zeros":
            v = jnp.zeros(s.shape, dtype)
        elif s.init == "ones":
            v = jnp.ones(s.shape, dtype)
        elif s.init == "normal":
            v = (s.scale * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)
        else:
            raise ValueError(f"unknown initializer {s.init!r}")
        out.append(v)
    return jax.tree.unflatten(treedef, out)
