"""OpenAI-compatible HTTP server over an :class:`~hypertron.serve.orchestrator.Orchestrator` (in this
process, or in one of its own behind an :class:`~hypertron.serve.engine_process.EngineClient`).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json`` (the API's
description), ``POST /reset_prefix_cache`` (drops the cached KV pages no request holds). Streaming is server-sent events, ``data: {json}\\n\\n`` per chunk, ending with
``data: [DONE]\\n\\n``. With an API key every ``/v1`` endpoint (and ``/openapi.json``, ``/reset_prefix_cache``) wants
``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open. Errors have
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Choices where OpenAI leaves room: a text prompt gets the tokenizer's BOS in front (token-id
prompts are taken as they are); EOS and ``stop_token_ids`` tokens are not returned and not
counted in ``usage.completion_tokens``, which counts the tokens returned; legacy
``logprobs.top_logprobs`` also hold the chosen token (as OpenAI's do); chat prompts are
rendered with the tokenizer's ``chat_template`` (from ``tokenizer_config.json``) or else
:data:`DEFAULT_CHAT_TEMPLATE`, which puts ``<|role|>`` lines before each message and BOS first.
Structured output (:mod:`hypertron.serve.structured`): ``response_format`` (``json_object``,
``json_schema``; OpenAI's on chat, vLLM's on completions too) and the extension
``structured_outputs`` (vLLM's: ``json``, ``regex``, ``grammar``, ``choice``, ``json_object``).
Extensions: ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt`` (vLLM's); ``usage`` has
``prompt_tokens_details.cached_tokens`` (the prompt tokens the prefix cache held).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import signal
import time
import uuid
from typing import NoReturn

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hypertron.config import ConfigError, ServeConfig
from hypertron.errors import DataError
from pydantic import BaseModel

from hypertron.serve.api import (
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    ApiError,
    ApiLimits,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageOut,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    TokenLogprob,
    TopLogprob,
    Usage,
    openapi_schema,
    read_request,
    responses,
    schema_error,
)
from hypertron.serve.detokenize import detokenizer
from hypertron.serve.engine_process import EngineClient, end_process
from hypertron.serve.readying import engine_side, tune_for_serving
from hypertron.serve.lora_routes import add_lora_routes, adapter_cards, api_error
from hypertron.serve.orchestrator import ABORT, ERROR, Generation, Orchestrator, QueueFull
from hypertron.serve.sse import TEXT_MARK, Template, dump_event, sse_exclude
from hypertron.serve.structured import Grammars, Guide, StructuredError, grammar_for
from hypertron.serve.types import LoraError, SamplingError, SamplingParams, TokenLogprobs, check_token_ids
from hypertron.tokenizer import compile_chat_template, render_chat
log = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_MAX_BODY_BYTES = 4 << 20
OFF_LOOP_CHARS = 2048  # a prompt this long (about 0.4 ms of BPE here) is tokenized off the event loop


def create_app(orchestrator: Orchestrator, tokenizer, model_name: str, *, api_key: str | None = None,
               max_prompt_tokens: int | None = None, max_tokens_limit: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = None,
               openapi: bool = True, lora_updates: bool = False) -> FastAPI:
    """The FastAPI app. It starts ``orchestrator`` at startup and stops it at shutdown.

    ``max_prompt_tokens`` defaults to (and is capped at) the engine's ``max_seq_len - 1``;
    ``max_tokens_limit`` to its ``max_seq_len``. ``chat_template`` is Jinja source (see the
    module docstring). ``openapi``: serve the API's description at ``GET /openapi.json`` (behind
    the API key when there is one). ``lora_updates``: the LoRA endpoints may load and unload adapters
    (``--allow-runtime-lora``; else they answer 403). Raises :class:`UserError` for a template that does not compile.
    """
    max_prompt = min(max_prompt_tokens or orchestrator.max_seq_len, orchestrator.max_seq_len - 1)
    max_tokens_limit = max_tokens_limit or orchestrator.max_seq_len
    render_chat = _chat_renderer(chat_template, tokenizer)
    api = _Api(orchestrator, tokenizer, model_name, max_prompt, max_tokens_limit, max_body_bytes, render_chat)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        orchestrator.start()
        yield
        await asyncio.to_thread(orchestrator.stop)

    app = FastAPI(title="hypertron", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    authorize = authorizer(api_key)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    v1.add_api_route("/completions", api.completions, methods=["POST"], summary="Complete a prompt",
                     responses=responses(Completion, stream=True))
    v1.add_api_route("/chat/completions", api.chat_completions, methods=["POST"], summary="Answer a chat",
                     responses=responses(ChatCompletion, stream=True))
    v1.add_api_route("/models", api.models, methods=["GET"], summary="The model served (and its LoRA adapters)",
                     responses=responses(ModelList))
    if api.lora is not None:
        add_lora_routes(v1, api.lora, api._read, model_name, updates=lora_updates)
        if model_name in {a.name for a in api.lora.adapters()}:
            raise ConfigError(f"--lora-modules: {model_name!r} is the base model's name (--model-name)")
    app.include_router(v1)

    @app.get("/health", summary="Liveness: 200 while the engine loop runs, else 503", responses=HEALTH_RESPONSES)
    async def health():
        ok = orchestrator.running
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus text", responses=METRICS_RESPONSES)
    async def metrics():
        return Response(await asyncio.to_thread(orchestrator.exposition), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", dependencies=[Depends(authorize)], include_in_schema=False)  # operators'
    async def reset_prefix_cache():
        try:
            dropped = await asyncio.wrap_future(orchestrator.reset_prefix_cache())
        except RuntimeError as e:
            raise ApiError(503, str(e), type="server_error", code="unavailable") from None
        return {"pages_dropped": dropped}

    if openapi:
        limits = ApiLimits(max_prompt_tokens=min(max_prompt, orchestrator.kv_pool_tokens - 1),
                           max_tokens_limit=max_tokens_limit, max_seq_len=orchestrator.max_seq_len,
                           max_top_logprobs=orchestrator.max_top_logprobs, vocab_size=tokenizer.vocab_size,
                           max_body_bytes=max_body_bytes)

        def describe() -> dict:
            if app.openapi_schema is None:
                app.openapi_schema = openapi_schema(app.routes, limits, model_name=model_name,
                                                    api_key=api_key is not None)
            return app.openapi_schema

        app.openapi = describe
        app.add_api_route("/openapi.json", lambda: JSONResponse(app.openapi()), methods=["GET"],
                          dependencies=[Depends(authorize)], include_in_schema=False)
    add_error_handlers(app)
    return app


def authorizer(api_key: str | None):
    """The dependency that wants ``Authorization: Bearer API_KEY`` (a 401 otherwise); none wanted
    without a key."""

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return authorize


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; a crash as a 500 with a request id and none of its text
    (the log has the traceback under the same id)."""

    @app.exception_handler(ApiError)
    async def on_api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request, exc: StarletteHTTPException):  # 404, 405 (with its Allow header)
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request, exc: RequestValidationError):
        error = schema_error([{**e, "loc": e["loc"][1:]} for e in exc.errors()])  # without "body"
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(Exception)
    async def on_crash(_request, exc: Exception):
        return JSONResponse(internal_error("request failed", exc=exc).body(), status_code=500)


def internal_error(what: str, detail: str = "", exc: BaseException | None = None) -> ApiError:
    """A 500 that names a request id and nothing of what went wrong; the log gets ``what``,
    ``detail`` and ``exc``'s traceback under that id."""
    rid = uuid.uuid4().hex[:16]
    log.error("%s (request id %s) %s", what, rid, detail, exc_info=exc)
    return ApiError(500, f"internal error (request id {rid}); the server log has the details", type="server_error")


class _Api:
    """The /v1 handlers and what they share."""

    def __init__(self, orch: Orchestrator, tokenizer, model_name, max_prompt, max_tokens_limit, max_body, render_chat):
        self.orch, self.tok, self.model_name, self.render_chat = orch, tokenizer, model_name, render_chat
        self.lora = orch.lora  # LoRA adapters, each served as a model
        self.max_prompt, self.max_tokens_limit, self.max_body = max_prompt, max_tokens_limit, max_body
        self._token_text: dict[int, str] = {}
        self.created = int(time.time())
        self.grammars = Grammars(tokenizer, orch.vocab_size)  # structured output

    async def models(self):
        cards = [ModelCard(id=self.model_name, created=self.created, max_model_len=self.orch.max_seq_len)]
        if self.lora is not None:
            cards += adapter_cards(self.lora, self.model_name, self.created, self.orch.max_seq_len)
        return ModelList(data=cards).model_dump(exclude_none=True)

    # -- POST /v1/completions -----------------------------------------------------------

    async def completions(self, request: Request):
        req = await self._read(request, CompletionRequest)
        served = req.model or self.model_name  # the model or the LoRA adapter asked for
        prompt = await self._completion_prompt(req.prompt)
        echo, n_logprobs = bool(req.echo), req.logprobs
        sampling = self._sampling(req, req.max_tokens, 16, n_logprobs, "logprobs")
        guide = await self._guide(req)
        gen = self._submit(prompt, sampling, req, want_prompt_logprobs=echo and n_logprobs is not None, guide=guide)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo_text, echo_offsets = _pieces(self.tok, prompt) if echo else ("", [])

        def completion(text: str, ids, lps, offsets, finish, first: bool, usage: Usage | None = None) -> Completion:
            logprobs = None
            if n_logprobs is not None:
                logprobs = self._legacy_logprobs(ids, lps, [len(echo_text) + o for o in offsets])
                if first and echo:  # the first prompt token has no log-probability
                    echoed = self._legacy_logprobs(prompt, [None, *(gen.prompt_logprobs or [])], echo_offsets)
                    logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
            choice = CompletionChoice(text=(echo_text if first else "") + text, finish_reason=finish,
                                      logprobs=None if logprobs is None else CompletionLogprobs(**logprobs))
            return Completion(id=rid, created=created, model=served, choices=[choice], usage=usage)

        if req.stream:
            text_only = None if n_logprobs is not None else Template(
                completion(TEXT_MARK, [], [], [], None, False), sse_exclude(req.include_usage))

            async def events():
                first = True
                async for c in gen:
                    _raise_if_failed(c)
                    if text_only is not None and not first and c.finish_reason is None:
                        yield text_only(c.text)
                    else:
                        yield completion(c.text, c.token_ids, c.logprobs, c.offsets, c.finish_reason, first)
                    first = False
            head = Completion(id=rid, created=created, model=served, choices=[])
            return self._sse(gen, events(), head, req.include_usage, len(prompt))
        chunks = await _collect(gen, request)
        if chunks is None:
            return Response(status_code=499)
        ids, lps, offsets = (_cat(chunks, f) for f in ("token_ids", "logprobs", "offsets"))
        text = "".join(c.text for c in chunks)
        return completion(text, ids, lps, offsets, chunks[-1].finish_reason, True,
                          Usage.of(len(prompt), gen.completion_tokens, gen.cached_tokens)).model_dump()

    async def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = ([self.tok.bos_id] if self.tok.bos_id is not None else []) + await self._encode(prompt)
        else:
            try:
                check_token_ids(prompt, self.tok.vocab_size, "prompt")
            except SamplingError as e:
                raise ApiError(400, str(e), param="prompt") from None
            ids = list(prompt)
        return self._check_prompt_len(ids, "prompt")

    async def _encode(self, text: str) -> list[int]:
        """``text``'s ids; a long one tokenized on a worker thread, while the event loop reads and
        streams the other requests (a tokenizer that lets go of the GIL then works beside it)."""
        if len(text) < OFF_LOOP_CHARS:
            return self.tok.encode(text)
        return await asyncio.to_thread(self.tok.encode, text)

    def _check_prompt_len(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(400, f"'{param}' is empty", param=param)
        if len(ids) > self.max_prompt:
            raise ApiError(400, f"'{param}' is {len(ids)} tokens; this server takes at most {self.max_prompt}",
                           param=param, code="context_length_exceeded")
        if len(ids) >= self.orch.kv_pool_tokens:  # the first sampled token needs a place too
            raise ApiError(400, f"'{param}' is {len(ids)} tokens; the KV cache's page pool holds "
                                f"{self.orch.kv_pool_tokens} tokens in all, so a prompt must be shorter",
                           param=param, code="context_length_exceeded")
        return ids

    # -- POST /v1/chat/completions ------------------------------------------------------

    async def chat_completions(self, request: Request):
        req = await self._read(request, ChatCompletionRequest)
        served = req.model or self.model_name
        messages = [{**m.model_dump(exclude={"content"}), "content": m.text()} for m in req.messages]
        long = sum(len(m["content"] or "") for m in messages) >= OFF_LOOP_CHARS  # rendered and tokenized off the loop
        ids = await asyncio.to_thread(self.render_chat, messages) if long else self.render_chat(messages)
        prompt = self._check_prompt_len(ids, "messages")
        want_logprobs, top_n = bool(req.logprobs), req.top_logprobs
        if top_n is not None and not want_logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        max_tokens, key = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens
                           is not None else (req.max_tokens, "max_tokens"))
        sampling = self._sampling(req, max_tokens, None, (top_n or 0) if want_logprobs else None, "top_logprobs",
                                  max_key=key)
        guide = await self._guide(req)
        gen = self._submit(prompt, sampling, req, want_prompt_logprobs=False, guide=guide)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(ids, lps) -> ChoiceLogprobs | None:
            return ChoiceLogprobs(content=[self._chat_logprob(i, lp, top_n or 0) for i, lp in zip(ids, lps)]) \
                if want_logprobs else None

        if req.stream:
            def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=served, choices=[choice])

            text_only = None if want_logprobs else Template(
                chunk(ChatChunkChoice(delta=Delta(content=TEXT_MARK))), sse_exclude(req.include_usage))

            async def events():
                yield chunk(ChatChunkChoice(delta=Delta(role="assistant", content="")))
                async for c in gen:
                    _raise_if_failed(c)
                    if text_only is not None and c.text and c.finish_reason is None:
                        yield text_only(c.text)
                        continue
                    yield chunk(ChatChunkChoice(delta=Delta(content=c.text or None), finish_reason=c.finish_reason,
                                                logprobs=logprobs(c.token_ids, c.logprobs) if c.token_ids else None))
            head = ChatCompletionChunk(id=rid, created=created, model=served, choices=[])
            return self._sse(gen, events(), head, req.include_usage, len(prompt))
        chunks = await _collect(gen, request)
        if chunks is None:
            return Response(status_code=499)
        ids, lps = _cat(chunks, "token_ids"), _cat(chunks, "logprobs")
        choice = ChatChoice(message=ChatMessageOut(content="".join(c.text for c in chunks)),
                            logprobs=logprobs(ids, lps), finish_reason=chunks[-1].finish_reason)
        return ChatCompletion(id=rid, created=created, model=served, choices=[choice],
                              usage=Usage.of(len(prompt), gen.completion_tokens, gen.cached_tokens)).model_dump()

    # -- shared -------------------------------------------------------------------------

    async def _read(self, request: Request, model: type[BaseModel]):
        adapters = frozenset(a.name for a in self.lora.adapters()) if self.lora is not None else frozenset()
        return await read_request(request, model, self.max_body, self.model_name, adapters)

    def _sampling(self, req, max_tokens: int | None, max_default: int | None, logprobs: int | None,
                  logprobs_key: str, max_key: str = "max_tokens") -> SamplingParams:
        """SamplingParams from the fields both endpoints share, within this server's limits."""
        if max_tokens is None:
            max_tokens = min(max_default or self.max_tokens_limit, self.max_tokens_limit)
        if max_tokens > self.max_tokens_limit:
            raise ApiError(400, f"'{max_key}' is {max_tokens}; expected 1 to {self.max_tokens_limit}", param=max_key)
        given = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p}
        try:  # SamplingParams checks its values (its message is this 400's); then against the model
            sampling = SamplingParams(
                max_tokens=max_tokens, seed=req.seed, logprobs=logprobs, stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=bool(req.ignore_eos), **{k: v for k, v in given.items() if v is not None})
            sampling.check(vocab_size=self.orch.vocab_size, max_top_logprobs=self.orch.max_top_logprobs)
        except SamplingError as e:  # the message names the SamplingParams field; param is the API's name
            param = {"max_tokens": max_key, "logprobs": logprobs_key}.get(e.field, e.field)
            raise ApiError(400, e.named(f"'{param}'"), param=param) from None
        return sampling

    async def _guide(self, req) -> Guide | None:
        """The request's grammar's state (:mod:`hypertron.serve.structured`), compiled off the
        event loop; None for free text. A grammar that cannot be used is a 400 naming its field."""
        def plain(model):
            return None if model is None else model.model_dump(by_alias=True, exclude_none=True)

        try:
            grammar = grammar_for(plain(req.response_format), plain(req.structured_outputs))
            return None if grammar is None else await asyncio.to_thread(self.grammars.guide, grammar)
        except StructuredError as e:
            raise ApiError(400, str(e), param=e.field) from None

    def _submit(self, prompt, sampling, req, want_prompt_logprobs: bool, guide: Guide | None = None) -> Generation:
        try:
            return self.orch.submit(prompt, sampling, stop=req.stop or [], want_prompt_logprobs=want_prompt_logprobs,
                                    cache_salt=req.cache_salt, adapter=None if req.model in (None, self.model_name)
                                    else req.model, guide=guide)
        except LoraError as e:  # unloaded since the request was read
            raise api_error(e) from None
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise ApiError(400, str(e), param=getattr(e, "field", None)) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), type="server_error", code="unavailable") from None

    def _sse(self, gen: Generation, events, head: BaseModel, include_usage: bool, n_prompt: int) -> StreamingResponse:
        """Server-sent events of ``events`` (response models, or their JSON made by a
        :class:`Template`); with ``include_usage``, each has ``usage: null`` and a last one
        (``head``, no choices) has the usage."""
        exclude = sse_exclude(include_usage)

        async def stream():
            try:
                async for event in events:
                    yield f"data: {event if isinstance(event, str) else dump_event(event, exclude)}\n\n"
                if include_usage:
                    head.usage = Usage.of(n_prompt, gen.completion_tokens, gen.cached_tokens)
                    yield f"data: {head.model_dump_json()}\n\n"
            except ApiError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            finally:
                gen.cancel()  # a client that went away frees its slot; after the end, a no-op
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def token_text(self, token_id: int) -> str:
        """How a token is shown in logprobs: its bytes as text, or, where they are not whole UTF-8
        characters (a lone byte, part of a character), as ``bytes:\\xNN...`` (as OpenAI does)."""
        text = self._token_text.get(token_id)
        if text is None:
            raw = self.tok.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_text[token_id] = text
        return text

    def _legacy_logprobs(self, ids, lps, offsets) -> dict:
        top = [None if lp is None else {**{self.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)},
                                        self.token_text(t): lp.logprob} for t, lp in zip(ids, lps)]
        return {"tokens": [self.token_text(t) for t in ids],
                "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": top, "text_offset": list(offsets)}

    def _chat_logprob(self, token_id: int, lp: TokenLogprobs, n: int) -> TokenLogprob:
        def entry(i: int, v: float) -> TopLogprob:
            return TopLogprob(token=self.token_text(i), logprob=v, bytes=list(self.tok.token_bytes(i)))
        return TokenLogprob(**entry(token_id, lp.logprob).model_dump(),
                            top_logprobs=[entry(i, v) for i, v in list(zip(lp.top_ids, lp.top_logprobs))[:n]])


def _raise_if_failed(chunk) -> None:
    if chunk.finish_reason == ERROR:
        raise internal_error("generation failed", chunk.error or "")  # the step's traceback is logged already
    if chunk.finish_reason == ABORT:
        raise ApiError(503, chunk.error or "the request was aborted", type="server_error")


async def _collect(gen: Generation, request: Request) -> list | None:
    """Every chunk of ``gen``; None (and ``gen`` cancelled) if the client goes away first."""
    async def drain():
        return [c async for c in gen]

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                chunks = task.result()
                _raise_if_failed(chunks[-1])
                return chunks
            if await request.is_disconnected():
                return None
    finally:
        task.cancel()
        gen.cancel()


def _pieces(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """Text of ``ids`` and where each token's text starts in it."""
    detok, text, offsets = detokenizer(tokenizer), "", []
    for t in ids:
        offsets.append(len(text))
        text += detok.add(t)
    return text + detok.flush(), offsets


def _cat(chunks: list, field: str) -> list:
    return list(itertools.chain.from_iterable(getattr(c, field) for c in chunks))


def _chat_renderer(template: str | None, tokenizer):
    """messages -> prompt token ids, by :func:`hypertron.tokenizer.render_chat` (``template``, else
    :data:`DEFAULT_CHAT_TEMPLATE` with BOS first). Raises :class:`UserError` for a template that does not compile."""
    source = template or DEFAULT_CHAT_TEMPLATE
    compile_chat_template(source)  # a DataError (a UserError) now rather than at the first request
    lead = [tokenizer.bos_id] if template is None and tokenizer.bos_id is not None else []

    def render(messages: list[dict]) -> list[int]:
        try:
            rendered = render_chat(tokenizer, messages, add_generation_prompt=True, template=source, with_mask=False)
        except DataError as e:  # the template's raise_exception
            raise ApiError(400, str(e), param="messages") from None
        return lead + rendered.ids

    return render


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> NoReturn:
    """Serve ``app`` with uvicorn until interrupted (^C, SIGTERM), then end the process (status 0).

    Two things a clean stop printed before: uvicorn raises the signal that stopped it again once it
    has shut down, for the handler it found, and asyncio's own SIGINT handler turned that into a
    KeyboardInterrupt inside the finished loop (a traceback after "Finished server process"): a
    handler of ours, which does nothing, takes it instead. And JAX's native threads (its compiler's,
    XLA's pools) could abort the interpreter's finalization: the process ends without it
    (:func:`~hypertron.serve.engine_process.end_process`)."""
    import uvicorn

    signal.signal(signal.SIGINT, lambda *_: None)  # uvicorn's own handler replaces it while it serves
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    end_process(0)


def build(serve: ServeConfig) -> tuple[FastAPI, Orchestrator | EngineClient]:
    """The app and its orchestrator (not started) for ``serve``: the engine of ``serve.checkpoint``
    with ``serve.engine``, the orchestrator and its scheduler with ``serve.scheduler``, each whole
    (:func:`engine_side`); with ``serve.engine_process`` they run in a process of their own,
    started now, and the orchestrator here is its :class:`EngineClient`."""
    if serve.engine_process:
        orchestrator = EngineClient(engine_side, (serve, True), max_queue=serve.max_queue)
        model_name = orchestrator.model_name
    else:
        orchestrator, model_name = engine_side(serve)
    tokenizer = orchestrator.tokenizer
    app = create_app(orchestrator, tokenizer, serve.model_name or model_name, api_key=serve.api_key,
                     max_prompt_tokens=serve.max_prompt_tokens, max_tokens_limit=serve.max_tokens_limit,
                     chat_template=tokenizer.chat_template, openapi=serve.openapi,
                     lora_updates=serve.allow_runtime_lora)
    return app, orchestrator


def main(serve: ServeConfig) -> int:
    """``hypertron serve``: load the engine of ``serve.checkpoint`` and serve it until interrupted."""
    app, orchestrator = build(serve)
    if serve.host not in ("127.0.0.1", "localhost", "::1") and not serve.api_key:
        log.warning("serving on %s without an api_key: anyone who can reach it can use it", serve.host)
    if isinstance(orchestrator, Orchestrator):  # else the engine's process tuned itself
        tune_for_serving(orchestrator.engine)
    run(app, serve.host, serve.port)
    return 0
