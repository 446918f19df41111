"""Many LoRA adapters served in one batch, against PEFT 0.21: a tiny random ``transformers`` Llama,
three PEFT adapters on it (all seven projections at rank 4, the attention's at rank 8, q and v at
rank 2), the real engine behind the OpenAI-compatible server with the adapters in its slots.

A request's ``model`` picks an adapter; each request's tokens and log-probabilities are PEFT's
with its adapter on (or off, for the base), whatever else shares the step; adapters load and
unload at run time; the prefix cache never shares one adapter's pages with another's.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.tiny import tiny_hf_llama  # noqa: E402  (tests/support)
from test_server import MODEL, TOK, Server  # noqa: E402  (tests/)

from hypertron.config import EngineConfig  # noqa: E402
from hypertron.models.hf import load_hf  # noqa: E402
from hypertron.serve.engine import PagedEngine  # noqa: E402
from hypertron.serve.lora_slots import slots_for  # noqa: E402

torch.set_num_threads(1)
ADAPTERS = {  # name: (rank, targets, seed)
    "a1": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 1),
    "a2": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], 2),
    "a3": (2, ["q_proj", "v_proj"], 3),
}
BIG = (16, ["q_proj"], 4)  # saved, not loaded: above the server's --max-lora-rank
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
    for name, (rank, modules, seed) in {**ADAPTERS, "big": BIG}.items():
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
                          enable_lora=True, max_loras=4, max_lora_rank=8)
    engine = PagedEngine(params, cfg, config, lora=slots_for(cfg, config, [(n, str(root / n)) for n in ADAPTERS]))
    assert engine.lora.max_rank == 8
    with Server(engine) as server:
        yield root, server


def _complete(server, model, prompt, **more):
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **more}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()


def test_echo_logprobs_under_each_adapter_and_the_base_are_peftmodels(setup):
    """``echo`` + ``logprobs`` of a prompt and its greedy tokens, each request under its adapter
    (or none), all four at once: PeftModel's log-softmax with that adapter on (1e-4), and its
    greedy tokens."""
    root, server = setup
    models = [MODEL, *ADAPTERS]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        answers = dict(zip(models, pool.map(lambda m: _complete(server, m, PROMPT, echo=True, logprobs=1), models)))
    texts = set()
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
    assert len(texts) == len(models)  # each adapter changes what is generated
    # a step with an adapter row computes the adapters' product; one without (the base's alone) skips it
    _complete(server, MODEL, [9, 8, 7])
    assert {s.lora for s in server.engine.compiled_shapes} == {False, True}


def test_models_lists_the_adapters_and_they_load_and_unload_at_run_time(setup):
    """``/v1/models`` lists each adapter with the base as parent; an adapter unloaded is a 404 and
    a name loaded again serves again; bad loads are 400s naming the limit; nothing recompiles."""
    root, server = setup
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
    assert post("/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": str(root / "a1")}).status_code == 200
    full = post("/v1/load_lora_adapter", {"lora_name": "a5", "lora_path": str(root / "a1")})
    assert full.status_code == 400 and "--max-loras=4" in full.json()["error"]["message"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "a4"}).status_code == 200
    assert server.engine.compiles == compiles  # nothing compiled for any of it
    server.wait_idle()


def test_a_shared_prompt_shares_cached_pages_under_one_adapter_only(setup):
    """With prefix caching on, a prompt of two full pages is prefilled again under another
    adapter (and under the base), and found cached under the same one."""
    _, server = setup
    prompt = [3 + i for i in range(17)]
    cached = []
    for model in ("a1", "a1", "a2", MODEL):
        answer = _complete(server, model, prompt, max_tokens=1)
        cached.append(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
    assert cached == [0, 16, 0, 0], cached


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "nope"], "--lora-modules: 'nope' is not NAME=PATH (a PEFT adapter directory)"),
    (["--lora-modules", "a1={root}/a1", "a2={root}/a2"], "--lora-modules: 2 adapters, more than --max-loras=1"),
])
def test_a_bad_adapter_at_start_is_one_line(setup, capsys, flags, message):
    from hypertron import cli

    root, _ = setup
    argv = ["serve", "--model", str(root / "base"), *[f.format(root=root) for f in flags]]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"error: {message.format(root=root)}\n"


def test_streams_keep_their_adapters_while_another_loads_and_unloads(setup):
    """32 streams over the base and three adapters, while a fourth adapter is loaded, used,
    unloaded, loaded again and unloaded: every stream gets the text its prompt and model get
    alone, and after it every slot, page and adapter slot is free."""
    root, server = setup
    prompts = {MODEL: [5, 6, 7, 8, 9], "a1": [100, 101, 102, 103, 104], "a2": [42] * 5, "a3": [250, 9, 31, 7, 7]}
    alone = {m: _complete(server, m, p, max_tokens=8)["choices"][0]["text"] for m, p in prompts.items()}

    def stream(model):
        body = {"model": model, "prompt": prompts[model], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text = ""
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    text += json.loads(line[6:])["choices"][0]["text"] if json.loads(line[6:])["choices"] else ""
        return model, text

    def churn():
        post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60).status_code  # noqa: E731
        codes = [post("/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": str(root / "a1")}),
                 _complete(server, "a4", prompts["a1"], max_tokens=8)["choices"][0]["text"] == alone["a1"],
                 post("/v1/unload_lora_adapter", {"lora_name": "a4"}),
                 post("/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": str(root / "a2")}),
                 post("/v1/unload_lora_adapter", {"lora_name": "a4"})]
        return codes

    with concurrent.futures.ThreadPoolExecutor(33) as pool:
        changes = pool.submit(churn)
        done = list(pool.map(stream, [m for _ in range(8) for m in prompts]))
    assert changes.result() == [200, True, 200, 200, 200]
    assert all(text == alone[model] for model, text in done), [(m, t) for m, t in done if t != alone[m]][:3]
    server.wait_idle()
    assert not +server.engine.lora._users and {a.name for a in server.engine.lora.adapters()} == set(ADAPTERS)
