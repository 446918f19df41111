"""Configuration: the typed schema, model presets, loading (YAML + ``key=value``) and validation.

* :mod:`~hypertron.config.schema`: frozen, keyword-only dataclasses; every choice a ``Literal``
  type, defined once (:func:`~hypertron.config.schema.choices` reads it back).
* :mod:`~hypertron.config.presets`: model presets as data.
* :mod:`~hypertron.config.loading`: recipes and overrides into a validated config.
* :mod:`~hypertron.config.validation`: checks that need no devices, data or model.

The package imports no JAX: the CLI reads it to build its parser.
"""

from hypertron.config.loading import (
    dump_yaml,
    from_dict,
    load_config,
    load_serve_config,
    parse_overrides,
    read_yaml,
    to_dict,
)
from hypertron.config.presets import PRESETS
from hypertron.config.schema import (
    TOKENIZABLE_SOURCES,
    CheckpointConfig,
    Config,
    DataConfig,
    DiffusionConfig,
    DlrmConfig,
    DistributedConfig,
    EmaConfig,
    LaunchConfig,
    MeshConfig,
    MonitorConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    Setting,
    TrainConfig,
    choices,
    dtype_on,
    flag_field,
)
from hypertron.config.serving import EngineConfig, SchedulerConfig, ServeConfig
from hypertron.config.validation import validate, validate_model, validate_serve
from hypertron.errors import ConfigError

__all__ = [
    "PRESETS",
    "TOKENIZABLE_SOURCES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DiffusionConfig",
    "DlrmConfig",
    "DistributedConfig",
    "EmaConfig",
    "EngineConfig",
    "LaunchConfig",
    "MeshConfig",
    "MonitorConfig",
    "ModelConfig",
    "MoEConfig",
    "RopeScaling",
    "SchedulerConfig",
    "ServeConfig",
    "Setting",
    "TrainConfig",
    "choices",
    "dump_yaml",
    "flag_field",
    "from_dict",
    "load_config",
    "load_serve_config",
    "parse_overrides",
    "read_yaml",
    "to_dict",
    "validate",
    "validate_model",
    "validate_serve",
]
