"""Checkpoints with Orbax: the train state of a run, and parameters alone.

A run directory holds::

    config.yaml          the run's config (written once, never overwritten)
    checkpoints/<step>/  Orbax steps: items "params", "opt_state", "meta", "data" (and
                         "quant": fp8 amax histories, with delayed scaling; "reference",
                         task: dpo's; "ema", task: diffusion's),
                         and hypertron_manifest.json (file sizes, written when final)
    metrics.jsonl        one JSON line per training step (and per evaluation)
    events.jsonl         job events (see hypertron.train.events); events.<i>.jsonl for process i > 0
    host_metrics.<i>.jsonl  process i's host samples (see hypertron.monitor.collector)
    tensorboard/         the same scalars for TensorBoard

Converted Hugging Face models use the same layout with only the ``params``
item, so ``hypertron generate`` and ``hypertron train`` read both alike.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grain
import grain.checkpoint
import jax
import orbax.checkpoint as ocp

from hypertron.config import Config, ConfigError, dump_yaml, from_dict, to_dict
from hypertron.errors import UserError

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
MANIFEST = "hypertron_manifest.json"
# Trees a task's state may hold beside params and opt_state, saved and restored when it does:
# reference, task: dpo's frozen parameters; ema, task: diffusion's average of the parameters. (The
# frozen base LoRA adapters train on is not saved: a resumed run reads it from train.init_from
# again, checked by its digest; older runs saved "base".)
CARRIED = ("reference", "ema")
ITEMS = ("params", "opt_state", "quant", *CARRIED, "base", "meta", "data")
# Orbax splits a replicated array into a slice per replica so that the replicas write it in
# parallel (its default off GPUs), with a JAX slice dispatched per slice: for a small replicated
# state that was most of a save (the shapes UNet on 8 CPU devices, data-parallel: 3.8 of a
# save's 5.5 s blocking). Slices under a MiB are not worth a replica; larger arrays still split.
MIN_REPLICA_SLICE = 2**20
ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE), override=True)


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


# Model fields that do not change the weights (their shapes and meaning): they may change on
# resume. Some change how the weights compute (dtype, quantisation), not what they are.
_EXECUTION_FIELDS = ("name", "attention", "remat", "scan_layers", "dtype", "param_dtype", "max_seq_len",
                     "quantization", "fp8_scaling", "amax_history", "quantize_unembed")


# DLRM fields that do not change the weights' shapes (nor their optimiser state's).
_DLRM_EXECUTION_FIELDS = ("name", "placement", "source", "paths", "eval_paths", "teacher_seed", "teacher_scale", "eps")


def _weights_view(cfg: Config) -> dict:
    if cfg.task == "dlrm":
        return {"task": "dlrm", **{k: v for k, v in to_dict(cfg.dlrm).items() if k not in _DLRM_EXECUTION_FIELDS}}
    model = to_dict(cfg.model)
    return {k: v for k, v in model.items() if k not in _EXECUTION_FIELDS}


def write_run_config(run_dir: str | Path, cfg: Config, write: bool = True) -> None:
    """Write ``config.yaml`` unless it exists; an existing one must describe the same model
    (execution choices such as remat, attention kernel or compute dtype may change on resume).
    With ``write=False`` (processes other than 0) only the check is made."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    if path.is_file():
        saved = read_run_config(run_dir)
        if _weights_view(saved) != _weights_view(cfg):
            raise ConfigError(
                f"run_dir={run_dir} already holds a run of a different model "
                f"({saved.dlrm.name if saved.task == 'dlrm' else saved.model.name}); "
                "choose a new run_dir"
            )
        return
    if not write:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(path)


class Checkpointer:
    """Orbax ``CheckpointManager`` over ``run_dir/checkpoints``: async saves, keep-last-N, verified restores.

    Each step holds the items ``params``, ``opt_state``, ``meta`` (JSON: step
    and the data settings), ``data`` (the Grain iterator state of every
    process, one JSON file each, via Grain's own Orbax handler) and, with fp8
    delayed scaling, ``quant`` (the amax histories). A converted
    model holds ``params`` and ``meta`` only.

    Orbax makes a save atomic (written to a temporary directory, renamed when
    complete), so a save cut off by a kill never looks finished. Damage after
    that (a truncated or deleted file) is caught by a manifest: when a save is
    final, process 0 records the size of every file of the step in
    ``hypertron_manifest.json``; a step whose files no longer match is never
    restored. A step without a manifest (older checkpoints, or a kill between
    Orbax's finalisation and the manifest) is used, with a warning.
    """

    def __init__(self, run_dir: str | Path, keep: int = 3, async_save: bool = True, create: bool = True,
                 events=None):
        self.directory = Path(run_dir).absolute() / CHECKPOINTS
        if not create and not self.directory.is_dir():
            raise CheckpointError(f"{run_dir} holds no checkpoint yet")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=create, enable_async_checkpointing=async_save
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self.async_save = async_save
        self.events = events
        self._finisher: threading.Thread | None = None
        self._failure: BaseException | None = None

    def latest_step(self) -> int | None:
        """The newest step Orbax finished, verified or not (see :meth:`usable_steps`)."""
        return self.manager.latest_step()

    def problem(self, step: int) -> str | None:
        """Why ``step`` cannot be restored (a missing manifest, a missing or resized file), or None."""
        return _manifest_problem(self.directory / str(step))

    def unverified(self, step: int) -> bool:
        """True for a finished step without a manifest (saved by an older hypertron, or killed
        between Orbax's finalisation and the manifest): usable, but nothing vouches for its files."""
        return not (self.directory / str(step) / MANIFEST).is_file()

    def usable_steps(self) -> tuple[list[int], dict[int, str]]:
        """Finished steps newest first, split into usable ones and ``{step: problem}`` for the rest.

        With several processes every process must see the same answer: they all list the
        steps before any of them may move one aside (:meth:`set_aside`).
        """
        usable, broken = [], {}
        steps = sorted(self.manager.all_steps(), reverse=True)
        _sync("hypertron_usable_steps")
        for step in steps:
            problem = self.problem(step)
            if problem:
                broken[step] = problem
            else:
                usable.append(step)
        return usable, broken

    def set_aside(self, steps: list[int]) -> Path:
        """Move unusable steps out of the way (to ``run_dir/unusable_checkpoints``) rather than delete them.

        Only process 0 moves; every process then re-reads the step list.
        """
        target = self.directory.parent / "unusable_checkpoints"
        if jax.process_index() == 0:
            target.mkdir(exist_ok=True)
            for step in steps:
                dest = target / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                (self.directory / str(step)).rename(dest)
        _sync("hypertron_set_aside")
        self.manager.reload()
        return target

    def require_train_state(self, step: int) -> None:
        """Refuse a step without optimiser state (a converted model holds parameters only)."""
        if not (self.directory / str(step) / "opt_state").exists():
            raise CheckpointError(
                f"{self.directory.parent} holds parameters only (a converted model); to train from it, "
                f"use a new run_dir and train.init_from={self.directory.parent}"
            )

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None,
             data_iterator=None, reason: str = "interval", wait: bool = False,
             then: Callable[[], None] | None = None) -> None:
        """Start saving ``state`` (and the data iterator's position) at ``step``.

        With async saves this returns once the arrays are copied off the
        devices; training continues while they are written, and the manifest is
        written (and ``checkpoint_save_end`` emitted) when the step is final.
        With ``wait`` (the last save of a job, which the job waits for anyway) it returns
        when the step is final, after running ``then``; all of that time is blocking.
        """
        started = time.time()  # waiting for the previous save counts as this save's cost
        self._join_finisher()
        if self.events:
            self.events.emit("checkpoint_save_start", step, reason=reason)
        items = {
            "params": ocp.args.StandardSave(state["params"]),
            "meta": ocp.args.JsonSave({"step": int(step), **(meta or {})}),
        }
        if "opt_state" in state:
            items["opt_state"] = ocp.args.StandardSave(state["opt_state"])
        if "quant" in state:
            items["quant"] = ocp.args.StandardSave(state["quant"])
        for name in CARRIED:
            if name in state:
                items[name] = ocp.args.StandardSave(state[name])
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        if wait or not self.async_save:
            self._finish(step, started, None, then)
            self._join_finisher()  # raises what _finish met
            return
        blocking = time.time() - started
        self._finisher = threading.Thread(
            target=self._finish, args=(step, started, blocking), name=f"checkpoint-{step}", daemon=True
        )
        self._finisher.start()

    def _finish(self, step: int, started: float, blocking: float | None,
                then: Callable[[], None] | None = None) -> None:
        """Wait for ``step`` to be final, write its manifest, run ``then``, emit its end
        (``blocking`` None: the caller waited for all of it)."""
        try:
            self.manager.wait_until_finished()
            if jax.process_index() == 0:
                _write_manifest(self.directory / str(step))
            if then is not None:
                then()
        except BaseException as e:  # re-raised in the training thread by _join_finisher
            self._failure = e
            return
        if self.events:
            seconds = time.time() - started
            self.events.emit("checkpoint_save_end", step, seconds=seconds,
                             blocking_seconds=seconds if blocking is None else blocking)

    def _join_finisher(self) -> None:
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def meta(self, step: int) -> dict[str, Any]:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(self, step: int, abstract_state: dict[str, Any]) -> dict[str, Any]:
        """Restore params and optimiser state (and fp8 histories, and the frozen trees of
        :data:`CARRIED`, when ``abstract_state`` has them) into the shardings of ``abstract_state``. Histories a step lacks (it was saved without
        fp8 delayed scaling) start from zeros, as a new run's do."""
        self.require_train_state(step)
        items = {
            "params": ocp.args.StandardRestore(abstract_state["params"]),
            "opt_state": ocp.args.StandardRestore(abstract_state["opt_state"]),
            "meta": ocp.args.JsonRestore(),
        }
        carried = [name for name in CARRIED if name in abstract_state]
        items |= {name: ocp.args.StandardRestore(abstract_state[name]) for name in carried}
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        state = {"params": out["params"], "opt_state": out["opt_state"], "step": out["meta"]["step"]}
        state |= {name: out[name] for name in carried}
        if "quant" in abstract_state:
            state["quant"] = self._restore_quant(step, abstract_state["quant"])
        return state

    def _restore_quant(self, step: int, abstract: Any) -> Any:
        """The fp8 histories of ``step``; zeros when it has none, or none of this shape (a run
        resumed with another ``model.amax_history`` or ``model.quantize_unembed``): the scales
        then start over as at step 0, which the first step's current amaxes cover."""
        if (self.directory / str(step) / "quant").is_dir():
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(quant=ocp.args.StandardRestore(abstract)))
                return out["quant"]
            except (ValueError, TypeError, KeyError):
                print(f"warning: checkpoint {step}: its fp8 amax histories do not fit this config "
                      "(model.amax_history or model.quantize_unembed changed); they start over",
                      file=sys.stderr, flush=True)
        return jax.tree.map(lambda a: jax.device_put(jax.numpy.zeros(a.shape, a.dtype), a.sharding), abstract)

    def restore_data(self, step: int, data_iterator) -> None:
        """Move ``data_iterator`` to where it was when ``step`` was saved. An iterator with
        ``restore_from_files`` (the text pipeline's, whose shards any process may have saved) is
        given every process's saved state, whatever the process count then; any other reads this
        process's, as Grain's handler does."""
        from_files = getattr(data_iterator, "restore_from_files", None)
        if from_files is not None:
            from_files(sorted((self.directory / str(step) / "data").glob("process_*-of-*.json")))
            return
        self.manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data_iterator)))

    def has_data(self, step: int) -> bool:
        return (self.directory / str(step) / "data").is_dir()

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        out = self.manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))
        )
        return out["params"]

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self._join_finisher()

    def close(self) -> None:
        try:
            self._join_finisher()
        finally:
            self.manager.close()


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _step_files(step_dir: Path) -> dict[str, int]:
    return {
        str(path.relative_to(step_dir)): path.stat().st_size
        for path in sorted(step_dir.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def _write_manifest(step_dir: Path) -> None:
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": _step_files(step_dir)}, indent=1))
    tmp.replace(step_dir / MANIFEST)


def _manifest_problem(step_dir: Path) -> str | None:
    path = step_dir / MANIFEST
    if not path.is_file():
        return None  # finished by Orbax, not verified since: see Checkpointer.unverified
    try:
        expected = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    found = _step_files(step_dir)
    for name, size in expected.items():
        if name not in found:
            return f"{name} is missing"
        if found[name] != size:
            return f"{name} has {found[name]} bytes, {size} when saved"
    return None


def require_new_run_dir(run_dir: str | Path) -> None:
    """Refuse a directory that already holds a run or checkpoints (nothing saved is overwritten)."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINTS).exists() and any((run_dir / CHECKPOINTS).iterdir()):
        raise CheckpointError(f"{run_dir} already holds checkpoints; choose a new directory")
    if (run_dir / CONFIG_FILE).exists():
        raise CheckpointError(f"{run_dir} already holds a run; choose a new directory")


def save_params(run_dir: str | Path, cfg: Config, params: Any, step: int = 0) -> None:
    """Write a run directory holding only parameters (used by ``hypertron convert``).

    Refuses a directory that already holds checkpoints, so nothing saved is overwritten.
    """
    require_new_run_dir(run_dir)
    write_run_config(run_dir, cfg)
    ckpt = Checkpointer(run_dir, keep=1, async_save=False)
    ckpt.save(step, {"params": params})
    ckpt.close()


def newest_usable_step(ckpt: Checkpointer, report=None) -> int | None:
    """The newest step that passes its manifest check; None if the run has no checkpoint at all.

    ``report(step, problem)`` is called for each newer step that is skipped. A
    run whose checkpoints are all unusable is refused rather than started over.
    """
    usable, broken = ckpt.usable_steps()
    newest = usable[0] if usable else None
    for step, problem in sorted(broken.items(), reverse=True):
        if newest is None or step > newest:
            if report:
                report(step, problem)
    if newest is None and broken:
        details = "; ".join(f"step {s}: {p}" for s, p in sorted(broken.items(), reverse=True))
        raise CheckpointError(
            f"{ckpt.directory} holds no usable checkpoint ({details}); move the checkpoints "
            "directory away to start over"
        )
    return newest


def latest_step(run_dir: str | Path) -> int:
    """The newest usable checkpoint step of a run directory; refuses one without any."""
    ckpt = Checkpointer(run_dir, async_save=False, create=False)
    try:
        step = newest_usable_step(ckpt)
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
        problem = ckpt.problem(step)
        if problem:
            raise CheckpointError(f"{run_dir}: checkpoint {step} is unusable: {problem}")
        return cfg, ckpt.restore_params(step, abstract)
    finally:
        ckpt.close()
