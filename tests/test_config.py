"""Config loading: every shipped recipe, presets with overrides, YAML-typed values."""

import dataclasses
from pathlib import Path

import pytest

from hypertron.config import (PRESETS, TOKENIZABLE_SOURCES, ConfigError, ServeConfig, choices, dump_yaml,
                              from_dict, load_config)
from hypertron.config.schema import (IMAGE_DATA_SOURCES, DataSource, DiffusionDtype, DiffusionQuantization, GmmBackend, Quantization,
                                     WeightQuantization)
from hypertron.config.serving import KvCacheDtype

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(recipe):
    cfg = load_config(recipe)
    assert cfg.model.name in PRESETS


def test_preset_then_overrides():
    cfg = load_config(None, ["model=llama3-8b", "model.num_layers=2", "train.lr=1e-3",
                             "data.paths=a.txt,b.txt", "model.sliding_window=none"])
    assert cfg.model.name == "llama3-8b" and cfg.model.num_layers == 2
    assert cfg.model.num_kv_heads == 8 and cfg.model.rope_theta == 500000.0
    assert cfg.train.lr == 1e-3 and cfg.data.paths == ("a.txt", "b.txt")
    assert cfg.model.sliding_window is None


def test_overrides_after_model_key_order_does_not_matter():
    a = load_config(None, ["model.num_layers=3", "model=gemma-2b"])
    b = load_config(None, ["model=gemma-2b", "model.num_layers=3"])
    assert a == b and a.model.num_layers == 3 and a.model.tie_embeddings


def test_rope_scaling_override_keeps_the_presets_other_fields():
    cfg = load_config(None, ["model=tiny-llama3", "model.rope_scaling.factor=4"])
    assert cfg.model.rope_scaling.factor == 4.0
    assert cfg.model.rope_scaling.original_max_position == 64


def test_dump_and_reload_is_identity():
    import yaml

    cfg = load_config(None, ["model=llama3.1-8b", "mesh.tensor=2", "train.steps=7"])
    assert from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stepz=1"], "unknown config key 'train.stepz'"),
        (["train.steps=abc"], "train.steps: expected an integer"),
        (["model.num_heads=6", "model.num_kv_heads=4"], "not a multiple"),
        (["train.global_batch=6", "train.grad_accum=4"], "not divisible by train.grad_accum"),
        (["train.schedule=exp"], "train.schedule=exp"),
        (["model=nope"], "unknown preset"),
        (["train.seq_len=99999"], "exceeds model.max_seq_len"),
        (["train.min_lr_ratio=-0.5"], "train.min_lr_ratio"),
        (["model.norm_eps=-1"], "model.norm_eps"),
        (["model.dtype=float16"], "model.dtype=float16"),
        (["run_dir="], "run_dir"),
        (["train.eval_every=10"], "needs a held-out split: set data.eval_fraction"),
        (["data.eval_fraction=1.5"], "data.eval_fraction=1.5"),
        (["data.shards=3", "train.global_batch=8"], "data.shards=3 must divide train.global_batch=8"),
        (["data.shards=-1"], "data.shards=-1: must be at least 1"),
        (["task=diffusion", "data.source=shapes", "data.shards=2"], "data.shards=2: task=diffusion reads its data by process"),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def _option(parser, command: str, flag: str):
    """The argparse action of ``hypertron COMMAND FLAG``."""
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if flag in a.option_strings)


def test_every_option_list_is_the_schemas():
    from hypertron.cli import build_parser
    from hypertron.data import SOURCES
    from hypertron.kernels import gmm
    from hypertron.quant.einsum import MODES

    parser = build_parser()
    assert _option(parser, "serve", "--kv-cache-dtype").choices == choices(KvCacheDtype) == (
        "auto", "bfloat16", "float32", "int8")
    assert choices(WeightQuantization) == ("none", "int8")  # the text server's; a diffusers folder's also fp8
    assert _option(parser, "serve", "--quantize").choices == choices(DiffusionQuantization) == ("none", "int8", "fp8")
    assert _option(parser, "serve", "--dtype").choices == choices(DiffusionDtype) == ("float32", "bfloat16")
    assert _option(parser, "generate", "--quantize").choices == choices(WeightQuantization)
    assert _option(parser, "tokenize", "--source").choices == TOKENIZABLE_SOURCES
    # images: task: diffusion's (parquet holds text or images)
    assert set(TOKENIZABLE_SOURCES) | {"synthetic", "tokens", *IMAGE_DATA_SOURCES} == set(SOURCES) == set(
        choices(DataSource))
    assert gmm.BACKENDS == choices(GmmBackend) and "pallas" in gmm.BACKENDS
    assert MODES == choices(Quantization) == ("none", "fp8", "int8")
    # Every serving setting is a flag, and every flag a setting.
    flags = {a.dest for a in next(a for a in parser._actions if a.dest == "command").choices["serve"]._actions}
    assert flags - {"help", "config"} == {f.name for f in dataclasses.fields(ServeConfig)}


@pytest.mark.parametrize("argv, key, allowed", [
    (["train", "model.moe.gmm_backend=cuda", "model=tiny-moe"], "model.moe.gmm_backend=cuda", GmmBackend),
    (["train", "data.source=csv"], "data.source=csv", DataSource),
    (["train", "model.quantization=fp4"], "model.quantization=fp4", Quantization),
    (["serve", "--checkpoint", "x", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype", KvCacheDtype),
    (["serve", "--checkpoint", "x", "--quantize", "int4"], "--quantize", WeightQuantization),
    (["generate", "--checkpoint", "x", "--prompt", "a", "--quantize", "int4"], "--quantize", WeightQuantization),
    (["tokenize", "--source", "synthetic", "--tokenizer", "byte", "--out", "o"], "--source", TOKENIZABLE_SOURCES),
])
def test_an_unknown_choice_is_one_line_naming_the_key_and_the_allowed_values(argv, key, allowed, capsys):
    from hypertron.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's choices
        code = e.code
    err = capsys.readouterr().err
    allowed = allowed if isinstance(allowed, tuple) else choices(allowed)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and key in err, err
    assert all(value in err for value in allowed), err
