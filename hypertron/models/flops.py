"""Model FLOPs per token, and the device's peak for MFU (from :mod:`hypertron.hardware`).

Counted from the config, matmuls only (as MaxText and the PaLM paper do):
QKV and output projections, the gated MLP (for MoE: the router and the
``top_k`` active experts only), the unembedding, and causal attention (QK^T and PV over on average half the sequence, or the window).
Training costs 3x the forward pass (forward + two backward matmuls).
"""

from __future__ import annotations

import jax

from hypertron.config import ModelConfig
from hypertron.hardware import match

def dense_flops_per_token(cfg: ModelConfig) -> float:
    """Forward matmul FLOPs of one token through the weights (every layer's projections and MLP,
    the unembedding): all of :func:`forward_flops_per_token` but attention's scores."""
    d, n, k, h, f, v = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size)
    proj = 2 * d * (n * h + 2 * k * h) + 2 * n * h * d
    mlp = 3 * 2 * d * f
    if cfg.moe is not None:
        # Only the experts a token is routed to count (top_k), plus the router and shared experts.
        moe = cfg.moe
        mlp = mlp * (moe.top_k + moe.shared_experts) + 2 * d * moe.num_experts
    return cfg.num_layers * (proj + mlp) + 2 * d * v


def attention_flops(cfg: ModelConfig, pairs: float) -> float:
    """Forward FLOPs of ``pairs`` query-key pairs through every layer: QK^T and PV, a
    multiply-add each per head dimension. The one count: :func:`forward_flops_per_token` and the
    serving engine's step cost (``PagedEngine.cost``) both call it."""
    return cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * pairs


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward matmul FLOPs for one token at sequence length ``seq_len`` (2 per multiply-add)."""
    # Causal: on average a query sees (seq_len + 1) / 2 keys; a window caps that.
    keys = (seq_len + 1) / 2
    if cfg.sliding_window is not None and cfg.sliding_window < seq_len:
        w = cfg.sliding_window
        keys = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
    return dense_flops_per_token(cfg) + attention_flops(cfg, keys)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len)


# The layers' forward matmuls each remat policy runs again in the backward, by group
# (:func:`layer_flops`): ``full`` recomputes a layer's forward from its input; ``dots`` saves the
# matmuls' outputs (only the elementwise work between them runs again); ``none`` saves everything.
GROUPS = ("qkv", "out", "mlp_in", "mlp_out", "attention")
RECOMPUTED: dict[str, tuple[str, ...]] = {"none": (), "dots": (), "full": GROUPS}


def layer_flops(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """One layer's forward matmul FLOPs per token by group (:data:`GROUPS`); their sum over the
    layers, plus the unembedding, is :func:`forward_flops_per_token`."""
    d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    mlp_in, mlp_out = 2 * 2 * d * f, 2 * f * d
    if cfg.moe is not None:
        experts = cfg.moe.top_k + cfg.moe.shared_experts
        mlp_in, mlp_out = mlp_in * experts + 2 * d * cfg.moe.num_experts, mlp_out * experts
    attention = (forward_flops_per_token(cfg, seq_len) - dense_flops_per_token(cfg)) / cfg.num_layers
    return {"qkv": 2 * d * (n + 2 * k) * h, "out": 2 * n * h * d, "mlp_in": mlp_in, "mlp_out": mlp_out,
            "attention": attention}


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, groups: tuple[str, ...]) -> float:
    """Matmul FLOPs a token costs again when the backward recomputes these groups of every layer
    (the unembedding, outside the layers, never is). Not in MFU, which counts the model's FLOPs only."""
    per_layer = layer_flops(cfg, seq_len)
    return cfg.num_layers * sum(per_layer[g] for g in groups)


def device_peak_flops(override: float = 0.0, device=None, fmt: str = "bf16") -> float | None:
    """Peak FLOP/s of ``device`` (default: the first device) in ``fmt`` ("bf16", "fp8" or
    "int8"), or ``override`` when set: the hardware table's (:mod:`hypertron.hardware`).

    Returns None when unknown (CPU), in which case MFU is not reported.
    """
    if override > 0:
        return override
    device = device or jax.devices()[0]
    h = match(getattr(device, "device_kind", ""))
    return h.peak(fmt) if h is not None else None
