"""Checks of a run against what only training knows: the devices, the processes and the tokenizer.

They run in :func:`hypertron.train.loop.train` before anything compiles. The
config layer checks what needs none of these (:mod:`hypertron.config.validation`).
"""

from __future__ import annotations

import jax

from hypertron.config import Config
from hypertron.errors import ConfigError
from hypertron.tokenizer import check_vocab, get_tokenizer


def validate_for_devices(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks for training ``cfg`` on ``num_devices`` devices; returns the resolved mesh shape.

    Refuses cuDNN attention off NVIDIA GPUs, a vocabulary smaller than the tokenizer's, a mesh
    that does not match the devices, a batch that does not split over the data shards or the
    processes, an expert axis that does not divide the experts, and a tensor-parallel group that
    would span two processes.
    """
    if cfg.model.attention == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU; this backend is {jax.default_backend()}")
    if cfg.data.source != "synthetic":
        check_vocab(get_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size)
    shape = cfg.mesh.shape(num_devices, jax.process_count())
    data_shards = shape["data"] * shape["fsdp"] * shape["expert"]
    micro = cfg.train.global_batch // cfg.train.grad_accum
    if micro % data_shards:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} (micro-batch {micro}) is not divisible "
            f"by the {data_shards} data shards (mesh data x fsdp x expert)"
        )
    moe = cfg.model.moe
    if shape["expert"] > 1 and moe is not None and moe.num_experts % shape["expert"]:
        raise ConfigError(
            f"mesh.expert={shape['expert']} does not divide model.moe.num_experts={moe.num_experts}"
        )
    processes = jax.process_count()
    if processes > 1:
        # Each process feeds its own rows, so the batch axes must split over the processes and a
        # tensor-parallel group must not span two of them (its devices would get different rows).
        if data_shards % processes:
            raise ConfigError(
                f"mesh: the {data_shards} data shards (data x fsdp x expert) do not divide over {processes} processes"
            )
        if jax.local_device_count() % shape["tensor"]:
            raise ConfigError(
                f"mesh.tensor={shape['tensor']} does not divide the {jax.local_device_count()} devices of a process"
            )
    return shape
