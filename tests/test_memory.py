"""The memory model against the trainer's real arrays, and the hardware table.

Bytes per device of parameters, gradients and optimiser state come from the declarations and
the rules alone; here they are compared with the shards ``make_trainer`` actually allocates on
8 CPU devices, for several meshes and models.
"""

from __future__ import annotations

import dataclasses

import math

import jax
import numpy as np
import pytest

from hypertron.config import load_config
from hypertron import hardware
from hypertron.models import memory
from hypertron.models.flops import device_peak_flops
from hypertron.parallel.mesh import make_mesh
from hypertron.train.step import make_trainer

SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.mlp_dim=128", "model.vocab_size=512",
         "train.global_batch=8", "train.seq_len=16", "data.source=synthetic"]


def _shard_bytes(tree) -> int:
    """Bytes of the first device's shards of every array in ``tree``."""
    first = jax.devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        shard = next(s for s in x.addressable_shards if s.device == first)
        total += math.prod(shard.data.shape) * x.dtype.itemsize
    return total


@pytest.mark.parametrize("model,mesh", [
    ("tiny", ["mesh.data=8", "mesh.fsdp=1"]),
    ("tiny", []),                                            # fsdp 8
    ("tiny", ["mesh.fsdp=4", "mesh.tensor=2"]),
    ("tiny", ["mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2"]),  # embed over fsdp x context
    ("tiny", ["mesh.stage=2", "mesh.fsdp=4"]),  # the stacked layers over stage
    ("tiny-moe", ["mesh.expert=4", "mesh.fsdp=2"]),
    ("tiny-moe", ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "model.quantization=fp8"]),
])
def test_state_bytes_per_device_are_exact(model, mesh):
    cfg = load_config(None, [f"model={model}", *SMALL, *mesh])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    state = trainer.init(jax.random.key(0))
    want = memory.state_bytes(cfg, dict(trainer.mesh.shape))
    assert want.params == _shard_bytes(state["params"])
    assert want.optimizer == _shard_bytes(state["opt_state"])
    assert want.fp8_histories == (_shard_bytes(state["quant"]) if "quant" in state else 0)
    # The gradients the step computes carry the parameters' shardings.
    grads = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), out_shardings=trainer.state_shardings["params"])(
        state["params"])
    assert want.grads == _shard_bytes(grads)
    # Sharding really splits: fsdp 8 holds an eighth of what data 8 (replicated) holds, give or take
    # the tensors too small to split.
    if model == "tiny" and not mesh:
        replicated = memory.state_bytes(cfg, {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}).params
        assert replicated / 8 <= want.params < replicated / 4


def test_kv_cache_bytes_follow_the_page_layout():
    from hypertron.models.kv_pages import init_pages

    model = load_config(None, ["model=tiny-llama3"]).model
    for dtype in ("bfloat16", "int8", "float32"):
        cache = jax.eval_shape(lambda: init_pages(model, num_pages=6, page_size=4, dtype=dtype))
        real = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
        assert memory.kv_cache_bytes(model, 6 * 4, dtype) == real, dtype
    # Split over tensor by KV head, when it divides them.
    assert memory.kv_cache_bytes(model, 100, "bfloat16", tensor=2) * 2 == memory.kv_cache_bytes(model, 100)


def test_the_hardware_table_names_each_device_and_feeds_mfu():
    assert hardware.match("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware.match("NVIDIA H100 PCIe").name == "h100-pcie"
    assert hardware.match("NVIDIA H200").name == "h200"
    assert hardware.match("TPU v5 lite").name == "tpu-v5e"  # not the 8-chip serving host's entry
    assert hardware.lookup("tpu-v5e-8").per_node == 8 and hardware.lookup("tpu-v5e-8").memory == 16 * hardware.GB
    assert hardware.match("TPU v5p").name == "tpu-v5p"
    assert hardware.match("cpu").bf16 is None and hardware.match("something new") is None
    h100 = hardware.HARDWARE["h100"]
    assert (h100.bf16, h100.fp8, h100.memory, h100.per_node) == (989e12, 1979e12, 80e9, 8)

    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

    assert device_peak_flops(device=Device()) == 989e12
    assert device_peak_flops(device=Device(), fmt="fp8") == 1979e12
    assert device_peak_flops(device=jax.devices()[0]) is None  # CPU: no MFU
    assert np.isclose(device_peak_flops(123.0), 123.0)


# Held out of the fit in hypertron.models.memory: other widths, head counts, GQA groups, a
# tensor-parallel mesh and a larger vocabulary; seq 2048, width >= 512, two layers (four in the
# circular pipeline), where activations dominate. XLA's temporaries hold the activations and the
# gradients.
HELD_OUT = [
    ("none", ["model.embed_dim=640", "model.num_heads=10", "model.num_kv_heads=2", "model.mlp_dim=1792"], []),
    ("dots", ["model.embed_dim=640", "model.num_heads=10", "model.num_kv_heads=2", "model.mlp_dim=1792"], []),
    ("full", ["model.embed_dim=640", "model.num_heads=10", "model.num_kv_heads=2", "model.mlp_dim=1792",
              "model.vocab_size=16000"], []),
    ("none", ["model.embed_dim=512", "model.num_heads=8", "model.num_kv_heads=4", "model.mlp_dim=1536"],
     ["mesh.data=4", "mesh.tensor=2"]),
    ("dots", ["model.embed_dim=512", "model.num_heads=8", "model.num_kv_heads=4", "model.mlp_dim=1536"],
     ["mesh.data=2", "mesh.context=4"]),  # each device a quarter of every row, the keys gathered
    ("none", ["model.embed_dim=512", "model.num_heads=8", "model.num_kv_heads=2", "model.mlp_dim=1536"],
     ["mesh.context=8"]),
    # pipelines (memory.STAGED): GPipe's schedule, and the circular one, 2 blocks a stage
    ("dots", ["model.embed_dim=640", "model.num_heads=10", "model.num_kv_heads=2", "model.mlp_dim=1792",
              "train.pipeline_microbatches=2"], ["mesh.stage=2", "mesh.data=4"]),
    ("none", ["model.embed_dim=640", "model.num_heads=10", "model.num_kv_heads=2", "model.mlp_dim=1792",
              "model.num_layers=4", "train.pipeline_repeats=2", "train.pipeline_microbatches=2"],
     ["mesh.stage=2", "mesh.fsdp=4"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("remat,model,mesh", HELD_OUT)
def test_activation_estimate_is_within_15_percent_of_xla(remat, model, mesh):
    import jax.numpy as jnp

    from hypertron.train.step import BATCH_KEYS

    cfg = load_config(None, ["model=tiny", "data.source=synthetic", "train.global_batch=8", "train.seq_len=2048",
                             "model.num_layers=2", "model.head_dim=64", f"model.remat={remat}", "mesh.fsdp=1",
                             *(mesh or ["mesh.data=8"]), *model])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    state = jax.eval_shape(trainer.init, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((8, 2048), jnp.float32 if k == "loss_weights" else jnp.int32)
             for k in BATCH_KEYS}
    xla = trainer.step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    est = memory.step_bytes(cfg, dict(trainer.mesh.shape))
    assert not est.flash
    assert abs(est.activations + est.state.grads - xla) <= 0.15 * xla, (est.activations + est.state.grads, xla)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_the_memory_model_plans_flash_attention_exactly_where_cudnn_takes_the_shape(dtype):
    """One rule (``attention.cudnn_supported``) for the memory model and the attention it plans
    for: it once counted flash attention for ``llama-1b`` at an odd length (2047), where the run
    gets XLA's and its t x t scores (26 against 224 GiB of activations by its own coefficients).
    On a GPU, ``auto`` is bfloat16."""
    from hypertron.models.attention import cudnn_supported

    seen = set()
    for head_dim in (64, 72, 100, 128, 160, 256):
        for seq_len in (2047, 2048):
            cfg = load_config(None, ["model=llama-1b", f"model.dtype={dtype}", f"model.head_dim={head_dim}",
                                     f"train.seq_len={seq_len}", "train.global_batch=8"])
            est = memory.step_bytes(cfg, {"data": 1}, accelerator=True, gpu=True)
            compute = "bfloat16" if dtype == "auto" else dtype
            assert est.flash == cudnn_supported(cfg.model, compute, seq_len), (head_dim, seq_len)
            seen.add(est.flash)
    assert seen == ({True, False} if dtype != "float32" else {False})


def test_the_cudnn_rule_is_what_cudnn_took_on_an_h200():
    """docs/benchmarks.md t2.cudnn_grid (H200, 2026-11-26): head dims that are multiples of 8 up to
    256 in bf16 and fp16 at an even length; 100, length 2047 and float32 refused. Before Hopper
    the rule stays at 128 (cuDNN's backward there)."""
    from hypertron.models.attention import cudnn_supported

    model = load_config(None, ["model=llama-1b"]).model
    taken = {(dt, hd, n) for dt in ("bfloat16", "float16", "float32") for hd in (64, 100, 128, 160, 192, 256, 264)
             for n in (2047, 2048) if cudnn_supported(dataclasses.replace(model, head_dim=hd), dt, n)}
    assert taken == {(dt, hd, 2048) for dt in ("bfloat16", "float16") for hd in (64, 128, 160, 192, 256)}
    assert not cudnn_supported(dataclasses.replace(model, head_dim=256), "bfloat16", 2048, hopper=False)
    assert cudnn_supported(dataclasses.replace(model, head_dim=128), "bfloat16", 2048, hopper=False)
    # plan passes the hardware's generation on: an A100 plans head dim 256 without flash attention.
    cfg = load_config(None, ["model=llama-1b", "model.head_dim=256", "train.global_batch=8"])
    assert memory.step_bytes(cfg, {"data": 1}, accelerator=True, gpu=True).flash
    assert not memory.step_bytes(cfg, {"data": 1}, accelerator=True, gpu=True, hopper=False).flash


def test_a_run_that_cannot_fit_is_refused_in_one_line_and_the_override_lets_it_through(tmp_path, capsys,
                                                                                        monkeypatch):
    from hypertron import cli
    from hypertron.train import checks

    args = ["train", "model=tiny", *SMALL, "train.steps=1", "checkpoint.enabled=false", "monitor.collect=false"]
    monkeypatch.setattr(checks, "device_memory", lambda device: 2**16)  # a 64 KiB device
    assert cli.main([*args, f"run_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "per device" in err and "more than the 64 KiB a device has" in err
    assert "train.memory_check=false" in err and not (tmp_path / "a" / "events.jsonl").exists()  # nothing started
    assert cli.main([*args, f"run_dir={tmp_path / 'b'}", "train.memory_check=false"]) == 0


def test_plan_prints_the_breakdown_and_a_predicted_step(capsys):
    import json

    from hypertron import cli

    assert cli.main(["plan", "--hardware", "h100", "--devices", "16", "--json", "model=llama3-8b",
                     "train.global_batch=32", "train.seq_len=8192", "mesh.dcn.data=-1"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["nodes"] == 2 and p["mesh"] == {"data": 2, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1, "stage": 1}
    mem = p["memory"]
    # llama3-8b's 8.03B float32 parameters over fsdp 8; AdamW's two moments.
    assert mem["params"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01) and mem["optimizer"] == 2 * mem["params"] + 8
    assert mem["fits"] and mem["total"] < 80e9
    axes = {a["name"]: a for a in p["axes"]}
    assert axes["fsdp"]["across"] is False and axes["data"]["across"] is True
    # Compute at the bf16 peak: 6 x params x tokens, plus attention, over 16 devices.
    assert p["compute_seconds"] == pytest.approx(6 * 8.03e9 * 32 * 8192 / 16 / 989e12, rel=0.25)
    lo, hi = p["step_seconds"]
    assert p["compute_seconds"] <= lo <= hi and 0 < p["mfu"][0] <= p["mfu"][1] <= 1
    # Too big for one device: exit 1, and it says so.
    assert cli.main(["plan", "--hardware", "h100", "--devices", "1", "model=llama3-8b"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert cli.main(["plan", "--hardware", "b300"]) == 2
    assert "--hardware='b300': not one of h100" in capsys.readouterr().err


def test_rows_fewer_than_the_devices_are_refused_naming_the_context_split_that_runs(capsys):
    """128k-token rows, 8 of them, on 16 H100s: no data split gives each device a row, so the
    refusal names the smallest mesh.context that does (each row over 2 devices), and the same
    command with it plans a run that fits. At a fixed batch, context parallelism moves a device's
    tokens from more rows to parts of fewer: it never names one where the batch splits."""
    from hypertron import cli

    args = ["plan", "--hardware", "h100", "--devices", "16", "model=llama3.1-8b", "train.seq_len=131072"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not divisible by the 16 data shards" in err
    assert "mesh.context=2 splits each row over 2 devices" in err
    assert cli.main([*args, "mesh.context=2"]) == 0
    assert "fits" in capsys.readouterr().out
    assert cli.main([*args[:-1], "train.seq_len=4096", "train.global_batch=12"]) == 2  # 12 rows: 4 shards would
    assert "mesh.context=4 splits" in capsys.readouterr().err


def test_plan_counts_the_pipeline_bubble_and_the_stages_hand_offs(capsys):
    """stage 2 x fsdp 4 with 4 pieces: a fifth of each step idle ((2 - 1) / (4 + 2 - 1)), the step
    predicted that much longer than without it, the stage axis sending each piece's activations
    on and back, and the layers' state over the stages; with 2 repeats, a ninth."""
    import json

    from hypertron import cli

    args = ["plan", "--hardware", "h100", "--devices", "8", "--json", "model=llama-1b", "train.global_batch=16",
            "train.seq_len=2048"]
    assert cli.main([*args, "mesh.stage=2", "mesh.fsdp=4", "train.pipeline_microbatches=4"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert cli.main([*args, "mesh.fsdp=8"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert staged["bubble"] == pytest.approx(0.2) and flat["bubble"] == 0
    assert staged["step_seconds"][0] >= staged["compute_seconds"] / 0.8
    stage = next(a for a in staged["axes"] if a["name"] == "stage")
    # 2 x (4 + 2 - 1) hand-offs of a piece: (16 rows / 4 data shards / 4 pieces) x 2048 x 2048 x bf16
    assert stage["bytes"] == pytest.approx(2 * 5 * 1 * 2048 * 2048 * 2)
    assert staged["memory"]["params"] == pytest.approx(flat["memory"]["params"], rel=0.2)  # 8 shards either way
    # The circular schedule, 2 repeats (of 24 layers: llama-1b's 22 do not split in 4 blocks):
    # 1 / (4 x 2 + 2 - 1) idle, 2 x 9 hand-offs.
    assert cli.main([*args, "mesh.stage=2", "mesh.fsdp=4", "train.pipeline_microbatches=4",
                     "train.pipeline_repeats=2", "model.num_layers=24"]) == 0
    circular = json.loads(capsys.readouterr().out)
    assert circular["bubble"] == pytest.approx(1 / 9)
    assert next(a for a in circular["axes"] if a["name"] == "stage")["bytes"] == pytest.approx(2 * 9 * 2048 * 2048 * 2)


def test_a_hardware_name_is_looked_up_in_the_table_and_an_unknown_one_lists_its_names():
    from hypertron.config import ConfigError

    assert hardware.lookup("h100") is hardware.HARDWARE["h100"]
    with pytest.raises(ConfigError) as e:
        hardware.lookup("b300")
    assert str(e.value) == "--hardware='b300': not one of " + ", ".join(hardware.HARDWARE)


def test_plan_serve_fits_llama_70b_int8_on_eight_chips_and_says_what_fits_when_bf16_does_not(capsys):
    """``plan --serve``: the KV tokens are the most whose :func:`kv_cache_bytes` fit the room the
    weights and workspace leave of 90 % of the device; a plan that does not fit exits 1 naming int8
    and the wider split that would; an MoE split over its experts fits where it should."""
    import json

    from hypertron import cli
    from hypertron.config import PRESETS

    model = PRESETS["llama3.1-70b"]
    for hw in ("tpu-v5e-8", "h100"):  # one 8-chip v5e serving host (JetStream's), 8 H100s
        assert cli.main(["plan", "--serve", "--json", "--hardware", hw, "--quantize", "int8", "--tensor", "8",
                         "model=llama3.1-70b"]) == 0
        p = json.loads(capsys.readouterr().out)
        mem, tokens = p["memory"], p["kv_tokens"]
        assert memory.kv_cache_bytes(model, tokens, "bfloat16", 8) <= mem["kv_cache"] \
            < memory.kv_cache_bytes(model, tokens + 1, "bfloat16", 8)
        assert mem["weights"] + mem["workspace"] + mem["kv_cache"] == int(0.9 * hardware.lookup(hw).memory)
        # 70.6B weights, int8 values (a byte each) and float32 scales per output channel, over 8
        assert mem["weights"] == pytest.approx(70.6e9 / 8, rel=0.01) and p["fits"] and p["num_pages"] > tokens // 16
    assert cli.main(["plan", "--serve", "--hardware", "tpu-v5e-8", "--tensor", "8", "model=llama3.1-70b"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "--quantize int8 on 8 devices" in out and "--tensor 16: 16 devices" in out
    assert cli.main(["plan", "--serve", "--hardware", "h100", "--expert", "8", "model=mixtral-8x7b", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)  # 46.7B bf16 parameters, the experts' 45.1B split 8 ways
    assert p["memory"]["weights"] == pytest.approx(2 * (46.7e9 - 45.1e9 + 45.1e9 / 8), rel=0.02)


@pytest.mark.parametrize("args, message", [
    (["--serve", "--tensor", "3", "model=llama3.1-70b"], "--tensor=3 does not divide the model's 64 attention heads"),
    (["--serve", "--expert", "2", "model=llama3-8b"], "--expert=2: llama3-8b has no experts"),
    (["--serve", "--expert", "3", "model=mixtral-8x7b"], "--expert=3 does not divide the model's 8 experts"),
    (["--serve", "--tensor", "4", "model=tiny", "model.num_heads=12", "model.num_kv_heads=3"],
     "--tensor=4: a rank's 3 query heads would straddle the model's groups of 4 per KV head"),
    (["--serve", "--tensor", "8", "--devices", "4", "model=llama3-8b"], "--devices=4: --serve plans one engine over"),
    (["--tensor", "2", "model=llama3-8b"], "--tensor: only with --serve"),
])
def test_a_serving_split_the_model_cannot_take_is_one_line(capsys, args, message):
    from hypertron import cli

    assert cli.main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
