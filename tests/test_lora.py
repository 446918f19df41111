"""LoRA adapters from the declarations, in the einsum hook, in PEFT's files both ways: a PEFT adapter on a
converted tiny transformers Llama gives PeftModel's logits, unmerged and merged, and ours read back by
PeftModel gives ours."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from support.tiny import tiny_hf_llama  # noqa: E402  (tests/support)

from hypertron.config import ConfigError, load_config  # noqa: E402
from hypertron.models import forward, init_params  # noqa: E402
from hypertron.models.hf import load_hf  # noqa: E402
from hypertron.models.lora import ALL_LINEAR, LoraSettings, attach, init_adapters, load_peft, merge, save_peft, \
    targets, unmerge  # noqa: E402

torch.set_num_threads(1)
TOKENS = np.array([[5, 17, 33, 101, 7, 250, 3, 99, 42, 8]], np.int64)
_forward = jax.jit(forward, static_argnames="cfg")


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama3", "tiny-gemma"])
def test_adapters_cover_exactly_the_targets_in_the_weights_letters(preset):
    cfg = load_config(None, [f"model={preset}"]).model
    settings = LoraSettings(rank=4, alpha=8, targets=("q_proj", "down_proj"))
    adapters = init_adapters(cfg, settings, jax.random.key(0))
    assert set(adapters["layers"]) == {"wq", "w_down"}
    L, d, n, h, f = cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    assert adapters["layers"]["wq"]["a"].shape == (L, d, 4) and adapters["layers"]["wq"]["b"].shape == (L, 4, n, h)
    assert adapters["layers"]["w_down"]["a"].shape == (L, f, 4) and adapters["layers"]["w_down"]["b"].shape == (L, 4, d)
    assert not np.any(np.asarray(adapters["layers"]["wq"]["b"]))  # B starts at zero: no change
    assert {t.module for t in targets(cfg, "all-linear")} == set(ALL_LINEAR)
    with pytest.raises(ConfigError, match="has no fc1 to adapt"):
        targets(cfg, ("q_proj", "fc1"))


def _saved_bytes(capsys, fn, arg) -> int:
    """Bytes of what the backward pass of ``fn`` keeps from its forward, but for ``arg`` and the
    constants it closes over (JAX's ``print_saved_residuals``, one ``f32[4,64] source`` a line)."""
    import re

    from jax.ad_checkpoint import print_saved_residuals

    capsys.readouterr()
    print_saved_residuals(fn, arg)
    total = 0
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
        if m and not m[3].startswith(("from the argument", "from a constant", "from a literal")):
            size = {"bool": 1}.get(m[1]) or int(m[1].lstrip("bfiu")) // 8  # f32, bf16, i32, s8, u8, bool
            total += size * int(np.prod([int(d) for d in m[2].split(",") if d]))
    return total


@pytest.mark.parametrize("base_dtype", ["auto", "int8"])
def test_under_dots_remat_adapters_keep_one_activation_a_projection_as_full_training_does(capsys, base_dtype):
    """With ``model.remat=dots`` the backward pass of an adapted model keeps what full training's
    keeps: each projection's output once. The hook's own products (the base's, which an int8 base
    makes in float32, then ``x A`` and ``(x A) B``) are recomputed, not saved: saved, they made a
    QLoRA step on an H200 (llama-1b, batch 8 x 2,048) hold 39.6 GiB where full training held 31.9."""
    from hypertron.train.lora import hold_base
    from hypertron.train.step import loss_terms

    cfg = load_config(None, ["model=tiny", "model.remat=dots", "model.dtype=bfloat16", "model.vocab_size=256",
                             "lora.rank=4", "lora.alpha=8", f"lora.base_dtype={base_dtype}", "train.init_from=random"])
    params = init_params(cfg.model, jax.random.key(0))
    batch = {k: jnp.ones((4, 64), jnp.int32) for k in ("inputs", "targets", "segment_ids")}
    batch |= {"positions": jnp.broadcast_to(jnp.arange(64), (4, 64)), "loss_weights": jnp.ones((4, 64))}
    settings = LoraSettings.of(cfg.lora)
    base = hold_base(cfg, params)
    full = _saved_bytes(capsys, lambda p: loss_terms(p, batch, cfg)[0], params)
    adapted = _saved_bytes(capsys, lambda a: loss_terms(attach(base, a, settings), batch, cfg)[0],
                           init_adapters(cfg.model, settings, jax.random.key(1)))
    assert full > 0 and adapted <= 1.05 * full, (adapted, full)


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """A tiny Llama, PEFT's adapter on it (r=4, alpha 8, all seven projections, A and B random),
    both saved, and PeftModel's logits."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_hf_llama(seed=0, scaled_init=True, num_hidden_layers=2)
    base.save_pretrained(root / "base", safe_serialization=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(ALL_LINEAR), init_lora_weights=False,
                             lora_dropout=0.0)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(root / "adapter")
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits.numpy()
        plain = model.get_base_model()
        with model.disable_adapter():
            base_logits = plain(torch.tensor(TOKENS)).logits.numpy()
    return root, logits, base_logits


def test_a_peft_adapter_gives_peftmodels_logits_unmerged_and_merged(peft_adapter):
    root, theirs, base_logits = peft_adapter
    cfg, params = load_hf(root / "base")
    adapters, settings = load_peft(root / "adapter", cfg)
    assert (settings.rank, settings.scale) == (4, 2.0)
    tokens = jnp.asarray(TOKENS, jnp.int32)
    ours = np.asarray(_forward(attach(params, adapters, settings), tokens, cfg).logits)
    assert np.max(np.abs(theirs - base_logits)) > 0.1  # the adapter moves the logits
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    merged = merge(params, adapters, settings)
    np.testing.assert_allclose(np.asarray(_forward(merged, tokens, cfg).logits), theirs, atol=1e-5, rtol=0)
    back = unmerge(merged, adapters, settings)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), back, params)
    np.testing.assert_allclose(np.asarray(_forward(params, tokens, cfg).logits), base_logits, atol=1e-5, rtol=0)


def test_our_saved_adapter_is_read_by_peftmodel(peft_adapter, tmp_path):
    root, _, _ = peft_adapter
    cfg, params = load_hf(root / "base")
    settings = LoraSettings(rank=2, alpha=4, targets=("q_proj", "v_proj", "down_proj"))
    adapters = init_adapters(cfg, settings, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), adapters)  # B != 0
    save_peft(tmp_path, adapters, settings, cfg, base=str(root / "base"))
    model = peft.PeftModel.from_pretrained(tiny_hf_llama(seed=0, scaled_init=True, num_hidden_layers=2), tmp_path)
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(TOKENS)).logits.numpy()
    ours = np.asarray(_forward(attach(params, adapters, settings), jnp.asarray(TOKENS, jnp.int32), cfg).logits)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    again, same = load_peft(tmp_path, cfg)
    assert same == settings
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), again, adapters)


def test_a_peft_feature_we_lack_is_refused_naming_its_key(peft_adapter, tmp_path):
    import json
    import shutil

    root, _, _ = peft_adapter
    cfg, _ = load_hf(root / "base")
    for key, value, message in (("use_dora", True, "use_dora=True is not supported"),
                                ("bias", "all", "bias='all' is not supported"),
                                ("peft_type", "IA3", "peft_type 'IA3' is not LORA"),
                                ("r", "four", "r and lora_alpha must be numbers"),
                                ("target_modules", ".*proj", "target_modules='.*proj' is a pattern")):
        shutil.copytree(root / "adapter", tmp_path / key)
        config = json.loads((tmp_path / key / "adapter_config.json").read_text())
        (tmp_path / key / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ConfigError, match=message):
            load_peft(tmp_path / key, cfg)


@pytest.fixture(scope="module")
def base_bundle(tmp_path_factory):
    """A tiny base model bundle (random weights) that adapters train on."""
    from hypertron.models.bundle import save_model
    from support.tiny import TWO_LAYERS

    path = tmp_path_factory.mktemp("lora_base") / "model"
    cfg = load_config(None, TWO_LAYERS).model
    save_model(path, cfg, init_params(cfg, jax.random.key(3)))
    return path


def _lora_overrides(bundle, run, *more):
    from support.tiny import TWO_LAYERS

    return [*TWO_LAYERS, f"train.init_from={bundle}", f"run_dir={run}", "lora.rank=4", "lora.alpha=8",
            "train.lr=1e-2", "train.warmup_steps=2", "train.log_every=1", *more]


@pytest.mark.slow
def test_adapters_alone_train_over_a_frozen_base_and_leave_a_peft_adapter(base_bundle, tmp_path):
    from hypertron.models.bundle import read_bundle
    from hypertron.train.loop import train

    cfg = load_config(None, _lora_overrides(base_bundle, tmp_path / "run", "train.steps=20", "checkpoint.every=20"))
    result = train(cfg)
    assert np.mean(result.losses[-3:]) < np.mean(result.losses[:3]) - 0.3, result.losses
    adapters, settings = load_peft(tmp_path / "run" / "adapter", cfg.model)
    assert settings.targets == ALL_LINEAR and settings.rank == 4
    _, base, _ = read_bundle(base_bundle)
    _, merged, _ = read_bundle(tmp_path / "run" / "model")
    tokens = jnp.asarray(TOKENS % cfg.model.vocab_size, jnp.int32)
    np.testing.assert_allclose(np.asarray(_forward(merged, tokens, cfg.model).logits),
                               np.asarray(_forward(attach(base, adapters, settings), tokens, cfg.model).logits),
                               atol=1e-4, rtol=1e-4)
    saved = {p.name for p in (tmp_path / "run" / "checkpoints" / "20").iterdir()}
    assert {"params", "opt_state"} <= saved and "base" not in saved  # the adapters and their moments only

    # hypertron convert --lora ADAPTER --merge --out: the bundle the run left (its base from the adapter's config)
    from support.cli import run_cli

    done = run_cli(["convert", "--lora", str(tmp_path / "run" / "adapter"), "--merge", "--out", str(tmp_path / "m")])
    assert done.rc == 0, done.stderr
    _, converted, _ = read_bundle(tmp_path / "m")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), converted, merged)
    again = run_cli(["convert", "--lora", str(tmp_path / "run" / "adapter"), "--out", str(tmp_path / "m2")])
    assert again.rc == 2 and again.stderr.strip() == "error: convert --lora needs --merge (the adapter directory is " \
        "already PEFT's format)"

    # train.init_from=ADAPTER continues it over its base (base_model_name_or_path): it starts trained
    adapter = tmp_path / "run" / "adapter"
    more = _lora_overrides(adapter, tmp_path / "more", "train.steps=2", "checkpoint.every=2")
    again = train(load_config(None, more))
    assert again.losses[0] < np.mean(result.losses[:3]) - 0.3, (again.losses, result.losses)
    from hypertron.checkpoint import CheckpointError
    from hypertron.train.task import task_for

    for setting, message in (("lora.rank=8", "its adapter has rank 4, not lora.rank=8"),
                             ("lora.rank=0", "is a LoRA adapter: set lora.rank")):
        cfg = load_config(None, [*more, setting, f"run_dir={tmp_path / 'refused'}"])
        with pytest.raises(CheckpointError, match=message):
            task_for(cfg).check_init_from(cfg)


@pytest.mark.slow
def test_an_adapter_run_resumes_bit_for_bit_and_refuses_another_base(base_bundle, tmp_path):
    """4 steps straight equal 2, a restart (the base read from train.init_from again), then 2; a
    base whose files changed since the run began is refused in one line."""
    import shutil

    from hypertron.checkpoint import CheckpointError
    from hypertron.models import init_params
    from hypertron.models.bundle import save_model
    from hypertron.train.loop import train

    base = tmp_path / "base"
    shutil.copytree(base_bundle, base)
    common = _lora_overrides(base, tmp_path / "a", "train.steps=4", "checkpoint.every=2", "train.schedule=constant")
    straight = train(load_config(None, common))
    first = train(load_config(None, [*common, f"run_dir={tmp_path / 'b'}", "train.steps=2"]))
    saved = {p.name for p in (tmp_path / "b" / "checkpoints" / "2").iterdir()}
    assert "base" not in saved
    resumed = train(load_config(None, [*common, f"run_dir={tmp_path / 'b'}"]))
    assert resumed.first_step == 2
    np.testing.assert_array_equal(first.losses + resumed.losses, straight.losses)
    cfg = load_config(None, [*common, f"run_dir={tmp_path / 'b'}", "train.steps=6"])
    save_model(base, cfg.model, init_params(cfg.model, jax.random.key(9)))  # another base at the same path
    with pytest.raises(CheckpointError, match=r"train.init_from=.*base: not the base this run's adapters trained on"):
        train(cfg)


@pytest.mark.slow
def test_an_int8_base_trains_adapters_as_well_as_the_float_base_and_fp8_keeps_its_logits(base_bundle, tmp_path):
    """100 steps of the tiny SFT recipe's data over the base held int8 (``lora.base_dtype=int8``,
    QLoRA-style) end within 5 % of the float base's loss; a run's bundle merges the adapter into
    the base as read (float); on fsdp=8 the held base's bytes are the memory model's, and fp8's
    (e4m3 with per-channel scales: its logits within 10 % of the float base's, relative L2; 5.8 %
    measured, int8's 1.4 %) the same bytes. fp8 trains through the same code as int8 (a QArray of
    other values), so it does not get 100 steps of its own."""
    from hypertron.models import memory
    from hypertron.models.bundle import read_bundle
    from hypertron.parallel.mesh import make_mesh
    from hypertron.quant import QArray
    from hypertron.train.task import task_for

    def overrides(mode, *more):
        return _lora_overrides(base_bundle, tmp_path / mode, "task=sft", "data.source=jsonl",
                               "data.paths=recipes/cpu/data/sft.jsonl", "data.format=prompt_completion",
                               "train.seq_len=32", "train.steps=100", "train.warmup_steps=10", "train.log_every=50",
                               "checkpoint.every=100", f"lora.base_dtype={mode}", *more)

    def final_loss(mode):  # the loop's steps on one device, then (int8) what a run leaves (its bundle and adapter)
        cfg = load_config(None, overrides(mode))
        task = task_for(cfg)
        task.check_inputs(cfg)
        trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
        state, batches, losses = task.initial_state(cfg, trainer, quiet), task.batches(cfg), []
        for _ in range(cfg.train.steps):
            state, metrics = task.step(trainer, state, next(batches))
            losses.append(metrics["loss"])
        if mode == "int8":
            task.finish(cfg, state, quiet)
        return float(np.mean(jax.device_get(losses)[-10:]))

    quiet = type("C", (), {"print": lambda *a, **k: None})()
    final = {mode: final_loss(mode) for mode in ("auto", "int8")}
    assert abs(final["int8"] - final["auto"]) <= 0.05 * final["auto"], final
    cfg = load_config(None, overrides("int8"))
    adapters, settings = load_peft(tmp_path / "int8" / "adapter", cfg.model)
    _, base, _ = read_bundle(base_bundle)
    _, merged, _ = read_bundle(tmp_path / "int8" / "model")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), merged,
                 jax.device_get(merge(base, adapters, settings)))

    cfg = load_config(None, overrides("int8", "mesh.fsdp=8", f"run_dir={tmp_path / 'fsdp'}"))
    task = task_for(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, None))
    state = task.initial_state(cfg, trainer, quiet)
    assert isinstance(state["base"]["layers"]["wq"], QArray) and state["base"]["layers"]["wq"].values.dtype == np.int8
    first = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    held = memory.state_bytes(cfg, dict(trainer.mesh.shape))
    assert held.base == first(state["base"]) < memory.state_bytes(
        load_config(None, overrides("auto", "mesh.fsdp=8")), dict(trainer.mesh.shape)).base / 2
    fp8 = load_config(None, overrides("fp8", "mesh.fsdp=8"))  # one byte a weight too
    assert task_for(fp8).trainer(fp8, trainer.mesh).abstract_state()["base"]["layers"]["wq"].values.dtype == \
        jnp.float8_e4m3fn and memory.state_bytes(fp8, dict(trainer.mesh.shape)).base == held.base
    from hypertron.train.lora import hold_base

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 250, (2, 32)))
    want = np.asarray(_forward(base, tokens, cfg.model).logits)
    got = np.asarray(_forward(hold_base(fp8, base), tokens, cfg.model).logits)
    assert np.linalg.norm(got - want) <= 0.10 * np.linalg.norm(want)


def test_the_adapter_step_computes_no_base_weight_gradient(base_bundle, tmp_path):
    """No matmul of the traced adapter step yields a base weight's shape (a weight gradient), where
    full fine-tuning's step has one for every weight: the base gets no gradient, not one thrown away."""
    from hypertron.models import declare
    from hypertron.models.params import leaves_with_paths
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.step import global_batch
    from hypertron.train.task import task_for

    def matmul_shapes(lora):
        cfg = load_config(None, _lora_overrides(base_bundle, tmp_path / "r", "data.source=synthetic",
                                                *(() if lora else ("lora.rank=0",))))
        task = task_for(cfg)
        trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
        state = trainer.abstract_state()
        batch = global_batch(next(task.batches(cfg)), trainer.batch_sharding)
        shapes = set()

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "dot_general":  # its dimensions in any order
                    shapes.add(tuple(sorted(eqn.outvars[0].aval.shape)))
                for sub in jax.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jax.make_jaxpr(trainer.step)(state, batch).jaxpr)
        return cfg, shapes

    cfg, full = matmul_shapes(lora=False)
    weights = {tuple(sorted(s.shape[1:] if s.axes[:1] == ("layers",) else s.shape))
               for _, s in leaves_with_paths(declare(cfg.model)) if s.einsum is not None}
    assert weights <= full  # the probe sees full fine-tuning's weight gradients
    _, adapted = matmul_shapes(lora=True)
    assert not weights & adapted, weights & adapted


@pytest.mark.slow
def test_an_adapter_step_on_fsdp8_equals_one_device(base_bundle, tmp_path):
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.step import global_batch
    from hypertron.train.task import task_for

    def one_step(mesh, devices):
        cfg = load_config(None, _lora_overrides(base_bundle, tmp_path / "r", "data.source=synthetic", *mesh))
        task = task_for(cfg)
        trainer = task.trainer(cfg, make_mesh(cfg.mesh, devices))
        state = task.initial_state(cfg, trainer, console=type("C", (), {"print": lambda *a, **k: None})())
        state = dict(state, params=jax.tree.map(lambda x: x + 0.01, state["params"]))  # B != 0
        from hypertron.models import memory

        held = memory.state_bytes(cfg, dict(trainer.mesh.shape))  # the memory model: adapters, moments, base
        first = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
        assert (held.params, held.optimizer, held.base) == (first(state["params"]), first(state["opt_state"]),
                                                            first(state["base"]))
        assert held.optimizer < held.base  # the adapters' moments only
        state, metrics = trainer.step(state, global_batch(next(task.batches(cfg)), trainer.batch_sharding))
        return jax.device_get(metrics), jax.device_get(state["params"])

    want_metrics, want = one_step(["mesh.fsdp=1"], jax.devices()[:1])
    metrics, got = one_step(["mesh.fsdp=8"], None)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-4), got, want)


def test_a_base_digest_is_kept_by_the_run_and_read_back_while_its_files_are_unchanged(base_bundle, tmp_path):
    """A resumed run checks its base by the digest kept in RUN/files_digests.json while the files'
    names, sizes and times are those it hashed; a file touched since is read and hashed again."""
    import json
    import os
    import shutil

    from hypertron.train.task import DIGESTS_FILE, files_digest

    base = tmp_path / "base"
    shutil.copytree(base_bundle, base)
    run = tmp_path / "run"
    digest = files_digest(str(base), str(run))
    assert digest == files_digest(str(base))  # the same digest, kept or not
    kept = json.loads((run / DIGESTS_FILE).read_text())
    kept[str(base.resolve())]["sha256"] = "kept"  # what a second call returns if it reads nothing
    (run / DIGESTS_FILE).write_text(json.dumps(kept))
    assert files_digest(str(base), str(run)) == "kept"
    weights = next(p for p in base.iterdir() if p.suffix == ".safetensors")
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert files_digest(str(base), str(run)) == digest


def test_held_out_loss_with_adapters_is_the_merged_models(base_bundle, tmp_path):
    """train.eval_every with adapters: the evaluation of a LoRA state (the base with its adapters
    attached) equals full fine-tuning's evaluation of the merged parameters on the same batches."""
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.task import task_for

    quiet = type("C", (), {"print": lambda *a, **k: None})()
    more = ("data.source=synthetic", "train.eval_every=1", "train.eval_batches=2",
            "lora.targets=[q_proj,v_proj,down_proj]")
    cfg = load_config(None, _lora_overrides(base_bundle, tmp_path / "r", *more))
    task = task_for(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state = task.initial_state(cfg, trainer, quiet)
    state["params"] = jax.tree.map(lambda a: a + 0.05, state["params"])  # B non-zero: the adapters count
    full_cfg = load_config(None, _lora_overrides(base_bundle, tmp_path / "f", *more, "lora.rank=0"))
    full = task_for(full_cfg).trainer(full_cfg, trainer.mesh)
    merged = {"params": merge(state["base"], state["params"], LoraSettings.of(cfg.lora))}
    batches = [task.batches(cfg, "eval") for _ in range(2)]
    got = task.evaluate(trainer, state, batches[0], 2)
    want = task.evaluate(full, merged, batches[1], 2)
    assert got["tokens"] == want["tokens"] and abs(got["loss"] - want["loss"]) < 1e-5, (got, want)
