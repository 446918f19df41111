"""Building configs: defaults, then a YAML file, then ``key=value`` overrides, then validation.

A run is described by one :class:`~hypertron.config.schema.Config`, built in
order from the defaults, an optional YAML recipe and command-line overrides
(``train.steps=100``, ``model=llama3-8b``, ``model.num_layers=2``). ``model``
may be given as a preset name; the remaining ``model.*`` keys then modify that
preset. A server's :class:`~hypertron.config.serving.ServeConfig` is built the
same way from a YAML file and the flags given.

Unknown keys, wrong types and values outside a ``Literal`` choice raise
:class:`~hypertron.errors.ConfigError` with one line naming the key.

Why the coercion is written here rather than taken from dacite or draccus:
values arrive as YAML scalars or as override strings, and each needs a
user-facing message naming the dotted key and, for choices, the allowed values.
dacite (1.8) checks types but reports them as Python types ("should be
'int' instead of value '3' of type 'str'") and would still need every override
string converted and every message rewritten; draccus builds its own argparse
CLI around the dataclasses, which ``key=value`` overrides and presets do not
fit. What is left is about eighty lines of one recursive function.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from hypertron.config.presets import DLRM_PRESETS, PRESETS
from hypertron.config.schema import (
    RENAMED_KEYS,
    Config,
    DlrmConfig,
    LoraConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    choice_error,
)
from hypertron.config.serving import ServeConfig
from hypertron.config.numbers import parse_number
from hypertron.config.validation import FINE_TUNING_DATA_KEYS, validate, validate_serve
from hypertron.errors import ConfigError, UserError, one_line


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or a ``key=value`` string) to type ``tp`` or fail naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) and value in allowed:
            return value
        raise choice_error(key, value, allowed)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                last = e
        raise last or ConfigError(f"{key}: cannot be {value!r}")
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return build(tp, value, key + ".")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (elem,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, elem, key) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp in (int, float):
        return parse_number(value, key, tp)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def build(cls: type, values: dict[str, Any], prefix: str = "", base: Any = None, *,
          name: typing.Callable[[str], str] | None = None, where: str = "") -> Any:
    """An instance of the dataclass ``cls`` from ``values`` (coerced key by key), on top of
    ``base`` when given; an unknown key is an error naming it. Messages call a key ``prefix + key``,
    or ``name(key)`` when given; ``where`` follows an unknown key's name (" in serve config F")."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in values.items():
        if k not in names:
            if prefix + k in RENAMED_KEYS:
                raise ConfigError(f"{prefix}{k} is now {RENAMED_KEYS[prefix + k]}{where}")
            raise ConfigError(f"unknown config key {prefix + k!r}{where}")  # repr: a key may hold a newline
        kwargs[k] = _coerce(v, hints[k], name(k) if name else prefix + k)
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{name(missing[0]) if name else prefix + missing[0]}: required{where}")
    return cls(**kwargs)


def _set_nested(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if isinstance(child, str) and p in ("model", "dlrm"):
            child = {"preset": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"config key {dotted!r}: {p!r} is not a section")
        node[p] = child
        node = child
    last = parts[-1]
    if last in ("model", "dlrm") and len(parts) == 1 and isinstance(node.get(last), dict):
        node[last]["preset"] = value
    else:
        node[last] = value


BUNDLE_FORMAT, BUNDLE_VERSION, BUNDLE_MANIFEST = "hypertron-model", 1, "model.json"


def read_json(path: Path, error: type[UserError], missing: str, unreadable: typing.Callable[[str], str]) -> Any:
    """The JSON value in the file ``path``: ``error(missing)`` if there is no such file,
    ``error(unreadable(reason))`` if it cannot be read or parsed (``reason``: the library's message on
    one line). The one reader of the JSON files a user hands over (bundles, corpora, HF configs)."""
    if not path.is_file():
        raise error(missing)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise error(unreadable(one_line(e))) from None


def read_manifest(path: Path, error: type[UserError], form: tuple[str, int], *, missing: str,
                  unreadable: typing.Callable[[str], str], wrong_format: str, wrong_version: typing.Callable[[Any], str]
                  ) -> dict[str, Any]:
    """A versioned JSON manifest: a dict whose ``format`` and ``version`` are ``form``. Read by
    :func:`read_json`; ``error(wrong_format)`` for another format, ``error(wrong_version(found))``
    for another version."""
    manifest = read_json(path, error, missing, unreadable)
    if not isinstance(manifest, dict) or manifest.get("format") != form[0]:
        raise error(wrong_format)
    if manifest.get("version") != form[1]:
        raise error(wrong_version(manifest.get("version")))
    return manifest


def bundle_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a model bundle (:mod:`hypertron.models.bundle`), checked: a dict with its
    ``model`` (the ModelConfig's fields) and ``tokenizer``. Read here, below the models, so that
    ``model=BUNDLE`` works in any config."""
    manifest_file = Path(path) / BUNDLE_MANIFEST
    return read_manifest(
        manifest_file, ConfigError, (BUNDLE_FORMAT, BUNDLE_VERSION),
        missing=f"{path}: not a model bundle (no {BUNDLE_MANIFEST})",
        unreadable=lambda reason: f"{manifest_file}: unreadable ({reason})",
        wrong_format=f"{manifest_file}: not a {BUNDLE_FORMAT} manifest",
        wrong_version=lambda found: f"{manifest_file}: version {found!r}, this hypertron reads {BUNDLE_VERSION}",
    )


def bundle_model(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` a model bundle holds."""
    manifest = bundle_manifest(path)
    return build(ModelConfig, manifest.get("model") or {}, "model.",
                 where=f" in {Path(path) / BUNDLE_MANIFEST}")


def _split_preset(raw: Any) -> tuple[Any, dict[str, Any]]:
    """A ``model:`` or ``dlrm:`` section, given as a preset name or as a mapping of fields with an
    optional ``preset:``: the preset (None when not named) and the other fields."""
    fields = {} if raw is None else dict(raw) if isinstance(raw, dict) else {"preset": raw}
    return fields.pop("preset", None), fields


def _resolve_model(raw: Any) -> ModelConfig:
    preset, raw = _split_preset(raw)
    if preset is None:
        base = PRESETS["tiny"]
    elif (Path(str(preset)) / BUNDLE_MANIFEST).is_file():  # model=BUNDLE: the bundle's model
        base = bundle_model(str(preset))
    else:
        if str(preset) not in PRESETS:
            raise ConfigError(
                f"model={preset}: unknown preset (choose from {', '.join(sorted(PRESETS))}) "
                "and not a model bundle"
            )
        base = PRESETS[str(preset)]
    if isinstance(raw.get("rope_scaling"), dict):
        # Changing one field keeps the preset's others.
        raw["rope_scaling"] = build(
            RopeScaling, raw["rope_scaling"], "model.rope_scaling.", base=base.rope_scaling or RopeScaling()
        )
    if isinstance(raw.get("moe"), dict):
        raw["moe"] = build(MoEConfig, raw["moe"], "model.moe.", base=base.moe or MoEConfig())
    return build(ModelConfig, raw, "model.", base=base)


def _resolve_dlrm(raw: Any) -> DlrmConfig:
    """``dlrm:`` as a preset name, or a mapping of fields (``preset:`` first, if given)."""
    preset, raw = _split_preset(raw)
    preset = "dlrm-v2-tiny" if preset is None else str(preset)
    if preset not in DLRM_PRESETS:
        raise ConfigError(f"dlrm={preset}: unknown preset (choose from {', '.join(sorted(DLRM_PRESETS))})")
    return build(DlrmConfig, raw, "dlrm.", base=DLRM_PRESETS[preset])


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Split ``key=value`` strings; one that has no ``=`` is an error naming it."""
    out = []
    for a in args:
        if "=" not in a:
            raise ConfigError(f"override {a!r} is not of the form key=value")
        k, v = a.split("=", 1)
        if not k:
            raise ConfigError(f"override {a!r} has an empty key")
        out.append((k.strip(), v))
    return out


def _parse_value(text: str) -> Any:
    """Read an override value like YAML does (numbers, booleans, lists), keeping strings as-is."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, (dict,)) or v is None and text.strip() not in ("null", "None", "~", ""):
        return text
    return text if v is None and text.strip() == "" else v


def read_yaml(path: str | Path, what: str = "recipe") -> dict[str, Any]:
    """The mapping at the top of a YAML file; a missing, invalid or non-mapping file is an error
    naming it (``what`` says what the file is for)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path} must hold a mapping at the top level")
    return loaded


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated :class:`Config` from a YAML recipe and ``key=value`` overrides."""
    tree: dict[str, Any] = read_yaml(recipe) if recipe is not None else {}
    for k, v in parse_overrides(overrides or []):
        _set_nested(tree, k, _parse_value(v))
    return from_dict(tree)


def from_dict(tree: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a nested dict (as in a recipe)."""
    tree = dict(tree)
    model = _resolve_model(tree.pop("model", None))
    dlrm = _resolve_dlrm(tree.pop("dlrm", None))
    cfg = build(Config, tree)
    cfg = dataclasses.replace(cfg, model=model, dlrm=dlrm)
    validate(cfg)
    return cfg


def load_serve_config(path: str | Path | None = None, given: dict[str, Any] | None = None,
                      name: typing.Callable[[str], str] = lambda key: key) -> ServeConfig:
    """A validated :class:`ServeConfig`: the YAML file ``path`` (if any), then the settings in
    ``given`` (the flags typed on the command line) on top. ``name`` turns a key into what the user
    wrote, for messages."""
    tree = read_yaml(path, "serve config") if path is not None else {}
    cfg = build(ServeConfig, {**tree, **(given or {})}, name=name, where=f" in serve config {path}")
    validate_serve(cfg, name)
    return cfg


def to_dict(cfg: Any) -> Any:
    """A plain, YAML-serialisable dict of a config dataclass."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


def dump_yaml(cfg: Any) -> str:
    """``cfg`` (any config dataclass) as YAML that the matching loader reads back to an equal config.
    A run's config leaves out the section its task does not read: ``task`` and ``dlrm`` for a
    language model (as before there were tasks), ``model`` for a recommender; and the data keys of
    fine-tuning (:data:`FINE_TUNING_DATA_KEYS`) but for ``task: sft`` and ``dpo``, and ``dpo`` but for
    ``task: dpo``, and ``lora`` when it is off."""
    tree = to_dict(cfg)
    if isinstance(cfg, Config):
        for key in {"lm": ("task", "dlrm", "dpo"), "sft": ("dlrm", "dpo"), "dpo": ("dlrm",)}.get(cfg.task,
                                                                                           ("model", "dpo")):
            tree.pop(key)
        if cfg.lora == LoraConfig():  # LoRA off: the section as its defaults
            tree.pop("lora")
        if cfg.task not in ("sft", "dpo"):  # the fine-tuning keys, as their defaults (validate refuses others)
            for key in FINE_TUNING_DATA_KEYS:
                tree["data"].pop(key)
    return yaml.safe_dump(tree, sort_keys=False)
