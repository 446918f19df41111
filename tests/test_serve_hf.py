"""The real engine behind the OpenAI-compatible server, against a tiny random ``transformers`` Llama.

The model is built from a config (no download), loaded with :func:`load_hf` and served
with the paged engine and the byte tokenizer; prompts are token ids, so both sides see the
same tokens.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from http_harness import ThreadedServer  # tests/
from test_server import MODEL, TOK, Server  # tests/

from hypertron.models.hf import load_hf
from hypertron.config import EngineConfig
from hypertron.serve.engine import PagedEngine

torch.set_num_threads(1)
VOCAB = 300  # the byte tokenizer's 259 ids fit


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.ndim > 1 else 1 + 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf-llama")
    model.save_pretrained(path, safe_serialization=True)
    cfg, params = load_hf(path)
    return model, cfg, params


@pytest.fixture(scope="module")
def server(hf):
    _, cfg, params = hf
    # No eos_ids: the byte tokenizer's eos (2) is just another id to this random model. Background
    # compiles, as `hypertron serve` runs: steps run padded to compiled shapes while theirs compile.
    engine = PagedEngine(params, cfg, EngineConfig(max_slots=4, page_size=8, num_pages=40, max_top_logprobs=5,
                                                   compile="background"))
    with Server(engine) as s:
        yield s


def test_echo_logprobs_equal_the_log_softmax_of_transformers_logits(hf, server):
    model = hf[0]
    prompt = [17, 250, 3, 99, 140, 7, 64, 201, 33, 12]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 5,
            "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    generated = r["usage"]["completion_tokens"]
    assert generated == 4 and len(lp["token_logprobs"]) == len(prompt) + 4
    with torch.no_grad():
        full = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                              pad_token_id=None)[0]
        logp = torch.log_softmax(model(full[None]).logits[0].double(), dim=-1).numpy()
    seq = full.tolist()
    assert lp["token_logprobs"][0] is None
    for i in range(1, len(seq)):
        assert lp["token_logprobs"][i] == pytest.approx(logp[i - 1, seq[i]], abs=1e-4), i
        # top_logprobs is keyed by token text (ids past the byte range share one), so check values:
        # each is one of the true top-5 (or the chosen token's), and the best is the true best.
        allowed = np.append(np.sort(logp[i - 1])[::-1][:5], logp[i - 1, seq[i]])
        values = list(lp["top_logprobs"][i].values())
        assert all(np.abs(allowed - v).min() < 1e-4 for v in values)
        assert max(values) == pytest.approx(allowed[0], abs=1e-4)


def test_concurrent_greedy_requests_equal_transformers_generate(hf, server):
    model = hf[0]
    prompts = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108], [42] * 14, [250, 9]]

    def complete(prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(complete, prompts))
    for prompt, answer in zip(prompts, answers):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=None)[0, len(prompt):].tolist()
        assert answer["choices"][0]["text"] == TOK.decode(out), (prompt, out)


def test_openai_client_with_the_real_engine_repeats_a_seeded_sample(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    kw = dict(model=MODEL, prompt=[11, 12, 13, 14], max_tokens=8, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=3, **kw).choices[0].text
    b = client.completions.create(seed=3, **kw).choices[0].text
    c = client.completions.create(seed=4, **kw).choices[0].text
    assert a == b and a != c
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(stream=True, **(kw | {"seed": 3}))
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == a
    server.wait_idle()


def test_256_concurrent_streams_through_the_real_engine_each_get_exactly_their_tokens(hf, server):
    """256 streaming requests at once (16 distinct prompts of 2-9 tokens, 16 copies each) through the
    scheduler and the real engine (4 slots, a budget of 512 tokens a step): every one completes with
    200 and exactly transformers' greedy tokens, and every slot and page is free afterwards."""
    import asyncio

    from test_server import _stream  # tests/

    from hypertron.serve.detokenize import detokenizer

    model = hf[0]
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 259, 2 + i % 8)] for i in range(16)]
    def streamed(prompt):  # the greedy tokens' text as the server streams it (bytes that are not whole
        detok = detokenizer(TOK, prompt)  # characters included)
        return "".join(detok.add(t) for t in _greedy(model, prompt, 6)) + detok.flush()

    want = {tuple(p): streamed(p) for p in prompts}
    bodies = [{"model": MODEL, "prompt": prompts[i % 16], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
              for i in range(256)]

    async def run():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(_stream(http, b) for b in bodies))

    cached = []
    for body, (status, text, reason, usage) in zip(bodies, asyncio.run(run())):
        assert (status, text, reason, usage["completion_tokens"]) == (200, want[tuple(body["prompt"])], "length", 6)
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert set(cached) == {0, 8}  # copies of the 9-token prompts admitted after the first share its page of 8
    server.wait_idle()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face directory as one is downloaded: weights, ``config.json``, a byte-level BPE
    ``tokenizer.json`` (400 ids) and a ``generation_config.json``, written in the test."""
    from test_tokenizers import train_bpe  # tests/

    path = tmp_path_factory.mktemp("hf-dir")
    train_bpe(path / "tokenizer.json")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.ndim > 1 else 1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def _greedy(model, prompt, n, eos=None):
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                              pad_token_id=0)[0, len(prompt):].tolist()


def test_serve_model_hf_dir_stops_at_either_eos_of_generation_config(hf_dir, monkeypatch):
    """``hypertron serve --model HF_DIR``: the directory's own tokenizer, and both end-of-sequence
    ids of its ``generation_config.json`` (as Llama 3 instruct lists ``<|eot_id|>`` beside
    ``<|end_of_text|>``); greedy continuations equal ``transformers.generate`` with those ids."""
    import json

    from test_serve_config import _serve  # tests/

    from hypertron.tokenizer import get_tokenizer

    model, path = hf_dir
    prompts = [[40, 41, 42, 43], [300, 7, 9], [120, 121]]
    free = [_greedy(model, p, 8) for p in prompts]
    # An end id for each of the first two prompts: a token its free continuation reaches after a few
    # steps and the other's does not reach before.
    eos_a = next(t for t in free[0][2:6] if t not in free[1][:6])
    eos_b = next(t for t in free[1][2:6] if t not in free[0][:free[0].index(eos_a) + 1] and t != eos_a)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_a, eos_b]}))
    tok = get_tokenizer(str(path))
    eos = sorted(tok.eos_ids)  # the tokenizer's own </s> as well
    assert {eos_a, eos_b} <= set(eos)
    app, _ = _serve(["--model", str(path), "--max-slots", "2", "--page-size", "8"], monkeypatch)
    with ThreadedServer(app, lifespan="on") as s:
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["id"] == path.name
        for prompt in prompts:
            want = _greedy(model, prompt, 8, eos=eos)
            body = {"model": path.name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            choice = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            stopped = want[-1] in eos
            assert choice["finish_reason"] == ("stop" if stopped else "length"), (prompt, want)
            assert choice["text"] == tok.decode(want[:-1] if stopped else want), (prompt, want)
    assert _greedy(model, prompts[0], 8, eos=eos)[-1] == eos_a  # the first prompt did stop at its end id


def test_generate_model_hf_dir_equals_transformers(hf_dir, capsys):
    from hypertron import cli
    from hypertron.tokenizer import get_tokenizer

    model, path = hf_dir
    tok = get_tokenizer(str(path))
    ids = [tok.bos_id] + tok.encode("def main")  # generate starts a prompt with the tokenizer's BOS
    eos = sorted(tok.eos_ids) or None
    want = _greedy(model, ids, 6, eos=eos)
    if eos and want[-1] in eos:
        want = want[:-1]
    assert cli.main(["generate", "--model", str(path), "--prompt", "def main", "--max-new-tokens", "6"]) == 0
    assert tok.decode(want) in capsys.readouterr().out
