"""Factories of an engine process (:class:`hypertron.serve.engine_process.EngineClient`) for the
tests: each builds, in that process, what it returns, ``(orchestrator, model_name)``."""

from __future__ import annotations

MODEL = "fake-model"


def fake_orchestrator(engine: dict, scheduler: dict | None = None):
    """An orchestrator over ``FakeEngine(**engine)`` (tests/fake_engine.py) with the byte tokenizer."""
    from fake_engine import FakeEngine  # tests/

    from hypertron.config import SchedulerConfig
    from hypertron.serve.orchestrator import Orchestrator
    from hypertron.tokenizer import get_tokenizer

    return Orchestrator(FakeEngine(**engine), get_tokenizer("byte"), SchedulerConfig(**(scheduler or {}))), MODEL


def lora_orchestrator(base: str, adapters: dict[str, str], engine: dict):
    """An orchestrator over the real engine of the Hugging Face model at ``base`` with the byte
    tokenizer and ``adapters`` (name: PEFT directory) in its LoRA slots, ``EngineConfig(**engine)``."""
    from hypertron.config import EngineConfig, SchedulerConfig
    from hypertron.models.hf import load_hf
    from hypertron.serve.engine import PagedEngine
    from hypertron.serve.lora_slots import slots_for
    from hypertron.serve.orchestrator import Orchestrator
    from hypertron.tokenizer import get_tokenizer

    cfg, params = load_hf(base)
    config = EngineConfig(**engine)
    engine = PagedEngine(params, cfg, config, lora=slots_for(cfg, config, list(adapters.items())))
    return Orchestrator(engine, get_tokenizer("byte"), SchedulerConfig(max_queue=1024)), MODEL


def refuse_to_start(error: type[BaseException], message: str):
    """A factory that raises ``error(message)``."""
    raise error(message)
