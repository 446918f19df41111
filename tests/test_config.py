"""Config loading: every shipped recipe, presets with overrides, YAML-typed values."""

from pathlib import Path

import pytest

from hypertron.config import ConfigError, dump_yaml, from_dict, load_config
from hypertron.presets import PRESETS

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
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def test_config_knows_every_data_source():
    from hypertron.config import DATA_SOURCES
    from hypertron.data.sources import SOURCES

    assert DATA_SOURCES == SOURCES
