"""``hypertron serve --config serve.yaml``: a typed ServeConfig from a file equals the same settings
given as flags, flags override the file, and mistakes in either are one line naming the key.

The end-to-end test serves a small random checkpoint twice, once from the file and once from the
flags (uvicorn in a thread on 127.0.0.1, stopped by the test), and both answer the same request
the same way.
"""

from __future__ import annotations

import dataclasses

import httpx
import jax
import pytest
from http_harness import ThreadedServer  # tests/

from hypertron import cli
from hypertron.config import PRESETS, Config, ServeConfig, TrainConfig
from hypertron.errors import ConfigError

SETTINGS = {"max_slots": 3, "page_size": 8, "num_pages": 40, "kv_cache_dtype": "int8", "quantize": "int8",
            "max_queue": 5, "max_tokens_limit": 30, "model_name": "from-yaml", "api_key": "k3y", "port": 8123,
            "compile": "lazy", "dispatch_ahead": "on"}


def _flags(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in (cli.flag(key), str(value))]


def _config(argv: list[str]) -> ServeConfig:
    return cli.serve_config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_a_config_file_equals_the_same_flags_and_flags_override_it(tmp_path):
    import yaml

    path = _yaml(tmp_path, yaml.safe_dump({"checkpoint": "runs/x", **SETTINGS}))
    from_file = _config(["--config", path])
    from_flags = _config(["--checkpoint", "runs/x", *_flags(SETTINGS)])
    assert from_file == from_flags == ServeConfig(checkpoint="runs/x", **SETTINGS)
    assert _config(["--config", path, "--max-slots", "7", "--checkpoint", "runs/y"]) == \
        dataclasses.replace(from_file, max_slots=7, checkpoint="runs/y")
    assert _config(["--checkpoint", "runs/x"]) == ServeConfig(checkpoint="runs/x")  # the schema's defaults
    assert _config(["--checkpoint", "runs/x", "--no-enable-prefix-caching"]) == \
        _config(["--config", _yaml(tmp_path, "checkpoint: runs/x\nenable_prefix_caching: false\n")]) == \
        ServeConfig(checkpoint="runs/x", enable_prefix_caching=False)
    # dispatch_ahead=auto: every step one ahead on an accelerator, only small ones on a CPU.
    from hypertron.serve.server import CPU_AHEAD_MAX_TOKENS, resolve_dispatch_ahead
    on_cpu = jax.default_backend() == "cpu"
    assert resolve_dispatch_ahead("auto") == (True, CPU_AHEAD_MAX_TOKENS if on_cpu else None)
    assert resolve_dispatch_ahead("on") == (True, None) and resolve_dispatch_ahead("off") == (False, None)


@pytest.mark.parametrize("text, argv, message", [
    ("checkpoint: runs/x\nmax_slotz: 4\n", [], "unknown config key 'max_slotz' in serve config"),
    ("checkpoint: runs/x\nmax_slots: 0\n", [], "serve.yaml: max_slots=0: must be positive"),
    ("checkpoint: runs/x\nkv_cache_dtype: fp8\n", [], "serve.yaml: kv_cache_dtype=fp8: must be one of auto, bfloat16"),
    ("checkpoint: runs/x\npage_size: 12\n", [], "serve.yaml: page_size=12: must be a power of two"),
    ("checkpoint: runs/x\ncompile: eager\n", [], "serve.yaml: compile=eager: must be one of background, lazy"),
    ("checkpoint: runs/x\nport: [1]\n", [], "serve.yaml: port: expected an integer"),
    ("max_slots: 4\n", [], "serve.yaml: checkpoint: required"),
    ("checkpoint: runs/x\n", ["--max-slots", "0"], "--max-slots=0: must be positive"),
    ("- a list\n", [], "must hold a mapping"),
])
def test_config_file_mistakes_are_one_line_naming_the_key(tmp_path, capsys, text, argv, message):
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        _config(["--config", path, *argv])
    assert cli.main(["serve", "--config", path, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_without_a_checkpoint_serve_says_which_flag_is_missing(capsys):
    assert cli.main(["serve", "--max-slots", "2"]) == 2
    assert capsys.readouterr().err == "error: --checkpoint: required (the run directory or Hugging Face model directory to serve)\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from hypertron.checkpoint import save_params
    from hypertron.models import init_params

    model = dataclasses.replace(PRESETS["tiny"], num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1,
                                head_dim=16, mlp_dim=64, max_seq_len=64)
    path = tmp_path_factory.mktemp("serve-config") / "run"
    cfg = Config(run_dir=str(path), model=model, train=TrainConfig(seq_len=32))
    save_params(path, cfg, init_params(model, jax.random.key(0)))
    return str(path)


def _serve(argv: list[str], monkeypatch):
    """Run ``hypertron serve ARGV`` up to the point it would serve (uvicorn's run); return its app."""
    import hypertron.serve.server as server

    captured = {}
    monkeypatch.setattr(server, "run", lambda app, host, port: captured.update(app=app, host=host, port=port))
    assert cli.main(["serve", *argv]) == 0
    cfg = _config(argv)
    assert (captured["host"], captured["port"]) == (cfg.host, cfg.port)
    return captured["app"], cfg


@pytest.mark.slow
def test_serve_from_a_config_file_answers_as_from_flags(tmp_path, run_dir, monkeypatch):
    settings = {"max_slots": 2, "page_size": 8, "kv_cache_dtype": "int8", "model_name": "tiny-served",
                "api_key": "secret", "max_tokens_limit": 12}
    path = _yaml(tmp_path, "\n".join(f"{k}: {v}" for k, v in {"checkpoint": run_dir, **settings}.items()))
    answers = []
    for argv in (["--config", path], ["--checkpoint", run_dir, *_flags(settings)]):
        app, cfg = _serve(argv, monkeypatch)
        assert cfg == ServeConfig(checkpoint=run_dir, **settings)
        with ThreadedServer(app, lifespan="on") as s:
            headers = {"Authorization": "Bearer secret"}
            assert httpx.get(s.url + "/v1/models").status_code == 401  # the api_key is in force
            models = httpx.get(s.url + "/v1/models", headers=headers).json()
            body = {"model": "tiny-served", "prompt": "def f", "max_tokens": 8, "temperature": 0}
            done = httpx.post(s.url + "/v1/completions", json=body, headers=headers, timeout=60).json()
            too_long = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 13}, headers=headers)
        answers.append((models["data"][0]["id"], done["choices"][0]["text"], too_long.status_code))
    assert answers[0] == answers[1] and answers[0][0] == "tiny-served" and answers[0][2] == 400


@pytest.mark.parametrize("groups", ["auto", "max"])
def test_serve_measures_a_steps_cost_at_start_unless_prefill_groups_is_max(groups, run_dir, monkeypatch, capsys):
    """``--prefill-groups auto`` (the default) measures a step's cost before serving, says so in one
    line, and hands the scheduler the fixed cost in tokens' worth; ``max`` measures nothing. Prefix
    caching reaches the scheduler on by default, off with ``--no-enable-prefix-caching``."""
    import hypertron.serve.orchestrator as orchestrator

    made, real = [], orchestrator.Orchestrator
    monkeypatch.setattr(orchestrator, "Orchestrator", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    caching = [] if groups == "auto" else ["--no-enable-prefix-caching"]
    _serve(["--checkpoint", run_dir, "--prefill-groups", groups, *caching], monkeypatch)
    overhead, err = made[0].scheduler.step_overhead_tokens, capsys.readouterr().err
    assert made[0].scheduler.pool.enabled == (not caching)
    if groups == "max":
        assert overhead is None and "a step costs" not in err
    else:
        assert err.count("hypertron serve: a step costs") == 1 and (overhead is None or overhead >= 0)


def test_generate_gives_what_the_server_answers(run_dir, monkeypatch):
    """``hypertron generate`` (its function, :func:`hypertron.serve.generate.generate`, called as the
    CLI calls it) drives the same engine and sampler as the server: the same prompt and settings
    give the same tokens, greedy and seeded (compared as the server's detokenizer writes them:
    this random model emits bytes that are not whole characters)."""
    from hypertron.serve.generate import generate
    from hypertron.serve.model import load_for_inference
    from hypertron.serve.detokenize import detokenizer

    model, params, tok = load_for_inference(run_dir)
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode("def f")
    app, _ = _serve(["--checkpoint", run_dir, "--max-slots", "2"], monkeypatch)
    with ThreadedServer(app, lifespan="on") as s:
        for settings in ({"temperature": 0}, {"temperature": 0.9, "top_k": 20, "seed": 3}):
            (out,) = generate(params, model, [ids], 10, eos_ids=tok.eos_ids, **settings)
            body = {"model": "run", "prompt": "def f", "max_tokens": 10, **settings}
            answer = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            detok = detokenizer(tok, ids)
            text = "".join(detok.add(t) for t in out if t not in tok.eos_ids) + detok.flush()
            assert answer == text, (settings, out)
