"""A tiny ``StableDiffusionPipeline`` folder written by diffusers (random weights, a hand-written CLIP
vocabulary), for the diffusion pipeline's and the image server's tests. diffusers, transformers and
torch are imported when a folder is made, not at collection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue"]
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def write_clip_vocab(folder, words=WORDS) -> tuple[str, str]:
    """A CLIP BPE as the hub ships it (bytes, bytes + ``</w>``, merges of ``words``, the specials)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = [chr(b if b in printable else next(extra)) for b in range(256)]
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars])}
    merges = []
    for word in words:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            merges.append(f"{parts[0]} {parts[1]}")
            vocab.setdefault(parts[0] + parts[1], len(vocab))
            parts = [parts[0] + parts[1], *parts[2:]]
    vocab |= {BOS: len(vocab), EOS: len(vocab) + 1}
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def tiny_sd(root: Path):
    """``(folder, diffusers pipeline)``: a random tiny SD 1.x pipeline (16x16 images, 8x8 latents),
    DDIM as SD 1.x configures it, saved with ``save_pretrained`` under ``root``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    diffusers = pytest.importorskip("diffusers")
    tokenizer = transformers.CLIPTokenizer(*write_clip_vocab(root / "vocab"), pad_token=EOS, model_max_length=77)
    torch.manual_seed(0)
    n = len(tokenizer)
    encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=n, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=n - 2, eos_token_id=n - 1))
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=8)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8)
    scheduler = diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = diffusers.StableDiffusionPipeline(vae=vae, text_encoder=encoder, tokenizer=tokenizer, unet=unet,
                                             scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    pipe.save_pretrained(root / "sd")
    # The reference is the folder read back: a scheduler built in memory marks the options it was not
    # given, and from_config gives another class its own defaults for those (timestep_spacing)
    return root / "sd", diffusers.StableDiffusionPipeline.from_pretrained(root / "sd")
