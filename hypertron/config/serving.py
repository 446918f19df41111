"""The serving settings: the engine's (:class:`EngineConfig`), the scheduler's
(:class:`SchedulerConfig`) and a server's (:class:`ServeConfig`, whence both derive), with the checks
each runs when made. Split from :mod:`hypertron.config.schema` (the training run's settings), which
holds the helpers and choice types both use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from hypertron.config.schema import (
    MODEL_INDEX,
    DiffusionDtype,
    DiffusionQuantization,
    WeightQuantization,
    check_choices,
)
from hypertron.errors import ConfigError

KvCacheDtype = Literal["auto", "bfloat16", "float32", "int8"]  # auto: the model's compute dtype
# The image server's limits where ServeConfig leaves them None (None there, so that a text model,
# which has no use for them, can refuse them rather than ignore them): images per request (n),
# num_inference_steps, and prompts whose text-encoder outputs are kept (LRU; 0: none).
IMAGE_DEFAULTS = {"max_batch": 4, "max_steps": 100, "embedding_cache": 32}
# background: a new step shape compiles on a background thread while its steps run padded to a compiled
# shape that holds it (if none, the step waits); lazy: each step shape compiles when first met, and waits
CompileMode = Literal["background", "lazy"]
# on: dispatch step n + 1 before step n's tokens reach the host; off: collect each step first; auto: on
# where the model runs on an accelerator, on a CPU only for small steps (a large one takes the cores the
# host needs to stream the last step's tokens: docs/serving.md)
DispatchAhead = Literal["auto", "on", "off"]
# auto: measure a step's fixed cost when the server starts, and give each step the number of new prompts
# that minimises their mean time to first token (one at a time where prefill is compute-bound, as on a
# CPU); max: as many as --max-num-batched-tokens and --max-prefill-rows allow (docs/serving.md)
PrefillGroups = Literal["auto", "max"]
# off: one token per sequence per step; ngram: a sequence whose last tokens occurred before in it proposes
# what followed them there, and the step keeps what the model agrees with (hypertron.serve.speculative);
# draft: a smaller model with the same tokenizer (draft_model) proposes, in the step that emitted the last token
Speculative = Literal["off", "ngram", "draft"]
MAX_SPECULATIVE_TOKENS = 16  # num_speculative_tokens, at most

# A step of the serving engine whose shape is not compiled yet runs padded to a compiled shape that holds it;
# if that costs over this many times its own (hypertron.serve.engine.PagedEngine.cost), its own is compiled in
# the background at once (else only once it has been met a few times).
MAX_PADDED_COST = 4.0
# dispatch_ahead=auto on a CPU: only steps of at most this many tokens run while the next is
# dispatched. A small step leaves a core to the host; a larger one takes both of a small machine's,
# and streaming the last step's tokens then waits for it (docs/benchmarks.md: on 2 cores, one step
# ahead helped at 1 and 4 streams and cost a third of the throughput at 16).
CPU_AHEAD_MAX_TOKENS = 8


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The serving engine's settings (:class:`hypertron.serve.engine.PagedEngine`), handed to it
    whole; the scheduler reads its slots, pages and limits from the engine that holds it.
    Checked when made (:func:`check_engine_settings`), so nothing below
    checks them again. :attr:`ServeConfig.engine` derives it from a server's settings."""

    max_slots: int = 8  # sequences decoding at once, at most
    page_size: int = 16  # tokens per KV page (a power of two)
    num_pages: int | None = None  # KV pages, the null page 0 included; None: every slot at max_seq_len
    kv_cache_dtype: KvCacheDtype = "auto"
    max_top_logprobs: int = 20  # the most log-probabilities a request may ask for per token
    compile: CompileMode = "background"  # see CompileMode
    # LoRA adapters served in the batch (hypertron.serve.lora_slots): slots and the highest rank, as vLLM's flags
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    tensor: int = 1  # devices the weights and KV pages split over (heads, MLP, vocabulary), as training's rules
    expert: int = 1  # devices an MoE's experts split over (times tensor: the engine's devices)

    def __post_init__(self):
        check_engine_settings(self)

    def pool_pages(self, max_seq_len: int) -> int:
        """The pages of the KV pool, the null page included: ``num_pages``, else every slot at
        ``max_seq_len``."""
        return self.num_pages or self.max_slots * -(-max_seq_len // self.page_size) + 1


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How the serving loop fills and runs its steps (:class:`hypertron.serve.scheduler.Scheduler`,
    :class:`hypertron.serve.orchestrator.Orchestrator`), handed to them whole. Checked when made;
    that the budget holds every slot's decode token is checked where both are known
    (:func:`check_budget`). :attr:`ServeConfig.scheduler` derives it."""

    max_num_batched_tokens: int = 512  # tokens per engine step: decode tokens + prefill chunks (>= max_slots)
    max_prefill_rows: int = 8  # prompts (or chunks of prompts) prefilled in one step, at most
    prefill_groups: PrefillGroups = "auto"  # see PrefillGroups
    max_queue: int = 256  # requests waiting for a slot before new ones get 429
    dispatch_ahead: DispatchAhead = "auto"  # see DispatchAhead
    # share the KV pages of prompts' common prefixes between requests: the scheduler's pages, host only
    enable_prefix_caching: bool = True
    speculative: Speculative = "off"  # see Speculative
    num_speculative_tokens: int = 4  # k: drafted tokens a step verifies per sequence, at most
    prompt_lookup_min: int = 2  # ngram: the shortest run of last tokens looked up
    prompt_lookup_max: int = 5  # ngram: the longest (the longest that matches proposes)

    def __post_init__(self):
        check_scheduler_settings(self)


def check_engine_settings(e: EngineConfig | ServeConfig, name: Callable[[str], str] = lambda key: key) -> None:
    """The serving engine's settings, each in its range (run when an :class:`EngineConfig` is made,
    and by :func:`validate_serve`). ``name`` turns a key into what the user wrote (``--max-slots``
    for a flag)."""
    check_choices(e, name=name)
    for key in ("max_slots", "page_size", "num_pages", "max_top_logprobs", "max_loras", "max_lora_rank", "tensor", "expert"):
        value = getattr(e, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{name(key)}={value}: must be positive")
    if e.page_size & (e.page_size - 1):
        raise ConfigError(f"{name('page_size')}={e.page_size}: must be a power of two")
    if e.num_pages is not None and e.num_pages < 2:
        raise ConfigError(f"{name('num_pages')}={e.num_pages}: needs at least 2 (page 0 is reserved)")


def check_lora_modules(s: ServeConfig, name: Callable[[str], str] = lambda key: key) -> None:
    """Each of ``lora_modules`` is ``NAME=PATH``, the names distinct, at most ``max_loras`` of them."""
    names = []
    for module in s.lora_modules:
        adapter, eq, path = module.partition("=")
        if not (eq and adapter.strip() and path.strip()):
            raise ConfigError(f"{name('lora_modules')}: {module!r} is not NAME=PATH (a PEFT adapter directory)")
        if adapter in names:
            raise ConfigError(f"{name('lora_modules')}: the name {adapter!r} is given twice")
        names.append(adapter)
    if len(names) > s.max_loras:
        raise ConfigError(f"{name('lora_modules')}: {len(names)} adapters, more than {name('max_loras')}={s.max_loras}")
    if s.allow_runtime_lora and not (s.enable_lora or s.lora_modules):
        raise ConfigError(f"{name('allow_runtime_lora')}: needs {name('enable_lora')} (or {name('lora_modules')})")


def check_scheduler_settings(s: SchedulerConfig | ServeConfig, name: Callable[[str], str] = lambda key: key) -> None:
    """The scheduler's and the serving loop's settings, each in its range (run when a
    :class:`SchedulerConfig` is made, and by :func:`validate_serve`)."""
    check_choices(s, name=name)
    for key in ("max_num_batched_tokens", "max_prefill_rows", "max_queue"):
        if getattr(s, key) <= 0:
            raise ConfigError(f"{name(key)}={getattr(s, key)}: must be positive")
    k = s.num_speculative_tokens
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{name('num_speculative_tokens')}={k}: must be 1 to {MAX_SPECULATIVE_TOKENS}")
    if s.prompt_lookup_min < 1:
        raise ConfigError(f"{name('prompt_lookup_min')}={s.prompt_lookup_min}: must be at least 1")
    if s.prompt_lookup_max < s.prompt_lookup_min:
        raise ConfigError(f"{name('prompt_lookup_max')}={s.prompt_lookup_max}: must be at least "
                          f"{name('prompt_lookup_min')}={s.prompt_lookup_min}")


def check_budget(max_num_batched_tokens: int, max_slots: int, name: Callable[[str], str] = lambda key: key) -> None:
    """A step's token budget holds a decode token of every slot: the one rule, for
    :func:`validate_serve` (a flag or a file) and the scheduler's constructor (Python)."""
    if max_num_batched_tokens < max_slots:
        raise ConfigError(f"{name('max_num_batched_tokens')}={max_num_batched_tokens}: must be at least "
                          f"{name('max_slots')}={max_slots} (each decoding sequence takes a token of every step)")


_E, _S = EngineConfig, SchedulerConfig  # ServeConfig's defaults are theirs


# The share of an accelerator's memory a server plans to use (weights, a step's workspace, the KV
# pool: what is left of it sizes the pool when --num-pages is not given), as vLLM's
# --gpu-memory-utilization; the rest is the allocator's and XLA's slack.
KV_CACHE_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What ``hypertron serve`` runs: the flags of the same names (``max_slots`` is
    ``--max-slots``), or the keys of a ``--config`` YAML file. It holds no training setting."""

    checkpoint: str = ""  # run directory (its latest checkpoint) or Hugging Face model directory; required
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on /v1 endpoints
    max_slots: int = _E.max_slots
    max_num_batched_tokens: int = _S.max_num_batched_tokens
    max_prefill_rows: int = _S.max_prefill_rows
    prefill_groups: PrefillGroups = _S.prefill_groups
    page_size: int = _E.page_size
    num_pages: int | None = _E.num_pages
    kv_cache_dtype: KvCacheDtype = _E.kv_cache_dtype
    max_top_logprobs: int = _E.max_top_logprobs
    quantize: DiffusionQuantization = "none"  # a run or Hugging Face directory: a WeightQuantization (no fp8)
    compile: CompileMode = _E.compile
    compile_cache: str | None = None  # JAX's persistent compilation cache's folder; None: the default; "none": off
    dispatch_ahead: DispatchAhead = _S.dispatch_ahead
    max_queue: int = _S.max_queue
    max_prompt_tokens: int | None = None  # None: max_seq_len - 1
    max_tokens_limit: int | None = None  # largest max_tokens; None: max_seq_len
    model_name: str | None = None  # the id in /v1/models; None: the run directory's name
    openapi: bool = True  # serve the API's description at GET /openapi.json (behind api_key when set)
    enable_prefix_caching: bool = _S.enable_prefix_caching
    speculative: Speculative = _S.speculative
    num_speculative_tokens: int = _S.num_speculative_tokens
    prompt_lookup_min: int = _S.prompt_lookup_min
    prompt_lookup_max: int = _S.prompt_lookup_max
    draft_model: str | None = None  # speculative: draft: the draft model's directory (as checkpoint)
    enable_lora: bool = _E.enable_lora  # serve LoRA adapters: --lora-modules, /v1/load_lora_adapter
    max_loras: int = _E.max_loras
    max_lora_rank: int = _E.max_lora_rank
    lora_modules: tuple[str, ...] = ()  # NAME=PATH: PEFT adapters loaded at start (enable_lora implied)
    tensor: int = _E.tensor  # tensor parallelism over this host's first devices (hypertron.serve.placement)
    expert: int = _E.expert  # expert parallelism (an MoE's experts) over tensor x expert devices
    # refuse, before loading, an engine the memory model says its device cannot hold (hypertron plan --serve)
    memory_check: bool = True
    # of each device's memory: weights, a step's workspace and the KV pool; on an accelerator without
    # num_pages the pool takes what is left of it
    kv_cache_memory_fraction: float = KV_CACHE_MEMORY_FRACTION
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter may change the adapters (a load reads a
    # path on the server); off: they answer 403 (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora: bool = False
    # the engine loop in a process of its own, the HTTP front end in this one (hypertron.serve.engine_process;
    # vLLM's layout): they share no GIL
    engine_process: bool = False
    # A diffusers folder (model_index.json) serves POST /v1/images/generations instead:
    sizes: str | None = None  # "WxH,WxH": the image sizes served, compiled at start; None: the model's default
    max_batch: int | None = None  # images per request (n), at most; None: IMAGE_DEFAULTS's (a text model: refused)
    max_steps: int | None = None  # num_inference_steps, at most; None: IMAGE_DEFAULTS's (text: refused)
    embedding_cache: int | None = None  # prompts whose encodings are kept; None: IMAGE_DEFAULTS's (text: refused)
    mesh: str | None = None  # "data=2,fsdp=2": images over data, weights by the sharding rules; None: one device
    dtype: DiffusionDtype | None = None  # the pipeline's weights; None: DIFFUSION_DTYPE (a text model: refused)
    text_encoder_quantize: WeightQuantization | None = None  # the text encoders' matmuls; None: none (text: refused)

    def image_limit(self, key: str) -> int:
        """``max_batch``, ``max_steps`` or ``embedding_cache``: as set, else :data:`IMAGE_DEFAULTS`'s."""
        value = getattr(self, key)
        return IMAGE_DEFAULTS[key] if value is None else value

    @property
    def serves_images(self) -> bool:
        """Whether ``checkpoint`` is a diffusers pipeline folder (its ``model_index.json``), served
        as ``POST /v1/images/generations`` rather than by the text server."""
        return (Path(self.checkpoint) / MODEL_INDEX).is_file()

    @property
    def engine(self) -> EngineConfig:
        """The engine's settings of this server."""
        settings = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        return EngineConfig(**{**settings, "enable_lora": self.enable_lora or bool(self.lora_modules)})

    def lora_adapters(self) -> list[tuple[str, str]]:
        """``lora_modules`` as ``(name, path)`` pairs (checked by :func:`check_lora_modules`)."""
        return [tuple(m.split("=", 1)) for m in self.lora_modules]

    @property
    def scheduler(self) -> SchedulerConfig:
        """The scheduler's and the serving loop's settings of this server."""
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in fields(SchedulerConfig)})
