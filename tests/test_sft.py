"""Fine-tuning data: chat examples with the assistant mask, packed whole into rows, give the loss
and gradients transformers gives on the same conversations padded with ``labels=-100``.

One tiny random Llama (float32, eager attention), converted as tests/test_hf.py converts it, and one
jitted loss-and-gradient of hypertron's ``loss_terms`` on [1, SEQ] rows, shared by every test.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from support.chat import CHATML_GENERATION, CONVERSATION, chat_tokenizers  # noqa: E402  (tests/support)

from hypertron.data.chat import chat_example, prompt_completion_example  # noqa: E402
from hypertron.data.packing import best_fit_decreasing, pack_rows  # noqa: E402
from hypertron.errors import DataError  # noqa: E402
from hypertron.models.hf import FAMILIES, from_hf_tensors, load_hf  # noqa: E402
from hypertron.train.step import loss_terms  # noqa: E402

torch.set_num_threads(1)

SEQ = 160  # one row holds both conversations
CONVERSATIONS = [CONVERSATION[:3], CONVERSATION[:1] + CONVERSATION[3:]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tokenizers, the HF model and hypertron's load of it, and the jitted loss."""
    theirs, ours = chat_tokenizers(tmp_path_factory.mktemp("sft_bpe"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**FAMILIES["llama"].tiny, vocab_size=ours.vocab_size, num_hidden_layers=2,
                                      max_position_embeddings=2 * SEQ, rms_norm_eps=1e-5,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # default init leaves norms at 1 and weights tiny: perturb every tensor
        for p in model.parameters():
            p.copy_(p + 0.2 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp("sft_llama")
    model.save_pretrained(path, safe_serialization=True)
    cfg, params = load_hf(path)
    train_cfg = SimpleNamespace(model=cfg, data=SimpleNamespace(source="jsonl"),
                                train=SimpleNamespace(z_loss=0.0, pipeline_microbatches=0, pipeline_repeats=1))

    @jax.jit
    def loss_and_grads(params, batch):
        """(mean NLL over the counted targets, loss_terms' aux), and the mean's gradients."""
        def mean_nll(p):
            _, aux = loss_terms(p, batch, train_cfg)
            return aux["nll_sum"] / aux["weight"], aux
        return jax.value_and_grad(mean_nll, has_aux=True)(params)

    return SimpleNamespace(theirs=theirs, ours=ours, model=model, cfg=cfg, params=params, loss=loss_and_grads)


def _examples(setup):
    return [chat_example(setup.ours, messages, template=CHATML_GENERATION) for messages in CONVERSATIONS]


def test_packed_row_loss_and_gradients_are_transformers(setup):
    examples = _examples(setup)
    batch, truncated = pack_rows(examples, SEQ, setup.ours.pad_id)
    assert batch["inputs"].shape == (1, SEQ) and truncated == 0
    assert set(batch["segment_ids"][0]) == {0, 1, 2}
    (ours, aux), grads = setup.loss(setup.params, batch)

    # transformers: the two conversations padded on the right, labels -100 outside its own assistant mask
    encoded = [setup.theirs.apply_chat_template(m, chat_template=CHATML_GENERATION, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True) for m in CONVERSATIONS]
    width = max(len(e["input_ids"]) for e in encoded)
    ids, labels, attention = (np.zeros((2, width), np.int64) for _ in range(3))
    labels[:] = -100
    for row, e in enumerate(encoded):
        n = len(e["input_ids"])
        assert (list(e["input_ids"]), list(e["assistant_masks"])) == examples[row]
        ids[row, :n], attention[row, :n] = e["input_ids"], 1
        labels[row, :n] = np.where(np.asarray(e["assistant_masks"]) == 1, e["input_ids"], -100)
    setup.model.zero_grad()
    theirs = setup.model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(attention),
                         labels=torch.tensor(labels)).loss
    theirs.backward()

    assert float(aux["weight"]) == np.sum(labels[:, 1:] != -100)
    assert abs(float(ours) - theirs.item()) <= 1e-6 * abs(theirs.item())
    their_grads = from_hf_tensors(setup.cfg, {n: p.grad.numpy() for n, p in setup.model.named_parameters()})
    ours_flat = jax.tree_util.tree_leaves_with_path(grads)
    theirs_flat = jax.tree_util.tree_leaves_with_path(their_grads)
    assert [p for p, _ in ours_flat] == [p for p, _ in theirs_flat]
    for (name, g), (_, t) in zip(ours_flat, theirs_flat, strict=True):
        t = np.asarray(t)
        assert np.max(np.abs(np.asarray(g) - t)) <= 1e-5 * np.max(np.abs(t)), jax.tree_util.keystr(name)


def test_packed_row_loss_is_its_examples_one_at_a_time(setup):
    examples = _examples(setup)
    (_, packed), _ = setup.loss(setup.params, pack_rows(examples, SEQ, setup.ours.pad_id)[0])
    alone = [setup.loss(setup.params, pack_rows([e], SEQ, setup.ours.pad_id)[0])[0][1] for e in examples]
    assert float(packed["weight"]) == sum(float(a["weight"]) for a in alone)
    np.testing.assert_allclose(float(packed["nll_sum"]), sum(float(a["nll_sum"]) for a in alone), rtol=1e-6)


def test_packing_never_splits_an_example():
    rng = np.random.default_rng(0)
    seq_len, n = 64, 1000
    lengths = rng.integers(1, 80, n)  # some longer than a row
    rows, truncated = best_fit_decreasing(lengths, seq_len)
    assert sorted(i for row in rows for i in row) == list(range(n))
    assert all(sum(min(lengths[i], seq_len) for i in row) <= seq_len for row in rows)
    assert truncated == np.sum(lengths > seq_len) > 0
    assert len(rows) <= 1.05 * np.minimum(lengths, seq_len).sum() / seq_len + 1  # it packs tightly

    # the rows' fields: each example whole and from its start in its own segment, the mask shifted
    examples = [(rng.integers(0, 1000, length + 1), rng.integers(0, 2, length + 1)) for length in lengths]
    batch, truncated_again = pack_rows(examples, seq_len, pad_id=-1)
    assert truncated_again == truncated and batch["inputs"].shape == (len(rows), seq_len)
    for r, row in enumerate(rows):
        segments = batch["segment_ids"][r]
        for segment, index in enumerate(row, 1):
            at = segments == segment
            ids, mask = examples[index][0][:seq_len + 1], examples[index][1][:seq_len + 1]
            np.testing.assert_array_equal(batch["inputs"][r, at], ids[:-1])
            np.testing.assert_array_equal(batch["targets"][r, at], ids[1:])
            np.testing.assert_array_equal(batch["loss_weights"][r, at], mask[1:])
            np.testing.assert_array_equal(batch["positions"][r, at], np.arange(len(ids) - 1))
        pad = segments == 0
        assert np.all(batch["loss_weights"][r, pad] == 0) and np.all(batch["inputs"][r, pad] == -1)
        assert np.all(np.diff(segments[~pad]) >= 0) and not np.any(np.diff(pad.astype(int)) < 0)  # padding at the end


def test_example_masks_and_bad_messages(setup):
    ours = setup.ours
    ids, mask = chat_example(ours, CONVERSATIONS[0], loss_on="all", template=CHATML_GENERATION)
    assert ids == _examples(setup)[0][0] and set(mask) == {1}
    ids, mask = prompt_completion_example(ours, CONVERSATIONS[0][:2], CONVERSATIONS[0][2:], template=CHATML_GENERATION)
    assert ids == _examples(setup)[0][0]
    assert ours.decode([i for i, m in zip(ids, mask, strict=True) if m]) == CONVERSATIONS[0][2]["content"] + "\n"
    ids, mask = prompt_completion_example(ours, "Hello there", " fine")
    assert ids == [ours.bos_id, *ours.encode("Hello there"), *ours.encode(" fine"), ours.eos_id]
    assert mask == [0] * (len(ids) - len(ours.encode(" fine")) - 1) + [1] * (len(ours.encode(" fine")) + 1)
    for messages, message in (([{"role": "user", "content": "hi"}, {"content": "x"}],
                               "^messages\\[1\\] has no 'role'$"),
                              ([{"role": "user"}], "^messages\\[0\\] has no 'content'$"),
                              ("hello", "^messages must be a list of \\{role, content\\} messages, not str$")):
        with pytest.raises(DataError, match=message):
            chat_example(ours, messages, template=CHATML_GENERATION)
    with pytest.raises(DataError, match="^loss_on='completion': must be one of assistant, all"):
        chat_example(ours, CONVERSATIONS[0], loss_on="completion")
