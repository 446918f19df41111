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
    gpus: int                # per node (0: CPU only)
    machine_type: str = ""   # GCE machine type
    accelerator: str = ""    # GKE's cloud.google.com/gke-accelerator label
    network: str = "none"    # tcpxo | rdma | none
    note: str = ""

    @property
    def devices_per_node(self) -> int:
        return self.gpus or 1


MACHINES: dict[str, Machine] = {m.name: m for m in (
    Machine("a3mega-h100", "h100", 8, "a3-megagpu-8g", "nvidia-h100-mega-80gb", "tcpxo",
            "8 x H100 80 GB, 8 x 200 Gb/s GPUDirect-TCPXO NICs per node"),
    Machine("a3ultra-h200", "h200", 8, "a3-ultragpu-8g", "nvidia-h200-141gb", "rdma",
            "8 x H200 141 GB, 8 x 400 Gb/s GPUDirect-RDMA NICs per node"),
    Machine("cpu", "cpu", 0, note="one process per node on the CPU (tests, and laptops)"),
)}


def machine(name: str) -> Machine:
    if name not in MACHINES:
        raise UserError(f"launch.machine={name!r}: not a machine hypertron knows ({', '.join(MACHINES)})")
    return MACHINES[name]
