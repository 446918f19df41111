"""The schema: every setting of a run and of a server, as frozen, keyword-only dataclasses.

Each choice is a ``Literal`` type defined once here. The loader
(:mod:`hypertron.config.loading`) refuses a value outside it, naming the key and
the allowed values; the CLI's ``choices``, the kernels' backend list and the
serving engine's cache dtypes are derived from the same types with
:func:`choices`, so an option list exists in exactly one place.

This module imports nothing heavy (no JAX, no data libraries): the CLI reads it
to build its parser.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

from hypertron.errors import ConfigError

# ---------------------------------------------------------------------------
# Choices

Activation = Literal["silu", "gelu"]  # silu -> SwiGLU, gelu -> GeGLU (tanh approximation)
Attention = Literal["auto", "cudnn", "splash", "xla", "plain"]
Remat = Literal["none", "full", "dots"]
# No float16: training it needs loss scaling, which hypertron does not do.
Dtype = Literal["auto", "float32", "bfloat16"]


def dtype_on(name: str, accelerator: bool) -> str:
    """A :data:`Dtype` setting as it resolves on a kind of device: ``auto`` is float32 on a CPU
    (where bfloat16 is slower) and bfloat16 on accelerators. The one rule: the model
    (``models.resolve_dtype``, the device in hand) and the memory model (planned hardware)
    both ask here."""
    return ("bfloat16" if accelerator else "float32") if name == "auto" else name


Quantization = Literal["none", "fp8", "int8"]  # quantised training matmuls
Fp8Scaling = Literal["delayed", "current"]
MoEMode = Literal["dropless", "capped"]
Gating = Literal["topk_softmax", "softmax_topk"]
GmmBackend = Literal["auto", "pallas", "ragged_dot", "grouped", "reference"]
DataSource = Literal["stdlib", "synthetic", "text", "jsonl", "parquet", "hf", "arrayrecord", "tokens",
                     "shapes", "imagefolder", "webdataset"]
# task: diffusion's sources (parquet holds images too; shapes: the CPU demo's rendered pictures)
IMAGE_DATA_SOURCES = ("shapes", "imagefolder", "parquet", "webdataset")
Schedule = Literal["cosine", "linear", "constant"]
WeightQuantization = Literal["none", "int8"]  # weight precision for generation and serving
# A diffusion pipeline (hypertron diffuse, the image server): its weights' dtype (float32 the default,
# as diffusers loads one) and its denoiser's matmuls (int8 weights, or fp8 e4m3 operands).
DiffusionDtype = Literal["float32", "bfloat16"]
DIFFUSION_DTYPE: DiffusionDtype = "float32"
DiffusionQuantization = Literal["none", "int8", "fp8"]
# A diffusers pipeline folder holds this index; hypertron serve serves images for such a folder.
MODEL_INDEX = "model_index.json"
# a language model; fine-tuned on examples or pairs; a recommender; a diffusion model
Task = Literal["lm", "sft", "dpo", "dlrm", "diffusion"]
DataFormat = Literal["text", "messages", "prompt_completion", "preference"]  # a record, as TRL's dataset formats
DpoLossType = Literal["sigmoid", "ipo", "hinge"]  # as TRL 1.16's DPOTrainer (hypertron.train.preference)
LossOn = Literal["auto", "assistant", "completion", "all"]  # auto: assistant for messages, else completion
# auto: the parameter dtype; int8, fp8 (e4m3): per-channel scales, one byte a weight (QLoRA-style)
LoraBaseDtype = Literal["auto", "bfloat16", "int8", "fp8"]
Overlong = Literal["truncate", "error"]  # a fine-tuning example longer than a row: keep its start, or refuse it
DlrmSource = Literal["synthetic", "criteo"]  # planted-teacher samples, or Criteo-format TSV files
TableOptimizer = Literal["sgd", "adagrad", "rowwise_adagrad"]  # as hypertron.embed.OPTIMIZERS
TablePlacement = Literal["auto", "row", "column", "table", "data"]  # auto: hypertron.embed.plan decides per table
# Diffusion training (hypertron.diffusion.objectives): what the model learns, how its timesteps are
# drawn, and how each example's loss is weighted.
DiffusionObjective = Literal["epsilon", "v_prediction", "flow"]
ObjectiveSetting = Literal["auto", "epsilon", "v_prediction", "flow"]  # auto: the model's scheduler's
TimestepSampler = Literal["uniform", "logit_normal", "mode"]
Weighting = Literal["none", "min_snr", "sigma_sqrt", "cosmap"]


def choices(choice_type: typing.Any) -> tuple[str, ...]:
    """The allowed values of a ``Literal`` choice type, in their declared order."""
    if typing.get_origin(choice_type) is not Literal:
        raise TypeError(f"{choice_type!r} is not a Literal choice type")
    return typing.get_args(choice_type)


def choice_error(key: str, value: Any, allowed: tuple[str, ...]) -> ConfigError:
    """The one error of a value outside a choice type: ``key=value: must be one of a, b``."""
    return ConfigError(f"{key}={value}: must be one of {', '.join(allowed)}")


def check_choices(obj: Any, prefix: str = "", name: Callable[[str], str] | None = None) -> None:
    """Every ``Literal`` field of the dataclass ``obj`` (and of its nested dataclasses) holds an
    allowed value. Configs built in Python skip the loader; this catches them too."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        key = name(f.name) if name else prefix + f.name
        if value is not None and typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None: X's
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) is Literal and value not in choices(tp):
            raise choice_error(key, value, choices(tp))
        if is_dataclass(value):
            check_choices(value, key + ".")


def flag_field(default: typing.Any, help: str, metavar: str | None = None) -> typing.Any:
    """A settings dataclass's field whose command-line flag has this help and metavar, kept in the
    field's metadata (``hypertron.cli.flags.add_dataclass_flags`` makes the flag from it)."""
    return field(default=default, metadata={"help": help} | ({"metavar": metavar} if metavar else {}))


# Sources ``hypertron tokenize`` reads (the other two are token ids already).
TOKENIZABLE_SOURCES = tuple(s for s in choices(DataSource)
                            if s not in ("synthetic", "tokens", *IMAGE_DATA_SOURCES) or s == "parquet")


# ---------------------------------------------------------------------------
# A training run


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 style RoPE frequency scaling (``rope_type: llama3`` in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-Experts MLPs: each token goes to ``top_k`` of ``num_experts`` SwiGLU experts
    of hidden size ``model.mlp_dim``."""

    num_experts: int = 8
    top_k: int = 2
    # dropless: every routed token is computed (grouped matmul); capped: at most
    # capacity_factor * seq_len * top_k / num_experts copies per expert and row, the rest dropped.
    mode: MoEMode = "dropless"
    capacity_factor: float = 1.25
    # topk_softmax: softmax over the top-k logits (Mixtral); softmax_topk: softmax over all
    # experts, then the top-k probabilities as weights (Switch / GShard, not renormalised).
    gating: Gating = "topk_softmax"
    shared_experts: int = 0  # dense experts every token also goes through
    load_balance_weight: float = 0.01  # Switch load-balancing loss
    router_z_weight: float = 0.001  # router z-loss
    gmm_backend: GmmBackend = "auto"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The decoder's architecture. One decoder covers Llama, Mistral and Gemma."""

    name: str = "custom"
    vocab_size: int = 259
    embed_dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 384
    activation: Activation = "silu"
    norm_eps: float = 1e-5
    norm_zero_centered: bool = False  # Gemma: scale = 1 + w
    embed_scale: bool = False  # Gemma: embeddings times sqrt(embed_dim)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # Mistral: attend to the last N positions only
    max_seq_len: int = 4096
    attention: Attention = "auto"
    # With mesh.context > 1: each row's tokens reordered so that every context device scores as
    # many causal pairs (hypertron.data.pipeline.balanced_order); seq_len must divide by 2 x context.
    context_load_balance: bool = True
    remat: Remat = "full"
    scan_layers: bool = True
    # Master weights stay float32 by default: in bfloat16, AdamW updates much smaller
    # than a weight round away. "auto" means the compute rule below.
    param_dtype: Dtype = "float32"
    dtype: Dtype = "auto"  # compute dtype; auto: float32 on CPU, bfloat16 on accelerators
    moe: MoEConfig | None = None  # Mixture-of-Experts MLPs instead of dense ones
    # Quantised training matmuls (hypertron.quant). Generation and serving compute in the
    # compute dtype whatever this says (serving has its own --quantize).
    quantization: Quantization = "none"
    fp8_scaling: Fp8Scaling = "delayed"  # delayed: an amax history in the train state
    amax_history: int = 16  # steps of amax kept per tensor for delayed scaling
    quantize_unembed: bool = False  # quantise the unembedding too

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def check_sizes(sizes: dict[str, int], prefix: str) -> list[str]:
    """Refuse sizes that are neither positive nor -1, or more than one -1; returns the -1 axes."""
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ConfigError(f"{prefix}.{a}={s}: sizes must be positive (or -1 for the rest)")
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"{prefix}: at most one axis may be -1, got {', '.join(free)}")
    return free


def _resolve(sizes: dict[str, int], total: int, what: str, prefix: str) -> dict[str, int]:
    """Sizes with their one -1 resolved, multiplying to ``total`` (``what`` names the total)."""
    sizes = dict(sizes)
    free = check_sizes(sizes, prefix)
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if total % fixed:
            raise ConfigError(f"{prefix}: fixed axes multiply to {fixed}, which does not divide {total} {what}")
        sizes[free[0]] = total // fixed
    if math.prod(sizes.values()) != total:
        desc = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError(f"{prefix}: {desc} = {math.prod(sizes.values())} {what}, but {total} are available")
    return sizes


@dataclass(frozen=True, kw_only=True)
class DcnConfig:
    """The across-node part of each mesh axis: how many nodes (processes) it spans. One may be -1
    (the remaining processes). All 1 (the default): the mesh ignores node boundaries."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1
    stage: int = 1

    @property
    def hybrid(self) -> bool:
        return any(getattr(self, a) != 1 for a in MeshConfig.AXES)


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes. One axis may be -1: it takes the remaining devices.

    With ``dcn`` (``mesh.dcn.data=-1``), each axis is split into an inside-node part (these
    sizes, over one process's devices) and an across-node part (``dcn``, over the processes): the
    axis's size is their product, and the devices of one process fill the inside parts, so
    collectives over those stay on the node's links (MaxText's ``ici_*`` and ``dcn_*``).
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1  # MoE expert parallelism; a data-parallel axis outside the experts
    context: int = 1  # sequence (context) parallelism: each row's tokens split over it
    tensor: int = 1
    stage: int = 1  # pipeline parallelism: the stacked layers split into stages over it
    dcn: DcnConfig = field(default_factory=DcnConfig)

    AXES: typing.ClassVar[tuple[str, ...]] = ("data", "fsdp", "expert", "context", "tensor", "stage")

    def split(self, num_devices: int, num_processes: int = 1) -> tuple[dict[str, int], dict[str, int]]:
        """(inside-node sizes, across-node sizes), resolved; across-node all 1 unless ``dcn`` is set."""
        ici = {a: getattr(self, a) for a in self.AXES}
        if not self.dcn.hybrid:
            return _resolve(ici, num_devices, "devices", "mesh"), dict.fromkeys(self.AXES, 1)
        if num_devices % num_processes:
            raise ConfigError(f"mesh.dcn: {num_devices} devices do not split evenly over {num_processes} processes (or TPU slices)")
        dcn = _resolve({a: getattr(self.dcn, a) for a in self.AXES}, num_processes, "processes", "mesh.dcn")
        return _resolve(ici, num_devices // num_processes, "devices per process", "mesh"), dcn

    def shape(self, num_devices: int, num_processes: int = 1) -> dict[str, int]:
        """Each axis's size (inside-node x across-node); checks the product against ``num_devices``."""
        ici, dcn = self.split(num_devices, num_processes)
        return {a: ici[a] * dcn[a] for a in self.AXES}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training text comes from and how it is tokenised."""

    source: DataSource = "stdlib"
    paths: tuple[str, ...] = ()
    text_field: str = "text"
    tokenizer: str = "byte"  # byte | a tokenizer.json (or its directory) | a SentencePiece .model
    shuffle: bool = True
    seed: int = 0
    eval_fraction: float = 0.0  # documents held out of training for train.eval_every (0 = none)
    # Text (task: lm): the documents as this many streams, each global batch the same rows of each, so a
    # run resumes exactly on any process count that divides it (docs/launch.md "Elastic restarts");
    # 0 = 8, or the largest divisor of train.global_batch below it that the processes divide, else one
    # a process (a resume then needs the same process count).
    shards: int = 0
    # Fine-tuning (task: sft; docs/finetuning.md): how each record reads, and its fields
    format: DataFormat = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    loss_on: LossOn = "auto"
    chat_template: str = ""  # a Jinja file; "" = the tokenizer's (its tokenizer_config.json)
    overlong: Overlong = "truncate"
    # Images (task: diffusion; docs/diffusion.md): the image column of parquet records (text_field
    # is the caption's), the side images are resized and cropped to (0: the model's), and how.
    image_field: str = "image"
    resolution: int = 0
    center_crop: bool = True
    random_flip: bool = False


@dataclass(frozen=True, kw_only=True)
class DpoConfig:
    """``task: dpo`` (docs/finetuning.md): the pair objective against a reference."""

    beta: float = 0.1  # how far the policy may move from the reference
    loss_type: DpoLossType = "sigmoid"
    reference: str = "frozen"  # frozen, precomputed, or a model bundle or run to score against (docs/finetuning.md)


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA (hypertron.models.lora): with ``rank`` > 0, only adapters on ``train.init_from``'s frozen base train."""

    rank: int = 0
    alpha: float = 16.0  # the adapter's scale is alpha / rank (alpha / sqrt(rank) with rslora)
    targets: tuple[str, ...] = ("all-linear",)  # PEFT's module names (q_proj ...), or all-linear
    rslora: bool = False
    base_dtype: LoraBaseDtype = "auto"  # how the frozen base is held (its matmul weights; norms stay float32)


@dataclass(frozen=True, kw_only=True)
class EmaConfig:
    """An exponential moving average of the trained parameters, as diffusers' ``EMAModel`` keeps one
    (the decay of each update from these: :mod:`hypertron.train.ema`)."""

    decay: float = 0.9999
    min_decay: float = 0.0
    update_after_step: int = 0
    warmup: bool = False
    inv_gamma: float = 1.0
    power: float = 2 / 3


@dataclass(frozen=True, kw_only=True)
class DiffusionConfig:
    """``task: diffusion`` (docs/diffusion.md): the model, its objective and its EMA.

    ``model``: a diffusers folder to fine-tune (its denoiser trains, its text encoders and VAE stay
    frozen), or a preset trained from scratch (``shapes-unet``). ``objective`` ``auto`` is the
    folder's ``prediction_type`` (flow for a flow-matching scheduler); ``timesteps`` draws each
    example's timestep (``logit_mean``, ``logit_std``, ``mode_scale`` as diffusers' scripts);
    ``shift`` (flow; 0: the scheduler's) moves the sigmas as SD3's 3.0; ``weighting`` weighs each
    example's loss (``snr_gamma`` for min_snr). ``noise_offset`` adds a per-channel offset to the
    noise; ``cond_dropout`` empties that share of the captions (the unconditional branch CFG
    needs). ``use_ema``: keep ``ema`` (diffusers' ``EMAModel``) in the train state; the
    evaluation and the final model then use it. ``eval_timesteps``: the held-out loss is taken at
    that many fixed, evenly spaced timesteps with fixed noise. ``cache_dir``: cached encodings
    (``hypertron diffusion cache`` writes them) the run reads in place of encoding each batch: the
    captions' prompt embeddings, and with ``cache_latents`` the images' VAE latents (or a pixel
    model's pixels); such a run does not load the text encoder (nor, with latents, the VAE)."""

    model: str = "shapes-unet"
    objective: ObjectiveSetting = "auto"
    timesteps: TimestepSampler = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 0.0
    dynamic_shift: bool = False  # flow: shift by Flux's exp(mu) of the latents' token count (FluxPipeline's)
    weighting: Weighting = "none"
    snr_gamma: float = 5.0
    noise_offset: float = 0.0
    cond_dropout: float = 0.0
    use_ema: bool = False
    ema: EmaConfig = field(default_factory=EmaConfig)
    eval_timesteps: int = 8
    cache_dir: str = ""
    cache_latents: bool = False
    guidance: float = 0.0  # Flux-dev's embedded guidance while training (0: the pipeline's, 3.5)
    max_sequence_length: int = 512  # Flux: T5's tokens a caption


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and the loop."""

    steps: int = 100
    global_batch: int = 8
    seq_len: int = 128
    grad_accum: int = 1
    # With mesh.stage > 1: each micro-batch's rows (per data shard) cut into this many pieces that
    # follow one another through the stages (0: as many as the stages). The bubble is
    # (stage - 1) / (microbatches x repeats + stage - 1) of a step.
    pipeline_microbatches: int = 0
    # With mesh.stage > 1: the circular schedule, each stage holding this many blocks of
    # num_layers / (stage x repeats) layers (block r x stage + s on stage s); the pieces go through
    # the stages this many times. 1: GPipe's, a block of num_layers / stage layers a stage.
    pipeline_repeats: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: Schedule = "cosine"
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0 disables clipping
    z_loss: float = 0.0
    seed: int = 0
    log_every: int = 10
    peak_flops: float = 0.0  # per-device bf16 peak; 0 = look it up from the device kind
    init_from: str = ""  # a model bundle (e.g. a converted HF model) or run directory whose parameters start this run
    eval_every: int = 0  # steps between eval-loss measurements on the held-out split (0 = off)
    eval_batches: int = 4  # global batches per evaluation
    memory_check: bool = True  # refuse, before compiling, a run the memory model says cannot fit a device
    # The exit code of a run stopped by SIGTERM before its last step (its checkpoint saved). 0 counts
    # it done; a workload sets a code its restart set holds (42), so the scheduler restarts the gang.
    preempt_exit_code: int = 0


@dataclass(frozen=True, kw_only=True)
class DlrmConfig:
    """A DLRM-v2 (DCNv2) recommender and its data, for ``task: dlrm`` (:mod:`hypertron.recsys`).

    One embedding table per sparse feature (``table_rows``, each ``embed_dim`` wide), pooled by
    sum over the feature's ``ids_per_sample`` ids; the bottom MLP (ReLU after every layer, the last
    of width ``embed_dim``) over the ``dense_features``; a low-rank cross network of
    ``cross_layers`` layers of rank ``cross_rank`` over the concatenated dense output and pooled
    embeddings; the top MLP (ReLU between layers, none after the last, of width 1) gives the logit.
    As TorchRec's ``DLRM_DCN``. ``dlrm=NAME`` picks a preset (``dlrm-v2``: MLPerf's; ``dlrm-v2-tiny``).
    """

    name: str = "dlrm-v2-tiny"
    dense_features: int = 13
    table_rows: tuple[int, ...] = (1000, 500, 200, 100, 50, 20, 10, 5)
    ids_per_sample: tuple[int, ...] = (3, 2, 1, 2, 4, 1, 1, 1)  # per feature (multi-hot sizes)
    embed_dim: int = 16
    bottom_mlp: tuple[int, ...] = (32, 16)
    top_mlp: tuple[int, ...] = (64, 32, 1)
    cross_layers: int = 2
    cross_rank: int = 8
    # The tables' optimiser; the MLPs take plain Adagrad for either Adagrad (as MLPerf's reference), SGD for SGD.
    optimizer: TableOptimizer = "rowwise_adagrad"
    eps: float = 1e-8  # the Adagrads' epsilon (added to the root of the accumulator)
    placement: TablePlacement = "auto"
    placements: tuple[TablePlacement, ...] = ()  # per table, in place of placement (auto: the planner's); () none
    source: DlrmSource = "synthetic"
    paths: tuple[str, ...] = ()  # Criteo-format files (label, 13 integers, 26 hex ids; tab-separated)
    eval_paths: tuple[str, ...] = ()  # held-out Criteo-format files, for train.eval_every
    teacher_seed: int = 1  # the planted teacher's weights (synthetic)
    teacher_scale: float = 3.0  # the spread of the teacher's logits (synthetic): larger is easier


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    enabled: bool = True
    every: int = 100  # steps; a checkpoint is also written at the end
    keep: int = 3


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-process runs (``jax.distributed``). Empty values fall back to the environment:
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (what ``hypertron launch``
    sets); under Slurm or Open MPI with several tasks JAX finds them itself."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0  # 0 = from the environment (1 if unset)
    process_id: int = -1  # -1 = from the environment
    initialization_timeout: int = 300  # seconds to wait for every process to join
    heartbeat_timeout: int = 100  # seconds without a heartbeat before a process is presumed dead


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """What each process of ``hypertron train`` measures about its host, beside the steps
    (``host_metrics.<i>.jsonl``; docs/monitoring.md), and where it serves those to Prometheus."""

    collect: bool = True  # sample host, device and data-loading figures in a background thread
    interval: float = 10.0  # seconds between samples
    h2d_every: int = 100  # steps between host-to-device transfer timings (0 = never; each blocks on a copy)
    h2d_bytes: int = 8 << 20  # the size of that copy
    port: int = 0  # serve Prometheus metrics on port + process index (0 = off)
    host: str = "127.0.0.1"  # the address they are served on (0.0.0.0 for a cluster's Prometheus)


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One XLA flag or environment variable of a recipe, with why it is there."""

    value: str  # "--xla_flag=value" or "NAME=value"
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Where a recipe runs: read by ``hypertron recipes``, ``workload`` and ``launch``, not by the
    training loop (a workload puts the flags and the environment into each process's environment)."""

    machine: str = ""  # a machine of hypertron.launch.machines (a3mega-h100, a3ultra-h200, cpu); "" = none
    nodes: int = 1  # the default node count; the mesh's dcn axes take the rest
    processes_per_node: int = 1  # 1: one process drives a node's devices; a GPU machine's GPU count: one per GPU
    tpu_type: str = ""  # a TPU machine's slice type (XPK's --tpu-type: v5p-128); nodes = slices x its VMs
    slices: int = 1  # TPU slices (the dcn axes span them)
    xla_flags: tuple[Setting, ...] = ()  # on a TPU machine they go in LIBTPU_INIT_ARGS
    env: tuple[Setting, ...] = ()


# Config keys that were renamed: the old dotted key -> what a recipe or override writes now. Given,
# the old key is one line naming the new one (not "unknown config key"). The machines' names are
# not listed here: their table is hypertron.launch.machines, a layer above, and an unknown name
# there lists them.
RENAMED_KEYS = {
    "launch.hardware": "launch.machine (the machine the recipe runs on, as in recipes/<machine>/; "
                       "plan's --hardware is the accelerator)",
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything one run needs."""

    run_dir: str = "runs/default"
    task: Task = "lm"
    model: ModelConfig = field(default_factory=ModelConfig)
    dlrm: DlrmConfig = field(default_factory=DlrmConfig)  # task: dlrm only
    dpo: DpoConfig = field(default_factory=DpoConfig)  # task: dpo only
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)  # task: diffusion only
    lora: LoraConfig = field(default_factory=LoraConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
