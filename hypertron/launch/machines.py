"""The machines recipes are written for: one node's devices and what a cluster needs to place a pod.

A recipe's ``launch.machine`` names one of these (``recipes/<machine>/<model>.yaml``). The
device's figures (memory, peaks, links) are :mod:`hypertron.hardware`'s; this table adds
what a Kubernetes pod needs: the GKE machine type and accelerator label, GPUs per node, and how
the nodes talk (``tcpxo``: A3 Mega's GPUDirect-TCPXO, which needs a sidecar daemon and the
NCCL plugin's environment; ``rdma``: A3 Ultra's GPUDirect-RDMA; ``none``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypertron.errors import UserError


# The cluster's priority classes (XPK's five names and values; Kueue orders workloads by their
# pods' priority class). Here, not in k8s.py, so that the CLI's help imports nothing heavy.
PRIORITIES = {"very-low": 100, "low": 250, "medium": 500, "high": 750, "very-high": 1000}


@dataclass(frozen=True)
class Machine:
    name: str
    device: str              # the hypertron.hardware entry of one device
    gpus: int                # per node (0: CPU only, or TPU chips below)
    machine_type: str = ""   # GCE machine type
    accelerator: str = ""    # GKE's cloud.google.com/gke-accelerator label (TPU: gke-tpu-accelerator)
    network: str = "none"    # tcpxo | rdma | none
    note: str = ""
    tpus: int = 0            # TPU chips per VM (a multi-chip machine type: its slices' :data:`TPU_SLICES`)

    @property
    def devices_per_node(self) -> int:
        return self.gpus or self.tpus or 1


MACHINES: dict[str, Machine] = {m.name: m for m in (
    Machine("a3mega-h100", "h100", 8, "a3-megagpu-8g", "nvidia-h100-mega-80gb", "tcpxo",
            "8 x H100 80 GB, 8 x 200 Gb/s GPUDirect-TCPXO NICs per node"),
    Machine("a3ultra-h200", "h200", 8, "a3-ultragpu-8g", "nvidia-h200-141gb", "rdma",
            "8 x H200 141 GB, 8 x 400 Gb/s GPUDirect-RDMA NICs per node"),
    Machine("cpu", "cpu", 0, note="one process per node on the CPU (tests, and laptops)"),
    Machine("tpu-v5p", "tpu-v5p", 0, "ct5p-hightpu-4t", "tpu-v5p-slice", note="4 TPU v5p chips per VM", tpus=4),
    Machine("tpu-v5e", "tpu-v5e", 0, "ct5lp-hightpu-4t", "tpu-v5-lite-podslice", note="4 TPU v5e chips per VM",
            tpus=4),
    Machine("tpu-v6e", "tpu-v6e", 0, "ct6e-standard-4t", "tpu-v6e-slice", note="4 TPU v6e (Trillium) chips per VM",
            tpus=4),
)}


@dataclass(frozen=True)
class TpuSlice:
    """One TPU slice type as XPK names it (``--tpu-type``): its machine, the chips' topology, and from
    them its chips and VMs (one VM of 1 chip for a single chip, else VMs of the machine's 4)."""

    name: str       # v5p-16: the generation's prefix and its TensorCores
    machine: str    # a MACHINES key
    topology: str   # 2x2x2

    @property
    def chips(self) -> int:
        n = 1
        for side in self.topology.split("x"):
            n *= int(side)
        return n

    @property
    def vms(self) -> int:
        return 1 if self.chips == 1 else self.chips // MACHINES[self.machine].tpus

    @property
    def machine_type(self) -> str:
        """The GCE machine type of its VMs: the 1-chip one (``-1t``) for a single chip."""
        base = MACHINES[self.machine].machine_type
        return base.rsplit("-", 1)[0] + "-1t" if self.chips == 1 else base


# XPK 1.16's system characteristics for these generations (xpk/core/system_characteristics.py): the
# name prefix, TensorCores per chip, and the topology each slice type gets.
_TPU_TOPOLOGIES = {
    "tpu-v5p": ("v5p", 2, ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16")),
    "tpu-v5e": ("v5litepod", 1, ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    "tpu-v6e": ("v6e", 1, ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
}


def _slices() -> dict[str, TpuSlice]:
    out = {}
    for machine_name, (prefix, cores, topologies) in _TPU_TOPOLOGIES.items():
        for topology in topologies:
            name = f"{prefix}-{TpuSlice('', machine_name, topology).chips * cores}"
            out[name] = TpuSlice(name, machine_name, topology)
    return out


TPU_SLICES: dict[str, TpuSlice] = _slices()


def tpu_slice(name: str) -> TpuSlice:
    if name not in TPU_SLICES:
        raise UserError(f"--tpu-type={name}: not a TPU type hypertron knows ({', '.join(TPU_SLICES)})")
    return TPU_SLICES[name]


def machine(name: str) -> Machine:
    if name not in MACHINES:
        raise UserError(f"launch.machine={name!r}: not a machine hypertron knows ({', '.join(MACHINES)})")
    return MACHINES[name]
