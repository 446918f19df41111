"""Loading a served model: the engine of a run, bundle or Hugging Face directory, with its LoRA
slots and its draft model (speculative decoding), for ``hypertron serve`` and the tests. Apart from
:mod:`hypertron.serve.engine`, which runs what it is given and reads no file."""

from __future__ import annotations

from pathlib import Path

from hypertron.config import EngineConfig
from hypertron.serve.engine import PagedEngine
from hypertron.serve.lora_slots import slots_for
from hypertron.serve.model import check_draft, load_for_inference, model_config_of, served_name
from hypertron.serve.placement import engine_mesh
from hypertron.serve.types import DraftModel


def load_engine(checkpoint: str | Path, config: EngineConfig, *, quantize: str = "none", lora_modules=(),
                draft: tuple[str, int] | None = None):
    """``(engine, tokenizer, model_name)`` for a run directory (trained or converted from HF), each
    weight read into its shards; ``eos_ids`` the tokenizer's; with ``config.enable_lora`` its LoRA
    slots, holding ``lora_modules`` (``(name, path)`` pairs); with ``draft`` (``(path, k)``:
    speculative decoding's draft model, loaded as the served one is, with its tokenizer checked
    against it), a :class:`DraftModel` proposing ``k`` tokens."""
    model = model_config_of(checkpoint)
    mesh = model and engine_mesh(model, config, draft and model_config_of(draft[0]))
    model, params, tok = load_for_inference(checkpoint, quantize, mesh)
    lora = slots_for(model, config, lora_modules)
    drafter = None
    if draft is not None:
        draft_model, draft_params, draft_tok = load_for_inference(draft[0], quantize, mesh)
        check_draft(draft_model, draft_tok, model, tok)
        drafter = DraftModel(draft_params, draft_model, draft[1])
    return PagedEngine(params, model, config, eos_ids=tok.eos_ids, lora=lora, draft=drafter), tok, served_name(checkpoint)
