"""Diffusion pipelines' tokenizers and text encoders against transformers (float32, no download).

The CLIP tokenizer folders are written by hand as the hub ships them (``vocab.json`` + ``merges.txt``
+ ``tokenizer_config.json``, no ``tokenizer.json``), once with SD 1.x's pad token and once with
SD 2.x's ``!``; T5's folder holds an ``spiece.model`` trained here. The encoders are tiny random
transformers models written with ``save_pretrained`` and read back by hypertron.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from hypertron.diffusion.text_encoders import (
    clip_encode, declare, load_text_encoder, prompt_ids, sd_prompt_embeds, sdxl_prompt_embeds, t5_encode,
)
from hypertron.errors import ConfigError, DataError
from hypertron.models.bundle import copy_tokenizer
from hypertron.models.params import logical_axes
from hypertron.parallel.rules import shardings_for, use_rules
from hypertron.tokenizer import get_tokenizer, tokenizer_file
from support.diffusion_folders import write_clip_vocab  # tests/support

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
WORDS = ["a", "photo", "of", "an", "astronaut", "riding", "horse", "on", "mars", "the", "cat", "in", "hat", "12"]
PROMPTS = [
    "a photo of an astronaut riding a horse on mars", "A Photo Of An ASTRONAUT", "THE CAT IN THE HAT",
    "Hello, World!", "wow!!! really?!", "it's don't we'll they're I'm you've he'd", "1234567890",
    "3.14159 and 2,718", "100% (maybe) [yes] {no}", "e-mail: x@y.z", "tab\there", "new\nline\r\nend",
    "   leading and trailing   ", "many     spaces", "", " ", "naïve café", "Ünïcödé ÀÉÎÕÜ", "straße",
    "日本語のテキスト", "中文 text mixed", "emoji 🐶🐱🚀", "flags 🇫🇷 and ZWJ 👩‍👩‍👧", "é vs e\u0301 (NFD)",
    "ＡＢＣ full width", "Ωmega α β γ", "<|endoftext|> inside", "x <|startoftext|> y", "cat</w> suffix",
    "horse, horse; horse: horse.", "an astronaut" * 3, "photo " * 40, "mars" * 90, "riding-a-horse",
    "under_score", "quote \"double\" 'single'", "back\\slash /slash", "$5 & €7 £9 ¥1", "#hash @at ~tilde",
    "a" * 200, "Cat cAT caT", "12 12 12", "x1y2z3", "ﬁ ligature", "Ⅻ roman", "zero\u200bwidth",
    "mixed 日本 and english and 🐶 and 123", "end.", "!", "!!",
]
T5_PROMPTS = [p for p in PROMPTS if "<|" not in p] + ["x" * 80]  # T5's literal special tokens are text here


def _write_clip_tokenizer(folder, pad: str) -> None:
    """A CLIP BPE folder as the hub ships it: bytes, bytes + ``</w>``, merges of WORDS, the specials."""
    write_clip_vocab(folder, WORDS)
    config = {"tokenizer_class": "CLIPTokenizer", "bos_token": BOS, "eos_token": EOS, "unk_token": EOS,
              "pad_token": pad, "model_max_length": 77}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer and text encoder folders: ``clip_sd1`` / ``clip_sd2`` tokenizers; ``clip`` (SD 1.x
    style, quick_gelu, legacy eos id 2) and ``clip_proj`` (SDXL's second: gelu, projection) and
    ``t5`` encoders; ``spiece`` a T5 tokenizer folder."""
    import sentencepiece

    root = tmp_path_factory.mktemp("diffusion_text")
    _write_clip_tokenizer(root / "clip_sd1", EOS)
    _write_clip_tokenizer(root / "clip_sd2", "!")
    vocab_size = len(json.loads((root / "clip_sd1" / "vocab.json").read_text()))
    eos_id = vocab_size - 1
    torch.manual_seed(0)
    tiny = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=eos_id - 1)
    transformers.CLIPTextModel(transformers.CLIPTextConfig(**tiny, hidden_act="quick_gelu", eos_token_id=2)
                               ).save_pretrained(root / "clip")
    transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        **tiny, hidden_act="gelu", eos_token_id=eos_id, projection_dim=24)).save_pretrained(root / "clip_proj")
    corpus = root / "corpus.txt"
    # Not the long repeats: a piece of 15 "a"s and one of 16 make segmentations of equal score, which
    # sentencepiece and tokenizers' Unigram break differently.
    corpus.write_text("\n".join([p for p in PROMPTS if len(p) < 60] * 4))
    (root / "spiece").mkdir()
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(root / "spiece" / "spiece"), vocab_size=150, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    (root / "spiece" / "spiece.vocab").unlink()
    t5 = transformers.T5Config(vocab_size=250, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4,
                               feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                               relative_attention_max_distance=20)
    transformers.T5EncoderModel(t5).save_pretrained(root / "t5")
    return root


@pytest.mark.parametrize("pad", ["clip_sd1", "clip_sd2"])
def test_clip_ids_are_clip_tokenizers(folders, pad):
    """The BPE built from vocab.json + merges.txt gives CLIPTokenizer's ids (77, truncated, padded
    with the folder's pad token) on every prompt."""
    reference = transformers.CLIPTokenizer.from_pretrained(folders / pad)
    tokenizer = get_tokenizer(str(folders / pad))
    assert tokenizer_file(str(folders / pad))[0] == "clip"
    assert tokenizer.pad_id == reference.pad_token_id == (reference.eos_token_id if pad == "clip_sd1" else 33)
    want = reference(PROMPTS, padding="max_length", max_length=77, truncation=True).input_ids
    np.testing.assert_array_equal(prompt_ids(tokenizer, PROMPTS, 77, bos=True), np.array(want))


def test_t5_ids_are_t5_tokenizer_fasts(folders):
    """An spiece.model folder is a tokenizer; its ids, cut and ended with </s>, are T5TokenizerFast's."""
    assert tokenizer_file(str(folders / "spiece"))[0] == "sentencepiece"
    reference = transformers.T5TokenizerFast.from_pretrained(folders / "spiece")
    want = reference(T5_PROMPTS, padding="max_length", max_length=24, truncation=True).input_ids
    got = prompt_ids(get_tokenizer(str(folders / "spiece")), T5_PROMPTS, 24, bos=False)
    np.testing.assert_array_equal(got, np.array(want))


def test_clip_tokenizer_copies_whole(folders, tmp_path):
    """A bundle or HF export copies both of CLIP's files, under their names: the copy gives the same ids."""
    assert copy_tokenizer(str(folders / "clip_sd2"), tmp_path, names=("tokenizer.json", "tokenizer.model"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    ids = [prompt_ids(get_tokenizer(str(f)), PROMPTS, 77, bos=True) for f in (folders / "clip_sd2", tmp_path)]
    np.testing.assert_array_equal(*ids)


def test_vocab_merges_folder_must_be_clip(folders, tmp_path):
    shutil.copytree(folders / "clip_sd1", tmp_path / "gpt2")
    (tmp_path / "gpt2" / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    with pytest.raises(DataError, match="does not name CLIPTokenizer"):
        tokenizer_file(str(tmp_path / "gpt2"))


def _ids(folders, n: int) -> np.ndarray:
    return prompt_ids(get_tokenizer(str(folders / "clip_sd1")), PROMPTS[:n], 77, bos=True)


@pytest.mark.parametrize("name", ["clip", "clip_proj"])
def test_clip_matches_transformers(folders, name):
    """Last hidden state, penultimate state, pooled and projected outputs, clip_skip: within 1e-4."""
    ids = _ids(folders, 3)
    model = getattr(transformers, json.loads((folders / name / "config.json").read_text())["architectures"][0]
                    ).from_pretrained(folders / name)
    with torch.no_grad():
        want = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True)
        text_model = model.text_model if name == "clip_proj" else model
        skipped = text_model.final_layer_norm(want.hidden_states[-2]).numpy()
    cfg, params = load_text_encoder(folders / name)[:2]
    out = jax.jit(lambda p, i: clip_encode(p, cfg, i))(params, ids)
    close = lambda got, ref: np.testing.assert_allclose(np.asarray(got), ref.numpy(), atol=1e-4, rtol=0)  # noqa: E731
    close(out.last_btd, want.last_hidden_state)
    close(out.hidden_lbtd[-2], want.hidden_states[-2])
    np.testing.assert_allclose(sd_prompt_embeds(out, params, cfg, clip_skip=1), skipped, atol=1e-4, rtol=0)
    if name == "clip":
        close(out.pooled_bd, want.pooler_output)
        assert out.projected_bp is None
    else:
        close(out.projected_bp, want.text_embeds)
        embeds, pooled = sdxl_prompt_embeds(out, out)
        assert embeds.shape == (3, 77, 64) and pooled is out.projected_bp


def test_t5_matches_transformers(folders):
    """T5 v1.1's last hidden state within 1e-4, over 32 tokens (every bucket kind: exact, log, capped),
    and the same sharded over 8 devices."""
    ids = np.random.default_rng(0).integers(0, 250, (2, 32)).astype(np.int32)
    model = transformers.T5EncoderModel.from_pretrained(folders / "t5")
    with torch.no_grad():
        want = model(torch.tensor(ids, dtype=torch.long)).last_hidden_state.numpy()
    cfg, params = load_text_encoder(folders / "t5")[:2]
    got = np.asarray(jax.jit(lambda p, i: t5_encode(p, cfg, i))(params, ids))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # Placed by the rules on (data=2, fsdp=2, tensor=2), activations pinned: the same numbers.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    placed = jax.device_put(params, shardings_for(logical_axes(declare(cfg)), params, mesh))
    assert placed["position_bias"].sharding.spec == P(None, "tensor")
    with use_rules(mesh):
        sharded = jax.jit(lambda p, i: t5_encode(p, cfg, i))(placed, ids)
    np.testing.assert_allclose(np.asarray(sharded), got, atol=1e-5, rtol=0)


def test_int8_text_encoders_are_within_5_percent_in_a_quarter_of_the_bytes(folders):
    """``--text-encoder-quantize int8`` (placement.quantize_text): CLIP's projected output and T5's last
    hidden state within 5 % relative L2 of float32, every matmul weight and the token embedding an
    int8 QArray (values and one scale per output channel or row: at most 0.3x the float32 bytes)."""
    from hypertron.diffusion import placement
    from hypertron.diffusion.pipeline import Pipeline
    from hypertron.models.params import is_spec
    from hypertron.quant import QArray

    encoders = tuple(load_text_encoder(folders / name) for name in ("clip_proj", "t5"))
    pipe = Pipeline(spec=None, text_encoders=encoders, tokenizers=(), denoiser_cfg=None, denoiser_params=None,
                    vae_params=None, dtype=jnp.float32, denoise=None)
    (clip, t5), ids = placement.quantize_text(pipe, "int8").text_encoders, _ids(folders, 3)
    want = clip_encode(encoders[0].params, clip.cfg, ids).projected_bp
    got = jax.jit(lambda p, i: clip_encode(p, clip.cfg, i, quantization=clip.quantize).projected_bp)(clip.params, ids)
    t5_ids = np.random.default_rng(1).integers(0, 250, (2, 16)).astype(np.int32)
    t5_want, t5_got = (t5_encode(e.params, t5.cfg, t5_ids, quantization=e.quantize) for e in (encoders[1], t5))
    for a, b in ((got, want), (t5_got, t5_want)):
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)) < 0.05
    for plain, quantized in zip(encoders, (clip, t5)):
        pairs = jax.tree.leaves(jax.tree.map(lambda s, f, q: (f, q) if s.quantize else None, declare(plain.cfg),
                                             plain.params, quantized.params, is_leaf=is_spec),
                                is_leaf=lambda x: isinstance(x, tuple))
        assert pairs and all(isinstance(q, QArray) for _, q in pairs)
        size = lambda a: sum(x.nbytes for x in jax.tree.leaves(a))  # noqa: E731
        assert sum(size(q) for _, q in pairs) <= 0.3 * sum(size(f) for f, _ in pairs)


@pytest.mark.parametrize("change, match", [
    ("drop", r"missing tensor text_model.final_layer_norm.bias \(1 in all\) for .*clip/model.safetensors"),
    ("reshape", r"tensor text_model.final_layer_norm.bias of .*clip/model.safetensors: shape \(16,\)"),
    ("extra", r"unexpected tensor extra.weight"),
    ("architecture", r"config.json: architecture 'BertModel' is not a supported text encoder"),
    ("bin", r"clip: only .bin weights, which need torch to read"),
])
def test_bad_folder_is_one_clear_error(folders, tmp_path, change, match):
    folder = shutil.copytree(folders / "clip_proj", tmp_path / "clip")
    tensors = load_file(folder / "model.safetensors")
    if change == "drop":
        del tensors["text_model.final_layer_norm.bias"]
    elif change == "reshape":
        tensors["text_model.final_layer_norm.bias"] = np.zeros(16, np.float32)
    elif change == "extra":
        tensors["extra.weight"] = np.zeros(2, np.float32)
    elif change == "architecture":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"architectures": ["BertModel"]}))
    save_file(tensors, folder / "model.safetensors")
    if change == "bin":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=match):
        load_text_encoder(folder)
