"""Tiny diffusers pipeline folders written by diffusers (random weights, a hand-written CLIP vocabulary,
a SentencePiece model trained here for T5), for the diffusion tests, the image server's tests and
``bench/diffuse.py``: :func:`tiny_sd`, :func:`small_sd`, :func:`tiny_sdxl` and :func:`tiny_flux`,
each ``(folder, diffusers pipeline read back from it)``. diffusers, transformers and torch are
imported when a folder is made, not at collection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue"]
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def write_clip_vocab(folder, words=WORDS) -> tuple[str, str]:
    """A CLIP BPE as the hub ships it (bytes, bytes + ``</w>``, merges of ``words``, the specials:
    :func:`hypertron.diffusion.folders.clip_vocab`)."""
    from hypertron.diffusion.folders import clip_vocab

    vocab, merges = clip_vocab(words)
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def _libraries():
    return pytest.importorskip("torch"), pytest.importorskip("transformers"), pytest.importorskip("diffusers")


def _clip(root: Path, name: str, hidden: int, projection_dim: int | None = None):
    """``(tokenizer, encoder)``: the hand-written vocabulary and a random 2-layer CLIP text model."""
    _, transformers, _ = _libraries()
    tokenizer = transformers.CLIPTokenizer(*write_clip_vocab(root / name), pad_token=EOS, model_max_length=77)
    n = len(tokenizer)
    config = dict(vocab_size=n, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=77, bos_token_id=n - 2, eos_token_id=n - 1)
    if projection_dim is None:
        return tokenizer, transformers.CLIPTextModel(transformers.CLIPTextConfig(**config))
    return tokenizer, transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        **config, projection_dim=projection_dim, hidden_act="gelu"))


def _vae(**options):
    return _libraries()[2].AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                         up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                                         norm_num_groups=8, **options)


TINY_UNET = dict(sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8, norm_num_groups=8)
# SD 1.x's UNet shape at a small width: three resolutions (two with cross-attention), 64x64 latents
SMALL_UNET = dict(sample_size=64, block_out_channels=(64, 128, 256), layers_per_block=2, cross_attention_dim=32,
                  down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
                  norm_num_groups=32)


def _saved(pipe, folder: Path):
    # The reference is the folder read back: a scheduler built in memory marks the options it was not
    # given, and from_config gives another class its own defaults for those (timestep_spacing)
    pipe.save_pretrained(folder)
    return folder, type(pipe).from_pretrained(folder)


def tiny_sd(root: Path, unet: dict = TINY_UNET, name: str = "sd"):
    """A random tiny SD 1.x pipeline (16x16 images, 8x8 latents), DDIM as SD 1.x configures it, saved
    under ``root / name``; ``unet``: the UNet's config (:data:`SMALL_UNET` for :func:`small_sd`)."""
    torch, _, diffusers = _libraries()
    torch.manual_seed(0)
    tokenizer, encoder = _clip(root, f"{name}-vocab", 32)
    denoiser = diffusers.UNet2DConditionModel(**unet)  # then the VAE: the order of the random draws
    vae = _vae()
    scheduler = diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = diffusers.StableDiffusionPipeline(vae=vae, text_encoder=encoder, tokenizer=tokenizer, unet=denoiser,
                                             scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    return _saved(pipe, root / name)


def small_sd(root: Path):
    """:func:`tiny_sd` with :data:`SMALL_UNET` (UNet channels 64/128/256, 64x64 latents: 128x128 images)."""
    return tiny_sd(root, SMALL_UNET, "small-sd")


def tiny_sdxl(root: Path, unet: dict = TINY_UNET):
    """A random tiny SDXL pipeline (16x16 images): two CLIP encoders (16 + 16 penultimate features, the
    second's pooled projection of 24), a ``text_time`` UNet (``unet``'s config besides), Euler."""
    torch, _, diffusers = _libraries()
    torch.manual_seed(0)
    tokenizer, encoder = _clip(root, "sdxl-vocab", 16)
    tokenizer_2, encoder_2 = _clip(root, "sdxl-vocab-2", 16, projection_dim=24)
    unet = diffusers.UNet2DConditionModel(**unet | dict(
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 24))
    scheduler = diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                 steps_offset=1, timestep_spacing="leading")
    pipe = diffusers.StableDiffusionXLPipeline(vae=_vae(), text_encoder=encoder, text_encoder_2=encoder_2,
                                               tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet,
                                               scheduler=scheduler, add_watermarker=False)
    return _saved(pipe, root / "sdxl")


def tiny_flux(root: Path):
    """A random tiny Flux-dev pipeline (16x16 images, 16 packed tokens): CLIP's pooled output (24), a
    2-layer T5 v1.1 encoder (32) with an ``spiece.model`` trained here, one double and one single
    block, embedded guidance, flow-match Euler with the dynamic shift."""
    torch, transformers, diffusers = _libraries()
    import sentencepiece

    torch.manual_seed(0)
    tokenizer, encoder = _clip(root, "flux-vocab", 24)
    spiece = root / "flux-spiece"
    spiece.mkdir()
    (root / "corpus.txt").write_text("\n".join(f"a {c} photo of a {a} {b}" for a in WORDS for b in WORDS
                                               for c in ("red", "blue", "small")))
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "corpus.txt"), model_prefix=str(spiece / "spiece"), vocab_size=27, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    tokenizer_2 = transformers.T5TokenizerFast.from_pretrained(spiece)
    encoder_2 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8, relative_attention_max_distance=20))
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=24, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=4,
                                                          max_image_seq_len=64, base_shift=0.5, max_shift=1.15)
    pipe = diffusers.FluxPipeline(
        scheduler=scheduler, vae=_vae(use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.5,
                                      shift_factor=0.1),
        text_encoder=encoder, tokenizer=tokenizer, text_encoder_2=encoder_2, tokenizer_2=tokenizer_2,
        transformer=transformer)
    return _saved(pipe, root / "flux")
