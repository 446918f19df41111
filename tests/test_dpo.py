"""The DPO objective against TRL 1.16's ``DPOTrainer.compute_loss``: two different tiny random Llamas
(policy and reference) converted to hypertron, the pairs TRL's dataset preparation tokenises, its
collator's batch. Losses, TRL's metrics and the policy's gradients agree (float32; ``bf16=False``,
since ``DPOConfig`` defaults to bf16 autocast)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import jax  # noqa: E402
from support.chat import chat_tokenizers  # noqa: E402  (tests/support)
from support.tiny import write_tiny_hf_llama  # noqa: E402

from hypertron.errors import ConfigError  # noqa: E402
from hypertron.models.hf import from_hf_tensors, load_hf  # noqa: E402
from hypertron.train.preference import dpo_loss  # noqa: E402

torch.set_num_threads(1)

PROMPTS = ["Hello there, how are you", "Tell me a story about", "The quick brown fox"]
CHOSEN = [" today? I am fine.", " a café in Zürich.", " jumps over the lazy dog."]
REJECTED = [" no.", " nothing at all, thank you", " is brown."]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    (root / "tok").mkdir()
    theirs_tok, _ = chat_tokenizers(root / "tok")
    theirs_tok.pad_token = theirs_tok.eos_token
    kw = dict(vocab_size=theirs_tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              scaled_init=True)
    policy = write_tiny_hf_llama(root / "policy", seed=0, **kw)
    reference = write_tiny_hf_llama(root / "reference", seed=1, **kw)
    cfg, policy_params = load_hf(root / "policy")
    _, reference_params = load_hf(root / "reference")
    return root, theirs_tok, policy, reference, cfg, policy_params, reference_params


def _trl(models, loss_type):
    """TRL's trainer on the pairs, its collated batch, its loss (backpropagated) and metrics."""
    root, tok, policy, reference, *_ = models
    args = trl.DPOConfig(output_dir=str(root / f"out-{loss_type}"), bf16=False, beta=0.1, loss_type=loss_type,
                         per_device_train_batch_size=len(PROMPTS), report_to=[], use_cpu=True)
    data = datasets.Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=data,
                             processing_class=tok)
    examples = [trainer.train_dataset[i] for i in range(len(PROMPTS))]
    batch = trainer.data_collator(examples)
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    pairs = [(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in examples]
    metrics = {k: trainer._metrics["train"][k][-1] for k in METRICS}
    grads = {n: p.grad.numpy() for n, p in trainer.model.named_parameters()}
    return pairs, loss.item(), metrics, grads


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_metrics_and_gradients_are_trls(models, loss_type):
    *_, cfg, policy_params, reference_params = models
    pairs, their_loss, their_metrics, their_grads = _trl(models, loss_type)

    def loss_of(params):
        return dpo_loss(params, reference_params, pairs, cfg, beta=0.1, loss_type=loss_type)

    (ours, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(policy_params)
    assert abs(float(ours) - their_loss) <= 1e-6 * abs(their_loss) + 1e-7, (float(ours), their_loss)
    for key in METRICS:
        assert abs(float(metrics[key]) - their_metrics[key]) <= 1e-5 * abs(their_metrics[key]) + 1e-6, key
    theirs = from_hf_tensors(cfg, their_grads)
    ours_flat, theirs_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(theirs)
    assert [p for p, _ in ours_flat] == [p for p, _ in theirs_flat]
    for (name, g), (_, t) in zip(ours_flat, theirs_flat, strict=True):
        t = np.asarray(t)
        assert np.max(np.abs(np.asarray(g) - t)) <= 1e-5 * np.max(np.abs(t)), jax.tree_util.keystr(name)


def test_bad_dpo_settings_are_one_line(models):
    *_, cfg, policy_params, reference_params = models
    pairs = [([5, 6], [7], [8])]
    with pytest.raises(ConfigError, match=r"^dpo.beta=0: must be positive$"):
        dpo_loss(policy_params, reference_params, pairs, cfg, beta=0)
    with pytest.raises(ConfigError, match=r"^dpo.loss_type='kto': must be one of sigmoid, ipo, hinge$"):
        dpo_loss(policy_params, reference_params, pairs, cfg, loss_type="kto")


PAIRS = [{"prompt": "Is the sky blue?", "chosen": " Yes, it is.", "rejected": " No way."},
         {"prompt": "Two plus two?", "chosen": " Four.", "rejected": " Five, surely."},
         {"prompt": "Say hello.", "chosen": " Hello!", "rejected": " Bye."},
         {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Rome."}]


def _dpo_overrides(tmp_path, records, *more):
    import json

    from support.tiny import TWO_LAYERS

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [*TWO_LAYERS, "train.seq_len=64", "train.log_every=1", "task=dpo", "data.source=jsonl",
            f"data.paths={data}", "data.format=preference", f"run_dir={tmp_path / 'run'}", *more]


@pytest.mark.slow
def test_task_dpo_starts_at_log_2_and_learns_every_pair(tmp_path):
    """The reference is the starting parameters (the first step's sigmoid loss is log 2, every
    log-ratio 0); 30 steps rank every chosen completion above its rejected one."""
    import json

    from hypertron.config import load_config
    from hypertron.train.loop import train

    result = train(load_config(None, _dpo_overrides(tmp_path, PAIRS, "train.steps=30", "train.lr=3e-3",
                                                    "train.warmup_steps=3", "dpo.beta=0.5")))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[0]["loss"] - np.log(2)) < 1e-6 and rows[0]["rewards/margins"] == 0
    assert rows[-1]["rewards/accuracies"] == 1.0 and rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()


@pytest.mark.parametrize("records, more, message", [
    ([{"prompt": "a", "chosen": " b"}], [], "line 1 of pairs.jsonl: no 'rejected' (data.rejected_field)"),
    (PAIRS, ["dpo.beta=0"], "dpo.beta=0.0: must be positive"),
    (PAIRS, ["dpo.loss_type=kto"], "dpo.loss_type=kto: must be one of sigmoid, ipo, hinge"),
    (PAIRS, ["data.format=text"], "task=dpo needs preference pairs, not data.format=text"),
    ([{"prompt": "a" * 40, "chosen": " b", "rejected": " c"}], ["data.overlong=error"],
     "data.overlong=error: the pair at line 1 of pairs.jsonl"),
])
def test_bad_dpo_input_is_one_line_before_compiling(tmp_path, records, more, message):
    import re

    from hypertron.config import load_config
    from hypertron.errors import UserError
    from hypertron.train.task import task_for

    with pytest.raises(UserError, match=re.escape(message)):
        cfg = load_config(None, _dpo_overrides(tmp_path, records, *more))
        task_for(cfg).check_inputs(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_task_dpo_resumes_exactly_against_the_same_reference(tmp_path):
    """4 steps straight equal 2, a restart from the checkpoint (the reference restored with it), then 2.
    A precomputed reference (``dpo.reference=precomputed``: no reference in the state, its
    log-probabilities of every pair computed before step 1) gives the frozen one's losses, resumed
    with its table read back, and resumed again with the table gone (computed again)."""
    from hypertron.config import load_config
    from hypertron.train.loop import train

    common = _dpo_overrides(tmp_path, PAIRS, "train.steps=4", "checkpoint.every=1", "train.warmup_steps=1",
                            "train.lr=3e-3", "train.schedule=constant")  # runs cut short keep the schedule
    straight = train(load_config(None, [*common, f"run_dir={tmp_path / 'a'}"]))
    first = train(load_config(None, [*common, f"run_dir={tmp_path / 'b'}", "train.steps=2"]))
    resumed = train(load_config(None, [*common, f"run_dir={tmp_path / 'b'}"]))
    assert resumed.first_step == 2
    np.testing.assert_allclose(first.losses + resumed.losses, straight.losses, rtol=1e-6)
    assert straight.losses[2] < 0.5 * straight.losses[0]  # the policy has moved off the reference

    precomputed = [*common, f"run_dir={tmp_path / 'c'}", "dpo.reference=precomputed"]
    losses = train(load_config(None, [*precomputed, "train.steps=2"])).losses
    (table,) = (tmp_path / "c" / "reference_logps").iterdir()
    losses += train(load_config(None, [*precomputed, "train.steps=3"])).losses  # reads the table back
    table.unlink()
    losses += train(load_config(None, precomputed)).losses  # computes it again from the start
    np.testing.assert_allclose(losses, straight.losses, rtol=1e-6)
    assert table.exists()
    from hypertron.models import memory

    held = {precomputed[-1]: 0, "dpo.reference=frozen": memory.state_bytes(load_config(None, common), {}).params}
    for setting, reference in held.items():  # the memory model counts no reference when it is precomputed
        assert memory.state_bytes(load_config(None, [*common, setting]), {}).reference == reference


@pytest.mark.slow
def test_task_dpo_trains_lora_adapters_against_the_base(tmp_path):
    """With ``lora.rank`` the adapters train over a frozen base, which is the reference with the
    adapters off (TRL's for PEFT models): the first loss is log 2, the pairs are learnt, and no
    checkpoint holds a reference or the base; a precomputed reference gives the same losses, resumed too."""
    from hypertron.config import load_config
    from hypertron.models import init_params
    from hypertron.models.bundle import save_model
    from hypertron.train.loop import train

    common = _dpo_overrides(tmp_path, PAIRS, "train.steps=15", "train.lr=2e-2", "train.warmup_steps=2",
                            "train.schedule=constant", "dpo.beta=0.5", "lora.rank=4", "lora.alpha=8",
                            f"train.init_from={tmp_path / 'base'}", "checkpoint.every=15")
    save_model(tmp_path / "base", load_config(None, common).model,
               init_params(load_config(None, common).model, jax.random.key(3)))
    frozen = train(load_config(None, common))
    assert abs(frozen.losses[0] - np.log(2)) < 1e-6
    assert frozen.rows[-1]["rewards/accuracies"] == 1.0 and frozen.losses[-1] < 0.5 * frozen.losses[0]
    saved = {p.name for p in (tmp_path / "run" / "checkpoints" / "15").iterdir()}
    assert "params" in saved and not {"reference", "base"} & saved
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
    pre = [*common, "dpo.reference=precomputed", "checkpoint.every=1", f"run_dir={tmp_path / 'pre'}"]
    losses = train(load_config(None, [*pre, "train.steps=2"])).losses
    resumed = train(load_config(None, [*pre, "train.steps=3"]))  # the base read again, the table read back
    assert resumed.first_step == 2
    np.testing.assert_allclose(losses + resumed.losses, frozen.losses[:3], rtol=1e-6)


@pytest.mark.slow
def test_a_reference_from_a_model_bundle(tmp_path):
    """``dpo.reference=BUNDLE``: the first step's loss and metrics are :func:`dpo_loss`'s of the
    batch's pairs, with the starting parameters as the policy and the bundle's as the reference; a
    path that holds no model is one line before compiling."""
    from rich.console import Console

    from hypertron.checkpoint import CheckpointError
    from hypertron.config import load_config
    from hypertron.models.bundle import read_bundle, save_model
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.task import task_for

    cfg = load_config(None, _dpo_overrides(tmp_path, PAIRS, f"dpo.reference={tmp_path / 'nothing'}"))
    task = task_for(cfg)
    with pytest.raises(CheckpointError, match=r"^dpo.reference=.*nothing: not a model bundle .* or a run with "
                                              r"checkpoints$"):
        task.check_init_from(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    other = jax.device_get(trainer.init(jax.random.key(7))["params"])
    save_model(tmp_path / "ref", cfg.model, other, cfg.data.tokenizer)
    cfg = load_config(None, _dpo_overrides(tmp_path, PAIRS, f"dpo.reference={tmp_path / 'ref'}", "dpo.beta=0.5"))
    task = task_for(cfg)
    task.check_inputs(cfg)
    task.check_init_from(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state = task.initial_state(cfg, trainer, Console(quiet=True))
    policy = jax.device_get(state["params"])
    local = next(task.batches(cfg))
    _, metrics = task.step(trainer, state, local)
    pairs = task._examples(cfg).pairs
    _, reference, _ = read_bundle(tmp_path / "ref")
    want_loss, want = dpo_loss(policy, reference, [pairs[i] for i in local["pair"]], cfg.model, beta=0.5)
    assert abs(float(want_loss) - np.log(2)) > 0.01  # not the starting parameters
    np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-5)
    for key in METRICS:
        np.testing.assert_allclose(float(metrics[key]), float(want[key]), rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_a_dpo_step_on_a_mesh_equals_one_device(tmp_path):
    """The pair objective's step on (fsdp=8) and (data=2, fsdp=2, tensor=2) gives one device's loss,
    metrics and parameters: each pair stays in its row, whatever the shards."""
    from hypertron.config import load_config
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.task import task_for
    from hypertron.train.step import global_batch

    def one_step(mesh, devices):
        cfg = load_config(None, _dpo_overrides(tmp_path, PAIRS, *mesh, "train.warmup_steps=0", "dpo.beta=0.5"))
        task = task_for(cfg)
        task.check_inputs(cfg)
        trainer = task.trainer(cfg, make_mesh(cfg.mesh, devices))
        state = trainer.init(jax.random.key(0))
        state = dict(state, params=jax.tree.map(lambda p: p * 1.5, state["params"]))  # policy != reference
        from hypertron.models import memory

        held = memory.state_bytes(cfg, dict(trainer.mesh.shape))  # the reference is counted
        assert held.reference == held.params == sum(x.addressable_shards[0].data.nbytes
                                                    for x in jax.tree.leaves(state["reference"]))
        state, metrics = trainer.step(state, global_batch(next(task.batches(cfg)), trainer.batch_sharding))
        return jax.device_get(metrics), jax.device_get(state["params"])

    want_metrics, want_params = one_step(["mesh.fsdp=1"], jax.devices()[:1])
    assert want_metrics["rewards/margins"] != 0
    for mesh in (["mesh.fsdp=8"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]):
        metrics, params = one_step(mesh, None)
        for key, value in want_metrics.items():
            np.testing.assert_allclose(metrics[key], value, rtol=2e-5, atol=1e-6, err_msg=f"{mesh} {key}")
        # Adam's first update is about lr (3e-3) an element whatever its gradient's size: a gradient near 0
        # moves by float32 noise between meshes, so parameters are held to 1e-4, 3 % of an update
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-4), params, want_params)
