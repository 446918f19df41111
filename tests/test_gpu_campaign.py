"""The GPU campaign's smoke mode: every row of every tier, at tiny sizes on CPU.

What the device runs is ``bench/gpu_campaign.py TIER``; here each tier runs with ``--smoke`` and
must produce every planned row, each ``ok``, each field filled (except those only a known
accelerator fills), so that the one call a GPU session gets does not fail on something a CPU
could have caught.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import gpu_campaign  # noqa: E402  (bench/gpu_campaign.py)
from support import processes  # tests/support

pytestmark = pytest.mark.slow


def _campaign(*args, timeout=600):
    # One CPU device, as on a GPU host; compiled fast: the smoke checks the machinery, not the numbers.
    env = processes.fast_compile({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    return processes.run([sys.executable, str(REPO / "bench" / "gpu_campaign.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# In make test, T2 and T3 run one row of each code path (their other rows are the same
# measurements at other sizes or settings: t2.train.none is t2.train.dots with another remat
# policy, t2.quant.int8 is t2.quant.fp8 in another format (t2.lora.fp8 t2.lora.int8's), the dense and ragged_dot gmm rows and
# the reference ragged row are the pallas rows' function on another backend, the bf16 paged rows
# the int8 ones' with other pages, t3.moe.e16 is
# t3.moe.e8 with more experts); HYPERTRON_SMOKE_ALL=1 runs every row, as the campaign does.
SMOKE_ROWS = {
    "T2": ["t2.device", "t2.train.dots", "t2.monitor", "t2.train.packed", "t2.profile", "t2.quant.fp8", "t2.lora.int8",
           "t2.gmm.pallas", "t2.ragged.pallas", "t2.paged.int8", "t2.cudnn_grid", "t2.decode.b64.int8.ctx8192",
           "t2.loop"],
    "T3": ["t3.device", "t3.train.batch4", "t3.moe.e8", "t3.decode.b8", "t3.serve.layers", "t3.gmm.pallas.64x64x64"],
}


@pytest.mark.parametrize("tier", gpu_campaign.TIERS)
def test_smoke_mode_fills_every_row_of_the_tier(tier, tmp_path):
    out = tmp_path / "out"
    only = [] if os.environ.get("HYPERTRON_SMOKE_ALL") else SMOKE_ROWS.get(tier, [])
    proc = _campaign(tier, "--smoke", "--out", str(out), *(["--only", *only] if only else []))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / f"{tier}.json").read_text())
    assert report["mode"] == "smoke"
    planned = [r for r in gpu_campaign.plan(tier) if not only or any(r.id.startswith(p) for p in only)]
    assert [r["id"] for r in report["rows"]] == [r.id for r in planned]
    for row, want in zip(report["rows"], planned):
        assert row["status"] == "ok", (row["id"], row["error"])
        assert list(row["fields"]) == list(want.fields), row["id"]
        empty = [k for k, v in row["fields"].items() if v is None and k not in gpu_campaign.HARDWARE_FIELDS]
        assert not empty, (row["id"], empty)
    # The table is printed last, one line per row.
    assert all(r.id in proc.stdout for r in planned)
    # What comes back from the device: at most 8 files, none deeper than 2 folders, each under 16 MiB.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files)
    assert all(p.stat().st_size < 16 * 2**20 for p in files)
    fields = {r["id"]: r["fields"] for r in report["rows"]}
    if tier == "T0":
        assert fields["t0.imports"]["missing"] == [] and fields["t0.imports"]["broken"] == []
        assert fields["t0.imports"]["imported"] == fields["t0.imports"]["modules"] > 40
        assert fields["t0.train_step"]["dtype"] == "bfloat16"
    if tier == "T1":
        for group in {g for g, _, _ in gpu_campaign.T1_GROUPS}:
            f = fields[f"t1.pytest.{group}"]
            assert f["selected"] >= 1 and f["failed"] == 0, (group, f)
        # On CPU the GPU-only tests skip and say so; the others pass, interpreted.
        assert fields["t1.pytest.cudnn_attention"]["skipped"] == fields["t1.pytest.cudnn_attention"]["selected"]
        assert fields["t1.pytest.gmm"]["passed"] >= 1
        xla = fields["t1.xla_flags"]
        assert xla["tested"] == len(xla["accepted"]) + len(xla["rejected"]) == len(gpu_campaign.recipe_xla_flags())
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in xla["accepted"]
    if tier == "T2":
        assert (out / fields["t2.profile"]["hlo_file"]).stat().st_size == fields["t2.profile"]["hlo_bytes"] > 0
        assert (out / fields["t2.profile"]["trace_file"]).is_file()
        assert fields["t2.train.packed"]["packed"] and fields["t2.quant.fp8"]["quantization"] == "fp8"
        assert all(fields[f"t2.decode.b64.{kv}.ctx8192"]["kv"] == kv for kv in ("bfloat16", "int8")
                   if f"t2.decode.b64.{kv}.ctx8192" in fields)
        assert "t2.decode.b64.int8.ctx8192" in fields
        # The collector sampled while the kept step trained, and timed a host-to-device copy.
        assert fields["t2.monitor"]["samples"] >= 1 and fields["t2.monitor"]["h2d_gbs"] > 0
    if tier == "T3":
        # Each engine compiled its own steps (nothing shared from the decode rows), layers as named.
        layers = [fields[f"t3.serve.layers.{n}"] for n in ("unrolled", "scanned")]
        assert [f["scan_layers"] for f in layers] == [False, True]
        assert all(f["compiles"] >= 1 and f["compile_s"] > 0 for f in layers)


def test_a_spent_budget_skips_rows_and_says_how_to_rerun_them(tmp_path):
    proc = _campaign("T0", "--smoke", "--out", str(tmp_path), "--budget", "0", timeout=120)
    assert proc.returncode == 1
    rows = json.loads((tmp_path / "T0.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["skipped"] * 3
    assert "--only t0.install" in rows[0]["error"]


def test_only_that_selects_nothing_is_one_line_and_exit_2(tmp_path):
    proc = _campaign("T2", "--smoke", "--only", "t9.nothing", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --only t9.nothing selects no row of T2 (see --plan)"]


def test_the_script_starts_where_hypertron_is_not_installed_yet():
    """On the GPU machine hypertron is importable only after ``--wheels`` installed it, so the
    script must get that far without it (2026-11-25: a module-level import stopped the first call).
    ``-S``: no site-packages, so neither hypertron nor JAX."""
    proc = processes.run([sys.executable, "-S", str(REPO / "bench" / "gpu_campaign.py"), "T1", "--plan"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split()[0] == "t1.xla_flags"


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    import zipfile

    dist = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}/METADATA", meta)
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def test_the_wheel_check_names_what_neither_the_wheels_nor_the_image_have(tmp_path):
    import gpu_wheels  # bench/gpu_wheels.py

    image = gpu_wheels.image_packages()
    assert image["jax"] == "0.11.2" and "grain" not in image
    # hypertron's own needs are part of the check: without grain & co., they are named.
    problems = gpu_wheels.check(tmp_path, image)
    assert problems and "no wheels" in problems[0]
    _wheel(tmp_path, "lonely", "1.0", ["nowhere-to-be-found>=1", "numpy>=99", "skipped-on-windows; sys_platform == 'win32'",
                                       "only-an-extra; extra == 'docs'"])
    problems = gpu_wheels.check(tmp_path, image)
    assert any("needs nowhere-to-be-found>=1: neither in the wheels nor in the image" in p for p in problems)
    assert any("needs numpy>=99: the image has 2.5.2" in p for p in problems)
    assert not any("skipped-on-windows" in p or "only-an-extra" in p for p in problems)
    assert any("hypertron needs grain" in p for p in problems)
