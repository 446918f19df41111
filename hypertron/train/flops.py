"""Model FLOPs per token and the peak table used for MFU.

Counted from the config, matmuls only (as MaxText and the PaLM paper do):
QKV and output projections, the gated MLP (for MoE: the router and the
``top_k`` active experts only), the unembedding, and causal attention (QK^T and PV over on average half the sequence, or the window).
Training costs 3x the forward pass (forward + two backward matmuls).
"""

from __future__ import annotations

import jax

from hypertron.config import ModelConfig

# Dense bf16 peak FLOP/s per device (no sparsity).
# Matched in order against the lower-cased device kind: specific names first.
PEAK_FLOPS = {
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "tpu v5p": 459e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v6": 918e12,
}


# Dense fp8 / int8 peak FLOP/s (OP/s for int8) per device, for the MFU of quantised training
# (EMFU stays against the bf16 peak above). Same matching as PEAK_FLOPS; no entry: unknown.
QUANT_PEAK_FLOPS = {
    "fp8": {"h100 pcie": 1513e12, "h100 nvl": 1671e12, "h100": 1979e12, "h200": 1979e12},
    "int8": {"h100 pcie": 1513e12, "h100 nvl": 1671e12, "h100": 1979e12, "h200": 1979e12,
             "a100": 624e12, "tpu v5p": 918e12, "tpu v5 lite": 394e12, "tpu v5e": 394e12, "tpu v6": 1836e12},
}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward matmul FLOPs for one token at sequence length ``seq_len`` (2 per multiply-add)."""
    d, n, k, h, f, v = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size)
    proj = 2 * d * (n * h + 2 * k * h) + 2 * n * h * d
    mlp = 3 * 2 * d * f
    if cfg.moe is not None:
        # Only the experts a token is routed to count (top_k), plus the router and shared experts.
        moe = cfg.moe
        mlp = mlp * (moe.top_k + moe.shared_experts) + 2 * d * moe.num_experts
    # Causal: on average a query sees (seq_len + 1) / 2 keys; a window caps that.
    keys = (seq_len + 1) / 2
    if cfg.sliding_window is not None and cfg.sliding_window < seq_len:
        w = cfg.sliding_window
        keys = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
    attn = 2 * 2 * n * h * keys
    return cfg.num_layers * (proj + mlp + attn) + 2 * d * v


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 3 * forward_flops_per_token(cfg, seq_len)


def device_peak_flops(override: float = 0.0, device=None, fmt: str = "bf16") -> float | None:
    """Peak FLOP/s of ``device`` (default: the first device) in ``fmt`` ("bf16", "fp8" or
    "int8"), or ``override`` when set.

    Returns None when unknown (CPU), in which case MFU is not reported.
    """
    if override > 0:
        return override
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "").lower()
    for name, peak in (PEAK_FLOPS if fmt == "bf16" else QUANT_PEAK_FLOPS[fmt]).items():
        if name in kind:
            return peak
    return None
