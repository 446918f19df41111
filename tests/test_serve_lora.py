"""Many LoRA adapters served in one batch, against PEFT 0.21: a tiny random ``transformers`` Llama,
three PEFT adapters on it (all seven projections at rank 4, the attention's at rank 8, q and v at
rank 2; five more of rank 2 on q and v for the load test), the real engine behind the
OpenAI-compatible server with the adapters in its slots.

A request's ``model`` picks an adapter; each request's tokens and log-probabilities are PEFT's
with its adapter on (or off, for the base), and its merged weights', whatever else shares the step;
adapters load and unload at run time; the prefix cache never shares one adapter's pages with
another's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import httpx
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.tiny import tiny_hf_llama  # noqa: E402  (tests/support)
from test_server import MODEL, TOK, Server  # noqa: E402  (tests/)

from hypertron.config import EngineConfig  # noqa: E402
from hypertron.models import forward  # noqa: E402
from hypertron.models.hf import load_hf  # noqa: E402
from hypertron.models.lora import load_peft, merge  # noqa: E402
from hypertron.serve.engine import PagedEngine  # noqa: E402
from hypertron.serve.lora_slots import slots_for  # noqa: E402

torch.set_num_threads(1)
ADAPTERS = {  # name: (rank, targets, seed)
    "a1": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 1),
    "a2": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], 2),
    "a3": (2, ["q_proj", "v_proj"], 3),
}
MORE = {f"b{k}": (2, ["q_proj", "v_proj"], 10 + k) for k in range(1, 6)}  # saved, loaded by the load test
BIG = (16, ["q_proj"], 4)  # saved, not loaded: above the server's --max-lora-rank
MAX_LORAS = 9
PROMPT = [17, 250, 3, 99, 140, 7, 64, 201, 33, 12, 5, 6, 7, 8, 9, 10, 11, 12]  # two full 8-token pages


def _peft_model(root, name):
    """PEFT's model of the base with adapter ``name`` (None: the base alone)."""
    base = transformers.LlamaForCausalLM.from_pretrained(root / "base").eval()
    return base if name is None else peft.PeftModel.from_pretrained(base, root / name).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lora")
    base = tiny_hf_llama(seed=0, scaled_init=True, num_hidden_layers=2, hidden_size=48, intermediate_size=96,
                         num_attention_heads=4, num_key_value_heads=2)
    base.save_pretrained(root / "base", safe_serialization=True)
    for name, (rank, modules, seed) in {**ADAPTERS, **MORE, "big": BIG}.items():
        torch.manual_seed(seed)
        model = peft.get_peft_model(tiny_hf_llama(seed=0, scaled_init=True, num_hidden_layers=2, hidden_size=48,
                                                  intermediate_size=96, num_attention_heads=4,
                                                  num_key_value_heads=2),
                                    peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                    init_lora_weights=False, lora_dropout=0.0))
        with torch.no_grad():  # PEFT's non-default init is small: make each adapter move the logits
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.mul_(3.0)
        model.save_pretrained(root / name)
    other = peft.get_peft_model(tiny_hf_llama(seed=0, num_hidden_layers=2), peft.LoraConfig(  # another base's
        r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False, lora_dropout=0.0))
    other.save_pretrained(root / "other")
    cfg, params = load_hf(root / "base")
    config = EngineConfig(max_slots=4, page_size=8, num_pages=64, max_top_logprobs=5, compile="lazy",
                          enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=8)
    engine = PagedEngine(params, cfg, config, lora=slots_for(cfg, config, [(n, str(root / n)) for n in ADAPTERS]))
    assert engine.lora.max_rank == 8
    with Server(engine, max_queue=1024, lora_updates=True) as server:
        yield root, server, (cfg, params, config)


def _complete(server, model, prompt, **more):
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **more}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()


def test_echo_logprobs_under_each_adapter_and_the_base_are_peftmodels(setup):
    """``echo`` + ``logprobs`` of a prompt and its greedy tokens, each request under its adapter
    (or none), all four at once: PeftModel's log-softmax with that adapter on (1e-4), and its
    greedy tokens; and the adapter's merged weights alone (the model's forward pass): the same
    greedy tokens, log-probabilities within 1e-5."""
    root, server, (cfg, params, config) = setup
    models = [MODEL, *ADAPTERS]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        answers = dict(zip(models, pool.map(lambda m: _complete(server, m, PROMPT, echo=True, logprobs=1), models)))
    texts, sequences = set(), {}
    for model, answer in answers.items():
        assert answer["model"] == model
        reference = _peft_model(root, None if model == MODEL else model)
        with torch.no_grad():
            full = reference.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                                      eos_token_id=None, pad_token_id=None)[0]
            logp = torch.log_softmax(reference(full[None]).logits[0].double(), dim=-1).numpy()
        choice = answer["choices"][0]
        assert choice["text"] == TOK.decode(PROMPT + full[len(PROMPT):].tolist()), model
        got = choice["logprobs"]["token_logprobs"]
        want = [None] + [logp[i - 1, full[i]] for i in range(1, len(full))]
        np.testing.assert_allclose(got[1:], want[1:], atol=1e-4, err_msg=model)
        texts.add(choice["text"])
        sequences[model] = full.numpy()
    assert len(texts) == len(models)  # each adapter changes what is generated
    # Each adapter's merged weights, alone through the model's own forward pass (one program for all
    # three): the served tokens are its greedy ones, the served log-probabilities its own (1e-5).
    run = jax.jit(forward, static_argnames="cfg")
    for name in ADAPTERS:
        adapters, settings = load_peft(root / name, cfg)
        full = sequences[name]
        logits = np.asarray(run(merge(params, adapters, settings), full[None], cfg).logits[0], np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        n = len(PROMPT)
        np.testing.assert_array_equal(logits[n - 1:-1].argmax(-1), full[n:], err_msg=name)
        np.testing.assert_allclose(answers[name]["choices"][0]["logprobs"]["token_logprobs"][1:],
                                   logp[np.arange(len(full) - 1), full[1:]], atol=1e-5, rtol=0, err_msg=name)
    # a step with an adapter row computes the adapters' product; one without (the base's alone) skips it
    _complete(server, MODEL, [9, 8, 7])
    assert {s.lora for s in server.engine.compiled_shapes} == {False, True}


def test_models_lists_the_adapters_and_they_load_and_unload_at_run_time(setup):
    """``/v1/models`` lists each adapter with the base as parent; an adapter unloaded is a 404 and
    a name loaded again serves again; bad loads are 400s naming the limit; nothing recompiles.
    A server without ``--allow-runtime-lora`` answers both endpoints 403."""
    from fastapi.testclient import TestClient

    from hypertron.serve.orchestrator import Orchestrator
    from hypertron.serve.server import create_app

    root, server, _ = setup
    fixed = TestClient(create_app(Orchestrator(server.engine, TOK), TOK, MODEL))  # not started: refused first
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "a1")}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a1"})):
        r = fixed.post(path, json=body)
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"], r.json()
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    assert set(cards) == {MODEL, *ADAPTERS} and cards["a2"]["parent"] == MODEL
    before = _complete(server, "a3", PROMPT, cache_salt="before")["choices"][0]["text"]  # salted: prefilled whole
    compiles = dict(server.engine.compiles)

    def post(path, body):
        return httpx.post(server.url + path, json=body, timeout=60)

    r = post("/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert r.status_code == 200
    missing = _complete(server, "a3", PROMPT)["error"]
    assert (missing["param"], missing["code"]) == ("model", "model_not_found")
    assert post("/v1/unload_lora_adapter", {"lora_name": "a3"}).json()["error"]["param"] == "lora_name"
    assert post("/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a3")}).status_code == 200
    assert _complete(server, "a3", PROMPT, cache_salt="after")["choices"][0]["text"] == before
    for body, status, message in (
            ({"lora_name": "a1", "lora_path": str(root / "a1")}, 400, "'a1' is loaded already"),
            ({"lora_name": "x", "lora_path": str(root / "nothing")}, 400, "is not a PEFT adapter directory"),
            ({"lora_name": "x", "lora_path": str(root / "big")}, 400, "has rank 16, above --max-lora-rank=8"),
            ({"lora_name": "x", "lora_path": str(root / "other")}, 400,
             "base_model.model.model.layers.0.self_attn.q_proj has lora_A (2, 32)")):
        r = post("/v1/load_lora_adapter", body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.json()
    extra = [f"x{k}" for k in range(MAX_LORAS - len(ADAPTERS))]  # fill every slot
    assert [post("/v1/load_lora_adapter", {"lora_name": n, "lora_path": str(root / "a1")}).status_code
            for n in extra] == [200] * len(extra)
    full = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "a1")})
    assert full.status_code == 400 and f"--max-loras={MAX_LORAS}" in full.json()["error"]["message"]
    assert [post("/v1/unload_lora_adapter", {"lora_name": n}).status_code for n in extra] == [200] * len(extra)
    assert server.engine.compiles == compiles  # nothing compiled for any of it
    server.wait_idle()


def test_a_shared_prompt_shares_cached_pages_under_one_adapter_only(setup):
    """With prefix caching on, a prompt of two full pages is prefilled again under another
    adapter (and under the base), and found cached under the same one."""
    _, server, _ = setup
    prompt = [3 + i for i in range(17)]
    cached = []
    for model in ("a1", "a1", "a2", MODEL):
        answer = _complete(server, model, prompt, max_tokens=1)
        cached.append(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
    assert cached == [0, 16, 0, 0], cached


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "nope"], "--lora-modules: 'nope' is not NAME=PATH (a PEFT adapter directory)"),
    (["--lora-modules", "a1={root}/a1", "a2={root}/a2"], "--lora-modules: 2 adapters, more than --max-loras=1"),
    (["--allow-runtime-lora"], "--allow-runtime-lora: needs --enable-lora (or --lora-modules)"),
])
def test_a_bad_adapter_at_start_is_one_line(setup, capsys, flags, message):
    from hypertron import cli

    root, _, _ = setup
    argv = ["serve", "--model", str(root / "base"), *[f.format(root=root) for f in flags]]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"error: {message.format(root=root)}\n"


def test_256_requests_over_8_adapters_keep_their_own_while_a_ninth_loads_and_unloads(setup):
    """256 concurrent requests, 64 of them streamed, over 8 adapters and the base (five adapters
    loaded for it), while a ninth is loaded, used, unloaded, loaded again and unloaded: each request
    gets the text its prompt and model get alone, and after it every slot, page and adapter slot is
    free and the five are unloaded."""
    root, server, _ = setup
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60).status_code  # noqa: E731
    assert [post("/v1/load_lora_adapter", {"lora_name": n, "lora_path": str(root / n)}) for n in MORE] == [200] * 5
    models = [MODEL, *ADAPTERS, *MORE]
    prompts = {m: [(7 * i + 3 * j) % 250 + 3 for j in range(5)] for i, m in enumerate(models)}
    alone = {m: _complete(server, m, p, max_tokens=4)["choices"][0]["text"] for m, p in prompts.items()}
    assert len(set(alone.values())) == len(models)

    async def one(client, k):
        model = models[k % len(models)]
        body = {"model": model, "prompt": prompts[model], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": k % 4 == 0}
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            return model, r.json()["choices"][0]["text"]
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and (chunk := json.loads(line[6:]))["choices"]:
                    text += chunk["choices"][0]["text"]
        return model, text

    async def run_all():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, k) for k in range(256)))

    def churn():
        return [post("/v1/load_lora_adapter", {"lora_name": "c9", "lora_path": str(root / "a1")}),
                _complete(server, "c9", prompts["a1"], max_tokens=4)["choices"][0]["text"] == alone["a1"],
                post("/v1/unload_lora_adapter", {"lora_name": "c9"}),
                post("/v1/load_lora_adapter", {"lora_name": "c9", "lora_path": str(root / "a2")}),
                post("/v1/unload_lora_adapter", {"lora_name": "c9"})]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        changes = pool.submit(churn)
        done = asyncio.run(run_all())
    assert changes.result() == [200, True, 200, 200, 200]
    assert len(done) == 256 and all(text == alone[model] for model, text in done), \
        [(m, t) for m, t in done if t != alone[m]][:3]
    assert [post("/v1/unload_lora_adapter", {"lora_name": n}) for n in MORE] == [200] * 5
    server.wait_idle()
    assert not +server.engine.lora._users and {a.name for a in server.engine.lora.adapters()} == set(ADAPTERS)


def test_an_engine_in_a_process_of_its_own_serves_the_same_adapters(setup, monkeypatch):
    """The engine of ``setup`` built in a process of its own (``--engine-process``): the adapters
    live in its slots, and each model's greedy text is the one-process server's (PEFT's, above);
    ``/v1/models`` lists them; one unloaded through the front end is a 404, a bad load the same
    400, and loaded again it serves again."""
    from http_harness import ThreadedServer  # tests/
    from support.engine_factories import lora_orchestrator  # tests/support

    from hypertron.serve.engine_process import EngineClient
    from hypertron.serve.server import create_app

    root, server, (_, _, config) = setup
    engine = {k: getattr(config, k) for k in ("max_slots", "page_size", "num_pages", "max_top_logprobs", "compile",
                                              "enable_lora", "max_loras", "max_lora_rank")}
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")  # compiled as in process: the suite's cache serves
    client = EngineClient(lora_orchestrator, (str(root / "base"), {n: str(root / n) for n in ADAPTERS}, engine),
                          max_queue=1024)
    with ThreadedServer(create_app(client, TOK, MODEL, lora_updates=True), lifespan="on") as two:
        def post(path, body):
            return httpx.post(two.url + path, json=body, timeout=60)

        texts = {m: [_complete(s, m, PROMPT)["choices"][0]["text"] for s in (server, two)] for m in (MODEL, *ADAPTERS)}
        assert all(one == other for one, other in texts.values()) and len({t for t, _ in texts.values()}) == 4
        cards = {c["id"]: c for c in httpx.get(two.url + "/v1/models").json()["data"]}
        assert set(cards) == {MODEL, *ADAPTERS} and cards["a2"]["parent"] == MODEL
        assert post("/v1/unload_lora_adapter", {"lora_name": "a3"}).status_code == 200
        assert _complete(two, "a3", PROMPT)["error"]["code"] == "model_not_found"
        big = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "big")})
        assert big.status_code == 400 and "has rank 16, above --max-lora-rank=8" in big.json()["error"]["message"]
        assert post("/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a3")}).status_code == 200
        assert _complete(two, "a3", PROMPT)["choices"][0]["text"] == texts["a3"][0]
    assert not client.running
