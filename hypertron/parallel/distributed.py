"""Starting ``jax.distributed`` for multi-process runs, from config or the environment.

JAX itself reads ``JAX_COORDINATOR_ADDRESS`` but not the process count or
index outside a detected cluster (Slurm, Open MPI, Kubernetes, TPU pods: GKE's TPU slices are found
from ``TPU_WORKER_HOSTNAMES`` and ``MEGASCALE_NUM_SLICES``), so
hypertron reads ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` too; this is
what ``hypertron launch local`` sets, and what a plain ``docker run`` or
``ssh`` launcher can set by hand. Config values win over the environment.
"""

from __future__ import annotations

import os

import jax

from hypertron.config import ConfigError, DistributedConfig

_CLUSTER_SIZE_VARS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def settings(cfg: DistributedConfig, environ=os.environ) -> dict | None:
    """The arguments for ``jax.distributed.initialize``, ``{}`` to let JAX detect a cluster, or None
    for a single-process run."""
    coordinator = cfg.coordinator or environ.get("JAX_COORDINATOR_ADDRESS", "")
    num_processes = cfg.num_processes or _int_env(environ, "JAX_NUM_PROCESSES", 0)
    process_id = cfg.process_id if cfg.process_id >= 0 else _int_env(environ, "JAX_PROCESS_ID", -1)
    timeouts = {"initialization_timeout": cfg.initialization_timeout,
                "heartbeat_timeout_seconds": cfg.heartbeat_timeout}
    if num_processes > 1:
        if not coordinator:
            raise ConfigError(
                f"distributed: {num_processes} processes need a coordinator address "
                "(distributed.coordinator or JAX_COORDINATOR_ADDRESS)"
            )
        if not 0 <= process_id < num_processes:
            raise ConfigError(
                f"distributed: process id {process_id} is outside 0..{num_processes - 1} "
                "(distributed.process_id or JAX_PROCESS_ID)"
            )
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"distributed: coordinator address {coordinator!r} is not host:port")
        return {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id,
                **timeouts}
    if num_processes == 1:
        return None
    if any(_int_env(environ, var, 1) > 1 for var in _CLUSTER_SIZE_VARS):
        return timeouts  # JAX reads the scheduler's variables
    if "," in environ.get("TPU_WORKER_HOSTNAMES", "") or _int_env(environ, "MEGASCALE_NUM_SLICES", 1) > 1:
        return timeouts  # a multi-host TPU slice (or several) on GKE: JAX finds its processes itself
    return None


def initialize(cfg: DistributedConfig) -> bool:
    """Start ``jax.distributed`` if this is one process of several; True if it was started.

    Must run before anything else touches JAX's backends.
    """
    kwargs = settings(cfg)
    if kwargs is None:
        return False
    if jax.distributed.is_initialized():
        return True
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:  # e.g. a coordinator that never answers
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"distributed: could not join the job ({first[:200]})") from None
    return True


def _int_env(environ, name: str, default: int) -> int:
    value = environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected an integer") from None
