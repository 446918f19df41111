"""The accelerators hypertron plans for: memory, peak FLOP/s and bandwidths, from vendor datasheets.

One table: MFU's peaks (:mod:`hypertron.models.flops`), the memory model's fit check
(:mod:`hypertron.models.memory`) and ``hypertron plan`` read it. A figure nobody here has a
datasheet for is None, and whatever needs it says so instead of guessing.

Bandwidths are bytes/s in one direction, per device: ``hbm``; ``inside`` over the fast links of
the device's domain (a node's NVLink; a TPU slice's ICI, which joins every chip of the slice);
``across`` over the data-centre network between domains (a node's NICs shared by its GPUs; a TPU
chip's share of its VM's DCN).

``hypertron plan`` predicts a step from these at two kinds of fitted factor, each fitted on a few
published results (:mod:`hypertron.models.published`, docs/memory.md "Held to published results"):
``efficiency``, the share of the dense peak a tuned training step's matmuls reach on that
hardware, and :data:`LINK_EFFICIENCY`, the share of a link kind's bandwidth its collectives reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypertron.config import ConfigError


@dataclass(frozen=True)
class Hardware:
    name: str
    kinds: tuple[str, ...]        # lower-case device_kind substrings that mean this device
    memory: float | None          # bytes per device
    bf16: float | None            # dense peak FLOP/s
    fp8: float | None = None
    int8: float | None = None     # OP/s
    hbm: float | None = None
    inside: float | None = None
    across: float | None = None
    per_node: int = 1             # devices per node (process); a TPU's per VM
    note: str = ""
    links: tuple[str, str] = ("nvlink", "network")  # the link kinds of inside and across (LINK_EFFICIENCY)
    slice_max: int = 0            # a TPU: the most chips one slice (one ICI domain) holds; 0: the domain is a node
    efficiency: float | None = None  # the bf16 peak's share a tuned step's matmuls reach (fitted; None: not fitted)
    fp8_efficiency: float | None = None  # the fp8 peak's share, for fp8 training

    def peak(self, fmt: str = "bf16") -> float | None:
        return {"bf16": self.bf16, "fp8": self.fp8, "int8": self.int8}[fmt]

    def achieved(self, fmt: str = "bf16") -> float | None:
        """The fitted share of ``fmt``'s peak (None: not fitted for it)."""
        return {"bf16": self.efficiency, "fp8": self.fp8_efficiency}.get(fmt)


GB = 1e9
# The share of a link kind's one-way bandwidth a step's ring collectives reach (fitted beside each
# hardware's ``efficiency``; None: not fitted, and a plan over such links predicts no step).
# Fitted: dcn (MaxText's v5e runs over 32 slices, whose gradient all-reduce outlasts nothing). The
# others are 1.0, not fitted: in no published row here do their collectives outlast the compute
# they overlap, so no row says what share they reach ("network": a node's NICs of no known kind).
LINK_EFFICIENCY: dict[str, float | None] = {
    "dcn": 0.265, "nvlink": 1.0, "ici": 1.0, "tcpxo": 1.0, "rdma": 1.0, "infiniband": 1.0, "network": None,
}
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("h100", ("h100",), 80 * GB, 989e12, 1979e12, 1979e12, hbm=3.35e12, inside=450 * GB,
             across=25 * GB, per_node=8, note="H100 SXM 80 GB, A3 Mega: 8 x 200 Gb/s (GPUDirect-TCPXO) per node",
             links=("nvlink", "tcpxo"), efficiency=0.573, fp8_efficiency=0.334),
    # NVIDIA's DGX H100 (the NeMo and Megatron performance tables' nodes): the H100 SXM with
    # 8 x 400 Gb/s InfiniBand NDR per node. Named with --hardware only (its device_kind is the H100's).
    Hardware("dgx-h100", ("h100, dgx",), 80 * GB, 989e12, 1979e12, 1979e12, hbm=3.35e12, inside=450 * GB,
             across=50 * GB, per_node=8, note="DGX H100: 8 x 400 Gb/s InfiniBand NDR per node",
             links=("nvlink", "infiniband"), efficiency=0.573, fp8_efficiency=0.334),
    Hardware("h100-pcie", ("h100 pcie",), 80 * GB, 756e12, 1513e12, 1513e12, hbm=2.0e12, per_node=8),
    Hardware("h100-nvl", ("h100 nvl",), 94 * GB, 835e12, 1671e12, 1671e12, hbm=3.9e12, per_node=8),
    Hardware("h200", ("h200",), 141 * GB, 989e12, 1979e12, 1979e12, hbm=4.8e12, inside=450 * GB,
             across=50 * GB, per_node=8, note="H200 SXM 141 GB, A3 Ultra: 8 x 400 Gb/s (GPUDirect-RDMA) per node",
             links=("nvlink", "rdma"), efficiency=0.573, fp8_efficiency=0.334),
    Hardware("a100", ("a100",), 80 * GB, 312e12, None, 624e12, hbm=2.039e12, inside=300 * GB, per_node=8,
             note="A100 SXM 80 GB"),
    # TPUs: ICI and DCN per chip from Google's system pages (v5p: 1,200 GB/s ICI both ways, 50 Gb/s
    # DCN; v5e: 400 GB/s ICI, 2 x 100 Gb/s NICs per 8-chip host); v6e's DCN is not published there.
    Hardware("tpu-v5p", ("tpu v5p",), 95 * GB, 459e12, None, 918e12, hbm=2.765e12, inside=600 * GB,
             across=6.25 * GB, per_node=4, links=("ici", "dcn"), slice_max=6144, efficiency=0.778),
    Hardware("tpu-v5e", ("tpu v5 lite", "tpu v5e"), 16 * GB, 197e12, None, 394e12, hbm=0.819e12,
             inside=200 * GB, across=3.125 * GB, per_node=4, links=("ici", "dcn"), slice_max=256, efficiency=0.838),
    # The same chip in JetStream's serving host (v5litepod-8, ct5lp-hightpu-8t): 8 on one VM. Named
    # with --hardware only (its device_kind is the chip's, which means tpu-v5e).
    Hardware("tpu-v5e-8", ("tpu v5 lite, 8 on one host",), 16 * GB, 197e12, None, 394e12, hbm=0.819e12,
             inside=200 * GB, across=3.125 * GB, per_node=8, note="v5litepod-8 serving host: 8 chips, one VM",
             links=("ici", "dcn"), slice_max=8, efficiency=0.838),
    Hardware("tpu-v6e", ("tpu v6",), 32 * GB, 918e12, None, 1836e12, hbm=1.64e12, inside=448 * GB, per_node=4,
             links=("ici", "dcn"), slice_max=256, efficiency=0.543),
    Hardware("cpu", ("cpu",), None, None, note="host memory, read at run time; no peak: no MFU"),
)}


def lookup(name: str) -> Hardware:
    """The table's entry named ``name`` (``--hardware``); a name not in it is one line listing the names."""
    if name not in HARDWARE:
        raise ConfigError(f"--hardware={name!r}: not one of {', '.join(HARDWARE)}")
    return HARDWARE[name]


def host_memory_per_device(devices: int) -> float:
    """The ``cpu`` entry's memory: this host's, shared by ``devices`` devices."""
    import psutil

    return psutil.virtual_memory().total / devices


def match(device_kind: str) -> Hardware | None:
    """The table's entry for a JAX ``device_kind`` (most specific name first), or None."""
    kind = device_kind.lower()
    for h in sorted(HARDWARE.values(), key=lambda h: -max(len(k) for k in h.kinds)):
        if any(k in kind for k in h.kinds):
            return h
    return None


def device_memory(device) -> float | None:
    """Bytes one device can hold: what its allocator says, else the hardware table's figure, else
    (CPU) the host's memory shared by this process's devices."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # backends without memory statistics
        limit = None
    if limit:
        return float(limit)
    h = match(getattr(device, "device_kind", ""))
    if h is not None and h.memory:
        return h.memory
    if device.platform == "cpu":
        import jax

        return host_memory_per_device(jax.local_device_count())
    return None
