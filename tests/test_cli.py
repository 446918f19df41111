"""The hypertron command end to end: train, then generate (as processes, what a shell sees; the
repeats in process), convert both ways (in process)."""

import numpy as np
import pytest

from support.cli import run_cli  # tests/support
from support.processes import fast_compile, hypertron_env, run_hypertron as run
from support.tiny import ONE_LAYER, write_tiny_hf_llama


@pytest.mark.slow
@pytest.mark.optimized  # its sampled text equals the processes' bit for bit
def test_train_then_generate(tmp_path):
    # Trained compiled fast (what it saves is what every generate below reads); generated as users compile.
    r = run("train", *ONE_LAYER, "train.steps=3", "train.log_every=1", "run_dir=run", cwd=tmp_path,
            env=fast_compile(hypertron_env()))
    assert r.returncode == 0, r.stderr
    assert "loss" in r.stderr and "saved checkpoint at step 3" in r.stderr
    assert (tmp_path / "run" / "config.yaml").is_file()
    g = run("generate", "--checkpoint", "run", "--prompt", "def ", "--max-new-tokens", "12",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("def ")
    sampling = ["--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "20", "--top-p",
                "0.9", "--seed", "3"]
    # The same again, in this process: the seed makes sampling repeatable, from process to process.
    again = run_cli(["generate", "--checkpoint", "run", *sampling], cwd=tmp_path)
    assert again.rc == 0 and again.stdout == g.stdout, again.stderr
    # The final save also wrote the model bundle: the same model, read without the run.
    assert "wrote the model bundle run/model" in r.stderr and (tmp_path / "run" / "model" / "model.json").is_file()
    b = run_cli(["generate", "--model", "run/model", *sampling], cwd=tmp_path)
    assert b.rc == 0 and b.stdout == g.stdout, b.stderr


@pytest.mark.slow
def test_convert_round_trip(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from test_tokenizers import train_bpe

    write_tiny_hf_llama(tmp_path / "hf", vocab_size=400, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    train_bpe(tmp_path / "hf" / "tokenizer.json")  # a model comes with its tokenizer: 400 ids
    r = run_cli(["convert", "--from-hf", "hf", "--out", "imported"], cwd=tmp_path)
    assert r.rc == 0, r.stderr
    assert (tmp_path / "imported" / "tokenizer" / "tokenizer.json").is_file()
    g = run_cli(["generate", "--checkpoint", "imported", "--prompt", "hello world", "--max-new-tokens", "4"],
                cwd=tmp_path)
    assert g.rc == 0, g.stderr
    assert g.stdout.startswith("hello world")  # encoded and decoded with the model's own tokenizer
    assert (tmp_path / "imported" / "model.json").is_file()  # a model bundle, no training config
    # Fine-tuning starts from the bundle: its model, its parameters, its tokenizer.
    ft = run_cli(["train", "model=imported", "train.init_from=imported", "data.tokenizer=imported/tokenizer",
                  "train.steps=1", "train.global_batch=8", "train.seq_len=16", "run_dir=ft"], cwd=tmp_path)
    assert ft.rc == 0 and "starting from the parameters in imported" in ft.stderr, ft.stderr
    into = run_cli(["train", "model=imported", "train.steps=1", "train.seq_len=16", "run_dir=imported"], cwd=tmp_path)
    assert into.rc == 2 and "holds a model bundle" in into.stderr, into.stderr
    e = run_cli(["convert", "--checkpoint", "imported", "--to-hf", "exported"], cwd=tmp_path)
    assert e.rc == 0, e.stderr
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
