"""``task: sft`` end to end: a tiny model fine-tuned on conversations learns their replies, the
bundle carries the chat template, and ``hypertron serve`` on it answers a conversation with the reply
it learned; bad fine-tuning input is refused in one line before anything compiles.

One tokenizer (the byte-level BPE of tests/support/chat.py, ChatML in its tokenizer_config.json) and
one 40-step run shared by the tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from support.chat import CHATML_GENERATION, chat_tokenizers  # tests/support
from support.tiny import TWO_LAYERS

from hypertron.config import ConfigError, load_config
from hypertron.errors import DataError
from hypertron.train.loop import train

pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "The quick brown fox."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What about you?"},
     {"role": "assistant", "content": "A café in Zürich."}],
]


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _overrides(tok: Path, data: Path, run: Path, *more: str) -> list[str]:
    return [*TWO_LAYERS, "model.vocab_size=400", "train.seq_len=48", "train.log_every=1",
            "task=sft", "data.source=jsonl", f"data.paths={data}", "data.format=messages", f"data.tokenizer={tok}",
            f"run_dir={run}", *more]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The 40-step run (its template from a file: CHATML_GENERATION) and what it needs."""
    root = tmp_path_factory.mktemp("sft")
    (root / "tok").mkdir()
    chat_tokenizers(root / "tok")
    data = _jsonl(root / "chats.jsonl", [{"messages": m} for m in CHATS])
    template = root / "template.jinja"
    template.write_text(CHATML_GENERATION)
    run = root / "run"
    result = train(load_config(None, _overrides(root / "tok", data, run, "train.steps=40", "train.lr=1e-2",
                                                "train.warmup_steps=4", f"data.chat_template={template}",
                                                "checkpoint.every=40")))
    return root, run, result


@pytest.mark.slow
def test_the_assistant_loss_falls_and_the_bundle_carries_the_template(tuned):
    root, run, result = tuned
    first, last = np.mean(result.losses[:2]), np.mean(result.losses[-3:])
    assert last < first / 5, (first, last)
    config = json.loads((run / "model" / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML_GENERATION
    saved = load_config(run / "config.yaml", [])
    assert (saved.task, saved.data.format) == ("sft", "messages")


@pytest.mark.slow
def test_serve_answers_with_the_reply_it_learned(tuned):
    openai = pytest.importorskip("openai")
    from http_harness import ThreadedServer  # tests/

    from hypertron.config.serving import ServeConfig
    from hypertron.serve.server import build

    _, run, _ = tuned
    app, _ = build(ServeConfig(checkpoint=str(run / "model"), prefill_groups="max", compile="lazy"))
    with ThreadedServer(app, lifespan="on") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHATS[0][:1],
                                               temperature=0, max_tokens=16)
    assert reply.choices[0].message.content.startswith(CHATS[0][1]["content"])


@pytest.mark.parametrize("records, more, message", [
    ([{"messages": [{"content": "hi"}]}], [], "line 1 of bad.jsonl: messages[0] has no 'role'"),
    ([{"messages": CHATS[0]}, {"text": "x"}], [], "line 2 of bad.jsonl: no 'messages' (data.messages_field)"),
    ([{"messages": [{"role": "tool", "content": "x"}]}], ["data.chat_template=CHATML"], "Unknown role: tool"),
    ([{"messages": CHATS[0] * 8}], ["data.overlong=error"], "data.overlong=error: the example at line 1 of bad.jsonl"),
    ([{"messages": CHATS[0]}], ["data.tokenizer=byte", "model.vocab_size=259"],
     "data.format=messages needs a chat template: data.tokenizer=byte has none"),
])
def test_bad_fine_tuning_input_is_refused_before_compiling(tmp_path, records, more, message):
    from support.chat import CHATML
    from hypertron.train.task import task_for

    (tmp_path / "tok").mkdir()
    chat_tokenizers(tmp_path / "tok")
    if "data.chat_template=CHATML" in more:
        (tmp_path / "chatml.jinja").write_text(CHATML)
        more = [f"data.chat_template={tmp_path / 'chatml.jinja'}"]
    cfg = load_config(None, _overrides(tmp_path / "tok", _jsonl(tmp_path / "bad.jsonl", records), tmp_path / "run",
                                       *more))
    with pytest.raises(DataError, match=re.escape(message)):
        task_for(cfg).check_inputs(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("more, message", [
    (["task=sft", "data.source=jsonl", "data.paths=x"], "task=sft needs examples, not data.format=text: set data.format=messages"),
    (["data.format=messages"], "data.format=messages is for fine-tuning: set task=sft or task=dpo"),
    (["data.loss_on=all"], "data.loss_on=all is for fine-tuning: set task=sft or task=dpo"),
    (["task=sft", "data.format=messages", "data.source=stdlib"],
     "data.source=stdlib: task=sft reads jsonl, parquet or hf records"),
    (["task=sft", "data.format=messages", "data.source=jsonl", "data.paths=x", "data.loss_on=completion"],
     "data.loss_on=completion: data.format=messages takes auto, assistant, all"),
])
def test_settings_that_do_not_fit_fine_tuning_are_refused(more, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model=tiny", *more])


@pytest.mark.slow
def test_a_fine_tuning_run_resumes_exactly(tuned, tmp_path):
    """6 steps straight equal 3, a restart from the checkpoint, then 3 more: the packed stream
    resumes where it stopped."""
    root, _, _ = tuned
    common = _overrides(root / "tok", root / "chats.jsonl", tmp_path / "a", "train.steps=6", "checkpoint.every=3",
                        "train.warmup_steps=2")
    straight = train(load_config(None, common))
    first = train(load_config(None, [*common, f"run_dir={tmp_path / 'b'}", "train.steps=3"]))
    resumed = train(load_config(None, [*common, f"run_dir={tmp_path / 'b'}"]))
    assert resumed.first_step == 3
    np.testing.assert_allclose(first.losses + resumed.losses, straight.losses, rtol=1e-6)


@pytest.mark.slow
def test_a_fine_tuning_step_on_a_mesh_equals_one_device(tuned):
    """The packed examples' step on (fsdp=8) and (data=2, fsdp=2, tensor=2) gives one device's
    loss and updates (2e-5 of each leaf's largest); ``truncated`` counts the batch's examples cut
    to their row."""
    import jax

    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.task import task_for

    root, _, _ = tuned
    data = _jsonl(root / "overlong.jsonl", [{"messages": m} for m in CHATS + [CHATS[0] * 4]])

    def one_step(mesh, devices):
        # eps=1 makes Adam's first update about lr * gradient (not lr * its sign, which float32 noise
        # flips for gradients near 0): the updates compare as the gradients would
        cfg = load_config(None, _overrides(root / "tok", data, root / "unused", *mesh, "train.warmup_steps=0",
                                           "train.lr=1.0", "train.eps=1.0", "train.weight_decay=0"))
        task = task_for(cfg)
        task.check_inputs(cfg)
        trainer = task.trainer(cfg, make_mesh(cfg.mesh, devices))
        local = next(task.batches(cfg))
        state = trainer.init(jax.random.key(0))
        before = jax.device_get(state["params"])
        state, metrics = task.step(trainer, state, local)
        assert metrics["truncated"] == local["truncated"].sum() > 0
        return jax.device_get(metrics), jax.tree.map(np.subtract, jax.device_get(state["params"]), before)

    want_metrics, want_updates = one_step(["mesh.fsdp=1"], jax.devices()[:1])
    for mesh in (["mesh.fsdp=8"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]):
        metrics, updates = one_step(mesh, None)
        for key in ("loss", "grad_norm", "tokens"):
            np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=2e-5, err_msg=f"{mesh} {key}")
        for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates), strict=True):
            np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), err_msg=str(mesh))


def test_parquet_and_hf_records_and_implicit_prompts_read_as_jsonl(tmp_path):
    """The same conversations from jsonl, parquet and a saved Hugging Face dataset give the same
    examples; a preference record whose conversations share their first turns reads as the pair
    with those turns as its prompt (TRL's extract_prompt)."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hypertron.data.finetune import read_examples, read_pairs
    from hypertron.tokenizer import get_tokenizer

    (tmp_path / "tok").mkdir()
    chat_tokenizers(tmp_path / "tok")
    tok = get_tokenizer(str(tmp_path / "tok"))
    records = [{"messages": m} for m in CHATS]
    _jsonl(tmp_path / "c.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(records).save_to_disk(tmp_path / "hf")
    fields = {"messages": "messages", "prompt": "prompt", "completion": "completion"}
    read = [read_examples(source=source, paths=(str(tmp_path / name),), fmt="messages", fields=fields, tokenizer=tok,
                          loss_on="auto", template=None, seq_len=64, overlong="truncate").examples
            for source, name in (("jsonl", "c.jsonl"), ("parquet", "c.parquet"), ("hf", "hf"))]
    assert read[0] == read[1] == read[2] and len(read[0]) == 3

    chosen, rejected = CHATS[2], CHATS[2][:2] + [{"role": "assistant", "content": "No."}]
    fields = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    explicit = _jsonl(tmp_path / "p.jsonl", [{"prompt": chosen[:2], "chosen": chosen[2:], "rejected": rejected[2:]}])
    implicit = _jsonl(tmp_path / "i.jsonl", [{"chosen": chosen, "rejected": rejected}])
    pairs = [read_pairs(source="jsonl", paths=(str(path),), fields=fields, tokenizer=tok, template=None, seq_len=128,
                        overlong="truncate").pairs for path in (explicit, implicit)]
    assert pairs[0] == pairs[1]
    assert tok.decode(pairs[0][0][2]).startswith("No.")


def test_the_cpu_recipes_read_their_data():
    """recipes/cpu/sft-tiny.yaml and dpo-tiny.yaml (the latter from a random tiny model here: it
    starts from sft-tiny's bundle) load, and their corpora read before compiling."""
    from hypertron.train.task import task_for

    root = Path(__file__).parents[1]
    sft = load_config(root / "recipes" / "cpu" / "sft-tiny.yaml", [f"data.paths={root}/recipes/cpu/data/sft.jsonl"])
    dpo = load_config(root / "recipes" / "cpu" / "dpo-tiny.yaml", [
        "model=tiny", "train.init_from=", f"data.paths={root}/recipes/cpu/data/pairs.jsonl"])
    for cfg, count in ((sft, 300), (dpo, 200)):
        task = task_for(cfg)
        task.check_inputs(cfg)
        read = task._examples(cfg)
        assert len(getattr(read, "examples", None) or read.pairs) == count and read.truncated == 0
