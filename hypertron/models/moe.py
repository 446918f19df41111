"""Mixture-of-Experts MLP: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token.

Two ways to run the experts, one config switch (``model.moe.mode``):

* ``dropless``: the token copies are sorted by expert and multiplied with a
  grouped matmul (:mod:`hypertron.kernels.gmm`), so every routed token is
  computed whatever the skew; the work follows the real expert load.
* ``capped``: each expert takes at most ``capacity = ceil(capacity_factor *
  seq_len * top_k / num_experts)`` token copies *of each sequence*, in
  priority order (every token's first choice before any second choice, then
  token order); the rest are dropped (the residual stream carries those
  tokens unchanged) and their fraction is reported. The experts run as one
  dense batched matmul over ``[experts, capacity slots]``: a fixed,
  predictable cost. Capacity per sequence (as MaxText does) makes what is
  dropped independent of the batch size, ``grad_accum`` and the mesh.

With a capacity large enough for every copy, both give the same output.

Parallelism. Under a mesh (:func:`hypertron.parallel.rules.use_rules`), the
layer runs in ``shard_map``: each device routes only its own tokens (the
batch is split over ``data``, ``fsdp`` and ``expert``), and with an
``expert`` mesh axis each device holds ``num_experts / expert`` experts and
the token copies travel to their experts' devices and back with two
all-to-alls (GShard). An expert's hidden dimension may be split over
``tensor`` (the outputs are summed). Dropless exchange uses fixed-size
all-to-alls, with a buffer per peer as large as all of a device's copies,
since every copy may go to one peer: ``expert`` times the copies in memory.
``lax.ragged_all_to_all`` would send only real rows, but XLA:CPU does not
implement it (JAX 0.10.2); TODO(gpu): measure it against this on a GPU.
A batch too small to split over ``expert`` (serving's one flat row of a step's
tokens): in generation (``dropless=True``) every device routes all the tokens,
computes the copies of its own experts only, and the layer's output is summed
over ``expert`` (and ``tensor``): one all-reduce, no exchange, no expert weight
moved (the serving engine's expert parallelism, :mod:`hypertron.serve.placement`).
In training every device then computes all the experts, whole.

Router losses (weights in config): the Switch load-balancing loss
``E * sum_e f_e * P_e`` (``f_e`` the fraction of token copies routed to
expert ``e``, ``P_e`` its mean router probability; 1 when balanced, for any
``top_k``) and the router z-loss ``mean(logsumexp(logits)^2)``, both over
real tokens only, over the whole (micro-)batch on every mesh, and averaged
over layers (Switch sums over layers: its weight 0.01 corresponds to
``0.01 * num_layers`` here). With ``grad_accum > 1`` they are those of the
micro-batches, as in Megatron.

Naming as in :mod:`hypertron.models.decoder`, plus ``e`` experts, ``c``
capacity slots, ``r`` routed copies (tokens x top_k), ``T`` tokens, ``p``
peers on the expert axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hypertron.config import ModelConfig
from hypertron.models.mlp import declare_mlp, mlp
from hypertron.models.params import ParamSpec, matmul
from hypertron.parallel.rules import active_rules, constrain, mesh_axes, spec_for
from hypertron.quant import dense

# Logical axes of the routed experts' weights (one layer's slice).
_EXPERT_AXES = {
    "router": ("embed", None),
    "we_gate": ("expert", "embed", "mlp"),
    "we_up": ("expert", "embed", "mlp"),
    "we_down": ("expert", "mlp", "embed"),
}
# Mixtral as stored on disk (transformers 5 fuses the experts in memory, not in files).
_HF = "model.layers.{layer}.block_sparse_moe."


def declare_moe(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """One layer's MoE parameters (the decoder stacks them over layers). The routed experts run in
    the grouped matmul (dropless) or the hook's einsum (capped), with current fp8 scaling either
    way: they carry no amax history. The router decides in float32 and is never quantised."""
    d, f, e = cfg.embed_dim, cfg.mlp_dim, cfg.moe.num_experts
    hf_names = {"we_gate": "w1", "we_up": "w3", "we_down": "w2"}

    def expert(name: str, shape: tuple[int, ...], fan_in: int, einsum: str) -> ParamSpec:
        return matmul(shape, _EXPERT_AXES[name], fan_in, einsum, fp8_history=False,
                      hf=_HF + "experts.{expert}." + hf_names[name] + ".weight")

    params = {
        "router": ParamSpec((d, e), _EXPERT_AXES["router"], "normal", 1.0 / math.sqrt(d), hf=_HF + "gate.weight",
                            hf_layout="linear"),
        "we_gate": expert("we_gate", (e, d, f), d, "ecd,edf->ecf"),
        "we_up": expert("we_up", (e, d, f), d, "ecd,edf->ecf"),
        "we_down": expert("we_down", (e, f, d), f, "ecf,efd->ecd"),
    }
    if cfg.moe.shared_experts:  # no HF family has them in this form
        params |= declare_mlp(d, f * cfg.moe.shared_experts, None)
    return params


@dataclasses.dataclass(frozen=True)
class ShardAxes:
    """Where the layer's work is split, inside ``shard_map`` (all empty on one device)."""

    batch: tuple[str, ...] = ()  # tokens split over these: router statistics are summed over them
    expert: tuple[str, ...] = ()  # experts split over these: token copies are exchanged over them
    ep: int = 1  # devices along ``expert``
    tensor: tuple[str, ...] = ()  # the experts' hidden dim split over these: outputs are summed
    # tokens whole on every device of these (the experts split over them): each computes its own
    # experts' copies and the outputs are summed (generation with a batch too small to split)
    local: tuple[str, ...] = ()


def _psum(x, axes: tuple[str, ...]):
    return jax.lax.psum(x, axes) if axes else x


def route(x_td: jax.Array, router_de: jax.Array, cfg: ModelConfig, mask_t: jax.Array | None = None,
          axes: ShardAxes = ShardAxes()):
    """``(weights [T, k] float32, experts [T, k] int32, losses)`` for tokens ``x_td``.

    ``mask_t`` (bool [T]) marks real tokens: padding is left out of the load
    statistics and both losses, which cover the tokens of every ``axes.batch`` shard.
    """
    moe = cfg.moe
    m_t = jnp.ones(x_td.shape[0], jnp.float32) if mask_t is None else mask_t.astype(jnp.float32)
    n = jnp.maximum(_psum(jnp.sum(m_t), axes.batch), 1.0)
    logits_te = jnp.einsum("td,de->te", x_td.astype(jnp.float32), router_de.astype(jnp.float32))
    probs_te = jax.nn.softmax(logits_te, axis=-1)
    if moe.gating == "topk_softmax":  # Mixtral: softmax over the chosen logits
        top_logits, experts_tk = jax.lax.top_k(logits_te, moe.top_k)
        weights_tk = jax.nn.softmax(top_logits, axis=-1)
    else:  # softmax_topk: the chosen experts' probabilities, not renormalised
        weights_tk, experts_tk = jax.lax.top_k(probs_te, moe.top_k)
    copies_tk = jnp.broadcast_to(m_t[:, None], experts_tk.shape)
    counts_e = jnp.zeros(moe.num_experts, jnp.float32).at[experts_tk.reshape(-1)].add(copies_tk.reshape(-1))
    counts_e = _psum(counts_e, axes.batch)
    mean_probs_e = _psum(jnp.sum(probs_te * m_t[:, None], axis=0), axes.batch) / n
    z = _psum(jnp.sum(jnp.square(jax.nn.logsumexp(logits_te, axis=-1)) * m_t), axes.batch)
    losses = {
        "load_balance": moe.num_experts * jnp.sum(counts_e / (n * moe.top_k) * mean_probs_e),
        "router_z": z / n,
        "load": counts_e,
    }
    return weights_tk, experts_tk.astype(jnp.int32), losses


def moe_mlp(x_btd: jax.Array, p: dict[str, Any], cfg: ModelConfig, einsum, activation,
            mask_bt: jax.Array | None = None, dropless: bool = False):
    """The MoE block's output [b, t, d] and its statistics (losses, per-expert load, dropped fraction).

    ``mask_bt`` (bool) marks real tokens: padding never takes an expert's
    capacity, is computed by no expert and is left out of the statistics.
    ``dropless=True`` overrides a capped config (generation: a prompt's
    output must not depend on what else is in the batch).
    """
    mode = "dropless" if dropless else cfg.moe.mode
    mask_bt = jnp.ones(x_btd.shape[:2], bool) if mask_bt is None else mask_bt
    experts = {k: p[k] for k in _EXPERT_AXES}
    layer = functools.partial(_routed, cfg=cfg, einsum=einsum, activation=activation, mode=mode)
    active = active_rules()
    if active is None or active[0].size == 1:
        y_btd, stats = layer(x_btd, mask_bt, experts, axes=ShardAxes())
    else:
        y_btd, stats = _sharded(layer, x_btd, mask_bt, experts, *active, local=dropless)
    if cfg.moe.shared_experts:
        y_btd = y_btd + mlp(x_btd, p, cfg, einsum)
    return y_btd, stats


def _sharded(layer, x_btd, mask_bt, experts, mesh, rules, local: bool = False):
    """``layer`` in ``shard_map``: tokens split as the batch rule says, experts as the expert rule does.

    Each weight comes in sharded as the rules shard it and is all-gathered over its ``embed``
    (fsdp) shards inside, so that its gradient is reduce-scattered back, as FSDP does. ``local``
    (generation, dropless): a batch too small to split over the expert axis keeps the experts
    split there, each device computing its own (see the module docstring).
    """
    x_spec = P(spec_for(("batch", "seq", "act_embed"), rules, mesh, x_btd.shape)[0], None, None)
    batch = mesh_axes(x_spec[0])
    specs = {k: spec_for(axes, rules, mesh, experts[k].shape) for k, axes in _EXPERT_AXES.items()}
    expert, tensor = mesh_axes(specs["we_gate"][0]), mesh_axes(specs["we_gate"][2])
    replicated = ()
    if not set(expert) <= set(batch):
        # The batch is too small to split over the expert axis: every device has all the tokens,
        # so each computes its own experts' copies (local), or all the experts, whole.
        if local:
            replicated = expert
        else:
            specs = {k: P(None, *v[1:]) if k != "router" else v for k, v in specs.items()}
        expert = ()
    ep = math.prod(mesh.shape[a] for a in expert + replicated)
    axes = ShardAxes(batch=batch, expert=expert, ep=ep, tensor=tensor, local=replicated)

    def shard(x, mask, w):
        for k, logical in _EXPERT_AXES.items():
            dim = logical.index("embed")
            if specs[k][dim] is not None:
                w = w | {k: jax.lax.all_gather(w[k], mesh_axes(specs[k][dim]), axis=dim, tiled=True)}
        return layer(x, mask, w, axes=axes)

    # check_vma=False: Pallas calls and custom VJPs (the grouped matmul) carry no
    # varying-axes types. The gradients are right without them (tests/test_expert_parallel.py).
    fn = jax.shard_map(shard, mesh=mesh, in_specs=(x_spec, P(*x_spec[:2]), specs), out_specs=(x_spec, P()),
                       check_vma=False)
    return fn(x_btd, mask_bt, experts)


def _routed(x_btd, mask_bt, w, axes: ShardAxes, *, cfg: ModelConfig, einsum, activation, mode: str):
    """The routed experts on this device's tokens (all of them on one device)."""
    b, t, d = x_btd.shape
    x_td, mask_t = x_btd.reshape(b * t, d), mask_bt.reshape(b * t)
    weights_tk, experts_tk, stats = route(x_td, w["router"], cfg, mask_t, axes)
    if mode == "dropless":
        y_td = _dropless(x_td, weights_tk, experts_tk, w, cfg, activation, mask_t, axes)
        stats["dropped"] = jnp.zeros((), jnp.float32)
    else:
        y_td, stats["dropped"] = _capped(x_btd, weights_tk, experts_tk, w, cfg, einsum, activation, mask_bt, axes)
    y_td = _psum(y_td, axes.tensor + axes.local)  # partial sums over the hidden-dim shards (and local experts)
    return y_td.reshape(b, t, d).astype(x_btd.dtype), stats


def _dropless(x_td, weights_tk, experts_tk, w, cfg: ModelConfig, activation, mask_t=None, axes=ShardAxes()):
    """Every routed copy computed: copies sorted by expert, three grouped matmuls, weighted sum back."""
    from hypertron.kernels.gmm import gmm

    T, k = experts_tk.shape
    e = cfg.moe.num_experts
    real_t = jnp.ones(T, bool) if mask_t is None else mask_t
    # Padding copies get expert id e: they sort last and are in no group, so nothing computes them.
    flat_r = jnp.where(real_t[:, None], experts_tk, e).reshape(-1)
    order_r = jnp.argsort(flat_r, stable=True)  # copy r of the sorted list is flat copy order[r]
    x_rd = jnp.take(x_td, order_r // k, axis=0)
    sizes_e = jnp.zeros(e, jnp.int32).at[flat_r].add(1, mode="drop")
    dtype, backend = x_td.dtype, cfg.moe.gmm_backend

    def experts_ffn(x_rd, group_sizes):
        def grouped(lhs, rhs):
            return gmm(lhs, dense(rhs, dtype), group_sizes, backend=backend)

        return grouped(activation(grouped(x_rd, w["we_gate"]), cfg) * grouped(x_rd, w["we_up"]), w["we_down"])

    if axes.ep == 1:
        out_rd = experts_ffn(x_rd, sizes_e)
    elif axes.local:
        out_rd = _own_experts(x_rd, sizes_e, experts_ffn, axes)
    else:
        out_rd = _exchange(x_rd, sizes_e, experts_ffn, axes)
    # Back to [T, k] order, then the router-weighted sum over each token's k experts.
    unsorted_rd = jnp.zeros_like(out_rd).at[order_r].set(out_rd)
    out_tkd = unsorted_rd.reshape(T, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", out_tkd, weights_tk)


def _own_experts(x_rd, sizes_e, experts_ffn, axes: ShardAxes):
    """``experts_ffn`` on the copies (sorted by expert, the same on every device) of this device's
    experts, ``[me * el, (me + 1) * el)``: they are contiguous, so they are moved to the front,
    computed, and moved back; every other copy's row is zero (another device computes it)."""
    R, _ = x_rd.shape
    el = sizes_e.shape[0] // axes.ep
    first = jax.lax.axis_index(axes.local) * el
    mine_e = jax.lax.dynamic_slice_in_dim(sizes_e, first, el)
    start = jnp.sum(jnp.where(jnp.arange(sizes_e.shape[0]) < first, sizes_e, 0))
    rows = jnp.arange(R)
    out = experts_ffn(jnp.take(x_rd, jnp.minimum(start + rows, R - 1), axis=0), mine_e)  # rows past them: no group
    at = rows - start
    mine = (at >= 0) & (at < jnp.sum(mine_e))
    return jnp.where(mine[:, None], jnp.take(out, jnp.clip(at, 0, R - 1), axis=0), 0)


def _exchange(x_rd, sizes_e, experts_ffn, axes: ShardAxes):
    """``experts_ffn`` applied to copies sorted by expert, each on the device that holds its expert.

    Peer ``p`` holds experts ``[p * el, (p + 1) * el)``, so the copies for each peer are
    contiguous in the sorted list. They travel in a fixed ``[ep, R, d]`` buffer (a peer
    may receive all of a device's ``R`` copies), are regrouped by local expert on arrival,
    computed, and sent back the same way.
    """
    R, _ = x_rd.shape
    ep = axes.ep
    sizes_pe = sizes_e.reshape(ep, -1)  # my copies for peer p's local experts
    send_p = jnp.sum(sizes_pe, axis=1)
    start_p = jnp.cumsum(send_p) - send_p
    rows = jnp.arange(R)
    valid_pr = rows[None, :] < send_p[:, None]
    src_pr = jnp.minimum(start_p[:, None] + rows[None, :], R - 1)
    send_prd = jnp.where(valid_pr[..., None], jnp.take(x_rd, src_pr, axis=0), 0)
    recv_prd = jax.lax.all_to_all(send_prd, axes.expert, 0, 0, tiled=True)  # now p is the sender
    recv_sizes_pe = jax.lax.all_to_all(sizes_pe, axes.expert, 0, 0, tiled=True)
    # Local expert of every received row (el for a sender's padding rows, which then sort last).
    ends_pe = jnp.cumsum(recv_sizes_pe, axis=1)
    group_pr = jax.vmap(lambda ends: jnp.searchsorted(ends, rows, side="right"))(ends_pe)
    order = jnp.argsort(group_pr.reshape(-1), stable=True)
    out = experts_ffn(jnp.take(recv_prd.reshape(ep * R, -1), order, axis=0), jnp.sum(recv_sizes_pe, axis=0))
    back_prd = jnp.zeros_like(out).at[order].set(out).reshape(ep, R, -1)
    back_prd = jax.lax.all_to_all(back_prd, axes.expert, 0, 0, tiled=True)  # my copies, by the peer that did them
    peer_r = jnp.searchsorted(jnp.cumsum(send_p), rows, side="right")  # ep for my padding copies
    mine = peer_r < ep
    peer_r = jnp.minimum(peer_r, ep - 1)
    out_rd = back_prd[peer_r, jnp.clip(rows - start_p[peer_r], 0, R - 1)]
    return jnp.where(mine[:, None], out_rd, 0)


def capacity(cfg: ModelConfig, seq_len: int) -> int:
    """Copies each expert takes from one sequence of ``seq_len`` tokens."""
    moe = cfg.moe
    return max(1, math.ceil(moe.capacity_factor * seq_len * moe.top_k / moe.num_experts))


def _capped(x_btd, weights_tk, experts_tk, w, cfg: ModelConfig, einsum, activation, mask_bt=None,
            axes: ShardAxes = ShardAxes()):
    """At most ``capacity`` copies per expert and sequence; returns (output [T, d], fraction of real copies dropped)."""
    b, t, d = x_btd.shape
    k = experts_tk.shape[1]
    e, c = cfg.moe.num_experts, capacity(cfg, t)
    real_bt = jnp.ones((b, t), bool) if mask_bt is None else mask_bt

    def slots(experts_tk, real_t):
        # Priority: every token's 1st choice, then every 2nd choice...; within a choice, token order.
        # Padding copies are routed nowhere (all-zero one-hot), so they take no slot.
        experts_kt = experts_tk.T
        onehot_kte = jax.nn.one_hot(experts_kt, e, dtype=jnp.int32) * real_t[None, :, None]
        position_kt = jnp.sum((jnp.cumsum(onehot_kte.reshape(k * t, e), axis=0).reshape(k, t, e) - 1) * onehot_kte,
                              axis=-1)
        kept_kt = (position_kt < c) & real_t[None, :]
        # Slot e * c + position in the sequence's [e * c] buffer; dropped copies go to one extra slot.
        return jnp.where(kept_kt, experts_kt * c + position_kt, e * c), kept_kt

    slot_bkt, kept_bkt = jax.vmap(slots)(experts_tk.reshape(b, t, k), real_bt)
    tokens_kt = jnp.broadcast_to(jnp.arange(t), (k, t))
    buffer = jax.vmap(lambda s, x: jnp.zeros((e * c + 1, d), x.dtype).at[s.reshape(-1)].set(
        x[tokens_kt.reshape(-1)]))(slot_bkt, x_btd)
    x_ecd = buffer[:, :-1].reshape(b, e, c, d).swapaxes(0, 1).reshape(e, b * c, d)
    if axes.ep > 1:  # my slots for peer p's experts go to p; p's slots for mine come here
        x_ecd = jax.lax.all_to_all(x_ecd, axes.expert, 0, 1, tiled=True)
    gate = einsum("ecd,edf->ecf", x_ecd, w["we_gate"])
    up = einsum("ecd,edf->ecf", x_ecd, w["we_up"])
    out_ecd = einsum("ecf,efd->ecd", activation(gate, cfg) * up, w["we_down"])
    if axes.ep > 1:
        out_ecd = jax.lax.all_to_all(out_ecd, axes.expert, 1, 0, tiled=True)
    out_bsd = out_ecd.reshape(e, b, c, d).swapaxes(0, 1).reshape(b, e * c, d)
    out_bsd = jnp.concatenate([out_bsd, jnp.zeros((b, 1, d), out_bsd.dtype)], axis=1)
    out_bktd = jax.vmap(lambda o, s: o[s])(out_bsd, slot_bkt).astype(jnp.float32)
    weights_bkt = jnp.where(kept_bkt, weights_tk.reshape(b, t, k).swapaxes(1, 2), 0.0)
    y_td = jnp.einsum("bktd,bkt->btd", out_bktd, weights_bkt).reshape(b * t, d)
    kept = _psum(jnp.sum(kept_bkt.astype(jnp.float32)), axes.batch)
    real_copies = jnp.maximum(_psum(jnp.sum(real_bt.astype(jnp.float32)), axes.batch) * k, 1.0)
    return y_td, 1.0 - kept / real_copies
