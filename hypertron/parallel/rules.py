"""Logical-axis sharding rules: the one table that maps model axis names to mesh axes.

Model code names logical axes only (``batch``, ``embed``, ``heads``...). This
module turns those names into ``PartitionSpec``s for a given mesh, and lets
model code pin activations with :func:`constrain`, which is a no-op unless a
mesh and rules are active (so the model runs unchanged on one device).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None

# Logical axis -> mesh axis (or axes). Parameters are sharded over fsdp (and context)
# on their embed axis and over tensor on heads / mlp / vocab (Megatron style), MoE
# experts over expert; batches over data, fsdp and expert (outside the experts, the
# expert axis is one more data-parallel axis, as in GShard), and each row's tokens
# over context (attention then gathers a row's keys and values over it, in shard_map:
# models/attention.context_attention; embed over context too, as MaxText's rules, keeps a context group's
# parameter bytes those of an fsdp group of its size). ``act_*`` axes are
# activations; ``layers`` and ``head_dim`` stay whole.
DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    "embed": ("fsdp", "context"),
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    "head_dim": None,
    "layers": "stage",  # the stacked layers: a pipeline stage holds a contiguous block of them
    "norm": None,
    "cache_seq": None,
    "conv_in": None,  # a conv kernel's input channels (HWIO); its output channels as embed
    "conv_out": "fsdp",
}


class RulesError(ValueError):
    pass


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` names (None, one name, or several)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_for(
    axes: tuple[str | None, ...],
    rules: dict[str, MeshAxes],
    mesh: Mesh,
    shape: tuple[int, ...] | None = None,
) -> P:
    """``PartitionSpec`` for an array whose dimensions have these logical names.

    Mesh axes of size 1 are dropped. When ``shape`` is given, a dimension that
    the mesh axes do not divide is replicated instead (e.g. 1 KV head over
    ``tensor=2``). Two logical axes of one array that map to the same mesh axis
    are an error: the array would be sharded twice over one device set.
    """
    used: dict[str, str] = {}
    out: list[MeshAxes] = []
    for i, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise RulesError(f"no sharding rule for logical axis '{name}'")
        target = rules[name]
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if mesh.shape.get(a, 1) > 1)
        for a in mesh_axes:
            if a in used:
                raise RulesError(
                    f"logical axes '{used[a]}' and '{name}' of one array both map to mesh axis '{a}'"
                )
        # Drop trailing mesh axes until the dimension divides (e.g. a batch that
        # divides by data but not by data x fsdp stays sharded over data).
        while shape is not None and mesh_axes and shape[i] % int(np.prod([mesh.shape[a] for a in mesh_axes])):
            mesh_axes = mesh_axes[:-1]
        for a in mesh_axes:
            used[a] = name
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*out)


def shardings_for(axes_tree: Any, shapes_tree: Any, mesh: Mesh, rules: dict[str, MeshAxes] = DEFAULT_RULES) -> Any:
    """``NamedSharding`` tree for a tree of logical axes and a matching tree of shapes/arrays."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
    axes_leaves, treedef = jax.tree.flatten(axes_tree, is_leaf=is_axes)
    shape_leaves = treedef.flatten_up_to(shapes_tree)
    out = [NamedSharding(mesh, spec_for(a, rules, mesh, tuple(s.shape))) for a, s in zip(axes_leaves, shape_leaves)]
    return jax.tree.unflatten(treedef, out)


_ACTIVE: contextvars.ContextVar[tuple[Mesh, dict[str, MeshAxes]] | None] = contextvars.ContextVar(
    "hypertron_rules", default=None
)
_PIN: contextvars.ContextVar[bool] = contextvars.ContextVar("hypertron_pin", default=True)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: dict[str, MeshAxes] = DEFAULT_RULES, pin: bool = True) -> Iterator[None]:
    """Within this block (while tracing), :func:`constrain` pins activations on ``mesh``, and the
    layers that run in ``shard_map`` (the MoE's, context attention) split their work over it.
    ``pin=False``: only the latter; activations go where XLA's partitioner puts them (the
    serving engine, whose flat row of tokens the batch rules would not split)."""
    token, pin_token = _ACTIVE.set((mesh, rules)), _PIN.set(pin)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _PIN.reset(pin_token)


def active_rules() -> tuple[Mesh, dict[str, MeshAxes]] | None:
    """The mesh and rules of the enclosing :func:`use_rules` block, or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical axis names; identity when no rules are active."""
    active = _ACTIVE.get()
    if active is None or not _PIN.get():
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(axes, rules, mesh, x.shape)))
