"""Grouped matmul: every backend against the reference, forward and both gradients.

The Pallas kernels run in interpret mode (the default on CPU). Shapes are tiny and
chosen to hit the edges: groups of size 0 (first, middle, last), rows past
``sum(group_sizes)``, ``m`` not a multiple of ``tm``, row tiles that straddle
several groups, ``k`` and ``n`` not multiples of their tiles.

Tolerances: float32 within 1e-5 (relative to the largest reference value);
bfloat16 within 2e-2 of a float32 reference computed from the same bf16 inputs
(bf16 keeps 8 significant bits: the output and ``dout`` are each rounded once).
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.kernels.gmm import (
    gmm,
    gmm_reference,
    resolve_backend,
    tgmm,
    tgmm_reference,
)

# The GPU campaign's T1 runs these compiled for the GPU; the oracles multiply in exact float32
# (numpy, torch on the CPU, the reference), so the kernels are asked to as well (conftest.float32_matmuls).
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("float32_matmuls")]

TILING = (16, 16, 16)  # small tiles, so that tiny shapes still have several
BACKENDS = ["pallas", "grouped", "ragged_dot"]
# m=50 (3 full tiles of 16 and a partial one), sum=41 < m, zeros at both ends and inside.
SIZES = np.array([0, 7, 0, 20, 3, 11, 0], np.int32)
M, K, N = 50, 24, 40


def _operands(sizes, m=M, k=K, n=N, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(keys[1], (len(sizes), k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    dout = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), dout


def _assert_close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_and_grads_match_reference(backend, dtype):
    lhs, rhs, _, dout = _operands(SIZES, dtype=jnp.dtype(dtype))
    step = _jitted_step(backend, dout)
    # The oracle sees the same (possibly bf16-rounded) inputs, in float32.
    f32 = [x.astype(jnp.float32) for x in (lhs, rhs, dout)]
    reference = _jitted_step("reference", f32[2])
    for split in (SIZES, np.roll(SIZES, 3)):  # group sizes are data: one compiled step
        sizes = jnp.asarray(split)
        got = step(lhs, rhs, sizes)
        want = reference(f32[0], f32[1], sizes)
        tol = 1e-5 if dtype == "float32" else 2e-2
        for g, w, name in zip(got, want, ["out", "dlhs", "drhs"]):
            assert g.dtype == jnp.dtype(dtype), name
            _assert_close(g, w, tol)
        out, dlhs, drhs = (np.asarray(x, np.float32) for x in got)
        assert not out[split.sum():].any() and not dlhs[split.sum():].any()  # past the sum
        assert not drhs[split == 0].any()  # empty groups get no gradient
    assert step._cache_size() == 1


def _jitted_step(backend, dout):
    """Jitted ``(lhs, rhs, group_sizes) -> (out, dlhs, drhs)`` of ``backend``, tiny tiles."""

    @jax.jit
    def step(lhs, rhs, sizes):
        f = lambda l, r: gmm(l, r, sizes, backend=backend, tiling=TILING)
        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, *vjp(dout))

    return step


def test_reference_is_a_loop_over_groups():
    lhs, rhs, sizes, dout = _operands(SIZES)
    lhs_np, rhs_np, dout_np = (np.asarray(x) for x in (lhs, rhs, dout))
    ends = np.cumsum(SIZES)
    want = np.zeros((M, N), np.float32)
    want_t = np.zeros((len(SIZES), K, N), np.float32)
    for g, (start, end) in enumerate(zip(ends - SIZES, ends)):
        want[start:end] = lhs_np[start:end] @ rhs_np[g]
        want_t[g] = lhs_np[start:end].T @ dout_np[start:end]
    _assert_close(gmm_reference(lhs, rhs, sizes), want, 1e-5)
    _assert_close(tgmm_reference(lhs, dout, sizes), want_t, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tgmm_matches_reference(backend):
    lhs, _, sizes, dout = _operands(SIZES)
    _assert_close(tgmm(lhs, dout, sizes, backend=backend, tiling=TILING),
                  tgmm_reference(lhs, dout, sizes), 1e-5)


@pytest.mark.parametrize("backend", ["pallas", "grouped"])
def test_edge_cases(backend):
    """Nothing routed (all zeros), and one group holding all m=33 rows (no tile multiple)."""
    lhs, rhs, _, dout = _operands([0, 0, 0], m=33, k=16, n=16, seed=1)
    step, reference = _jitted_step(backend, dout), _jitted_step("reference", dout)
    for split in ([0, 0, 0], [0, 33, 0]):
        sizes = jnp.asarray(split, jnp.int32)
        for g, w in zip(step(lhs, rhs, sizes), reference(lhs, rhs, sizes)):
            _assert_close(g, w, 1e-5)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_float32_output_for_bf16_inputs(backend):
    lhs, rhs, sizes, _ = _operands(SIZES, dtype=jnp.bfloat16)
    out = gmm(lhs, rhs, sizes, backend=backend, preferred_element_type=np.dtype("float32"))
    assert out.dtype == jnp.float32
    want = gmm_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    _assert_close(out, want, 1e-5)  # only the inputs were rounded, and identically


def test_auto_backend_and_bad_arguments_are_refused():
    if jax.default_backend() == "cpu":
        assert resolve_backend("auto") == "grouped"  # measured: docs/kernels.md
    lhs, rhs, sizes, _ = _operands(SIZES)
    with pytest.raises(ValueError, match="backend"):
        gmm(lhs, rhs, sizes, backend="triton")
    with pytest.raises(ValueError, match="powers of two"):
        gmm(lhs, rhs, sizes, tiling=(24, 16, 16))
    with pytest.raises(ValueError, match="group_sizes"):
        gmm(lhs, rhs, sizes[:-1])
    with pytest.raises(ValueError, match="rhs"):
        gmm(lhs, rhs[:, :-1], sizes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_lowers_to_triton_for_cuda(dtype):
    """The kernels (forward, dlhs, drhs) lower to Triton IR for a CUDA target, without a GPU.

    This checks the Triton lowering rules (power-of-two loads, dynamic loops, dots);
    compiling that IR to PTX and running it needs a GPU and is not checked here.
    """
    from jax import export

    dt = jnp.dtype(dtype)
    specs = [jax.ShapeDtypeStruct(shape, d) for shape, d in
             [((100, 48), dt), ((5, 48, 80), dt), ((5,), jnp.int32), ((100, 80), dt)]]

    def step(lhs, rhs, sizes, dout):
        f = lambda l, r: gmm(l, r, sizes, backend="pallas", interpret=False)
        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, *vjp(dout))

    triton = "__gpu$xla.gpu.triton"
    exported = export.export(jax.jit(step), platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])
    module = exported(*specs).mlir_module()
    kernels = [line.split('name = "')[1].split('"')[0] for line in module.splitlines()
               if f"custom_call @{triton}" in line]
    assert sorted(kernels) == ["gmm", "gmm", "tgmm"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_binding_matches_torch_reference():
    import torch

    from hypertron.kernels.torch import gmm as torch_gmm

    gen = torch.Generator().manual_seed(0)
    lhs = torch.randn(M, K, generator=gen, requires_grad=True)
    rhs = torch.randn(len(SIZES), K, N, generator=gen, requires_grad=True)
    dout = torch.randn(M, N, generator=gen)
    sizes = torch.from_numpy(SIZES).to(torch.int64)  # int64, as torch makes them

    out = torch_gmm(lhs, rhs, sizes, tiling=TILING)  # "auto": "grouped" on CPU
    dlhs, drhs = torch.autograd.grad(out, (lhs, rhs), dout)

    want = torch.zeros(M, N)
    ends = np.cumsum(SIZES)
    for g, (start, end) in enumerate(zip(ends - SIZES, ends)):
        want[start:end] = lhs[start:end] @ rhs[g]
    want_dlhs, want_drhs = torch.autograd.grad(want, (lhs, rhs), dout)
    for got, ref in [(out, want), (dlhs, want_dlhs), (drhs, want_drhs)]:
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        _assert_close(got.detach().numpy(), ref.detach().numpy(), 1e-5)
