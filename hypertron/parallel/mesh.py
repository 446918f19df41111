"""The device mesh, built from :class:`~hypertron.config.MeshConfig`."""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import Mesh

from hypertron.config import MeshConfig
from hypertron.errors import ConfigError


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, expert, context, tensor, stage); one configured size may be -1 (the rest).

    ``stage`` varies fastest, then ``tensor``, so tensor-parallel groups sit on neighbouring
    devices (same host, fastest links; a pipeline's stages only hand activations on, and may span
    nodes with ``mesh.dcn.stage``), then ``expert`` (whose all-to-alls come next in traffic);
    ``data`` varies slowest. Devices are
    ordered by process, so each process holds a contiguous block of the batch
    axes and feeds exactly its own rows. With ``mesh.dcn``, see :func:`device_grid`.
    """
    devices = jax.devices() if devices is None else devices
    return Mesh(device_grid(cfg, devices), MeshConfig.AXES)


def device_grid(cfg: MeshConfig, devices: list) -> np.ndarray:
    """The devices as an array of the mesh's shape.

    Without ``mesh.dcn``: in (process, id) order, reshaped. With it, a hybrid mesh
    (``mesh_utils.create_hybrid_device_mesh``): each granule's devices form a block of the
    inside-node shape, the blocks are laid out in the across-node shape, and along each axis index
    ``i`` is block ``i // inside``, position ``i % inside``. A granule is a process, or on TPU
    slices (devices with a ``slice_index``, several of them) a slice, whose VMs share its ICI; a
    slice's block holds its chips in (process, id) order. One granule's devices then differ
    only in their inside coordinates, so a collective over an inside part never leaves it. Each
    process must still hold one contiguous block of the batch (:func:`check_process_rows`).
    """
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    processes = sorted({d.process_index for d in devices})
    by_slice = slice_count(devices) > 0
    ici, dcn = cfg.split(len(devices), slice_count(devices) or len(processes))
    axes = MeshConfig.AXES
    if not cfg.dcn.hybrid:
        return np.array(devices, dtype=object).reshape([ici[a] for a in axes])
    key = (lambda d: d.slice_index) if by_slice else (lambda d: d.process_index)
    if len(set(collections.Counter(map(key, devices)).values())) != 1:
        raise ConfigError(f"mesh.dcn: every {'slice' if by_slice else 'process'} must have the same number of devices")
    if by_slice:
        # Each slice's chips in (process, id) order, not JAX's physical layout: that would scatter a
        # VM's chips along fsdp, and each process feeds one block of rows.
        blocks = np.empty([dcn[a] for a in axes], dtype=object)
        for i, s in enumerate(sorted({d.slice_index for d in devices})):
            blocks.flat[i] = np.array([d for d in devices if d.slice_index == s], dtype=object).reshape(
                [ici[a] for a in axes])
        grid = np.block(blocks.tolist())
    else:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh([ici[a] for a in axes], [dcn[a] for a in axes], devices,
                                                    process_is_granule=True)
    check_process_rows(grid, len(processes), dcn["stage"])
    return grid


def slice_count(devices: list) -> int:
    """How many TPU slices ``devices`` span when more than one (each device's ``slice_index``), else 0:
    the across-node granule is then the slice, not the process."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    return len(slices) if None not in slices and len(slices) > 1 else 0


def row_block(cfg: MeshConfig, num_devices: int, processes: int, process: int) -> tuple[int, int]:
    """``(block, blocks)``: which block of each batch's rows ``process`` feeds, of how many. One a
    process, except that the processes of one pipeline (``mesh.dcn.stage``, the fastest across-node
    axis: in the hybrid layout they are consecutive) hold the same batch shards and feed the same
    rows (:func:`check_process_rows` checks the devices' grid agrees)."""
    stages = cfg.split(num_devices, processes)[1]["stage"] if cfg.dcn.hybrid else 1
    return process // stages, processes // stages


def check_process_rows(grid: np.ndarray, processes: int, stages: int = 1) -> None:
    """Each process feeds its own rows of the batch: its devices must hold one contiguous block of
    the batch shards (data x fsdp x expert, in that order), block b for processes ``b x stages``
    to ``b x stages + stages - 1`` (:func:`row_block`: a pipeline's processes share their rows)."""
    shards = grid.shape[0] * grid.shape[1] * grid.shape[2]
    if shards % (processes // stages):
        raise ConfigError(f"mesh: the {shards} batch shards (data x fsdp x expert) do not divide over "
                          f"{processes // stages} row blocks of processes")
    per = shards // (processes // stages)
    owners: dict[int, set[int]] = {}
    for index, device in np.ndenumerate(grid):
        shard = (index[0] * grid.shape[1] + index[1]) * grid.shape[2] + index[2]
        owners.setdefault(shard, set()).add(device.process_index)
    for shard, procs in sorted(owners.items()):
        if procs != set(range(shard // per * stages, (shard // per + 1) * stages)):
            raise ConfigError(
                "mesh.dcn: this split gives a process batch rows that are not one contiguous block "
                f"(batch shard {shard} is on processes {sorted(procs)}); split across nodes along "
                "mesh.dcn.data (or fsdp alone, with data 1 inside), never tensor or context")


def local_coords(mesh: Mesh) -> list[list[int]]:
    """This process's devices' coordinates in ``mesh`` (one list per device, in id order)."""
    coords = {d.id: list(map(int, index)) for index, d in np.ndenumerate(mesh.devices)
              if d.process_index == jax.process_index()}
    return [coords[i] for i in sorted(coords)]


def mesh_config_from_text(text: str) -> MeshConfig:
    """The :class:`MeshConfig` of a command line's ``--mesh data=2,fsdp=2``: the named axes at their
    sizes (positive), every other axis 1 (so the mesh holds exactly their product of devices)."""
    sizes = dict.fromkeys(MeshConfig.AXES, 1)
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in sizes or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"mesh={text!r}: expected AXIS=N pairs separated by commas, N a positive integer and "
                              f"AXIS one of {', '.join(MeshConfig.AXES)} (e.g. data=2,fsdp=2)")
        sizes[name] = int(value)
    return MeshConfig(**sizes)


def mesh_from_text(text: str, devices: list | None = None) -> Mesh:
    """The mesh of ``--mesh data=2,fsdp=2`` (:func:`mesh_config_from_text`) over the first devices
    (of ``devices``, default ``jax.devices()``)."""
    cfg = mesh_config_from_text(text)
    devices = jax.devices() if devices is None else devices
    need = int(np.prod([getattr(cfg, a) for a in MeshConfig.AXES]))
    if need > len(devices):
        raise ConfigError(f"mesh={text!r}: needs {need} devices, {len(devices)} available")
    return make_mesh(cfg, list(devices)[:need])
