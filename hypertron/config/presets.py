"""Model presets as data: each family is the shared decoder plus the fields that differ.

Presets live in the config package (not under ``models/``) because the config
loader resolves ``model=NAME`` and the config layer may not import upward. They
import only the schema.
"""

from __future__ import annotations

from dataclasses import replace

from hypertron.config.schema import DlrmConfig, ModelConfig, MoEConfig, RopeScaling

_LLAMA2_7B = ModelConfig(
    name="llama2-7b",
    vocab_size=32000,
    embed_dim=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    mlp_dim=11008,
    norm_eps=1e-5,
    rope_theta=10000.0,
    max_seq_len=4096,
)

_LLAMA3_8B = replace(_LLAMA2_7B, name="llama3-8b", vocab_size=128256, num_kv_heads=8, mlp_dim=14336,
                     rope_theta=500000.0, max_seq_len=8192)

# The 70B trunk, the same in Llama 2 and Llama 3 (GQA with 8 KV heads in both).
_LLAMA_70B = dict(embed_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, mlp_dim=28672)

_LLAMA3_70B = replace(_LLAMA3_8B, name="llama3-70b", **_LLAMA_70B)

_GEMMA = dict(
    activation="gelu",
    norm_eps=1e-6,
    norm_zero_centered=True,
    embed_scale=True,
    tie_embeddings=True,
    head_dim=256,
    vocab_size=256000,
    max_seq_len=8192,
)

# The schema's defaults are the tiny decoder; the preset adds only a name and a shorter context.
_TINY = ModelConfig(name="tiny", max_seq_len=2048)

PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": _LLAMA2_7B,
    "llama2-13b": replace(
        _LLAMA2_7B, name="llama2-13b", embed_dim=5120, num_layers=40, num_heads=40,
        num_kv_heads=40, mlp_dim=13824,
    ),
    "llama2-70b": replace(_LLAMA2_7B, name="llama2-70b", **_LLAMA_70B),
    "llama3-8b": _LLAMA3_8B,
    "llama3-70b": _LLAMA3_70B,
    "llama3.1-8b": replace(
        _LLAMA3_8B, name="llama3.1-8b", rope_scaling=RopeScaling(), max_seq_len=131072
    ),
    "llama3.1-70b": replace(
        _LLAMA3_70B, name="llama3.1-70b", rope_scaling=RopeScaling(), max_seq_len=131072
    ),
    "mistral-7b": replace(
        _LLAMA3_8B, name="mistral-7b", vocab_size=32000, rope_theta=10000.0,
        sliding_window=4096, max_seq_len=32768,
    ),
    "gemma-2b": replace(
        _LLAMA2_7B, name="gemma-2b", embed_dim=2048, num_layers=18, num_heads=8,
        num_kv_heads=1, mlp_dim=16384, **_GEMMA,
    ),
    "gemma-7b": replace(
        _LLAMA2_7B, name="gemma-7b", embed_dim=3072, num_layers=28, num_heads=16,
        num_kv_heads=16, mlp_dim=24576, **_GEMMA,
    ),
    # About 1.1B parameters, Llama architecture: the single-GPU MFU benchmark.
    "llama-1b": replace(
        _LLAMA3_8B, name="llama-1b", vocab_size=32000, embed_dim=2048, num_layers=22,
        num_heads=16, num_kv_heads=4, head_dim=128, mlp_dim=5632, rope_theta=10000.0,
        max_seq_len=4096,
    ),
    # Mixtral: Mistral-style attention (no window in the released configs), 8 experts, top-2.
    "mixtral-8x7b": replace(
        _LLAMA3_8B, name="mixtral-8x7b", vocab_size=32000, rope_theta=1e6, max_seq_len=32768,
        moe=MoEConfig(num_experts=8, top_k=2),
    ),
    "mixtral-8x22b": replace(
        _LLAMA3_8B, name="mixtral-8x22b", vocab_size=32768, embed_dim=6144, num_layers=56,
        num_heads=48, num_kv_heads=8, mlp_dim=16384, rope_theta=1e6, max_seq_len=65536,
        moe=MoEConfig(num_experts=8, top_k=2),
    ),
    # Tiny presets for tests and the demo (byte-level vocabulary).
    "tiny": _TINY,
    "tiny-llama3": replace(
        _TINY, name="tiny-llama3", rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, original_max_position=64),
    ),
    "tiny-mistral": replace(_TINY, name="tiny-mistral", sliding_window=64),
    "tiny-gemma": replace(
        _TINY, name="tiny-gemma", activation="gelu", norm_eps=1e-6, norm_zero_centered=True,
        embed_scale=True, tie_embeddings=True, num_kv_heads=1,
    ),
    # 4 experts of a third of tiny's MLP, top-2: about the active compute of tiny.
    "tiny-moe": replace(_TINY, name="tiny-moe", mlp_dim=192, moe=MoEConfig(num_experts=4, top_k=2)),
}

# DLRM recommenders (``dlrm=NAME``, with ``task: dlrm``).
DLRM_PRESETS: dict[str, DlrmConfig] = {
    # MLPerf Training's DLRM-v2 (DCNv2) on Criteo 1TB multi-hot: 26 tables capped at 40M rows, the
    # synthetic multi-hot sizes, dimension 128, bottom 512-256-128, 3 cross layers of rank 512, top
    # 1024-1024-512-256-1, row-wise Adagrad.
    "dlrm-v2": DlrmConfig(
        name="dlrm-v2", dense_features=13,
        table_rows=(40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
                    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36),
        ids_per_sample=(3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1),
        embed_dim=128, bottom_mlp=(512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1), cross_layers=3,
        cross_rank=512, optimizer="rowwise_adagrad",
    ),
    # For tests and CPU runs: 8 small tables, the same architecture.
    "dlrm-v2-tiny": DlrmConfig(),
}
