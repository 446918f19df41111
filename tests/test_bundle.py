"""Model bundles (``hypertron.models.bundle``): what training leaves for inference, and what
serve / generate / convert --to-hf read without the run."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hypertron import cli
from hypertron.config import PRESETS
from hypertron.models import init_params
from hypertron.models.bundle import BundleError, read_bundle, save_model

CFG = dataclasses.replace(PRESETS["tiny-moe"], num_layers=2, vocab_size=400, max_seq_len=64)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from test_tokenizers import train_bpe  # tests/

    path = tmp_path_factory.mktemp("tok")
    train_bpe(path / "tokenizer.json")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return path


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


@pytest.mark.slow
def test_round_trip_keeps_config_weights_tokenizer_and_eos_ids(tmp_path, tokenizer_dir, params):
    from hypertron.tokenizer import get_tokenizer

    save_model(tmp_path / "b", CFG, params, str(tokenizer_dir / "tokenizer.json"))
    save_model(tmp_path / "b", CFG, params, str(tokenizer_dir))  # replaces it; nothing else left beside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    cfg, loaded, tok = read_bundle(tmp_path / "b")
    assert cfg == CFG
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        assert b.dtype == np.float32 and np.array_equal(np.asarray(a), b)
    original = get_tokenizer(str(tokenizer_dir))
    assert tok.encode("def main(): return 42") == original.encode("def main(): return 42")
    assert tok.eos_ids == original.eos_ids and {7, 9} <= set(tok.eos_ids)
    assert tok.chat_template == original.chat_template is not None
    _, half, _ = read_bundle(tmp_path / "b", dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(half))


def _broken(path, what):
    tensors = load_file(path / "model.safetensors")
    if what == "missing":
        del tensors["layers.wq"]
    elif what == "shape":
        tensors["layers.wq"] = tensors["layers.wq"][:1]
    else:
        tensors["layers.extra"] = np.zeros(3, np.float32)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("what,message", [
    ("missing", "no tensor 'layers.wq' (the model declares it)"),
    ("shape", "layers.wq has shape (1,"),
    ("extra", "tensor 'layers.extra' is not a parameter of tiny-moe"),
    ("manifest", "not a model bundle (no model.json)"),
    ("format", "not a hypertron-model manifest"),
    ("key", "unknown config key 'model.nope'"),
])
def test_a_bad_bundle_is_one_line_naming_the_file_and_exit_2(tmp_path, params, capsys, what, message):
    path = tmp_path / "b"
    save_model(path, CFG, params)
    manifest = json.loads((path / "model.json").read_text())
    if what == "manifest":
        (path / "model.json").unlink()  # then it looks like neither a bundle, a run nor an HF model
    elif what == "format":
        (path / "model.json").write_text(json.dumps({**manifest, "format": "other"}))
    elif what == "key":
        (path / "model.json").write_text(json.dumps({**manifest, "model": {**manifest["model"], "nope": 1}}))
    else:
        _broken(path, what)
    if what == "manifest":  # then the CLI takes the folder for a run directory, and says it is not one
        with pytest.raises(BundleError, match=re.escape(message)):
            read_bundle(path)
        message = "is not a hypertron run directory"
    assert cli.main(["generate", "--model", str(path), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_serve_generate_and_export_read_a_bundle(tmp_path, tokenizer_dir, params, capsys):
    from hypertron.models.hf import load_hf
    from hypertron.serve.model import load_for_inference, served_name

    save_model(tmp_path / "run" / "model", CFG, params, str(tokenizer_dir))
    model, served, tok = load_for_inference(tmp_path / "run" / "model")
    assert served_name(tmp_path / "run" / "model") == "run"
    assert model.vocab_size == 400 and {7, 9} <= set(tok.eos_ids)
    assert cli.main(["convert", "--checkpoint", str(tmp_path / "run" / "model"), "--to-hf", str(tmp_path / "hf")]) == 0
    hf_cfg, hf_params = load_hf(tmp_path / "hf")
    assert (hf_cfg.vocab_size, hf_cfg.num_layers, hf_cfg.moe.num_experts) == (400, 2, CFG.moe.num_experts)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params)):
        assert np.array_equal(np.asarray(a), b)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert (tmp_path / "hf" / "generation_config.json").is_file()
