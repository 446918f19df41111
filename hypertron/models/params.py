"""Parameter declarations: every parameter is declared once, everything else is derived.

A model declares a nested dict of :class:`ParamSpec`: shape, logical axes and
initializer, and beside them every other fact about the parameter: the einsum
it feeds, whether it is quantised, whether fp8 training keeps an amax history
for it, and its Hugging Face name and layout. From that one tree come abstract
shapes (for counting and sharding without allocating), logical-axis trees (for
the sharding rules), the random initialisation, the int8 quantisation for
serving (:func:`quantize_params`), the fp8 histories
(:func:`fp8_histories`) and the HF tensor table
(:mod:`hypertron.models.hf`). Adding a parameter is one declaration; nothing
else keeps a list of names. Parameters themselves are nested dicts of arrays
with the same structure: plain pytrees that Orbax, Optax and the Hugging Face
converter handle without adapters, and that let a family add or drop a tensor
(tied embeddings, experts) without a new class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.quant import fp8, int8


# How a tensor is stored in a Hugging Face checkpoint, relative to ours:
#   same:      identically (embeddings, norms)
#   linear:    HF Linear weight [out, in]   <->  ours [in, out]
#   heads_in:  HF [heads*head_dim, D]       <->  ours [D, heads, head_dim] (q, k, v)
#   heads_out: HF [D, heads*head_dim]       <->  ours [heads, head_dim, D] (o)
#   conv:      torch Conv2d weight [out, in, kh, kw] (OIHW)  <->  ours [kh, kw, in, out] (HWIO)
HFLayout = Literal["same", "linear", "heads_in", "heads_out", "conv"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter and everything known about it.

    ``init`` is ``"normal"`` (std ``scale``), ``"zeros"`` or ``"ones"``.

    ``einsum``: the subscripts of the einsum-hook call this weight is the second operand of
    (``"btd,dnh->btnh"``), or None where it is not a hook matmul weight (norms, the router).
    ``quantize``: int8 for ``--quantize int8`` (scales per output channel of ``einsum``).
    ``fp8_history``: fp8 training with delayed scaling keeps an amax history for it.
    ``hf``: its tensor name in a Hugging Face checkpoint, ``{layer}`` and ``{expert}`` standing
    for the index along a ``layers`` or ``expert`` axis (each index is a tensor of its own), or
    None if it has no HF counterpart; ``hf_layout`` how that tensor is laid out.
    Axes in front of those of ``einsum``'s weight (the scanned ``layers``) are stacking axes:
    one scale set and one amax history per index.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    scale: float = 1.0
    einsum: str | None = None
    quantize: bool = False
    fp8_history: bool = False
    hf: str | None = None
    hf_layout: HFLayout = "same"

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")
        if (self.quantize or self.fp8_history) and self.einsum is None:
            raise ValueError("a quantised parameter needs its einsum")
        if self.einsum is not None and len(weight_subscripts(self.einsum)[0]) > len(self.shape):
            raise ValueError(f"einsum {self.einsum}: its weight has more axes than shape {self.shape}")

    @property
    def stack_rank(self) -> int:
        """Leading axes outside the einsum's weight (1 for a scanned layer's ``layers``)."""
        return len(self.shape) - len(weight_subscripts(self.einsum)[0]) if self.einsum else 0

    def contracting_axes(self) -> tuple[int, ...]:
        """The axes of the parameter (stacking axes included) its einsum contracts: where its int8
        scales have size 1."""
        w_sub, out = weight_subscripts(self.einsum)
        return tuple(self.stack_rank + i for i, c in enumerate(w_sub) if c not in out)


def weight_subscripts(subscripts: str) -> tuple[str, str]:
    """``(the weight's letters, the output's letters)`` of an einsum ``"x,w->out"``."""
    _, w_sub, out_sub = int8.split_subscripts(subscripts)
    return w_sub, out_sub


def matmul(shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int, einsum: str, *,
           hf: str | None = None, hf_layout: HFLayout = "linear", fp8_history: bool = True) -> ParamSpec:
    """A matmul weight of the einsum hook: fan-in normal init, int8-quantised for serving, with an
    fp8 history unless it runs outside the hook's delayed scaling (``fp8_history=False``)."""
    return ParamSpec(shape, axes, "normal", 1.0 / math.sqrt(fan_in), einsum=einsum, quantize=True,
                     fp8_history=fp8_history, hf=hf, hf_layout=hf_layout)


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def fan_in_normal(shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int) -> ParamSpec:
    """A weight with variance 1 / fan_in (LeCun normal)."""
    return ParamSpec(shape, axes, "normal", 1.0 / math.sqrt(fan_in))


def stack(spec: ParamSpec, n: int, axis_name: str = "layers") -> ParamSpec:
    """The same parameter repeated ``n`` times along a new leading axis (scanned layers); every other
    fact is kept."""
    return replace(spec, shape=(n, *spec.shape), axes=(axis_name, *spec.axes))


def abstract(specs: Any, dtype: Any) -> Any:
    """``jax.ShapeDtypeStruct`` tree of the declared parameters; allocates nothing."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), specs, is_leaf=is_spec)


def logical_axes(specs: Any) -> Any:
    """Tree of logical axis-name tuples, same structure as the parameters."""
    return jax.tree.map(lambda s: s.axes, specs, is_leaf=is_spec)


def leaves_with_paths(specs: Any) -> list[tuple[tuple[str, ...], ParamSpec]]:
    """``(key path, spec)`` of every declared parameter, in tree order: ``(("layers", "wq"), spec)``."""
    out = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if is_spec(node):
            out.append((path, node))
        else:
            for key, child in node.items():
                walk(child, (*path, key))

    walk(specs, ())
    return out


def count(specs: Any) -> int:
    """Number of scalar parameters, computed from shapes only."""
    leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    return int(sum(int(np.prod(s.shape, dtype=np.int64)) for s in leaves))


def initialize(specs: Any, key: jax.Array, dtype: Any) -> Any:
    """Random parameters as declared. Jit it with ``out_shardings`` to create them sharded.

    Each leaf gets its own key folded from its position in the tree, so adding a
    parameter does not change the others' values.
    """
    return _initialized(specs, jnp, lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32),
                        dtype)


def initialize_on_host(specs: Any, seed: int, dtype: Any = np.float32) -> Any:
    """:func:`initialize` in numpy, leaf ``i``'s normals from ``(seed, i)``: for a small model
    written straight to files (a diffusion preset), where compiling the random draws of hundreds
    of leaves would take longer than drawing them. Not the same numbers as :func:`initialize`'s."""
    return _initialized(specs, np, lambda i, shape: np.random.default_rng([seed, i]).standard_normal(shape, np.float32),
                        dtype)


def _initialized(specs: Any, xp, normal, dtype: Any) -> Any:
    """Each leaf as its spec's ``init`` says, ``xp`` the array module, ``normal(i, shape)`` leaf
    ``i``'s standard normals."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    out = []
    for i, s in enumerate(leaves):
        if s.init == "zeros":
            v = xp.zeros(s.shape, dtype)
        elif s.init == "ones":
            v = xp.ones(s.shape, dtype)
        elif s.init == "normal":
            v = (s.scale * normal(i, s.shape)).astype(dtype)
        else:
            raise ValueError(f"unknown initializer {s.init!r}")
        out.append(v)
    return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------------------
# Derived from the declarations: int8 weights for serving, fp8 amax histories for training


_quantize_jit = jax.jit(int8.quantize, static_argnums=(1, 2))


def quantize_params(specs: Any, params: Any, dtype: Any = jnp.int8) -> Any:
    """``params`` with every weight declared ``quantize=True`` replaced by an int8 (or ``dtype``
    float8_e4m3fn) :class:`~hypertron.quant.int8.QArray` (one scale per output channel of its
    einsum, per index of its stacking axes); the others, and weights already quantised, are kept. A parameter that is not
    declared, or whose shape is not its declaration's, is refused rather than guessed at. Each
    weight is quantised by its own small jitted program, so the temporaries are one weight's."""

    def one(spec: ParamSpec, w: Any, path: str) -> Any:
        if not spec.quantize or isinstance(w, int8.QArray):
            return w
        if tuple(w.shape) != tuple(spec.shape):
            stacked = f", stacked over {spec.shape[0]} layers" if spec.axes[:1] == ("layers",) else ""
            raise ValueError(f"{path}: shape {tuple(w.shape)} does not fit its use {spec.einsum}{stacked} "
                             f"(declared {tuple(spec.shape)})")
        return _quantize_jit(w, spec.contracting_axes(), jnp.dtype(dtype))

    return _map_declared(one, specs, params, "quantize_params")


def cast_params(specs: Any, params: Any, dtype: Any) -> Any:
    """``params`` as inference holds them: every weight declared ``quantize=True`` (the matmul and
    embedding weights) in ``dtype``, the others (norms, the MoE router: the model computes them in
    float32) in float32. int8 weights are kept. Cast once, at load, so that a decode step reads
    each weight in the compute dtype instead of casting float32 master weights every step. Every
    weight comes back a JAX array, one read from a file as numpy too (one at a time, cast before it
    leaves the host): a numpy weight would be copied to the device by every call that takes it,
    each serving step (on the CPU, 14 % of the engine's CPU time at the HTTP bench's model)."""
    dtype = jnp.dtype(dtype)

    def one(spec: ParamSpec, w: Any, path: str) -> Any:
        if isinstance(w, int8.QArray):
            return w
        return jnp.asarray(w, dtype if spec.quantize else jnp.dtype(jnp.float32))

    return _map_declared(one, specs, params, "cast_params")


def _sharding(spec: ParamSpec, shape: tuple[int, ...], mesh, rules):
    """Where a weight of declaration ``spec`` and ``shape`` lives on ``mesh``: training's sharding."""
    from jax.sharding import NamedSharding

    from hypertron.parallel.rules import spec_for

    return NamedSharding(mesh, spec_for(spec.axes, rules, mesh, tuple(shape)))


def on_mesh(specs: Any, abstract: Any, mesh, rules) -> Any:
    """``abstract`` (``jax.ShapeDtypeStruct`` per parameter) with the shardings :func:`place_params`
    gives, for restoring a checkpoint straight into its shards."""
    def one(spec: ParamSpec, a: Any, path: str) -> Any:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_sharding(spec, a.shape, mesh, rules))

    return _map_declared(one, specs, abstract, "on_mesh")


def place_params(specs: Any, params: Any, mesh, rules) -> Any:
    """``params`` on ``mesh``, each weight sharded as the rules shard its declared axes (training's
    shardings, :func:`hypertron.parallel.rules.spec_for`): an int8 :class:`~hypertron.quant.int8.QArray`'s
    values and scales each by its own shape (a size-1 scale axis stays whole). Each weight is put
    on its own, so no device holds more of it than its shard (from the host: each device is sent
    its slice only)."""
    def put(spec: ParamSpec, w: Any) -> Any:
        return jax.device_put(w, _sharding(spec, w.shape, mesh, rules))

    def one(spec: ParamSpec, w: Any, path: str) -> Any:
        return int8.QArray(put(spec, w.values), put(spec, w.scales)) if isinstance(w, int8.QArray) else put(spec, w)

    return _map_declared(one, specs, params, "place_params")


def fp8_histories(specs: Any, length: int) -> dict:
    """Zero amax histories of ``length`` steps for every parameter declared ``fp8_history``, in a tree
    of the parameters' structure holding only those (``{"layers": {...}}`` always present):
    plain dicts ``{"x", "w", "g"}`` of shape ``[*stacking axes, length]``, as the train state and
    its checkpoints hold them."""
    out: dict = {"layers": {}}
    for path, spec in leaves_with_paths(specs):
        if spec.fp8_history:
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = dict(vars(fp8.AmaxHistory.zeros(spec.shape[:spec.stack_rank], length)))
    return out


def _map_declared(fn, specs: Any, params: Any, what: str, path: str = "") -> Any:
    """``fn(spec, value, path)`` over the parameters, walking both trees; keys must match."""
    if is_spec(specs):
        return fn(specs, params, path)
    at = lambda key: f"{path}.{key}" if path else key  # noqa: E731
    unknown = [k for k in params if k not in specs]
    if unknown:
        raise ValueError(f"{what}: unknown parameter {at(unknown[0])!r}")
    missing = [k for k in specs if k not in params]
    if missing:
        raise ValueError(f"{what}: parameter {at(missing[0])!r} is missing")
    return {k: _map_declared(fn, specs[k], params[k], what, at(k)) for k in params}
