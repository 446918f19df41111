"""The LoRA adapters' endpoints, vLLM's: ``POST /v1/load_lora_adapter`` ``{"lora_name",
"lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` change the adapters served
while requests run (no restart, no recompile: :class:`~hypertron.serve.lora_slots.LoraSlots`), when
the server allows it (``--allow-runtime-lora``: a load reads a path on the server; else a 403); a
request's ``model`` names an adapter, and ``GET /v1/models`` lists each with its base as ``parent``.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from hypertron.serve.api import ApiError, ModelCard
from hypertron.serve.types import LoraError


class LoadLoraAdapter(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256, description="the model name requests use for it")
    lora_path: str = Field(min_length=1, description="a PEFT LoRA adapter directory on the server")


class UnloadLoraAdapter(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)


def api_error(e: LoraError) -> ApiError:
    return ApiError(e.status, str(e), param=e.param, code="model_not_found" if e.status == 404 else None)


def adapter_cards(slots, model_name: str, created: int, max_model_len: int) -> list[ModelCard]:
    """``/v1/models``' cards of the adapters loaded, each with its base as ``parent``."""
    return [ModelCard(id=a.name, created=created, max_model_len=max_model_len, root=a.path, parent=model_name)
            for a in slots.adapters()]


def add_lora_routes(router: APIRouter, slots, read, model_name: str, updates: bool) -> None:
    """The two endpoints on ``router`` (behind its API key) for ``slots`` (a
    :class:`~hypertron.serve.lora_slots.LoraSlots`); ``read(request, model)`` reads a body;
    ``updates``: whether they may change the adapters (else each answers 403)."""

    def allowed() -> None:
        if not updates:
            raise ApiError(403, "loading and unloading LoRA adapters at run time is off: start the server with "
                                "--allow-runtime-lora", type="permission_error")

    async def load_lora_adapter(request: Request):
        allowed()
        req = await read(request, LoadLoraAdapter)
        if req.lora_name == model_name:
            raise ApiError(400, f"{model_name!r} is the base model's name", param="lora_name")
        try:  # reading the files and writing the slot's arrays: off the event loop
            adapter = await asyncio.to_thread(slots.load, req.lora_name, req.lora_path)
        except LoraError as e:
            raise api_error(e) from None
        return {"lora_name": adapter.name, "lora_path": adapter.path, "rank": adapter.rank}

    async def unload_lora_adapter(request: Request):
        allowed()
        req = await read(request, UnloadLoraAdapter)
        try:  # off the event loop: an engine in a process of its own answers on it
            await asyncio.to_thread(slots.unload, req.lora_name)
        except LoraError as e:
            raise api_error(e) from None
        return {"lora_name": req.lora_name}

    router.add_api_route("/load_lora_adapter", load_lora_adapter, methods=["POST"],
                         summary="Load a LoRA adapter, served as the model lora_name")
    router.add_api_route("/unload_lora_adapter", unload_lora_adapter, methods=["POST"],
                         summary="Unload a LoRA adapter (requests using it finish with it)")
