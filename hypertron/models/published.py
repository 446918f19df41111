"""Pretraining results others published at scale, with their configurations: what ``hypertron
plan``'s step prediction is fitted on and held to (``hypertron plan --published``, docs/memory.md
"Held to published results", ``tests/test_plan_published.py``).

Each row is one run as its authors describe it: the model, the chips, the global batch and
sequence, the mesh as hypertron's axes (MaxText's ``ici_*`` / ``dcn_*``; Megatron's TP, PP, VP, CP
and its distributed optimizer's data parallelism as tensor, stage, ``pipeline_repeats``, context
and fsdp), the matmuls its
remat policy runs again, and the published throughput in tokens/s per device. Where a source
gives TFLOP/s per device only, tokens/s is that over the source's own FLOPs per token
(:func:`maxtext_2023_flops`). A row marked ``fitted`` sets a factor in
:mod:`hypertron.hardware` (:func:`fit` finds them again); every other row is a prediction.

The planner's own memory model is not applied: these runs used what hypertron does not have or
has not run on their hardware (host offloading, Megatron's distributed optimizer, MaxText's tuned
splash and cuDNN flash attention), so each row is planned for its step time only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hypertron.config import Config, load_config
from hypertron.hardware import HARDWARE, LINK_EFFICIENCY
from hypertron.models.flops import GROUPS
from hypertron.models.plan import Plan, plan

MAXTEXT = "github.com/AI-Hypercomputer/maxtext"
TPU_RECIPES = "github.com/AI-Hypercomputer/tpu-recipes"
GPU_RECIPES = "github.com/AI-Hypercomputer/gpu-recipes"
NEMO = "github.com/NVIDIA/NeMo docs/source/performance/performance_summary.md (24.07, rev 8e3d65d)"
BRIDGE = "github.com/NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (25.09)"

# MaxText's remat policies as the groups of matmuls they run again (hypertron.models.flops.GROUPS):
# "minimal" saves every dot without a batch dimension (the projections and the MLP); flash
# attention recomputes its scores in any case (counted in the efficiency, not here).
MLP = ("mlp_in", "mlp_out")
REMAT = {
    "full": GROUPS,
    "minimal": (),
    "offload q/k/v/out": MLP,                       # custom: those outputs and each layer's input offloaded
    "offload q/k/v": ("out",) + MLP,
    "qkv_proj_offloaded": ("out",) + MLP,
    "save_dot_except_mlpwi": ("mlp_in",),
    "context and mlpwo offloaded": ("qkv", "out", "mlp_in"),
    "save_dot_with_context_except_mlp": MLP,
    "none": (),
}


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    hardware: str
    devices: int
    domain: int                  # devices of one fast-link domain (a TPU slice, a GPU node)
    settings: tuple[str, ...]    # hypertron key=value for the run
    remat: str                   # its policy (REMAT)
    tokens: float                # published tokens/s per device (or derived, see ``derived``)
    fitted: str = ""             # the factor this row sets, if any
    derived: str = ""            # how ``tokens`` came from what was published, when it did not appear there
    mfu: float | None = None     # the published MFU, for reference

    def config(self) -> Config:
        return load_config(None, list(self.settings))


def maxtext_2023_flops(emb: int, heads: int, mlp: int, layers: int, seq: int, vocab: int = 32000,
                       head_dim: int = 128) -> float:
    """Training FLOPs per token as MaxText counted them in December 2023 (``MaxText/train.py``, which
    made the v5p and v5e tables): 6 x every parameter (embedding and unembedding included) plus
    causal attention's 6 x heads x layers x head_dim x seq."""
    params = 2 * vocab * emb + layers * (4 * emb * heads * head_dim + 3 * emb * mlp)
    return 6 * params + 6 * heads * layers * head_dim * seq


# MaxText's synthetic sizes (MaxText/configs/v5p/*.sh, v5e/*.sh of December 2023; dims from its
# base.yml scaled by get_individual_scales): emb, heads (= KV heads), mlp, layers.
SIZES = {"16B": (4096, 64, 28672, 32), "32B": (8192, 64, 28672, 32), "64B": (8192, 64, 28672, 64),
         "128B": (8192, 128, 57344, 64), "256B": (16384, 128, 57344, 64), "512B": (16384, 128, 57344, 128),
         "1024B": (16384, 256, 114688, 128)}


def _synthetic(size: str, chip: str, slice_chips: int, slices: int, pdb: int, tensor: int, remat: str,
               tflops: float, mfu: float, fitted: str = "") -> Published:
    emb, heads, mlp, layers = SIZES[size]
    devices = slice_chips * slices
    settings = ("model=llama2-7b", f"model.embed_dim={emb}", f"model.num_heads={heads}", f"model.num_kv_heads={heads}",
                f"model.mlp_dim={mlp}", f"model.num_layers={layers}", "model.dtype=bfloat16", "train.seq_len=2048",
                f"train.global_batch={pdb * devices}", f"mesh.tensor={tensor}", "mesh.fsdp=-1")
    if slices > 1:
        settings += (f"mesh.dcn.data={slices}",)
    name = f"MaxText {size}, {slices} x {chip}-{slice_chips * (2 if chip == 'v5p' else 1)}"
    per_token = maxtext_2023_flops(emb, heads, mlp, layers, 2048)
    table = "src/maxtext/configs/tpu/v5p/README.md" if chip == "v5p" else "src/maxtext/configs/tpu/v5e/README.md"
    return Published(name, f"{MAXTEXT} {table}", f"tpu-{chip}", devices, slice_chips, settings, remat,
                     tflops * 1e12 / per_token, fitted,
                     f"{tflops:g} TFLOP/s per chip over MaxText's {per_token / 1e9:.1f} GFLOP a token", mfu)


def _v5p(size, chips, slices, pdb, tensor, remat, tflops, mfu, fitted=""):
    return _synthetic(size, "v5p", chips, slices, pdb, tensor, remat, tflops, mfu, fitted)


def _v5e(size, slices, pdb, remat, tflops, mfu, fitted="", tensor=1):
    return _synthetic(size, "v5e", 256, slices, pdb, tensor, remat, tflops, mfu, fitted)


def _llama(name, source, hardware, devices, domain, preset, seq, batch, mesh, remat, tokens, mfu=None,
           fitted="", extra=()):
    settings = (f"model={preset}", "model.dtype=bfloat16", f"train.seq_len={seq}", f"train.global_batch={batch}",
                *mesh, *extra)
    return Published(name, source, hardware, devices, domain, settings, remat, tokens, fitted, mfu=mfu)


_405B = ("model.embed_dim=16384", "model.num_layers=126", "model.num_heads=128", "model.num_kv_heads=8",
         "model.mlp_dim=53248")


def _megatron(name, source, devices, preset, seq, batch, tp, pp, cp, vp, tokens, fitted="", extra=()):
    """A NeMo / Megatron run on DGX H100 nodes in fp8: TP, PP (VP virtual stages a device), CP, and
    the rest data parallel; one row a micro-batch (MBS 1), so GBS / DP pieces through the pipeline."""
    dp = devices // (tp * pp * cp)
    # Megatron's order: TP, then CP, then DP fill a node's 8 GPUs; PP and the rest go across nodes.
    inside_cp = min(cp, 8 // tp)
    inside_dp = min(dp, 8 // (tp * inside_cp))
    # Its distributed optimizer shards the optimizer state over DP, reduce-scatters the gradients
    # and all-gathers the parameters once a step, beside the compute: hypertron's fsdp axis.
    mesh = (f"mesh.tensor={tp}", f"mesh.context={inside_cp}", f"mesh.fsdp={inside_dp}", "model.quantization=fp8")
    if devices > 8:
        mesh += ("mesh.stage=1", f"mesh.dcn.stage={pp}", f"mesh.dcn.context={cp // inside_cp}",
                 f"mesh.dcn.fsdp={dp // inside_dp}")
    else:
        mesh += (f"mesh.stage={pp}",)
    if pp > 1:
        mesh += (f"train.pipeline_microbatches={batch // dp}", f"train.pipeline_repeats={vp}")
    return _llama(name, source, "dgx-h100", devices, 8, preset, seq, batch, mesh, "none", tokens, fitted=fitted,
                  extra=extra)


TRILLIUM = f"{TPU_RECIPES} training/trillium/*/README.md (the runs' logs); {MAXTEXT} benchmarks/maxtext_trillium_model_configs.py"

PUBLISHED: tuple[Published, ...] = (
    # TPU v5p, MaxText's synthetic models, one slice and two (data across the slices' DCN).
    _v5p("32B", 64, 1, 8, 4, "minimal", 328, 71.47, fitted="tpu-v5p"),
    _v5p("64B", 64, 1, 4, 4, "minimal", 323, 70.31),
    _v5p("128B", 128, 1, 2, 8, "minimal", 315, 68.68),
    _v5p("128B", 256, 1, 2, 8, "minimal", 316, 68.83),
    _v5p("256B", 512, 1, 2, 8, "minimal", 308, 67.09),
    _v5p("512B", 512, 1, 2, 16, "full", 294, 63.99, fitted="tpu-v5p"),
    _v5p("1024B", 1024, 1, 2, 16, "full", 254, 55.35),
    _v5p("1024B", 2048, 1, 2, 16, "full", 297, 64.80),
    _v5p("32B", 64, 2, 8, 4, "minimal", 319, 69.43),
    _v5p("128B", 256, 2, 2, 8, "minimal", 274, 59.66),
    _v5p("1024B", 2048, 2, 2, 16, "full", 279, 60.83),
    # TPU v5e, one v5e-256 slice and 4 or 32 of them.
    _v5e("32B", 1, 4, "full", 132, 66.86, fitted="tpu-v5e"),
    _v5e("16B", 1, 6, "full", 120, 61.10),
    _v5e("64B", 1, 2, "full", 118, 59.90, fitted="tpu-v5e"),
    _v5e("128B", 1, 1, "full", 110, 56.06, tensor=16),
    _v5e("16B", 4, 6, "full", 117, 59.14),
    _v5e("32B", 4, 4, "full", 126, 64.10),
    _v5e("16B", 32, 6, "full", 108, 54.65),
    _v5e("32B", 32, 4, "full", 119, 60.40),
    _v5e("64B", 32, 2, "full", 99, 50.18),
    _v5e("128B", 32, 1, "full", 91, 46.25, fitted="dcn", tensor=16),
    # TPU v6e (Trillium), MaxText's Llama recipes: fsdp over one v6e-256 (or smaller) slice.
    _llama("MaxText Llama 3.1 70B, v6e-256", TRILLIUM, "tpu-v6e", 256, 256, "llama3.1-70b", 8192, 5 * 256,
           ("mesh.fsdp=-1",), "offload q/k/v", 960.248, 50.33, fitted="tpu-v6e"),
    _llama("MaxText Llama 3.1 70B, v6e-64", TRILLIUM, "tpu-v6e", 64, 64, "llama3.1-70b", 8192, 2 * 64,
           ("mesh.fsdp=-1",), "offload q/k/v", 876.736),
    _llama("MaxText Llama 3.1 8B, v6e-256", TRILLIUM, "tpu-v6e", 256, 256, "llama3.1-8b", 8192, 4 * 256,
           ("mesh.fsdp=-1",), "offload q/k/v/out", 7207.336, 45.46, fitted="tpu-v6e"),
    _llama("MaxText Llama 3.1 8B, v6e-64", TRILLIUM, "tpu-v6e", 64, 64, "llama3.1-8b", 8192, 5 * 64,
           ("mesh.fsdp=-1",), "offload q/k/v/out", 7247.111),
    _llama("MaxText Llama 2 70B, v6e-256", TRILLIUM, "tpu-v6e", 256, 256, "llama2-70b", 4096, 2 * 256,
           ("mesh.fsdp=-1",), "qkv_proj_offloaded", 905.021, 43.8),
    # TPU v5p, MaxText's Llama recipes.
    _llama("MaxText Llama 2 70B, 512 v5p", f"{MAXTEXT} docs/reference/models/tiering.md", "tpu-v5p", 512, 512,
           "llama2-70b", 4096, 4 * 512, ("mesh.fsdp=-1",), "save_dot_except_mlpwi", 692, 65.4),
    _llama("MaxText Llama 3.1 405B, v5p-1024", f"{TPU_RECIPES} training/v5p/*/README.md", "tpu-v5p", 512, 512,
           "llama3-70b", 8192, 2 * 512, ("mesh.fsdp=-1",), "context and mlpwo offloaded", 124.618, extra=_405B),
    # GPUs on Google Cloud, MaxText (bf16): A3 Mega H100 (TCPXO), A3 Ultra H200 (RDMA).
    _llama("MaxText Llama 2 7B, 256 H100 (A3 Mega)", f"{GPU_RECIPES} training/a3mega/llama-2-7b/maxtext-pretraining-gke",
           "h100", 256, 8, "llama2-7b", 4096, 4 * 256, ("mesh.fsdp=8", "mesh.dcn.data=32"), "minimal", 10922.973,
           fitted="hopper bf16"),
    _llama("MaxText Llama 3.1 70B, 256 H200 (A3 Ultra)", f"{GPU_RECIPES} training/a3ultra/llama3-1-70b/maxtext-pretraining-gke",
           "h200", 256, 8, "llama3.1-70b", 8192, 2 * 256, ("mesh.fsdp=8", "mesh.dcn.data=2", "mesh.dcn.fsdp=16"),
           "save_dot_with_context_except_mlp", 1055.949),
    # NVIDIA's DGX H100 (InfiniBand), NeMo / Megatron in fp8.
    _megatron("NeMo 24.07 Llama 3 8B, 8 H100 fp8", NEMO, 8, "llama3-8b", 8192, 128, 1, 1, 2, 1, 12273,
              fitted="hopper fp8"),
    _megatron("NeMo 24.07 Llama 3 70B, 64 H100 fp8", NEMO, 64, "llama3-70b", 8192, 128, 4, 4, 2, 5, 1524,
              fitted="hopper fp8"),
    _megatron("NeMo 24.07 Llama 2 70B, 64 H100 fp8", NEMO, 64, "llama2-70b", 4096, 128, 4, 4, 1, 20, 1728),
    _megatron("Megatron-Bridge 25.09 Llama 3 8B, 8 H100 fp8", BRIDGE, 8, "llama3-8b", 8192, 128, 1, 1, 1, 1, 14079),
    _megatron("Megatron-Bridge 25.09 Llama 3 70B, 64 H100 fp8", BRIDGE, 64, "llama3-70b", 8192, 128, 4, 8, 1, 5, 1619),
    _megatron("Megatron-Bridge 25.09 Llama 3.1 405B, 1024 H100 fp8", BRIDGE, 1024, "llama3-70b", 8192, 512, 8, 8, 2, 8,
              302, extra=_405B),
)


@dataclass
class Compared:
    row: Published
    plan: Plan
    predicted: float | None  # tokens/s per device

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.row.tokens


def predict(row: Published) -> Compared:
    p = plan(row.config(), row.hardware, row.devices, row.domain, recompute=REMAT[row.remat], checked=False)
    step = p.predict()
    return Compared(row, p, None if step is None else p.tokens / step / p.devices)


def compare(rows: tuple[Published, ...] = PUBLISHED) -> list[Compared]:
    return [predict(r) for r in rows]


def fit(rows: tuple[Published, ...] = PUBLISHED, rounds: int = 4) -> dict[str, float]:
    """The factors again from the rows that set them: each fitted row's factor solved (bisection
    in log space) so that its prediction equals its published figure, the others held, a few
    rounds in turn (they touch one another little). Hardware factors are ``tpu-v5p`` (its bf16
    efficiency), ``hopper bf16`` / ``hopper fp8`` (the H100's and H200's), link factors by kind."""
    factors: dict[str, list[Published]] = {}
    for r in rows:
        if r.fitted:
            factors.setdefault(r.fitted, []).append(r)
    out: dict[str, float] = {}
    saved = dict(HARDWARE), dict(LINK_EFFICIENCY)
    try:
        _fit_rounds(factors, out, rounds)
    finally:  # the tables as they were: fitting reports, the tables are edited by hand
        HARDWARE.update(saved[0])
        LINK_EFFICIENCY.update(saved[1])
    return out


def _fit_rounds(factors: dict[str, list[Published]], out: dict[str, float], rounds: int) -> None:
    for _ in range(rounds):
        for name, fitted in factors.items():
            lo, hi = math.log(0.05), math.log(1.0)
            for _ in range(30):
                mid = (lo + hi) / 2
                with _factor(name, math.exp(mid)):
                    got = [predict(r).predicted for r in fitted]
                # more efficiency, more tokens/s: move toward the published figures (their geometric mean)
                low = all(g is not None for g in got) and sum(math.log(g / r.tokens) for g, r in zip(got, fitted)) < 0
                lo, hi = (mid, hi) if low else (lo, mid)
            out[name] = round(math.exp((lo + hi) / 2), 3)
            _set(name, out[name])


class _factor:
    """A factor set for the duration of a ``with`` (fitting), restored after."""

    def __init__(self, name: str, value: float):
        self.name, self.value = name, value

    def __enter__(self):
        self.saved = _get(self.name)
        _set(self.name, self.value)

    def __exit__(self, *exc):
        _set(self.name, self.saved)


def _hardware_of(name: str) -> tuple[list[str], str]:
    if name.startswith("hopper"):
        return ["h100", "dgx-h100", "h200"], name.split()[1]  # SXM Hoppers: one chip, its nodes
    return [h for h in HARDWARE if h.startswith(name)], "bf16"  # tpu-v5e: and the 8-chip serving host


def _get(name: str):
    if name in LINK_EFFICIENCY:
        return LINK_EFFICIENCY[name]
    names, fmt = _hardware_of(name)
    return HARDWARE[names[0]].achieved(fmt)


def _set(name: str, value) -> None:
    if name in LINK_EFFICIENCY:
        LINK_EFFICIENCY[name] = value
        return
    names, fmt = _hardware_of(name)
    for n in names:
        HARDWARE[n] = replace(HARDWARE[n], **{"efficiency" if fmt == "bf16" else "fp8_efficiency": value})


def to_json(c: Compared) -> dict:
    r = c.row
    return {"name": r.name, "source": r.source, "hardware": r.hardware, "devices": r.devices,
            "settings": list(r.settings), "remat": r.remat, "published_tokens_per_second": r.tokens,
            "derived": r.derived or None, "published_mfu": r.mfu, "predicted_tokens_per_second": c.predicted,
            "ratio": c.ratio, "fitted": r.fitted or None}


def render(compared: list[Compared]):
    from rich.table import Table

    table = Table(title="published pretraining results against hypertron plan's prediction (tokens/s per device)",
                  title_justify="left", show_edge=False)
    for col in ("run", "devices", "published", "predicted", "predicted / published", "fitted"):
        table.add_column(col, justify="left" if col in ("run", "fitted") else "right")
    for c in compared:
        table.add_row(c.row.name, str(c.row.devices), f"{c.row.tokens:,.1f}",
                      "-" if c.predicted is None else f"{c.predicted:,.1f}",
                      "-" if c.ratio is None else f"{c.ratio:.2f}", c.row.fitted or "")
    return table
