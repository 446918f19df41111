"""Tiny models for tests, spelled once: the CLI overrides of a model that trains two steps in a few
seconds on CPU, and a random Hugging Face Llama written with ``transformers``."""

from __future__ import annotations

from pathlib import Path

# The tiny preset cut down, as key=value overrides: two layers 64 wide, trained on batches of 8 x 32
# tokens (the training, resume, quantised-training and multi-process tests), or one layer 32 wide on
# 8 x 16 (the tracker and host-monitor tests, and below the CLI's).
TWO_LAYERS = ["model=tiny", "model.num_layers=2", "model.embed_dim=64", "model.mlp_dim=192",
              "train.global_batch=8", "train.seq_len=32"]
ONE_LAYER = ["model=tiny", "model.num_layers=1", "model.embed_dim=32", "model.mlp_dim=64",
             "train.global_batch=8", "train.seq_len=16"]
# One layer of two heads sharing one KV head; two steps from the synthetic source.
TINY_CLI = [*ONE_LAYER, "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
            "train.steps=2", "train.log_every=1", "data.source=synthetic"]


def tiny_hf_llama(*, seed: int = 0, scaled_init: bool = False, **config):
    """A random ``transformers`` Llama (eval mode): 1 layer, 32 wide, 2 heads, 1 KV head and a 300-id
    vocabulary unless ``config`` says otherwise; no special token ids. ``scaled_init`` draws every
    matrix at 1/sqrt(fan-in) and every norm at 1 +- 0.2, so logits spread as a trained model's do."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = dict(dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=256,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None), **config)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    if scaled_init:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.ndim > 1 else 1 + 0.2 * torch.randn_like(p))
    return model


def write_tiny_hf_llama(path: Path, **kwargs):
    """:func:`tiny_hf_llama` saved to ``path`` as safetensors; returns the model."""
    model = tiny_hf_llama(**kwargs)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_short_documents(path: Path, count: int = 300) -> list[str]:
    """``count`` JSON-lines documents of 5 to 60 bytes at ``path``: a 64-token row packs several,
    each at positions (and a segment) of its own. The overrides that read them."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    words = "the a row token device stage piece context query key value chunk".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(1, 10)))}) + "\n"
                            for _ in range(count)))
    return ["data.source=jsonl", f"data.paths={path}"]
