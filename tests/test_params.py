"""Every fact about a parameter is in its declaration: a parameter added in one place (the
declaration, plus the model code that uses it) is converted to and from Hugging Face, quantised
for serving, given an fp8 history and served, with no table anywhere else to edit.

The declarations also say which einsum each weight feeds; a traced forward pass checks that the
model code calls the hook with exactly those subscripts.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.config import PRESETS
from hypertron.models import decoder, fp8_histories, quantize_params
from hypertron.models.params import leaves_with_paths, matmul
from hypertron.quant import QArray

# Its own name and sizes: nothing compiled by another test can be reused for it.
CFG = dataclasses.replace(PRESETS["tiny"], name="tiny-extra", num_layers=2, embed_dim=40, mlp_dim=72,
                          num_heads=2, num_kv_heads=1, head_dim=16, max_seq_len=64)
EXTRA_HF = "model.layers.{layer}.mlp.extra_proj.weight"


@pytest.fixture
def extra_parameter(monkeypatch):
    """The model with one more weight per layer: ``w_extra [d, d]``, added to the MLP's output
    through the einsum hook. Declared once; the model code uses it. Everything else must follow."""
    declare, mlp = decoder.declare, decoder.mlp

    def declare_with_extra(cfg):
        specs = declare(cfg)
        d = cfg.embed_dim
        extra = matmul((d, d), ("embed", None), d, "btd,de->bte", hf=EXTRA_HF)
        specs["layers"]["w_extra"] = dataclasses.replace(extra, shape=(cfg.num_layers, d, d),
                                                         axes=("layers", "embed", None))
        return specs

    def mlp_with_extra(x_btd, p, cfg, einsum):
        return mlp(x_btd, p, cfg, einsum) + einsum("btd,de->bte", x_btd, p["w_extra"])

    # `declare` is imported by name into several modules: patch each binding of the one function.
    for module in [m for name, m in sys.modules.items() if name.startswith("hypertron")]:
        if getattr(module, "declare", None) is declare:
            monkeypatch.setattr(module, "declare", declare_with_extra)
    monkeypatch.setattr(decoder, "mlp", mlp_with_extra)
    from hypertron.models import init_params

    yield init_params(CFG, jax.random.key(0))
    # A module first imported during the test bound the patched function by name, and monkeypatch
    # knows nothing of it: unbind it too (else a later test in this worker saves w_extra).
    for module in [m for name, m in sys.modules.items() if name.startswith("hypertron")]:
        if getattr(module, "declare", None) is declare_with_extra:
            setattr(module, "declare", declare)


@pytest.mark.slow
def test_a_parameter_declared_once_is_converted_quantised_and_served(extra_parameter):
    from hypertron.models import forward
    from hypertron.models.hf import from_hf_tensors, to_hf_tensors
    from hypertron.serve.generate import generate
    from hypertron.serve.model import prepare_params

    params = extra_parameter
    d, L = CFG.embed_dim, CFG.num_layers
    assert params["layers"]["w_extra"].shape == (L, d, d)

    # Converted: its HF tensors, in HF's [out, in] layout, and back exactly.
    tensors = to_hf_tensors(CFG, params)
    for i in range(L):
        np.testing.assert_array_equal(tensors[EXTRA_HF.format(layer=i)], np.asarray(params["layers"]["w_extra"][i]).T)
    back = from_hf_tensors(CFG, tensors)
    np.testing.assert_array_equal(back["layers"]["w_extra"], np.asarray(params["layers"]["w_extra"]))

    # Quantised: int8, one scale per output channel of its einsum, per layer; an fp8 history per layer.
    q = quantize_params(params, CFG)
    assert isinstance(q["layers"]["w_extra"], QArray) and q["layers"]["w_extra"].scales.shape == (L, 1, d)
    assert fp8_histories(CFG)["layers"]["w_extra"]["x"].shape == (L, CFG.amax_history)

    # Used: zeroing it changes the logits.
    tokens = jnp.asarray([[1, 40, 50, 60, 70, 80]], jnp.int32)
    zeroed = {**params, "layers": {**params["layers"], "w_extra": jnp.zeros((L, d, d))}}
    assert not np.allclose(forward(params, tokens, CFG).logits, forward(zeroed, tokens, CFG).logits, atol=1e-3)

    # Served: the paged engine (a prompt in chunks), int8 weights, is greedy under the full forward.
    prompt, n = [1, 40, 50, 60, 70, 80], 6
    int8_params = prepare_params(params, CFG, "int8")
    (got,) = generate(int8_params, CFG, [prompt], n, page_size=4, max_num_batched_tokens=4)
    logits = forward(int8_params, jnp.asarray([prompt + got]), CFG).logits[0, len(prompt) - 1:-1]
    assert got == [int(t) for t in jnp.argmax(logits, -1)]


def test_each_weight_is_called_with_its_declared_einsum(monkeypatch):
    """Trace a forward pass of a dense and an MoE model (capped, so the experts go through the hook)
    with a recording einsum: every hook call on a weight uses the subscripts that weight declares.
    Weights are told apart by their shapes, chosen all different."""
    calls = []

    def recording(mode, dtype):
        def einsum(subscripts, x, w, out_dtype=None, *, quantize=True):
            calls.append((subscripts, tuple(w.shape)))
            return jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype or dtype)
        return einsum

    monkeypatch.setattr(decoder, "einsum_for", recording)
    from hypertron.config import MoEConfig
    from hypertron.models import declare

    dense = dataclasses.replace(CFG, name="tiny-einsums", embed_dim=24, mlp_dim=56, num_heads=3, num_kv_heads=1,
                                head_dim=8, vocab_size=301, scan_layers=False, remat="none")
    moe = dataclasses.replace(dense, name="tiny-einsums-moe", mlp_dim=20,
                              moe=MoEConfig(num_experts=4, top_k=2, mode="capped", shared_experts=1))
    for cfg in (dense, moe):
        calls.clear()
        specs = declare(cfg)
        jax.eval_shape(lambda p: decoder.forward(p, jnp.zeros((2, 5), jnp.int32), cfg),
                       jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs,
                                    is_leaf=lambda s: hasattr(s, "einsum")))
        declared = {}
        for path, spec in leaves_with_paths(specs):
            if spec.einsum is not None:
                declared.setdefault(spec.shape[spec.stack_rank:], set()).add((spec.einsum, "/".join(path)))
        used = set()
        for subscripts, shape in calls:
            matching = {name for einsum, name in declared.get(shape, ()) if einsum == subscripts}
            assert matching, f"{cfg.name}: a weight of shape {shape} is used as {subscripts}, declared {declared.get(shape)}"
            used |= matching
        want = {name for entries in declared.values() for _, name in entries}
        if not cfg.tie_embeddings:
            want.discard("embed")  # untied: the table is only gathered, never an einsum operand
        assert used == want, f"{cfg.name}: declared einsum weights never called: {want - used}"
