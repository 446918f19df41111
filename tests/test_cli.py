"""The hypertron command end to end: train, generate, convert both ways."""

import os
import subprocess
import sys

import numpy as np
import pytest

ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")


def run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hypertron.cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_train_then_generate(tmp_path):
    r = run("train", "model=tiny", "model.num_layers=1", "train.steps=3", "train.global_batch=8",
            "train.seq_len=16", "train.log_every=1", "run_dir=run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "loss" in r.stderr and "saved checkpoint at step 3" in r.stderr
    assert (tmp_path / "run" / "config.yaml").is_file()
    g = run("generate", "--checkpoint", "run", "--prompt", "def ", "--max-new-tokens", "12",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("def ")
    again = run("generate", "--checkpoint", "run", "--prompt", "def ", "--max-new-tokens", "12",
                "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", cwd=tmp_path)
    assert again.stdout == g.stdout  # the seed makes sampling repeatable
    # The final save also wrote the model bundle: the same model, read without the run.
    assert "wrote the model bundle run/model" in r.stderr and (tmp_path / "run" / "model" / "model.json").is_file()
    b = run("generate", "--model", "run/model", "--prompt", "def ", "--max-new-tokens", "12",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", cwd=tmp_path)
    assert b.returncode == 0 and b.stdout == g.stdout, b.stderr


def test_convert_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    from test_tokenizers import train_bpe

    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    train_bpe(tmp_path / "hf" / "tokenizer.json")  # a model comes with its tokenizer: 400 ids
    r = run("convert", "--from-hf", "hf", "--out", "imported", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "imported" / "tokenizer" / "tokenizer.json").is_file()
    g = run("generate", "--checkpoint", "imported", "--prompt", "hello world", "--max-new-tokens", "4",
            cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("hello world")  # encoded and decoded with the model's own tokenizer
    assert (tmp_path / "imported" / "model.json").is_file()  # a model bundle, no training config
    # Fine-tuning starts from the bundle: its model, its parameters, its tokenizer.
    ft = run("train", "model=imported", "train.init_from=imported", "data.tokenizer=imported/tokenizer",
             "train.steps=1", "train.global_batch=8", "train.seq_len=16", "run_dir=ft", cwd=tmp_path)
    assert ft.returncode == 0 and "starting from the parameters in imported" in ft.stderr, ft.stderr
    into = run("train", "model=imported", "train.steps=1", "train.seq_len=16", "run_dir=imported", cwd=tmp_path)
    assert into.returncode == 2 and "holds a model bundle" in into.stderr, into.stderr
    e = run("convert", "--checkpoint", "imported", "--to-hf", "exported", cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
