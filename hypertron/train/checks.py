"""Checks of a run against what only training knows: the devices, the processes and the tokenizer.

They run in :func:`hypertron.train.loop.train` before anything compiles. The
config layer checks what needs none of these (:mod:`hypertron.config.validation`).
"""

from __future__ import annotations

import jax

from hypertron.config import Config
from hypertron.config.validation import check_devices
from hypertron.errors import ConfigError
from hypertron.hardware import device_memory
from hypertron.tokenizer import check_vocab, get_tokenizer


def validate_for_devices(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks for training ``cfg`` on ``num_devices`` devices; returns the resolved mesh shape.

    Refuses what :func:`hypertron.config.validation.check_devices` refuses for these devices and
    processes (``hypertron plan`` runs the same), a vocabulary smaller than the tokenizer's, and
    (with ``train.memory_check``) a run the memory model says cannot fit a device.
    """
    from hypertron.parallel.mesh import slice_count

    shape = check_devices(cfg, num_devices, jax.process_count(), jax.local_device_count(), jax.default_backend(),
                          slice_count(jax.devices()) or None)
    if cfg.data.source != "synthetic":
        check_vocab(get_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size)
    if cfg.train.memory_check:
        check_memory(cfg, shape, jax.devices()[0])
    return shape


def check_memory(cfg: Config, shape: dict[str, int], device) -> None:
    """Refuse a run whose predicted bytes per device (:func:`hypertron.models.memory.step_bytes`)
    exceed the device's, in one line that says what would make it fit."""
    from hypertron.models.attention import is_hopper
    from hypertron.models.memory import step_bytes
    from hypertron.units import describe_bytes

    limit = device_memory(device)
    if limit is None:
        return
    need = step_bytes(cfg, shape, accelerator=device.platform != "cpu", gpu=device.platform == "gpu",
                      hopper=is_hopper(device), tpu=device.platform == "tpu")
    if need.total <= limit:
        return
    s = need.state
    raise ConfigError(
        f"this run needs about {describe_bytes(need.total)} per device (parameters {describe_bytes(s.params)}, "
        f"gradients {describe_bytes(s.grads)}, optimiser {describe_bytes(s.optimizer)}, "
        f"{f'the DPO reference {describe_bytes(s.reference)}, ' if s.reference else ''}"
        f"{f'the frozen base {describe_bytes(s.base)}, ' if s.base else ''}activations "
        f"{describe_bytes(need.activations)} for {need.micro_batch} rows of {cfg.train.seq_len}), more than the "
        f"{describe_bytes(limit)} a device has: fewer rows "
        "per device (train.global_batch, train.grad_accum, more devices), model.remat=full, a larger mesh.fsdp, "
        "or train.memory_check=false to try anyway (hypertron plan shows the breakdown)")
