"""Checkpoints with Orbax: the train state of a run, and parameters alone.

A run directory holds::

    config.yaml          the run's config (written once, never overwritten)
    checkpoints/<step>/  Orbax steps, items "params", "opt_state" and "meta"
    metrics.jsonl        one JSON line per training step

Converted Hugging Face models use the same layout with only the ``params``
item, so ``hypertron generate`` and ``hypertron train`` read both alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from hypertron.config import Config, ConfigError, dump_yaml, from_dict, to_dict
from hypertron.errors import UserError

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names it."""


def read_run_config(run_dir: str | Path) -> Config:
    """The config saved in a run directory."""
    import yaml

    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a hypertron run directory (no {CONFIG_FILE})")
    try:
        return from_dict(yaml.safe_load(path.read_text()) or {})
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


# Model fields that change neither the weights nor what they compute.
_EXECUTION_FIELDS = ("name", "attention", "remat", "scan_layers", "dtype", "param_dtype", "max_seq_len")


def _weights_view(cfg: Config) -> dict:
    model = to_dict(cfg.model)
    return {k: v for k, v in model.items() if k not in _EXECUTION_FIELDS}


def write_run_config(run_dir: str | Path, cfg: Config) -> None:
    """Write ``config.yaml`` unless it exists; an existing one must describe the same model
    (execution choices such as remat, attention kernel or compute dtype may change on resume)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if path.is_file():
        saved = read_run_config(run_dir)
        if _weights_view(saved) != _weights_view(cfg):
            raise ConfigError(
                f"run_dir={run_dir} already holds a run of a different model ({saved.model.name}); "
                "choose a new run_dir"
            )
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(path)


class Checkpointer:
    """Orbax ``CheckpointManager`` over ``run_dir/checkpoints`` with async saves and keep-last-N."""

    def __init__(self, run_dir: str | Path, keep: int = 3, async_save: bool = True, create: bool = True):
        self.directory = Path(run_dir).absolute() / CHECKPOINTS
        if not create and not self.directory.is_dir():
            raise CheckpointError(f"{run_dir} holds no checkpoint yet")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=create, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt_state", "meta")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def require_train_state(self, step: int) -> None:
        """Refuse a step without optimiser state (a converted model holds parameters only)."""
        if not (self.directory / str(step) / "opt_state").exists():
            raise CheckpointError(
                f"{self.directory.parent} holds parameters only (a converted model); to train from it, "
                f"use a new run_dir and train.init_from={self.directory.parent}"
            )

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Start saving ``state`` at ``step``; training continues while it is written."""
        items = {
            "params": ocp.args.StandardSave(state["params"]),
            "meta": ocp.args.JsonSave({"step": int(step), **(meta or {})}),
        }
        if "opt_state" in state:
            items["opt_state"] = ocp.args.StandardSave(state["opt_state"])
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state: dict[str, Any]) -> dict[str, Any]:
        """Restore params and optimiser state into the shardings of ``abstract_state``."""
        self.require_train_state(step)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_state["params"]),
                opt_state=ocp.args.StandardRestore(abstract_state["opt_state"]),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return {"params": out["params"], "opt_state": out["opt_state"], "step": out["meta"]["step"]}

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        out = self.manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))
        )
        return out["params"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def save_params(run_dir: str | Path, cfg: Config, params: Any, step: int = 0) -> None:
    """Write a run directory holding only parameters (used by ``hypertron convert``).

    Refuses a directory that already holds checkpoints, so nothing saved is overwritten.
    """
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINTS).exists() and any((run_dir / CHECKPOINTS).iterdir()):
        raise CheckpointError(f"{run_dir} already holds checkpoints; choose a new directory")
    if (run_dir / CONFIG_FILE).exists():
        raise CheckpointError(f"{run_dir} already holds a run; choose a new directory")
    write_run_config(run_dir, cfg)
    ckpt = Checkpointer(run_dir, keep=1, async_save=False)
    ckpt.save(step, {"params": params})
    ckpt.close()


def latest_step(run_dir: str | Path) -> int:
    """The newest checkpoint step of a run directory; refuses one without checkpoints."""
    ckpt = Checkpointer(run_dir, async_save=False, create=False)
    try:
        step = ckpt.latest_step()
    finally:
        ckpt.close()
    if step is None:
        raise CheckpointError(f"{run_dir} holds no checkpoint yet")
    return step


def load_params(
    run_dir: str | Path, step: int | None = None, dtype=None, shardings: Any = None
) -> tuple[Config, Any]:
    """``(config, params)`` of a run directory's latest (or given) checkpoint.

    Parameters land on the default device in ``dtype`` (default: the run's), or
    as ``shardings`` says (a tree of ``jax.ShapeDtypeStruct`` with shardings).
    """
    from hypertron.models import declare, resolve_dtype
    from hypertron.models import params as param_lib

    cfg = read_run_config(run_dir)
    if shardings is None:
        dtype = resolve_dtype(cfg.model.param_dtype) if dtype is None else dtype
        abstract = param_lib.abstract(declare(cfg.model), dtype)
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract)
    else:
        abstract = shardings
    step = latest_step(run_dir) if step is None else step
    ckpt = Checkpointer(run_dir, async_save=False, create=False)
    try:
        return cfg, ckpt.restore_params(step, abstract)
    finally:
        ckpt.close()
