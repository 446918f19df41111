"""Where a serving engine's arrays live: one device, or (``EngineConfig.tensor`` x
``EngineConfig.expert`` > 1) a mesh of ``tensor`` x ``expert`` of the first local devices, sharded
by training's rules (:data:`hypertron.parallel.rules.DEFAULT_RULES`): each weight as its
declaration's axes say (heads, KV heads, MLP width and vocabulary over ``tensor``, an MoE's experts
over ``expert``), the KV pages by KV head over ``tensor`` (replicated over the ranks that read the
same head when there are fewer KV heads than ranks, and over ``expert``), the per-sequence state
whole on every device. XLA's partitioner then splits each step as the arrays are split (the
matmuls Megatron style, all-reduces of ``[tokens, embed]``); the attention runs in ``shard_map``
by head (:mod:`hypertron.models.kv_cache`, under the step's mesh), and an MoE layer
runs in ``shard_map`` (:func:`hypertron.models.moe.moe_mlp` under the step's mesh): every device
routes all the step's tokens, computes its own experts' copies (their hidden dimension split over
``tensor``) and one all-reduce over both axes sums the layer's output. Outside the experts the
``expert`` devices repeat each other's work. The scheduler and the host side do not change.

Before anything loads, :func:`fit_memory` refuses an engine whose weights and KV pool exceed
a device's memory (``hypertron plan --serve`` plans the same from the config alone), and on an
accelerator sizes the pool from what is left (``--kv-cache-memory-fraction``).

Not yet (refused in one line): LoRA adapters on a mesh, and more than one host (issue 43).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hypertron.config import ConfigError, EngineConfig, MeshConfig, ModelConfig
from hypertron.config.serving import KV_CACHE_MEMORY_FRACTION
from hypertron.models import declare, resolve_dtype
from hypertron.models.kv_pages import init_pages
from hypertron.hardware import HARDWARE, device_memory, match
from hypertron.models.params import abstract, on_mesh, place_params
from hypertron.models.serve_plan import check_split, plan_serving
from hypertron.parallel.mesh import make_mesh
from hypertron.parallel.rules import DEFAULT_RULES, spec_for

# The pool's axes by name (hypertron.models.kv_pages): KV heads first, then pages, rows, head dim.
_PAGE_AXES = ("act_kv_heads", None, None, None)


def check_split_here(cfg: ModelConfig, config: EngineConfig, devices: int) -> None:
    """``tensor`` x ``expert`` ranks this model and host can take, or one line saying why not."""
    t, e = config.tensor, config.expert
    if t * e == 1:
        return
    split = f"--tensor={t}" if e == 1 else f"--expert={e}" if t == 1 else f"--tensor={t} --expert={e}"
    if t * e > devices:
        raise ConfigError(f"{split}: this host has {devices} devices")
    check_split(cfg, t, e)
    if config.enable_lora:
        raise ConfigError(f"{split} with LoRA adapters: not supported yet (issue 43)")


def engine_mesh(cfg: ModelConfig, config: EngineConfig, draft: ModelConfig | None = None) -> Mesh | None:
    """The engine's mesh (``tensor`` x ``expert`` of the first local devices), or None for one device.
    ``draft``: a draft model's config, split over the same mesh (a dense draft beside experts:
    over ``tensor`` alone, whole on each ``expert`` rank)."""
    devices = jax.local_devices()
    check_split_here(cfg, config, len(devices))
    if draft is not None and config.tensor * config.expert > 1:
        try:
            check_split(draft, config.tensor, config.expert if draft.moe else 1)
        except ConfigError as e:
            raise ConfigError(f"draft_model: {e}") from None
    if config.tensor * config.expert == 1:
        return None
    n = config.tensor * config.expert
    return make_mesh(MeshConfig(fsdp=1, tensor=config.tensor, expert=config.expert), devices[:n])


def place_weights(mesh: Mesh | None, cfg: ModelConfig, params):
    """``params`` sharded over ``mesh`` as training shards them (unchanged without a mesh)."""
    return params if mesh is None else place_params(declare(cfg), params, mesh, DEFAULT_RULES)


def weights_on(mesh: Mesh, cfg: ModelConfig):
    """The master weights of ``cfg`` as abstract arrays in the shards :func:`place_weights` gives
    (a checkpoint restores straight into them)."""
    specs = declare(cfg)
    return on_mesh(specs, abstract(specs, resolve_dtype(cfg.param_dtype)), mesh, DEFAULT_RULES)


def new_pages(mesh: Mesh | None, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> dict:
    """An empty KV pool (:func:`hypertron.models.kv_pages.init_pages`), split by KV head over
    ``tensor`` (its scales too): made in place, each device its own part, never whole on one."""
    make = functools.partial(init_pages, cfg, num_pages, page_size, dtype)
    if mesh is None:
        return make()
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, spec_for(_PAGE_AXES[:x.ndim], DEFAULT_RULES, mesh,
                                                                     tuple(x.shape))), jax.eval_shape(make))
    return jax.jit(make, out_shardings=shardings)()


def place_whole(mesh: Mesh | None, tree):
    """``tree`` whole on every device of ``mesh`` (the per-sequence state)."""
    return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def fit_memory(cfg: ModelConfig, config: EngineConfig, quantize: str, max_num_batched_tokens: int, device,
               fraction: float = KV_CACHE_MEMORY_FRACTION, draft: ModelConfig | None = None) -> EngineConfig:
    """Refuse, before anything loads, an engine whose weights and KV pool, both exact
    (:mod:`hypertron.models.serve_plan`), exceed what ``device`` holds
    (:func:`~hypertron.hardware.device_memory`), in one line saying what would fit. ``draft``: the
    engine's draft model (its weights and its pool of as many pages count too).

    Returns ``config``, on an accelerator without ``num_pages`` with the pool the plan leaves:
    what ``fraction`` of its memory holds after the weights and a step's workspace (as vLLM's
    ``--gpu-memory-utilization``); elsewhere the engine's default stays (every slot at
    ``max_seq_len``)."""
    from hypertron.units import describe_bytes

    limit = device_memory(device)
    if limit is None:
        return config
    hw = match(getattr(device, "device_kind", "")) or HARDWARE["cpu"]
    plan = plan_serving(cfg, hw, tensor=config.tensor, expert=config.expert, quantize=quantize,
                        kv_cache_dtype=config.kv_cache_dtype, max_num_batched_tokens=max_num_batched_tokens,
                        max_slots=config.max_slots, page_size=config.page_size, device_memory=limit,
                        accelerator=device.platform != "cpu", memory_fraction=fraction, draft=draft)
    anyway = "; --no-memory-check tries anyway"
    if device.platform != "cpu" and config.num_pages is None:
        if not plan.fits:
            raise ConfigError(f"{cfg.name} does not fit this {device.platform} device with a KV cache of one step's "
                              f"tokens in {100 * fraction:.0f}% of its {describe_bytes(limit)}: {plan.notes[-1]}{anyway}")
        return dataclasses.replace(config, num_pages=plan.kv_tokens // config.page_size + 1)
    pages = config.pool_pages(cfg.max_seq_len)
    pool = pages * config.page_size * plan.kv_token_bytes // plan.kv_split  # kv_cache_bytes (the draft's too)
    if plan.weights + pool <= limit:
        return config
    head = (f"{cfg.name} does not fit this {device.platform} device: its weights ({describe_bytes(plan.weights)}) and KV "
            f"pool ({describe_bytes(pool)}, {pages:,} pages of {config.page_size}) take more than its "
            f"{describe_bytes(limit)}")
    if plan.weights + plan.workspace < limit:
        most = int(limit - plan.weights - plan.workspace) * plan.kv_split // (config.page_size * plan.kv_token_bytes)
        raise ConfigError(f"{head}; --num-pages {most:,} or fewer leaves room for the steps "
                          f"(hypertron plan --serve){anyway}")
    raise ConfigError(f"{head}; {plan.notes[-1] if plan.notes else 'hypertron plan --serve says what fits'}{anyway}")
