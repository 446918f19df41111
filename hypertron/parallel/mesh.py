"""The device mesh, built from :class:`~hypertron.config.MeshConfig`."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from hypertron.config import MeshConfig


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, expert, tensor); one configured size may be -1 (the rest).

    ``tensor`` varies fastest, so tensor-parallel groups sit on neighbouring
    devices (same host, fastest links), then ``expert`` (whose all-to-alls come
    next in traffic); ``data`` varies slowest. Devices are
    ordered by process, so each process holds a contiguous block of the batch
    axes and feeds exactly its own rows.
    """
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    shape = cfg.shape(len(devices))
    grid = np.array(devices, dtype=object).reshape([shape[a] for a in MeshConfig.AXES])
    return Mesh(grid, MeshConfig.AXES)
