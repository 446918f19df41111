"""Meshes that span nodes: each axis an inside-node part times an across-node part (``mesh.dcn``).

Devices here are stand-ins with a process index and an id, so layouts of many processes can be
checked in one; ``tests/test_multiprocess.py`` trains on a split mesh with two real processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hypertron.config import ConfigError, MeshConfig, load_config
from hypertron.config.schema import DcnConfig
from hypertron.parallel.mesh import device_grid


@dataclass(frozen=True)
class Device:
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def devices(processes: int, per: int) -> list[Device]:
    return [Device(p * per + i, p) for p in range(processes) for i in range(per)]


def processes_of(grid: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(grid)


def ids_of(grid: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(grid)


def test_sizes_split_into_inside_and_across_nodes():
    flat = MeshConfig()
    assert flat.split(16, 2) == ({"data": 1, "fsdp": 16, "expert": 1, "context": 1, "tensor": 1, "stage": 1}, dict.fromkeys(MeshConfig.AXES, 1))
    hybrid = MeshConfig(tensor=2, dcn=DcnConfig(data=-1))
    assert hybrid.split(16, 2) == ({"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2, "stage": 1},
                                   {"data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, "stage": 1})
    assert hybrid.shape(16, 2) == {"data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2, "stage": 1}
    with pytest.raises(ConfigError, match=r"mesh.dcn: data=3 x fsdp=1 x expert=1 x context=1 x tensor=1 x stage=1 = 3 processes, but 2"):
        MeshConfig(dcn=DcnConfig(data=3)).shape(16, 2)
    with pytest.raises(ConfigError, match="12 devices do not split evenly over 8 processes"):
        hybrid.shape(12, 8)
    cfg = load_config(None, ["model=tiny", "mesh.dcn.data=-1", "mesh.tensor=2"])
    assert cfg.mesh == hybrid
    with pytest.raises(ConfigError, match="mesh.dcn: at most one axis may be -1, got data, fsdp"):
        load_config(None, ["model=tiny", "mesh.dcn.data=-1", "mesh.dcn.fsdp=-1"])


def test_without_dcn_the_mesh_is_the_devices_in_process_order():
    grid = device_grid(MeshConfig(tensor=2), devices(2, 4)[::-1])
    assert grid.shape == (1, 4, 1, 1, 2, 1)
    assert ids_of(grid).ravel().tolist() == list(range(8))


def test_each_process_fills_the_inside_part_of_every_axis():
    # 2 processes x 4: data across, fsdp inside.
    grid = device_grid(MeshConfig(dcn=DcnConfig(data=-1)), devices(2, 4))
    assert grid.shape == (2, 4, 1, 1, 1, 1)
    assert processes_of(grid)[:, :, 0, 0, 0, 0].tolist() == [[0] * 4, [1] * 4]
    assert ids_of(grid)[1, :, 0, 0, 0, 0].tolist() == [4, 5, 6, 7]
    # 8 processes x 8 (a 64-GPU job): data 4 across nodes, fsdp 2 across x 4 inside, tensor 2 inside.
    grid = device_grid(MeshConfig(fsdp=4, tensor=2, dcn=DcnConfig(data=4, fsdp=2)), devices(8, 8))
    assert grid.shape == (4, 8, 1, 1, 2, 1)
    procs = processes_of(grid)
    for d in range(4):
        for f in range(8):
            # fsdp index f is the across-node block f // 4, position f % 4 inside it.
            assert set(procs[d, f].ravel()) == {2 * d + f // 4}
    # Every tensor pair, and every inside-node fsdp group, is on one process.
    assert all(len(set(procs[d, 4 * b:4 * b + 4].ravel())) == 1 for d in range(4) for b in range(2))


@dataclass(frozen=True)
class TpuVm:
    """A stand-in TPU v5p chip: its VM's process, its slice and its place in the slice's 2x2x4
    topology (JAX's mesh_utils would lay a slice out by these, scattering a VM's chips along fsdp)."""

    id: int
    process_index: int
    slice_index: int
    coords: tuple = (0, 0, 0)
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v5p"


def test_tpu_slices_not_processes_fill_the_inside_part_of_every_axis():
    """2 slices of 4 VMs x 4 chips: the across-node (dcn) axes span the slices, each slice's 16 chips
    (over 4 processes) the inside part, each VM holding one contiguous block of the fsdp axis; on
    processes alone the dcn axis would span 8 VMs."""
    chips = [TpuVm(16 * s + 4 * v + c, 4 * s + v, s, (c % 2, c // 2, v)) for s in range(2) for v in range(4)
             for c in range(4)]
    grid = device_grid(MeshConfig(dcn=DcnConfig(data=-1)), chips)
    assert grid.shape == (2, 16, 1, 1, 1, 1)
    slices = np.vectorize(lambda d: d.slice_index)(grid)[:, :, 0, 0, 0, 0]
    assert slices.tolist() == [[0] * 16, [1] * 16]
    assert processes_of(grid)[1, :, 0, 0, 0, 0].tolist() == [p for p in range(4, 8) for _ in range(4)]
    uneven = [c for c in chips if c.id != 31]
    with pytest.raises(ConfigError, match=r"31 devices do not split evenly over 2 processes \(or TPU slices\)"):
        device_grid(MeshConfig(dcn=DcnConfig(data=-1)), uneven)


def test_a_split_that_scatters_a_process_rows_is_refused():
    # data 2 inside and fsdp across: process 0 would hold batch shards 0 and 2.
    with pytest.raises(ConfigError, match="not one contiguous block.*mesh.dcn.data"):
        device_grid(MeshConfig(data=2, fsdp=1, dcn=DcnConfig(fsdp=-1)), devices(4, 2))
    # tensor across nodes: a tensor group would need one process's rows on another's devices.
    with pytest.raises(ConfigError, match="batch shards"):
        device_grid(MeshConfig(fsdp=1, tensor=2, dcn=DcnConfig(data=2, tensor=2)), devices(4, 2))


def test_a_pipelines_processes_share_their_rows_and_a_stage_split_otherwise_is_refused():
    """With ``mesh.dcn.stage`` the processes of one pipeline hold the same batch shards and feed
    the same rows (``row_block``); without it a pipeline may not span processes."""
    from hypertron.config.validation import check_mesh
    from hypertron.parallel.mesh import row_block

    # 4 processes x 4: data 2 across, stage 2 across, fsdp 4 inside.
    cfg = MeshConfig(fsdp=4, dcn=DcnConfig(data=2, stage=2))
    procs = processes_of(device_grid(cfg, devices(4, 4)))
    assert procs.shape == (2, 4, 1, 1, 1, 2)
    assert [set(procs[d, :, 0, 0, 0, s].ravel()) for d in range(2) for s in range(2)] == [{0}, {1}, {2}, {3}]
    assert [row_block(cfg, 16, 4, p) for p in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert row_block(MeshConfig(dcn=DcnConfig(data=-1)), 16, 4, 3) == (3, 4)
    staged = ["model=tiny", "model.num_layers=2", "train.global_batch=16"]
    check_mesh(load_config(None, [*staged, "mesh.fsdp=4", "mesh.dcn.data=2", "mesh.dcn.stage=2"]), 16, 4, 4)
    with pytest.raises(ConfigError, match="mesh.stage=8 spans processes here.*mesh.dcn.stage"):
        check_mesh(load_config(None, [*staged, "model.num_layers=8", "mesh.fsdp=1", "mesh.stage=8"]), 8, 2, 4)
