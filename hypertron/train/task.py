"""What the training loop trains: a task.

The loop (:mod:`hypertron.train.loop`) owns what every run has: the checks before compiling,
checkpoints and exact resume, SIGTERM, job events, trackers, evaluation on schedule. A task owns
what depends on the model and its data: the mesh and the checks that need the devices, the data
stream and the settings that decide it (checked on resume), the sharded train state and step,
evaluation, the throughput's unit and FLOPs, and what is written at the end.

- :class:`LanguageModel` (``task: lm``): decoder LLMs on token streams (:mod:`hypertron.train.step`).
- :class:`FineTune` (``task: sft``): the same model, step and loss on fine-tuning examples packed whole.
- :class:`PreferenceTune` (``task: dpo``): the same model on preference pairs, the DPO objective against
  a reference: frozen in the state, or its log-probabilities precomputed (:mod:`hypertron.train.dpo`).
- :class:`hypertron.train.dlrm.Recommender` (``task: dlrm``): DLRM-v2 over sharded embedding tables;
  :class:`hypertron.train.diffusion_task.DiffusionTask` (``task: diffusion``): a diffusion model's denoiser.

The train state is a dict with ``params``, ``opt_state`` and ``step`` (and whatever else the
task's checkpoints hold: ``quant`` for fp8): :class:`hypertron.checkpoint.Checkpointer` saves and
restores it whatever the task.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hypertron.checkpoint import CheckpointError, latest_step, load_params, read_run_config
from hypertron.config import Config
from hypertron.data import DataError, check_source, make_batches, resolve_shards
from hypertron.errors import one_line
from hypertron.models import resolve_dtype
from hypertron.models.bundle import is_bundle, read_bundle, save_model, set_chat_template
from hypertron.models.bundle import read_config as read_bundle_config
from hypertron.models.flops import device_peak_flops, train_flops_per_token
from hypertron.parallel.mesh import make_mesh, row_block
from hypertron.train.checks import validate_for_devices
from hypertron.train.metrics import Throughput
from hypertron.tokenizer import get_tokenizer
from hypertron.train.lora import check_adapter, is_adapter, lora_base
from hypertron.train.step import make_trainer, row_array


class Task(Protocol):
    """The seam between the loop and what it trains (see the module's docstring)."""

    def check_inputs(self, cfg: Config) -> None:
        """Checks of the data and ``train.init_from`` that need no devices (before the backend starts)."""

    def mesh(self, cfg: Config, devices: list) -> Mesh:
        """The checks that need the devices, then the mesh."""

    def check_init_from(self, cfg: Config) -> None:
        """``train.init_from`` names something this run can start from (before anything is written)."""

    def batches(self, cfg: Config, split: str = "train") -> Iterator[dict]:
        """This process's share of each global batch, as a checkpointable Grain iterator."""

    def data_fingerprint(self, cfg: Config) -> dict[str, Any]:
        """What decides the data stream; a saved iterator position is only valid for the same values."""

    def trainer(self, cfg: Config, mesh: Mesh) -> Any:
        """The sharded train state's ``init(key)``, ``abstract_state()``, ``state_shardings`` and
        ``to_held`` / ``to_model`` (a state from the checkpoints' order into the step's, and back)."""

    def initial_state(self, cfg: Config, trainer: Any, console) -> dict:
        """A new run's state: random, or ``train.init_from``'s parameters."""

    def restored(self, cfg: Config, trainer: Any, state: dict, console) -> None:
        """After a checkpoint was restored into ``state``: what the task keeps beside it (``task: dpo``'s
        precomputed reference)."""

    def step(self, trainer: Any, state: dict, local: dict) -> tuple[dict, dict]:
        """One optimiser step on this process's rows; returns the new state and device-side metrics
        (``loss`` among them)."""

    def evaluate(self, trainer: Any, state: dict, batches: Iterator[dict], count: int) -> dict[str, float]:
        """Scalars of ``count`` held-out batches: ``loss`` and what else the task measures."""

    def throughput(self, cfg: Config) -> Throughput:
        ...

    def finish(self, cfg: Config, state: dict, console) -> None:
        """After the final checkpoint: what the run leaves for the next tool (a model bundle)."""


class LanguageModel:
    """Decoder LLMs: token batches, next-token loss, FLOPs per token, a model bundle at the end."""

    def check_inputs(self, cfg: Config) -> None:
        check_source(cfg.data.source, cfg.data.paths, cfg.data.text_field, tokenizer=cfg.data.tokenizer)

    def mesh(self, cfg: Config, devices: list) -> Mesh:
        validate_for_devices(cfg, len(devices))
        return make_mesh(cfg.mesh, devices)

    def check_init_from(self, cfg: Config) -> None:
        """``train.init_from`` must name a model bundle, or a run with a checkpoint, of the same
        parameter shapes; ``run_dir`` must not be a model bundle (nothing saved is overwritten)."""
        if is_bundle(cfg.run_dir) and not (Path(cfg.run_dir) / "config.yaml").exists():
            raise CheckpointError(f"run_dir={cfg.run_dir} holds a model bundle; to train from it, use a new "
                                  f"run_dir and train.init_from={cfg.run_dir}")
        if not cfg.train.init_from:
            return
        if is_adapter(cfg.train.init_from):
            check_adapter(cfg)
            check_params_source(cfg, f"{cfg.train.init_from}'s base_model_name_or_path", lora_base(cfg))
        else:
            check_params_source(cfg, "train.init_from", cfg.train.init_from)

    def batches(self, cfg: Config, split: str = "train") -> Iterator[dict]:
        d, t = cfg.data, cfg.train
        return make_batches(
            source=d.source, paths=d.paths, text_field=d.text_field, tokenizer=d.tokenizer,
            seq_len=t.seq_len, seed=d.seed, shuffle=d.shuffle, **process_rows(cfg), shards=text_shards(cfg),
            fewer_shards_for_few_documents=not cfg.data.shards,
            vocab_size=cfg.model.vocab_size, split=split, eval_fraction=d.eval_fraction,
        )

    def data_fingerprint(self, cfg: Config) -> dict[str, Any]:
        """The settings the saved data position holds for: the shards, not the process count (a
        run resumes on any process count its shards allow)."""
        return {**_records_fingerprint(cfg), "shards": text_shards(cfg)}

    def trainer(self, cfg: Config, mesh: Mesh):
        if cfg.lora.rank:  # adapters only, over a frozen base (hypertron.train.lora)
            from hypertron.train.lora import make_lora_trainer

            return make_lora_trainer(cfg, mesh)
        return make_trainer(cfg, mesh)

    def initial_state(self, cfg: Config, trainer, console) -> dict:
        state = trainer.init(jax.random.key(cfg.train.seed))
        if cfg.train.init_from:
            where = "base" if cfg.lora.rank else "params"  # LoRA: the frozen base the adapters train on
            console.print(f"starting from the parameters in {lora_base(cfg)}"
                          + (" (a frozen base for LoRA adapters)" if cfg.lora.rank else ""), highlight=False)
            state |= trainer.to_held({where: read_params(cfg, lora_base(cfg), trainer.abstract_state()[where],
                                                         _held(cfg))})
            if is_adapter(cfg.train.init_from):  # continuing an adapter: its tensors are the start
                from hypertron.models.lora import load_peft

                console.print(f"continuing the LoRA adapter {cfg.train.init_from}", highlight=False)
                adapters, _ = load_peft(cfg.train.init_from, cfg.model)
                state["params"] = jax.tree.map(
                    lambda a, s: jax.make_array_from_callback(a.shape, s.sharding, lambda i, a=np.asarray(a): a[i]),
                    adapters, trainer.abstract_state()["params"])
            if cfg.lora.rank and jax.process_index() == 0:  # what a resumed run checks the base by
                base = {"init_from": lora_base(cfg), "files": files_digest(lora_base(cfg), cfg.run_dir)}
                Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
                (Path(cfg.run_dir) / LORA_BASE_FILE).write_text(json.dumps(base, indent=1) + "\n")
        return state

    def restored(self, cfg: Config, trainer, state: dict, console) -> None:
        """LoRA: the frozen base is not in the checkpoints; it is read from ``train.init_from``
        again, whose files must be those the run started from (``RUN/lora_base.json``)."""
        if not cfg.lora.rank:
            return
        record = Path(cfg.run_dir) / LORA_BASE_FILE
        if record.exists():
            started = json.loads(record.read_text())
            if started["files"] != files_digest(lora_base(cfg), cfg.run_dir):
                raise CheckpointError(
                    f"train.init_from={cfg.train.init_from}: not the base this run's adapters trained on (the files "
                    f"of {lora_base(cfg)} differ from those of {started['init_from']} when the run began; {record}); "
                    "resume on that base, or start a new run_dir")
        console.print(f"reading the frozen base from {lora_base(cfg)}", highlight=False)
        state["base"] = read_params(cfg, lora_base(cfg), trainer.abstract_state()["base"], _held(cfg))

    def step(self, trainer, state: dict, local: dict) -> tuple[dict, dict]:
        return trainer.step(state, trainer.batch(local))

    def evaluate(self, trainer, state: dict, batches: Iterator[dict], count: int) -> dict[str, float]:
        """Mean loss per target token over ``count`` batches, and the tokens counted."""
        totals = [trainer.eval(state, trainer.batch(next(batches))) for _ in range(count)]
        totals = jax.device_get(totals)
        nll = sum(float(x["nll_sum"]) for x in totals)
        tokens = sum(float(x["weight"]) for x in totals)
        return {"loss": nll / max(tokens, 1.0), "tokens": tokens}

    def throughput(self, cfg: Config) -> Throughput:
        t, q = cfg.train, cfg.model.quantization
        tokens = t.global_batch * t.seq_len
        return Throughput(tokens, train_flops_per_token(cfg.model, t.seq_len) * tokens, jax.device_count(),
                          device_peak_flops(t.peak_flops),
                          None if q == "none" else device_peak_flops(0.0, fmt=q), quantized=q != "none")

    def finish(self, cfg: Config, state: dict, console) -> None:
        if not cfg.lora.rank:
            write_bundle(cfg, state["params"], console)
            return
        from hypertron.models.lora import merge, save_peft
        from hypertron.train.lora import lora_settings

        settings = lora_settings(cfg)
        if cfg.lora.base_dtype == "auto":
            merged = merge(state["base"], state["params"], settings)
        else:  # merged into the base as read, not as held (QLoRA's practice), in place of the copy read
            base = read_params(cfg, lora_base(cfg), float_shardings(cfg, state["base"]))
            merged = jax.jit(lambda b, a: merge(b, a, settings), donate_argnums=0)(base, state["params"])
        write_bundle(cfg, merged, console)  # what serve reads today
        if jax.process_index() == 0:
            path = Path(cfg.run_dir) / "adapter"
            save_peft(path, jax.device_get(state["params"]), settings, cfg.model,
                      base=str(Path(lora_base(cfg)).resolve()))  # found from any working directory
            console.print(f"wrote the LoRA adapter {path} (PEFT's format)", highlight=False)


class FineTune(LanguageModel):
    """``task: sft``: a language model fine-tuned on examples (``data.format`` messages or
    prompt_completion, :mod:`hypertron.data.finetune`), each example whole in a row with loss on
    the tokens ``data.loss_on`` names. The mesh, train state, step and loss are
    :class:`LanguageModel`'s: only the rows differ. The examples are read and tokenised once, in
    :meth:`check_inputs` (a bad record is refused before compiling), and the final bundle
    carries the chat template they were rendered with, so ``hypertron serve`` renders what the
    model learned."""

    TOO_LONG = "examples are longer than train.seq_len={} + 1 tokens"  # what data.overlong=truncate cut

    def __init__(self):
        self._read: tuple[tuple, Any] | None = None  # (what decides the examples, the examples)

    def check_inputs(self, cfg: Config) -> None:
        read = self._examples(cfg)
        if read.truncated:
            print(f"hypertron train: {read.truncated} of {len(read)} {self.TOO_LONG.format(cfg.train.seq_len)}: each "
                  "keeps its start (data.overlong=error refuses them)", file=sys.stderr)

    def batches(self, cfg: Config, split: str = "train") -> Iterator[dict]:
        from hypertron.data.finetune import make_sft_batches

        d, t = cfg.data, cfg.train
        tokenizer = get_tokenizer(d.tokenizer)
        return make_sft_batches(
            self._examples(cfg), seq_len=t.seq_len, seed=d.seed, shuffle=d.shuffle, **process_rows(cfg),
            pad_id=tokenizer.eos_id or 0, split=split, eval_fraction=d.eval_fraction)

    def step(self, trainer, state: dict, local: dict) -> tuple[dict, dict]:
        """Pre-training's step, and ``truncated``: the examples of the global batch cut to their row."""
        state, metrics = trainer.step(state, self._batch(trainer, local))
        return state, {**metrics, "truncated": jnp.sum(row_array(local["truncated"], trainer.batch_sharding))}

    def _batch(self, trainer, local: dict) -> dict:
        return trainer.batch(local)

    def data_fingerprint(self, cfg: Config) -> dict[str, Any]:
        d = cfg.data
        template = chat_template_of(cfg)
        # Examples are read by process (hypertron.data.finetune), so their position holds for the process count.
        return {**_records_fingerprint(cfg), "process_count": process_rows(cfg)["process_count"],
                "format": d.format, "loss_on": d.loss_on, "overlong": d.overlong,
                "fields": [d.messages_field, d.prompt_field, d.completion_field, d.chosen_field, d.rejected_field],
                "chat_template": None if template is None else hashlib.sha256(template.encode()).hexdigest()}

    def finish(self, cfg: Config, state: dict, console) -> None:
        super().finish(cfg, state, console)
        template = chat_template_of(cfg)
        if cfg.data.chat_template and template is not None and jax.process_index() == 0:
            set_chat_template(Path(cfg.run_dir) / "model", template)

    def _examples(self, cfg: Config):
        from hypertron.data.finetune import read_examples

        d = cfg.data
        key = (d.source, tuple(d.paths), d.format, d.messages_field, d.prompt_field, d.completion_field, d.loss_on,
               d.chat_template, d.tokenizer, d.overlong, cfg.train.seq_len)
        if self._read is None or self._read[0] != key:
            tokenizer = get_tokenizer(d.tokenizer)
            template = chat_template_of(cfg)
            if d.format == "messages":
                if template is None:
                    raise DataError(f"data.format=messages needs a chat template: data.tokenizer={d.tokenizer} has "
                                    "none (no chat_template in a tokenizer_config.json beside it); set "
                                    "data.chat_template=FILE")
                if d.tokenizer == "byte":
                    raise DataError("data.format=messages with data.tokenizer=byte: the model bundle could not carry "
                                    "the chat template; use a tokenizer file (a tokenizer.json)")
            fields = {"messages": d.messages_field, "prompt": d.prompt_field, "completion": d.completion_field}
            self._read = key, read_examples(source=d.source, paths=d.paths, fmt=d.format, fields=fields,
                                            tokenizer=tokenizer, loss_on=d.loss_on, template=template,
                                            seq_len=cfg.train.seq_len, overlong=d.overlong)
        return self._read[1]


class PreferenceTune(FineTune):
    """``task: dpo``: a language model tuned on preference pairs (``data.format=preference``) with
    the DPO objective against a reference (:mod:`hypertron.train.dpo`; docs/finetuning.md):
    ``dpo.reference`` ``frozen`` (the starting parameters, in the train state), a model bundle or
    run (its parameters, in the train state), or ``precomputed`` (the starting parameters'
    log-probabilities of every pair, computed once before step 1 and kept in
    ``RUN/reference_logps/`` under a digest of the pairs' rows and of where the parameters came
    from, so a resumed run reads them back). One pair a row; the rest is :class:`FineTune`'s (the
    template, the bundle)."""

    TOO_LONG = "pairs have a sequence longer than half of train.seq_len={} + 1 tokens"

    def __init__(self):
        super().__init__()
        self._reference_logps: np.ndarray | None = None  # [pairs, 2], with dpo.reference=precomputed

    def check_init_from(self, cfg: Config) -> None:
        super().check_init_from(cfg)
        if cfg.dpo.reference not in ("frozen", "precomputed"):
            check_params_source(cfg, "dpo.reference", cfg.dpo.reference)

    def batches(self, cfg: Config, split: str = "train") -> Iterator[dict]:
        from hypertron.data.finetune import make_dpo_batches

        d, t = cfg.data, cfg.train
        return make_dpo_batches(
            self._examples(cfg), seq_len=t.seq_len, seed=d.seed, shuffle=d.shuffle, **process_rows(cfg),
            pad_id=get_tokenizer(d.tokenizer).eos_id or 0)

    def trainer(self, cfg: Config, mesh: Mesh):
        from hypertron.train.dpo import make_dpo_trainer

        return make_dpo_trainer(cfg, mesh)

    def initial_state(self, cfg: Config, trainer, console) -> dict:
        state = super().initial_state(cfg, trainer, console)
        reference = cfg.dpo.reference
        if reference == "precomputed":  # the starting parameters; with LoRA the base, adapters off
            self._reference_logps = self._precompute(cfg, trainer, state["base" if cfg.lora.rank else "params"],
                                                     console)
        elif reference != "frozen":
            console.print(f"scoring against the parameters in {reference} (dpo.reference)", highlight=False)
            state["reference"] = read_params(cfg, reference, trainer.abstract_state()["reference"])
        elif cfg.train.init_from and not cfg.lora.rank:  # the reference is where this run starts: what it read
            state["reference"] = jax.tree.map(lambda a: a.copy(), state["params"])
        return state

    def restored(self, cfg: Config, trainer, state: dict, console) -> None:
        super().restored(cfg, trainer, state, console)  # LoRA: the base, read again
        if cfg.dpo.reference == "precomputed":  # read back; computed again (from the start) if it is gone
            self._reference_logps = self._precompute(cfg, trainer, state["base"] if cfg.lora.rank else None, console)

    def step(self, trainer, state: dict, local: dict) -> tuple[dict, dict]:
        if self._reference_logps is None and trainer.cfg.dpo.reference == "precomputed":
            raise RuntimeError("dpo.reference=precomputed: step before initial_state or restored")
        return super().step(trainer, state, local)

    def _batch(self, trainer, local: dict) -> dict:
        batch = super()._batch(trainer, local)
        if self._reference_logps is not None:
            from hypertron.train.dpo import reference_logps_sharding

            logps = self._reference_logps[local["pair"]]
            batch["reference_logps"] = jax.make_array_from_process_local_data(reference_logps_sharding(trainer), logps)
        return batch

    def _precompute(self, cfg: Config, trainer, params, console) -> np.ndarray:
        """The reference's log-probabilities of every pair [pairs, 2]: read from the run directory
        if this run computed them before, else one pass of ``params`` (None: the starting
        parameters, read again) over every pair, written there by process 0."""
        from hypertron.data.finetune import dpo_rows
        from hypertron.train.dpo import reference_logps

        pairs = self._examples(cfg)
        rows = dpo_rows(pairs, range(len(pairs)), seq_len=cfg.train.seq_len,
                        pad_id=get_tokenizer(cfg.data.tokenizer).eos_id or 0)
        digest = hashlib.sha256()
        for key in ("inputs", "targets", "loss_weights", "segment_ids", "positions"):
            digest.update(rows[key].tobytes())
        digest.update(json.dumps(reference_source(cfg), sort_keys=True, default=str).encode())
        path = Path(cfg.run_dir) / "reference_logps" / f"{digest.hexdigest()[:32]}.npy"
        if path.exists():
            table = np.load(path)
            if table.shape == (len(pairs), 2):
                console.print(f"read the reference's log-probabilities of {len(pairs)} pairs from {path}",
                              highlight=False)
                return table
        if params is None:  # the starting parameters, as a new run reads them (the restored policy has moved)
            shardings = trainer.abstract_state()["params"]
            params = (read_params(cfg, cfg.train.init_from, shardings) if cfg.train.init_from
                      else trainer.init(jax.random.key(cfg.train.seed))["params"])
        console.print(f"computing the reference's log-probabilities of {len(pairs)} pairs (dpo.reference="
                      "precomputed)", highlight=False)
        table = reference_logps(cfg, trainer, params, rows)
        if jax.process_index() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial.npy")
            np.save(partial, table)
            os.replace(partial, path)
        return table

    def throughput(self, cfg: Config) -> Throughput:
        """Tokens as pre-training's; FLOPs with the reference's forward pass (a third of a training
        step's) added, unless it was precomputed."""
        base = super().throughput(cfg)
        if cfg.dpo.reference == "precomputed":
            return base
        return dataclasses.replace(base, flops_per_step=base.flops_per_step * 4 / 3)

    def _examples(self, cfg: Config):
        from hypertron.data.finetune import read_pairs

        d = cfg.data
        key = ("dpo", d.source, tuple(d.paths), d.prompt_field, d.chosen_field, d.rejected_field, d.chat_template,
               d.tokenizer, d.overlong, cfg.train.seq_len)
        if self._read is None or self._read[0] != key:
            fields = {"prompt": d.prompt_field, "chosen": d.chosen_field, "rejected": d.rejected_field}
            self._read = key, read_pairs(source=d.source, paths=d.paths, fields=fields,
                                         tokenizer=get_tokenizer(d.tokenizer), template=chat_template_of(cfg),
                                         seq_len=cfg.train.seq_len, overlong=d.overlong)
        return self._read[1]


def check_params_source(cfg: Config, key: str, path: str) -> None:
    """``path`` (the setting ``key``) names a model bundle, or a run with a checkpoint, whose
    parameters have ``cfg.model``'s shapes; one line otherwise, before compiling."""
    from hypertron.models import declare
    from hypertron.models.params import abstract

    if is_bundle(path):
        src_model, _ = read_bundle_config(path)
    elif (Path(path) / "config.yaml").exists():
        src_model = read_run_config(path).model
        latest_step(path)  # refuses a run without usable checkpoints, before compiling
    else:
        raise CheckpointError(f"{key}={path}: not a model bundle (config.json and weights) or a run with "
                              "checkpoints")
    shapes = lambda m: jax.tree.map(lambda a: a.shape, abstract(declare(m), "float32"))
    if shapes(src_model) != shapes(cfg.model):
        raise CheckpointError(
            f"{key}={path} holds a {src_model.name} model whose parameter shapes differ from "
            f"model={cfg.model.name}; set model to match it (model={path} for a model bundle)"
        )


def read_params(cfg: Config, path: str, shardings, hold=None):
    """The parameters of a model bundle or a run's newest checkpoint, placed as ``shardings``
    (``hold``: what to make of them first, e.g. :func:`hypertron.train.lora.hold_base`: they are
    placed as read, each weight by the shardings of what it becomes, and held there under
    ``jit``, so no device ever holds a whole float weight)."""
    if hold is not None:
        made = read_params(cfg, path, float_shardings(cfg, shardings))
        return jax.jit(lambda p: hold(cfg, p), out_shardings=jax.tree.map(lambda s: s.sharding, shardings),
                       donate_argnums=0)(made)
    if not is_bundle(path):
        return load_params(path, shardings=shardings)[1]
    _, params, _ = read_bundle(path, dtype=resolve_dtype(cfg.model.param_dtype))
    # Each process places the slices its devices hold, from the whole array it read.
    return jax.tree.map(
        lambda a, s: jax.make_array_from_callback(a.shape, s.sharding, lambda index, a=a: a[index]),
        params, shardings)


def float_shardings(cfg: Config, held):
    """The parameters as read (shapes, dtypes, shardings) for a base held as ``held`` (abstract or
    not): each weight placed as what it becomes, an int8 weight as its values."""
    from hypertron.models import declare
    from hypertron.models import params as param_lib
    from hypertron.quant import QArray

    shapes = param_lib.abstract(declare(cfg.model), resolve_dtype(cfg.model.param_dtype))
    placed = jax.tree.map(lambda x: x.values.sharding if isinstance(x, QArray) else x.sharding, held,
                          is_leaf=lambda x: isinstance(x, QArray))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, placed)


LORA_BASE_FILE = "lora_base.json"  # in the run directory: the base LoRA adapters train on, by digest


def _held(cfg: Config):
    """How the base is held (:func:`hypertron.train.lora.hold_base`), with LoRA; None without."""
    if not cfg.lora.rank:
        return None
    from hypertron.train.lora import hold_base

    return hold_base


def reference_source(cfg: Config) -> dict[str, Any]:
    """Where a precomputed reference's parameters come from: ``train.init_from`` and a digest of
    its files, or the random start (model and seed)."""
    source = lora_base(cfg)  # with LoRA the reference is the base (held as lora.base_dtype)
    if not source:
        return {"random": cfg.train.seed, "model": dataclasses.asdict(cfg.model)}
    return {"init_from": source, "files": files_digest(source, cfg.run_dir), "dtype": cfg.model.param_dtype,
            **({"base_dtype": cfg.lora.base_dtype} if cfg.lora.rank else {})}


DIGESTS_FILE = "files_digests.json"  # in a run directory: digests of the files it read, by their names, sizes, times


def files_digest(path: str, run_dir: str | None = None) -> str:
    """A SHA-256 of the files parameters are read from: a model bundle's, or a run's newest
    checkpoint step's (names and contents). With ``run_dir``, kept in its :data:`DIGESTS_FILE`
    with the files' names, sizes and modification times, and read back while those are the same:
    a resumed run checks a base of many GB without reading it again (process 0 writes it)."""
    root = Path(path) if is_bundle(path) else Path(path) / "checkpoints" / str(latest_step(path))
    files = sorted(p for p in root.rglob("*") if p.is_file())
    stat = [[str(f.relative_to(root)), st.st_size, st.st_mtime_ns] for f in files for st in [f.stat()]]
    cache, key = (Path(run_dir) / DIGESTS_FILE if run_dir else None), str(root.resolve())
    try:
        known = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), dict) and known[key].get("stat") == stat:
        return known[key]["sha256"]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root)).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    if cache is not None and jax.process_index() == 0:
        known[key] = {"stat": stat, "sha256": digest.hexdigest()}
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(known) + "\n")
        tmp.replace(cache)
    return digest.hexdigest()


def process_rows(cfg: Config) -> dict[str, int]:
    """This process's rows of each batch (:func:`hypertron.parallel.mesh.row_block`)."""
    block, blocks = row_block(cfg.mesh, jax.device_count(), jax.process_count(), jax.process_index())
    return {"batch_size": cfg.train.global_batch // blocks, "process_index": block, "process_count": blocks}


def text_shards(cfg: Config) -> int:
    """The text pipeline's shards (:func:`hypertron.data.pipeline.resolve_shards`)."""
    return resolve_shards(cfg.data.shards, cfg.train.global_batch, process_rows(cfg)["process_count"])


def _records_fingerprint(cfg: Config) -> dict[str, Any]:
    """The data settings every text task's saved position holds for."""
    d, t = cfg.data, cfg.train
    return {"source": d.source, "paths": list(d.paths), "text_field": d.text_field,
            "tokenizer": d.tokenizer, "shuffle": d.shuffle, "seed": d.seed,
            "eval_fraction": d.eval_fraction, "seq_len": t.seq_len, "global_batch": t.global_batch}


def chat_template_of(cfg: Config) -> str | None:
    """The chat template fine-tuning renders with: ``data.chat_template`` (a file), else the
    tokenizer's; None if neither has one."""
    if cfg.data.chat_template:
        try:
            return Path(cfg.data.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"data.chat_template={cfg.data.chat_template}: cannot read it ({one_line(e)})") from None
    return get_tokenizer(cfg.data.tokenizer).chat_template


def write_bundle(cfg: Config, params, console) -> None:
    """The final parameters as the model bundle ``RUN/model`` (:mod:`hypertron.models.bundle`), what
    ``serve`` and ``generate`` read: every process takes part in gathering them, process 0 writes."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        params = multihost_utils.process_allgather(params, tiled=True)
    else:
        params = jax.device_get(params)
    if jax.process_index() == 0:
        path = Path(cfg.run_dir) / "model"
        save_model(path, cfg.model, params, cfg.data.tokenizer)
        console.print(f"wrote the model bundle {path}", highlight=False)


def task_for(cfg: Config) -> Task:
    own = {"dlrm": ("hypertron.train.dlrm", "Recommender"), "diffusion": ("hypertron.train.diffusion_task", "DiffusionTask")}
    if cfg.task in own:  # tasks in modules of their own, imported when run
        return getattr(importlib.import_module(own[cfg.task][0]), own[cfg.task][1])()
    return {"sft": FineTune, "dpo": PreferenceTune}.get(cfg.task, LanguageModel)()
