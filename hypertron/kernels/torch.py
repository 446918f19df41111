"""The grouped matmul for PyTorch tensors, computed by the JAX implementation.

:func:`gmm` is a ``torch.autograd.Function`` whose forward and backward call
:func:`hypertron.kernels.gmm.gmm` (and its VJP, jitted). Tensors cross between the
frameworks through DLPack:

* torch -> JAX: ``jax.dlpack.from_dlpack(tensor)``, zero-copy for contiguous tensors
  (checked on CPU for float32, bfloat16 and int32). JAX copies on its own where it
  cannot alias the buffer (int64 under JAX's default 32-bit mode, strided views);
  tensors that require grad are detached first, since torch refuses to export them.
* JAX -> torch: ``torch.utils.dlpack.from_dlpack(array)``, zero-copy.
* Where either side refuses DLPack (an older torch or JAX, a device the other
  framework does not see), the tensor goes through a host numpy copy instead, and
  the result comes back on the input's device.

Verified on CPU only (JAX 0.10.2, torch 2.13.0, ``tests/test_gmm.py``). CUDA tensors
should take the same DLPack path onto a CUDA JAX backend, but that is untested.

torch is a test extra, not a runtime dependency: it is imported on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np

from hypertron.kernels.gmm import gmm as _jax_gmm
from hypertron.kernels.gmm import resolve_backend


def gmm(lhs, rhs, group_sizes, *, backend: str = "auto",
        tiling: tuple[int, int, int] | None = None, interpret: bool | None = None):
    """Grouped matmul of torch tensors: ``out[rows of g] = lhs[rows of g] @ rhs[g]``.

    ``lhs [m, k]``, ``rhs [G, k, n]``, ``group_sizes [G]`` (integer, sum <= m) ->
    ``[m, n]`` in ``lhs.dtype``, zeros past ``sum(group_sizes)``. Differentiable in
    ``lhs`` and ``rhs`` with ``torch.autograd``. Keyword arguments as in
    :func:`hypertron.kernels.gmm.gmm`.
    """
    import torch

    options = (resolve_backend(backend),
               None if tiling is None else tuple(int(t) for t in tiling), interpret)
    return _function()(lhs, rhs, group_sizes.to(torch.int32), options)


@functools.cache
def _function():
    """The autograd Function, built on first use so that torch is imported lazily."""
    import torch

    class GroupedMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, lhs, rhs, group_sizes, options):
            ctx.save_for_backward(lhs, rhs, group_sizes)
            ctx.options = options
            backend, tiling, interpret = options
            out = _jax_gmm(_to_jax(lhs), _to_jax(rhs), _to_jax(group_sizes), backend=backend,
                           tiling=tiling, interpret=interpret)
            return _to_torch(out, like=lhs)

        @staticmethod
        def backward(ctx, dout):
            lhs, rhs, group_sizes = ctx.saved_tensors
            dlhs, drhs = _vjp(*ctx.options)(_to_jax(lhs), _to_jax(rhs), _to_jax(group_sizes),
                                            _to_jax(dout))
            need_lhs, need_rhs = ctx.needs_input_grad[:2]
            return (_to_torch(dlhs, like=lhs) if need_lhs else None,
                    _to_torch(drhs, like=rhs) if need_rhs else None, None, None)

    return GroupedMatmul.apply


@functools.cache
def _vjp(backend: str, tiling, interpret):
    """Jitted ``(lhs, rhs, group_sizes, dout) -> (dlhs, drhs)``; XLA drops the unused forward."""

    def grads(lhs, rhs, group_sizes, dout):
        f = lambda l, r: _jax_gmm(l, r, group_sizes, backend=backend, tiling=tiling,
                                  interpret=interpret)
        return jax.vjp(f, lhs, rhs)[1](dout.astype(lhs.dtype))

    return jax.jit(grads)


def _to_jax(t) -> jax.Array:
    """A torch tensor as a JAX array: DLPack (zero-copy where possible), else a numpy copy."""
    import torch

    t = t.detach()
    try:
        return jax.dlpack.from_dlpack(t if t.is_contiguous() else t.contiguous())
    except (BufferError, RuntimeError, TypeError, ValueError):
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the bits
            import ml_dtypes

            bits = t.cpu().view(torch.int16).numpy()
            return jnp.asarray(bits.view(ml_dtypes.bfloat16))
        return jnp.asarray(t.cpu().numpy())


def _to_torch(x: jax.Array, *, like: Any):
    """A JAX array as a torch tensor on ``like``'s device: DLPack, else a numpy copy."""
    import torch
    import torch.utils.dlpack

    x = x.block_until_ready()  # torch may read (or the caller free inputs) right away
    try:
        t = torch.utils.dlpack.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError):
        host = np.asarray(x)
        if host.dtype.name == "bfloat16":
            t = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(host.copy())
    return t.to(like.device)
