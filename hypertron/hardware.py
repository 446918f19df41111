"""The accelerators hypertron plans for: memory, peak FLOP/s and bandwidths, from vendor datasheets.

One table: MFU's peaks (:mod:`hypertron.models.flops`), the memory model's fit check
(:mod:`hypertron.models.memory`) and ``hypertron plan`` read it. A figure nobody here has a
datasheet for is None, and whatever needs it says so instead of guessing.

Bandwidths are bytes/s in one direction: ``hbm`` per device; ``inside`` per device over the
node's links (NVLink, or the TPU chip's ICI); ``across`` per node over the data-centre network.
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
    per_node: int = 1             # devices per node (process)
    note: str = ""

    def peak(self, fmt: str = "bf16") -> float | None:
        return {"bf16": self.bf16, "fp8": self.fp8, "int8": self.int8}[fmt]


GB = 1e9
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("h100", ("h100",), 80 * GB, 989e12, 1979e12, 1979e12, hbm=3.35e12, inside=450 * GB,
             across=200 * GB, per_node=8, note="H100 SXM 80 GB, A3 Mega: 8 x 200 Gb/s (GPUDirect-TCPXO) per node"),
    Hardware("h100-pcie", ("h100 pcie",), 80 * GB, 756e12, 1513e12, 1513e12, hbm=2.0e12, per_node=8),
    Hardware("h100-nvl", ("h100 nvl",), 94 * GB, 835e12, 1671e12, 1671e12, hbm=3.9e12, per_node=8),
    Hardware("h200", ("h200",), 141 * GB, 989e12, 1979e12, 1979e12, hbm=4.8e12, inside=450 * GB,
             across=400 * GB, per_node=8, note="H200 SXM 141 GB, A3 Ultra: 8 x 400 Gb/s per node"),
    Hardware("a100", ("a100",), 80 * GB, 312e12, None, 624e12, hbm=2.039e12, inside=300 * GB, per_node=8,
             note="A100 SXM 80 GB"),
    Hardware("tpu-v5p", ("tpu v5p",), 95 * GB, 459e12, None, 918e12, hbm=2.765e12, inside=600 * GB, per_node=4),
    Hardware("tpu-v5e", ("tpu v5 lite", "tpu v5e"), 16 * GB, 197e12, None, 394e12, hbm=0.819e12,
             inside=200 * GB, per_node=4),
    # The same chip in JetStream's serving host (v5litepod-8, ct5lp-hightpu-8t): 8 on one VM. Named
    # with --hardware only (its device_kind is the chip's, which means tpu-v5e).
    Hardware("tpu-v5e-8", ("tpu v5 lite, 8 on one host",), 16 * GB, 197e12, None, 394e12, hbm=0.819e12,
             inside=200 * GB, per_node=8, note="v5litepod-8 serving host: 8 chips, one VM"),
    Hardware("tpu-v6e", ("tpu v6",), 32 * GB, 918e12, None, 1836e12, hbm=1.64e12, inside=448 * GB, per_node=4),
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
