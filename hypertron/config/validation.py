"""Checks of settings that need no devices, no data and no model: value ranges and combinations.

Device-dependent checks (the mesh against the devices, batch divisibility over
the data shards) and data-dependent ones (the tokenizer against the vocabulary)
live where those things are known, in ``hypertron.train``. Every failure is a
:class:`~hypertron.errors.ConfigError` whose one line names the key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

from hypertron.config.schema import (
    MODEL_INDEX,
    Config,
    IMAGE_DATA_SOURCES,
    DataConfig,
    DiffusionConfig,
    DlrmConfig,
    DpoConfig,
    MeshConfig,
    ModelConfig,
    TablePlacement,
    WeightQuantization,
    check_choices,
    check_sizes,
    choice_error,
    choices,
)
from hypertron.config.serving import (ServeConfig, check_budget, check_engine_settings, check_lora_modules,
                                      check_scheduler_settings)
from hypertron.errors import ConfigError, one_line


def validate_model(m: ModelConfig) -> None:
    """Architecture checks that hold whatever the hardware."""
    check_choices(m, "model.")
    for k in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
        if getattr(m, k) <= 0:
            raise ConfigError(f"model.{k}={getattr(m, k)}: must be positive")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim}: RoPE needs an even head dimension")
    if m.amax_history < 1:
        raise ConfigError(f"model.amax_history={m.amax_history}: must be at least 1")
    if m.norm_eps <= 0:
        raise ConfigError(f"model.norm_eps={m.norm_eps}: must be positive")
    if m.rope_theta <= 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta}: must be positive")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        if rs.factor <= 0 or rs.original_max_position <= 0:
            raise ConfigError("model.rope_scaling: factor and original_max_position must be positive")
        if not 0 < rs.low_freq_factor < rs.high_freq_factor:
            raise ConfigError("model.rope_scaling: need 0 < low_freq_factor < high_freq_factor")
    if m.sliding_window is not None and m.sliding_window <= 0:
        raise ConfigError(f"model.sliding_window={m.sliding_window}: must be positive")
    if m.moe is not None:
        e = m.moe
        if e.num_experts <= 0 or not 0 < e.top_k <= e.num_experts:
            raise ConfigError(
                f"model.moe.top_k={e.top_k} must be in 1..model.moe.num_experts ({e.num_experts})"
            )
        if e.top_k == 1 and e.gating == "topk_softmax":
            raise ConfigError("model.moe.top_k=1 with gating=topk_softmax gives every token weight 1, so the "
                              "router learns nothing from the loss; use model.moe.gating=softmax_topk")
        if e.capacity_factor <= 0:
            raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor}: must be positive")
        if e.shared_experts < 0 or e.load_balance_weight < 0 or e.router_z_weight < 0:
            raise ConfigError("model.moe.shared_experts, load_balance_weight and router_z_weight must not be negative")


def _check_run_dir(run_dir: str) -> None:
    """A run directory that can be made here: neither it nor a folder above it an existing file."""
    path = Path(run_dir)
    try:
        blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    except OSError as e:  # a name too long, a folder that cannot be read
        raise ConfigError(f"run_dir={run_dir}: {one_line(e)}") from None
    if blocked is not None:
        raise ConfigError(f"run_dir={run_dir}: {blocked} is a file, not a directory")


def validate_dlrm(d: DlrmConfig) -> None:
    """A DLRM's sizes, each checked where a mistake would otherwise surface as a shape error."""
    check_choices(d, "dlrm.")
    if not d.table_rows or len(d.ids_per_sample) != len(d.table_rows):
        raise ConfigError(f"dlrm.ids_per_sample has {len(d.ids_per_sample)} entries and dlrm.table_rows "
                          f"{len(d.table_rows)}: give one per sparse feature (at least one)")
    for key in ("table_rows", "ids_per_sample", "bottom_mlp", "top_mlp"):
        values = getattr(d, key)
        if not values or min(values) <= 0:
            raise ConfigError(f"dlrm.{key}={list(values)}: every entry must be positive (and at least one)")
    for key in ("dense_features", "embed_dim", "cross_rank"):
        if getattr(d, key) <= 0:
            raise ConfigError(f"dlrm.{key}={getattr(d, key)}: must be positive")
    if d.cross_layers < 0:
        raise ConfigError(f"dlrm.cross_layers={d.cross_layers}: must not be negative")
    if d.bottom_mlp[-1] != d.embed_dim:
        raise ConfigError(f"dlrm.bottom_mlp ends at {d.bottom_mlp[-1]}: its last layer must be dlrm.embed_dim="
                          f"{d.embed_dim} wide (it joins the embeddings)")
    if d.top_mlp[-1] != 1:
        raise ConfigError(f"dlrm.top_mlp ends at {d.top_mlp[-1]}: its last layer gives the logit, so it must be 1")
    if d.eps <= 0 or d.teacher_scale <= 0:
        raise ConfigError("dlrm.eps and dlrm.teacher_scale must be positive")
    if d.placements:
        if len(d.placements) != len(d.table_rows):
            raise ConfigError(f"dlrm.placements has {len(d.placements)} entries and dlrm.table_rows "
                              f"{len(d.table_rows)}: give one per table, or none (dlrm.placement for all)")
        allowed = choices(TablePlacement)
        for p in d.placements:
            if p not in allowed:
                raise choice_error("dlrm.placements", p, allowed)
    if d.source == "criteo":
        if not d.paths:
            raise ConfigError("dlrm.paths: dlrm.source=criteo needs at least one file")
        if d.dense_features != 13 or len(d.table_rows) != 26:
            raise ConfigError(f"dlrm.source=criteo: Criteo rows have 13 dense and 26 sparse features, this model "
                              f"{d.dense_features} and {len(d.table_rows)}")


# DataConfig's keys that only task: diffusion reads
IMAGE_DATA_KEYS = ("image_field", "resolution", "center_crop", "random_flip")


def validate_diffusion(cfg: Config) -> None:
    """``task: diffusion``'s settings that need no model: an image source, values in range. What
    needs the model (an objective that fits its scheduler, a resolution it takes) is checked where
    the model's folder is read (:mod:`hypertron.train.diffusion`)."""
    d, f = cfg.data, cfg.diffusion
    if cfg.task != "diffusion":
        if cfg.diffusion != DiffusionConfig():
            raise ConfigError("diffusion: its settings are for task=diffusion")
        if d.source in IMAGE_DATA_SOURCES and d.source != "parquet":
            raise ConfigError(f"data.source={d.source} holds images: set task=diffusion")
        default = DataConfig()
        for key in IMAGE_DATA_KEYS:
            if getattr(d, key) != getattr(default, key):
                raise ConfigError(f"data.{key}={getattr(d, key)} is for images: set task=diffusion")
        return
    if d.source not in IMAGE_DATA_SOURCES:
        raise ConfigError(f"data.source={d.source}: task=diffusion reads images ({', '.join(IMAGE_DATA_SOURCES)})")
    if d.source != "shapes" and not d.paths:
        raise ConfigError(f"data.paths: data.source={d.source} needs at least one path")
    if not f.model.strip():
        raise ConfigError("diffusion.model is empty: a diffusers folder, or a preset (shapes-unet)")
    if d.resolution < 0:
        raise ConfigError(f"data.resolution={d.resolution}: must not be negative (0: the model's)")
    if not 0 < f.ema.decay < 1:
        raise ConfigError(f"diffusion.ema.decay={f.ema.decay}: must be in (0, 1)")
    if not 0 <= f.ema.min_decay <= f.ema.decay:
        raise ConfigError(f"diffusion.ema.min_decay={f.ema.min_decay}: must be in [0, diffusion.ema.decay]")
    if f.ema.update_after_step < 0 or f.ema.inv_gamma <= 0 or f.ema.power <= 0:
        raise ConfigError("diffusion.ema: update_after_step must not be negative, inv_gamma and power must be positive")
    if not 0 <= f.cond_dropout < 1:
        raise ConfigError(f"diffusion.cond_dropout={f.cond_dropout}: must be in [0, 1)")
    for key in ("logit_std", "snr_gamma", "eval_timesteps"):
        if not getattr(f, key) > 0:
            raise ConfigError(f"diffusion.{key}={getattr(f, key)}: must be positive")
    if f.max_sequence_length <= 0:
        raise ConfigError(f"diffusion.max_sequence_length={f.max_sequence_length}: must be positive")
    for key in ("shift", "noise_offset", "mode_scale", "guidance"):
        if getattr(f, key) < 0:
            raise ConfigError(f"diffusion.{key}={getattr(f, key)}: must not be negative")
    if f.cache_latents and not f.cache_dir:
        raise ConfigError("diffusion.cache_latents: set diffusion.cache_dir too (where the cache is)")
    if f.cache_dir and d.source == "shapes":
        raise ConfigError("diffusion.cache_dir: the shapes source draws new pictures every step; cache an image source")
    if f.cache_latents and (d.random_flip or not d.center_crop):
        raise ConfigError("diffusion.cache_latents: each image is encoded once, so data.random_flip and a random "
                          "crop (data.center_crop=false) would be drawn once; turn them off or cache the text alone")
    if cfg.train.grad_accum != 1:
        raise ConfigError(f"train.grad_accum={cfg.train.grad_accum}: task=diffusion takes whole batches (1) so far")
    if cfg.train.init_from:
        raise ConfigError("train.init_from: task=diffusion starts from diffusion.model (a folder or a preset)")


# DataConfig's keys that only task: sft and dpo read (a run of another task leaves them at their defaults)
FINE_TUNING_DATA_KEYS = ("format", "messages_field", "prompt_field", "completion_field", "chosen_field",
                         "rejected_field", "loss_on", "chat_template", "overlong")


def _check_shards(cfg: Config) -> None:
    """``data.shards`` (0: chosen for the batch) divides the global batch, for pre-training text only."""
    shards = cfg.data.shards
    if shards < 0:
        raise ConfigError(f"data.shards={shards}: must be at least 1 (0: chosen for the batch)")
    if shards and cfg.task != "lm":
        raise ConfigError(f"data.shards={shards}: task={cfg.task} reads its data by process; shards are "
                          "pre-training text's (task: lm)")
    if shards and cfg.train.global_batch % shards:
        raise ConfigError(f"data.shards={shards} must divide train.global_batch={cfg.train.global_batch} "
                          "(each shard gives the same number of rows)")


def _check_format(cfg: Config) -> None:
    """``data.format`` and ``data.loss_on`` fit the task: records of text for ``lm``, examples
    (messages, prompt_completion) for ``sft``, read from jsonl so far."""
    d = cfg.data
    if cfg.task == "sft":
        if d.format in ("text", "preference"):
            raise ConfigError(f"task=sft needs examples, not data.format={d.format}: set data.format=messages or "
                              "data.format=prompt_completion")
        if d.source not in ("jsonl", "parquet", "hf"):
            raise ConfigError(f"data.source={d.source}: task=sft reads jsonl, parquet or hf records")
        allowed = {"messages": ("auto", "assistant", "all"), "prompt_completion": ("auto", "completion", "all")}[d.format]
        if d.loss_on not in allowed:
            raise ConfigError(f"data.loss_on={d.loss_on}: data.format={d.format} takes {', '.join(allowed)}")
    elif cfg.task == "dpo":
        if d.format != "preference":
            raise ConfigError(f"task=dpo needs preference pairs, not data.format={d.format}: set data.format=preference")
        if d.source not in ("jsonl", "parquet", "hf"):
            raise ConfigError(f"data.source={d.source}: task=dpo reads jsonl, parquet or hf records")
        if d.loss_on != "auto":
            raise ConfigError(f"data.loss_on={d.loss_on}: task=dpo scores each pair's completions")
        if not cfg.dpo.beta > 0:
            raise ConfigError(f"dpo.beta={cfg.dpo.beta}: must be positive")
        if not cfg.dpo.reference.strip():
            raise ConfigError("dpo.reference is empty: frozen, precomputed, or a model bundle or run to score against")
        if cfg.train.eval_every:
            raise ConfigError("train.eval_every: task=dpo has no held-out evaluation yet")
        if cfg.model.quantization != "none":
            raise ConfigError(f"model.quantization={cfg.model.quantization}: task=dpo trains in bf16 or float32 so far")
        if cfg.train.seq_len % 2:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len}: task=dpo puts a pair's two sequences in one row "
                              "of two halves; make it even")
    else:
        default = DataConfig()
        for key in FINE_TUNING_DATA_KEYS:
            if getattr(d, key) != getattr(default, key):
                raise ConfigError(f"data.{key}={getattr(d, key)} is for fine-tuning: set task=sft or task=dpo")
    if cfg.task != "dpo" and cfg.dpo != DpoConfig():
        raise ConfigError("dpo: its settings are for task=dpo")
    lo = cfg.lora
    if lo.rank < 0 or lo.alpha <= 0:
        raise ConfigError(f"lora.rank={lo.rank}, lora.alpha={lo.alpha}: the rank must not be negative (0: off), "
                          "alpha must be positive")
    if lo.rank and cfg.task != "diffusion":  # diffusion's adapters are on diffusion.model's denoiser
        if cfg.task not in ("lm", "sft", "dpo"):
            raise ConfigError(f"lora.rank={lo.rank}: task={cfg.task} does not train adapters (lm, sft, dpo and "
                              "diffusion do)")
        if cfg.task == "dpo" and cfg.dpo.reference not in ("frozen", "precomputed"):
            raise ConfigError(f"dpo.reference={cfg.dpo.reference} with lora.rank={lo.rank}: the reference is the "
                              "base with the adapters off (frozen, or precomputed)")
        if not cfg.train.init_from:
            raise ConfigError(f"lora.rank={lo.rank}: adapters train on a frozen base: set train.init_from")
        if cfg.model.quantization != "none":
            raise ConfigError(f"lora.rank={lo.rank}: model.quantization (fp8 or int8 training) is not taken with "
                              "adapters yet (lora.base_dtype holds the base in int8 or fp8)")


def validate(cfg: Config) -> None:
    """Checks that need no devices (those are in ``hypertron.train.checks``)."""
    for f in dataclasses.fields(cfg):  # the model's choices are validate_model's
        section = getattr(cfg, f.name)
        if f.name not in ("model", "dlrm") and dataclasses.is_dataclass(section):
            check_choices(section, f.name + ".")
    validate_model(cfg.model)
    t = cfg.train
    for k in ("steps", "global_batch", "seq_len", "grad_accum", "log_every", "pipeline_repeats"):
        if getattr(t, k) <= 0:
            raise ConfigError(f"train.{k}={getattr(t, k)}: must be positive")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps}: must not be negative")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr}: must be positive")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio}: must be between 0 and 1")
    if t.clip_norm < 0 or t.weight_decay < 0 or t.z_loss < 0:
        raise ConfigError("train.clip_norm, train.weight_decay and train.z_loss must not be negative")
    if not cfg.run_dir.strip():
        raise ConfigError("run_dir: must not be empty")
    _check_run_dir(cfg.run_dir)
    if t.eval_every < 0 or t.eval_batches <= 0:
        raise ConfigError("train.eval_every must not be negative and train.eval_batches must be positive")
    _check_shards(cfg)
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction}: must be in [0, 1)")
    if cfg.task == "dlrm":
        validate_dlrm(cfg.dlrm)
        if t.eval_every and cfg.dlrm.source == "criteo" and not cfg.dlrm.eval_paths:
            raise ConfigError(f"train.eval_every={t.eval_every} needs held-out files: set dlrm.eval_paths")
    elif t.eval_every and cfg.data.source not in ("synthetic", "shapes") and cfg.data.eval_fraction == 0:
        raise ConfigError(
            f"train.eval_every={t.eval_every} needs a held-out split: set data.eval_fraction (e.g. 0.01)"
        )
    _check_format(cfg)
    validate_diffusion(cfg)
    if t.global_batch % t.grad_accum:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by train.grad_accum={t.grad_accum}"
        )
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}"
        )
    if not cfg.data.tokenizer.strip():
        raise ConfigError("data.tokenizer: must be 'byte' or a path to a tokenizer")
    if cfg.data.source not in ("stdlib", "synthetic", "shapes") and not cfg.data.paths:
        raise ConfigError(f"data.paths: data.source={cfg.data.source} needs at least one path")
    if cfg.checkpoint.every <= 0 or cfg.checkpoint.keep <= 0:
        raise ConfigError("checkpoint.every and checkpoint.keep must be positive")
    d = cfg.distributed
    if d.num_processes < 0 or d.process_id < -1 or (d.num_processes and d.process_id >= d.num_processes):
        raise ConfigError(
            f"distributed.process_id={d.process_id} must be in 0..num_processes-1 (num_processes={d.num_processes})"
        )
    if d.initialization_timeout <= 0 or d.heartbeat_timeout <= 0:
        raise ConfigError("distributed.initialization_timeout and distributed.heartbeat_timeout must be positive")
    mon = cfg.monitor
    if mon.interval <= 0 or mon.h2d_every < 0 or mon.h2d_bytes <= 0:
        raise ConfigError("monitor.interval and monitor.h2d_bytes must be positive, monitor.h2d_every not negative")
    if not 0 <= mon.port <= 65535:
        raise ConfigError(f"monitor.port={mon.port}: must be a port number (0 = off)")
    for where, sizes in (("mesh", cfg.mesh), ("mesh.dcn", cfg.mesh.dcn)):
        check_sizes({a: getattr(sizes, a) for a in MeshConfig.AXES}, where)
    if not 0 <= t.preempt_exit_code <= 255:
        raise ConfigError(f"train.preempt_exit_code={t.preempt_exit_code}: must be an exit code, 0..255")
    la = cfg.launch
    if la.nodes < 1 or la.processes_per_node < 1:
        raise ConfigError(f"launch.nodes={la.nodes}, launch.processes_per_node={la.processes_per_node}: "
                          "must be at least 1")
    for s in la.xla_flags:
        if not s.value.startswith("--xla_") or "=" not in s.value or any(c.isspace() for c in s.value):
            raise ConfigError(f"launch.xla_flags: {s.value!r} is not --xla_name=value")
    for s in la.env:
        name, eq, _ = s.value.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):  # a shell's and a pod's variable name
            raise ConfigError(f"launch.env: {s.value!r} is not NAME=value")


def check_mesh(cfg: Config, num_devices: int, processes: int, local_devices: int,
               granules: int | None = None) -> dict[str, int]:
    """The mesh shape of ``cfg`` on ``num_devices`` devices in ``processes`` processes of
    ``local_devices`` each, with no devices needed (``hypertron train`` checks the ones it has,
    ``hypertron recipes`` and ``workload`` a cluster's): a mesh that does not match the devices, a
    batch that does not split over the data shards or the processes, an expert axis that does not
    divide the experts, a tensor-parallel group that would span two processes, and an across-node
    split that would not give each process one contiguous block of the batch. ``granules``: what the
    across-node (dcn) axes span when it is not the processes (TPU slices, each of several VMs)."""
    ici, dcn = cfg.mesh.split(num_devices, granules or processes)
    if granules and granules != processes and dcn["stage"] > 1:
        raise ConfigError("mesh.dcn.stage across TPU slices: not supported yet (a pipeline's processes would "
                          "need the same rows); split the slices along mesh.dcn.data or mesh.dcn.fsdp")
    shape = {a: ici[a] * dcn[a] for a in ici}
    data_shards = shape["data"] * shape["fsdp"] * shape["expert"]
    micro = cfg.train.global_batch // cfg.train.grad_accum
    if micro % data_shards:
        context = _context_for_rows(cfg, ici, shape, micro, local_devices)
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} (micro-batch {micro}) is not divisible "
            f"by the {data_shards} data shards (mesh data x fsdp x expert)"
            + (f"; mesh.context={context} splits each row over {context} devices of mesh.fsdp instead, leaving "
               f"{data_shards // context} data shards (hypertron plan says whether it fits)" if context else "")
        )
    moe = cfg.model.moe
    if shape["context"] > 1:
        if cfg.train.seq_len % shape["context"]:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} is not divisible by mesh.context={shape['context']} "
                              "(each device holds an equal part of every row)")
        if cfg.model.context_load_balance and cfg.train.seq_len % (2 * shape["context"]):
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} is not divisible by 2 x mesh.context="
                              f"{2 * shape['context']} (model.context_load_balance: each device holds two chunks "
                              "of every row); set model.context_load_balance=false or change train.seq_len")
        if moe is not None and moe.mode == "capped":
            raise ConfigError(f"mesh.context={shape['context']} with model.moe.mode=capped: its capacity counts a "
                              "whole row's tokens; use model.moe.mode=dropless")
    if shape["stage"] > 1:
        _check_stages(cfg, shape, micro // data_shards)
    if shape["expert"] > 1 and moe is not None and moe.num_experts % shape["expert"]:
        raise ConfigError(
            f"mesh.expert={shape['expert']} does not divide model.moe.num_experts={moe.num_experts}"
        )
    if processes > 1:
        # Each process feeds its own rows (a pipeline's processes, mesh.dcn.stage, the same ones), so
        # the batch axes must split over the processes and a tensor-parallel group must not span two
        # of them (its devices would get different rows).
        inside = shape["context"] * shape["tensor"] * shape["stage"] // dcn["stage"]
        if shape["stage"] > 1 and local_devices % inside:
            raise ConfigError(f"mesh.stage={shape['stage']} spans processes here (their devices would get different "
                              "rows); split a pipeline across nodes with mesh.dcn.stage")
        if data_shards % (processes // dcn["stage"]):
            raise ConfigError(
                f"mesh: the {data_shards} data shards (data x fsdp x expert) do not divide over {processes} processes"
                + (f" in pipelines of {dcn['stage']}" if dcn["stage"] > 1 else "")
            )
        for a, what in (("tensor", "a tensor-parallel group"), ("context", "a context-parallel group")):
            if dcn[a] > 1:
                raise ConfigError(f"mesh.dcn.{a}={dcn[a]}: {what} must stay inside one process (its devices share "
                                  "that process's rows); split across nodes along mesh.dcn.data or mesh.dcn.fsdp")
        if local_devices % shape["tensor"]:
            raise ConfigError(
                f"mesh.tensor={shape['tensor']} does not divide the {local_devices} devices of a process"
            )
        _check_process_blocks(ici, dcn)
    return shape


def _check_stages(cfg: Config, shape: dict[str, int], rows: int) -> None:
    """A pipeline (``mesh.stage``) the decoder can run: layers that split into the stages, enough
    micro-batches to fill them that the rows per data shard divide into, a scanned dense model,
    with neither context nor tensor splits yet."""
    s, m, what = shape["stage"], cfg.train.pipeline_microbatches or shape["stage"], f"mesh.stage={shape['stage']}"
    r = cfg.train.pipeline_repeats
    if cfg.model.num_layers % (s * r):
        raise ConfigError(f"{what}" + (f" x train.pipeline_repeats={r}" if r > 1 else "")
                          + f" does not divide model.num_layers={cfg.model.num_layers} (each stage holds "
                          + ("an equal block of layers)" if r == 1 else f"{r} equal blocks of layers)"))
    if m < s:
        raise ConfigError(f"train.pipeline_microbatches={m} is below {what}: the stages would never all work")
    if rows % m:
        raise ConfigError(f"train.pipeline_microbatches={m} does not divide the {rows} rows of a data shard "
                          "(train.global_batch / train.grad_accum over mesh data x fsdp x expert)")
    if not cfg.model.scan_layers:
        raise ConfigError(f"{what} with model.scan_layers=false: a pipeline splits the stacked layers")
    for bad, why in ((cfg.model.moe is not None, "an MoE model"), (cfg.task == "dpo", "task=dpo"),
                     # each amax history would take every iteration's update (fp8.attach: one einsum a step)
                     (cfg.model.quantization == "fp8", "model.quantization=fp8"),
                     (shape["context"] > 1, "mesh.context"),
                     (shape["tensor"] > 1, "mesh.tensor"),
                     # the step holds the layers in the circular order; the frozen base is read in the model's
                     (cfg.lora.rank > 0 and r > 1, "lora.rank and train.pipeline_repeats > 1")):
        if bad:
            raise ConfigError(f"{what} with {why}: not supported yet (issue 42); use mesh.data or mesh.fsdp beside it")


def _context_for_rows(cfg: Config, ici: dict[str, int], shape: dict[str, int], micro: int,
                      local_devices: int) -> int | None:
    """The smallest ``mesh.context`` that, taking its devices from ``fsdp`` inside a node, leaves
    data shards that ``micro`` rows divide over, each row split over that many devices (None if
    none does, or the mesh already has a context axis). With fewer rows than devices, this is
    what context parallelism is for: at a fixed batch it does not shrink a device's tokens."""
    moe = cfg.model.moe
    if shape["context"] > 1 or shape["stage"] > 1 or (moe is not None and moe.mode == "capped"):
        return None  # a context split would be refused next
    shards = shape["data"] * shape["fsdp"] * shape["expert"]
    step = 2 if cfg.model.context_load_balance else 1
    for c in range(2, min(ici["fsdp"], local_devices) + 1):
        if ici["fsdp"] % c == 0 and local_devices % c == 0 and micro % (shards // c) == 0 \
                and cfg.train.seq_len % (step * c) == 0:
            return c
    return None


def _check_process_blocks(ici: dict[str, int], dcn: dict[str, int]) -> None:
    """Each process must feed one contiguous block of the batch shards (data x fsdp x expert, in
    that order): in the hybrid layout a process holds the inside-node part of every axis, which is
    contiguous only when every axis after the first one split inside a process is not split across
    processes (:func:`hypertron.parallel.mesh.check_process_rows` checks the devices' grid itself)."""
    inside = False
    for a in ("data", "fsdp", "expert"):
        if inside and dcn[a] > 1:
            split = ", ".join(f"{b}={ici[b]} x {dcn[b]}" for b in ("data", "fsdp", "expert"))
            raise ConfigError(f"mesh.dcn: this split ({split}, inside x across) gives a process batch rows that are "
                              "not one contiguous block; split across nodes along mesh.dcn.data (or fsdp alone, "
                              "with data 1 inside), never tensor")
        inside = inside or ici[a] > 1


def check_dlrm_devices(cfg: Config, num_devices: int, processes: int) -> None:
    """What ``task: dlrm`` needs of its devices, checked by ``train`` and by ``plan``: a batch that
    splits by samples over the devices."""
    if cfg.train.global_batch % num_devices:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch}: task=dlrm splits it by samples over the "
                          f"{num_devices} devices, so it must be a multiple of {num_devices}")


def check_devices(cfg: Config, num_devices: int, processes: int, local_devices: int, platform: str,
                  granules: int | None = None) -> dict[str, int]:
    """What ``hypertron train`` checks of its devices before compiling and ``hypertron plan`` of the
    devices it plans for (one function, so a plan that fits is a run that starts): cuDNN attention
    only on NVIDIA GPUs, then :func:`check_mesh`. ``platform`` is JAX's name (gpu, tpu, cpu)."""
    if cfg.model.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU; this backend is {platform}")
    if cfg.model.attention == "splash":
        if platform == "gpu":
            raise ConfigError("model.attention=splash is the TPU's kernel (a CPU runs it interpreted, for tests); "
                              "on a GPU, model.attention=cudnn or auto")
        if cfg.train.seq_len % 128:
            raise ConfigError(f"model.attention=splash: train.seq_len={cfg.train.seq_len} is no whole number of the "
                              "kernel's blocks (a multiple of 128)")
    return check_mesh(cfg, num_devices, processes, local_devices, granules)


def validate_serve(cfg: ServeConfig, name: Callable[[str], str] = lambda key: key) -> None:
    """Checks of a :class:`ServeConfig` that need no model; ``name`` as in :func:`check_engine_settings`."""
    check_choices(cfg, name=name)
    if not cfg.checkpoint.strip():
        raise ConfigError(f"{name('checkpoint')}: required (the run directory or Hugging Face model directory to serve)")
    # The engine's and the scheduler's own checks, naming keys as the user wrote them, before
    # deriving those configs (which run the same checks, naming plain keys).
    check_engine_settings(cfg, name)
    check_scheduler_settings(cfg, name)
    check_budget(cfg.max_num_batched_tokens, cfg.max_slots, name)
    check_lora_modules(cfg, name)
    if (cfg.speculative == "draft") != (cfg.draft_model is not None):
        raise ConfigError(f"{name('speculative')}=draft: needs a draft model directory: draft_model, or --draft-model DIR"
                          if cfg.draft_model is None else f"{name('draft_model')}: only with speculative=draft")
    for key in ("max_prompt_tokens", "max_tokens_limit", "max_batch", "max_steps"):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{name(key)}={value}: must be positive")
    if cfg.embedding_cache is not None and cfg.embedding_cache < 0:
        raise ConfigError(f"{name('embedding_cache')}={cfg.embedding_cache}: must be 0 (off) or more")
    if not 0 <= cfg.port < 65536:
        raise ConfigError(f"{name('port')}={cfg.port}: must be 0 to 65535")
    if not 0 < cfg.kv_cache_memory_fraction <= 1:
        raise ConfigError(f"{name('kv_cache_memory_fraction')}={cfg.kv_cache_memory_fraction}: must be above 0 "
                          "and at most 1 (a share of each device's memory)")
    if not cfg.serves_images:
        check_text_serve(cfg, name)
    if cfg.engine_process and cfg.serves_images:
        raise ConfigError(f"{name('engine_process')}: only a text model's engine runs in a process of its own")


def check_text_serve(cfg: ServeConfig, name: Callable[[str], str] = lambda key: key) -> None:
    """What only a diffusers folder takes, refused for a run or Hugging Face directory rather than
    ignored: ``dtype`` (a text model computes in its config's dtype), ``quantize`` fp8, ``sizes``,
    the image limits, ``mesh`` (the text server runs on one device) and ``text_encoder_quantize``."""
    for key, why in (("sizes", "a text model has no image sizes"), ("max_batch", "a text model makes no images"),
                     ("max_steps", "a text model has no denoising steps"),
                     ("embedding_cache", "a text model has no text encoders"),
                     ("mesh", "the text server runs on one device"),
                     ("text_encoder_quantize", "a text model has no text encoders; --quantize is its matmuls'")):
        if getattr(cfg, key) is not None:
            raise ConfigError(f"{name(key)}={getattr(cfg, key)}: only a diffusers folder ({MODEL_INDEX}) takes it; {why}")
    if cfg.dtype is not None:
        raise ConfigError(f"{name('dtype')}={cfg.dtype}: only a diffusers folder ({MODEL_INDEX}) takes a dtype; "
                          f"{cfg.checkpoint} is served in its model config's dtype")
    if cfg.quantize not in choices(WeightQuantization):
        raise ConfigError(f"{name('quantize')}={cfg.quantize}: only a diffusers folder ({MODEL_INDEX}) takes it; "
                          f"a text model takes {', '.join(choices(WeightQuantization))}")
