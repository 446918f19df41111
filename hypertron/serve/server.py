"""OpenAI-compatible HTTP server over an :class:`~hypertron.serve.orchestrator.Orchestrator`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). Streaming is server-sent events,
``data: {json}\\n\\n`` per chunk, ending with ``data: [DONE]\\n\\n``. With an API key every
``/v1`` endpoint wants ``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open.
Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Choices where OpenAI leaves room: a text prompt gets the tokenizer's BOS in front (token-id
prompts are taken as they are); EOS and ``stop_token_ids`` tokens are not returned and not
counted in ``usage.completion_tokens``, which counts the tokens returned; legacy
``logprobs.top_logprobs`` also hold the chosen token (as OpenAI's do); chat prompts are
rendered with the tokenizer's ``chat_template`` (from ``tokenizer_config.json``) or else
:data:`DEFAULT_CHAT_TEMPLATE`, which puts ``<|role|>`` lines before each message and BOS first.
Extensions: ``top_k``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hypertron.config import ServeConfig
from hypertron.errors import UserError
from hypertron.serve.detokenize import IncrementalDetokenizer
from hypertron.serve.orchestrator import ABORT, ERROR, Generation, Orchestrator, QueueFull
from hypertron.serve.types import SamplingParams, TokenLogprobs

log = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def create_app(orchestrator: Orchestrator, tokenizer, model_name: str, *, api_key: str | None = None,
               max_prompt_tokens: int | None = None, max_tokens_limit: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app. It starts ``orchestrator`` at startup and stops it at shutdown.

    ``max_prompt_tokens`` defaults to (and is capped at) the engine's ``max_seq_len - 1``;
    ``max_tokens_limit`` to its ``max_seq_len``. ``chat_template`` is Jinja source (see the
    module docstring). Raises :class:`UserError` for a template that does not compile.
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

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])
    v1.add_api_route("/completions", api.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", api.chat_completions, methods=["POST"])
    v1.add_api_route("/models", api.models, methods=["GET"])
    app.include_router(v1)

    @app.get("/health")
    async def health():
        ok = orchestrator.running
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(orchestrator.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(ApiError)
    async def on_api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_crash(_request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(ApiError(500, f"internal error: {exc}", type="server_error").body(), status_code=500)

    return app


class _Api:
    """The /v1 handlers and what they share."""

    def __init__(self, orch: Orchestrator, tokenizer, model_name, max_prompt, max_tokens_limit, max_body, render_chat):
        self.orch, self.tok, self.model_name, self.render_chat = orch, tokenizer, model_name, render_chat
        self.max_prompt, self.max_tokens_limit, self.max_body = max_prompt, max_tokens_limit, max_body
        self._token_text: dict[int, str] = {}
        self.created = int(time.time())

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "hypertron", "max_model_len": self.orch.max_seq_len}]}

    # -- POST /v1/completions -----------------------------------------------------------

    async def completions(self, request: Request):
        body = await self._read_json(request)
        prompt = self._completion_prompt(body.get("prompt"))
        echo = _field(body, "echo", bool, False)
        n_logprobs = _field(body, "logprobs", int, None)
        sampling, stop = self._sampling(body, "max_tokens", 16, n_logprobs, "logprobs")
        if _field(body, "suffix", str, None):
            raise ApiError(400, "'suffix' is not supported", param="suffix")
        gen = self._submit(prompt, sampling, stop, want_prompt_logprobs=echo and n_logprobs is not None)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo_text, echo_offsets = _pieces(self.tok, prompt) if echo else ("", [])
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}

        def choice(text: str, ids, lps, offsets, finish, first: bool) -> dict:
            logprobs = None
            if n_logprobs is not None:
                logprobs = self._legacy_logprobs(ids, lps, [len(echo_text) + o for o in offsets])
                if first and echo:  # the first prompt token has no log-probability
                    echoed = self._legacy_logprobs(prompt, [None, *(gen.prompt_logprobs or [])], echo_offsets)
                    logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
            return {"index": 0, "text": (echo_text if first else "") + text, "logprobs": logprobs,
                    "finish_reason": finish}

        if _field(body, "stream", bool, False):
            async def events():
                first = True
                async for c in gen:
                    _raise_if_failed(c)
                    yield {**head, "choices": [choice(c.text, c.token_ids, c.logprobs, c.offsets, c.finish_reason,
                                                      first)]}
                    first = False
            return self._sse(gen, events(), head, body, len(prompt))
        chunks = await _collect(gen, request)
        if chunks is None:
            return Response(status_code=499)
        ids, lps, offsets = (_cat(chunks, f) for f in ("token_ids", "logprobs", "offsets"))
        text = "".join(c.text for c in chunks)
        return {**head, "choices": [choice(text, ids, lps, offsets, chunks[-1].finish_reason, True)],
                "usage": _usage(len(prompt), gen.completion_tokens)}

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = ([self.tok.bos_id] if self.tok.bos_id is not None else []) + self.tok.encode(prompt)
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            if any(not 0 <= t < self.tok.vocab_size for t in prompt):
                raise ApiError(400, f"'prompt' token ids must be in [0, {self.tok.vocab_size})", param="prompt")
            ids = list(prompt)
        elif prompt is None:
            raise ApiError(400, "missing 'prompt'", param="prompt")
        else:
            raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding exactly "
                           "one of those (n=1: one prompt per request)", param="prompt")
        return self._check_prompt_len(ids, "prompt")

    def _check_prompt_len(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(400, f"'{param}' is empty", param=param)
        if len(ids) > self.max_prompt:
            raise ApiError(400, f"'{param}' is {len(ids)} tokens; this server takes at most {self.max_prompt}",
                           param=param, code="context_length_exceeded")
        return ids

    # -- POST /v1/chat/completions ------------------------------------------------------

    async def chat_completions(self, request: Request):
        body = await self._read_json(request)
        prompt = self._check_prompt_len(self.render_chat(_messages(body.get("messages"))), "messages")
        want_logprobs = _field(body, "logprobs", bool, False)
        top_n = _field(body, "top_logprobs", int, None)
        if top_n is not None and not want_logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        sampling, stop = self._sampling(body, key, None, (top_n or 0) if want_logprobs else None, "top_logprobs")
        gen = self._submit(prompt, sampling, stop, want_prompt_logprobs=False)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}

        def logprobs(ids, lps):
            return {"content": [self._chat_logprob(i, lp, top_n or 0) for i, lp in zip(ids, lps)]} \
                if want_logprobs else None

        if _field(body, "stream", bool, False):
            async def events():
                yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
                async for c in gen:
                    _raise_if_failed(c)
                    delta = {"content": c.text} if c.text else {}
                    yield {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs(c.token_ids,
                           c.logprobs) if c.token_ids else None, "finish_reason": c.finish_reason}]}
            return self._sse(gen, events(), head, body, len(prompt))
        chunks = await _collect(gen, request)
        if chunks is None:
            return Response(status_code=499)
        ids, lps = _cat(chunks, "token_ids"), _cat(chunks, "logprobs")
        message = {"role": "assistant", "content": "".join(c.text for c in chunks)}
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": logprobs(ids, lps),
                             "finish_reason": chunks[-1].finish_reason}],
                "usage": _usage(len(prompt), gen.completion_tokens)}

    # -- shared -------------------------------------------------------------------------

    async def _read_json(self, request: Request) -> dict:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            raise ApiError(413, f"request body over {self.max_body} bytes", code="request_too_large")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body:
                raise ApiError(413, f"request body over {self.max_body} bytes", code="request_too_large")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise ApiError(400, "missing 'model'", param="model")
        if model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return body

    def _sampling(self, body: dict, max_key: str, max_default: int | None, logprobs: int | None, logprobs_key: str):
        """SamplingParams and stop strings from the fields both endpoints share."""
        if _field(body, "n", int, 1) != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if _field(body, "best_of", int, 1) != 1:
            raise ApiError(400, "only best_of=1 is supported", param="best_of")
        for name in ("presence_penalty", "frequency_penalty"):
            if _field(body, name, float, 0.0) != 0:
                raise ApiError(400, f"'{name}' is not supported", param=name)
        if body.get("logit_bias"):
            raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")
        max_tokens = _field(body, max_key, int, min(max_default or self.max_tokens_limit, self.max_tokens_limit))
        if not 0 < max_tokens <= self.max_tokens_limit:
            raise ApiError(400, f"'{max_key}' is {max_tokens}; expected 1 to {self.max_tokens_limit}", param=max_key)
        temperature = _field(body, "temperature", float, 1.0)
        if temperature < 0:
            raise ApiError(400, f"'temperature' is {temperature}; it must not be negative", param="temperature")
        top_p = _field(body, "top_p", float, 1.0)
        if not 0 < top_p <= 1:
            raise ApiError(400, f"'top_p' is {top_p}; expected (0, 1]", param="top_p")
        top_k = _field(body, "top_k", int, 0)
        if top_k < -1:
            raise ApiError(400, f"'top_k' is {top_k}; expected 0 (or -1) for off, or a positive count", param="top_k")
        if logprobs is not None and not 0 <= logprobs <= self.orch.max_top_logprobs:
            raise ApiError(400, f"'{logprobs_key}' is {logprobs}; expected 0 to {self.orch.max_top_logprobs}",
                           param=logprobs_key)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty "
                           "strings", param="stop")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
            raise ApiError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=float(temperature), top_k=max(top_k, 0), top_p=float(top_p),
            seed=_field(body, "seed", int, None), logprobs=logprobs, stop_token_ids=tuple(stop_ids),
            ignore_eos=_field(body, "ignore_eos", bool, False))
        return sampling, stop

    def _submit(self, prompt, sampling, stop, want_prompt_logprobs: bool) -> Generation:
        try:
            return self.orch.submit(prompt, sampling, stop=stop, want_prompt_logprobs=want_prompt_logprobs)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), type="server_error", code="unavailable") from None

    def _sse(self, gen: Generation, events, head: dict, body: dict, n_prompt: int) -> StreamingResponse:
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and options.get("include_usage") is True

        async def stream():
            try:
                async for event in events:
                    if include_usage:
                        event["usage"] = None
                    yield f"data: {json.dumps(event)}\n\n"
                if include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(n_prompt, gen.completion_tokens)})}\n\n"
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

    def _chat_logprob(self, token_id: int, lp: TokenLogprobs, n: int) -> dict:
        def entry(i: int, v: float) -> dict:
            return {"token": self.token_text(i), "logprob": v, "bytes": list(self.tok.token_bytes(i))}
        return {**entry(token_id, lp.logprob),
                "top_logprobs": [entry(i, v) for i, v in list(zip(lp.top_ids, lp.top_logprobs))[:n]]}


def _field(body: dict, name: str, kind: type, default):
    """``body[name]`` checked against ``kind`` (int, float, bool, str); ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    ok = {int: _is_int(value), float: _is_int(value) or isinstance(value, float),
          bool: isinstance(value, bool), str: isinstance(value, str)}[kind]
    if not ok:
        raise ApiError(400, f"'{name}' must be {'an' if kind is int else 'a'} {kind.__name__}, "
                       f"not {json.dumps(value)[:40]}", param=name)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def _raise_if_failed(chunk) -> None:
    if chunk.finish_reason in (ERROR, ABORT):
        raise ApiError(500 if chunk.finish_reason == ERROR else 503, chunk.error or "the request was aborted",
                       type="server_error")


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
    detok, text, offsets = IncrementalDetokenizer(tokenizer), "", []
    for t in ids:
        offsets.append(len(text))
        text += detok.add(t)
    return text + detok.flush(), offsets


def _cat(chunks: list, field: str) -> list:
    return list(itertools.chain.from_iterable(getattr(c, field) for c in chunks))


def _messages(messages) -> list[dict]:
    """Chat messages as the template sees them: role and text content."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list" if messages is not None else "missing 'messages'",
                       param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({**m, "content": content or ""})
    return out


def _chat_renderer(template: str | None, tokenizer):
    """messages -> prompt token ids, by Jinja in a sandbox (as Hugging Face renders chat templates)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: time.strftime(f))
    try:
        compiled = env.from_string(template or DEFAULT_CHAT_TEMPLATE)
    except jinja2.TemplateError as e:
        raise UserError(f"chat_template does not compile: {e}") from None
    bos, eos = ("" if i is None else tokenizer.token_text(i) for i in (tokenizer.bos_id, tokenizer.eos_id))

    def render(messages: list[dict]) -> list[int]:
        try:
            text = compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
        except jinja2.TemplateError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
        lead = [tokenizer.bos_id] if template is None and tokenizer.bos_id is not None else []
        return lead + tokenizer.encode(text)

    return render


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


def main(serve: ServeConfig) -> int:
    """``hypertron serve``: load the engine of ``serve.checkpoint`` and serve it until interrupted."""
    from hypertron.serve.engine import load_engine
    from hypertron.serve.orchestrator import Orchestrator

    engine, tokenizer, model_name = load_engine(
        serve.checkpoint, max_slots=serve.max_slots, page_size=serve.page_size, num_pages=serve.num_pages,
        kv_cache_dtype=serve.kv_cache_dtype, quantize=serve.quantize)
    orchestrator = Orchestrator(engine, tokenizer, max_queue=serve.max_queue,
                                max_num_batched_tokens=serve.max_num_batched_tokens,
                                max_prefill_rows=serve.max_prefill_rows)
    app = create_app(orchestrator, tokenizer, serve.model_name or model_name, api_key=serve.api_key,
                     max_prompt_tokens=serve.max_prompt_tokens, max_tokens_limit=serve.max_tokens_limit,
                     chat_template=tokenizer.chat_template)
    if serve.host not in ("127.0.0.1", "localhost", "::1") and not serve.api_key:
        log.warning("serving on %s without an api_key: anyone who can reach it can use it", serve.host)
    run(app, serve.host, serve.port)
    return 0
