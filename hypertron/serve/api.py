"""The OpenAI-compatible API's requests and responses, as pydantic models.

Requests are validated strictly (a JSON string is not a number, a number not a boolean) against
what the schema says by itself: types, ``max_tokens >= 1``, ``n == 1``, stop strings (the
sampling values' ranges are :class:`~hypertron.serve.types.SamplingParams`' own, checked when the
server makes one, with the same error shape). :func:`schema_error` turns pydantic's first error into an
OpenAI-shaped 400 naming the field (``param``). What depends on the model being served (a prompt
longer than it takes, ids past its vocabulary, ``max_tokens`` over the limit, more
log-probabilities than it computes, another model's name) is checked by the server against the
engine's limits, with the same error shape. Fields OpenAI defines that this server ignores are
accepted and ignored (``user``, ``metadata``, ...); ``suffix``, penalties and ``logit_bias`` are
refused when they would change the output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator
from pydantic.json_schema import models_json_schema

MAX_STOP_STRINGS = 16
MAX_CACHE_SALT = 256  # characters
MAX_JSON_DEPTH = 32  # arrays and objects inside one another; a chat request with content parts needs 4


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def schema_error(errors: list[dict]) -> ApiError:
    """The first of pydantic's errors (``ValidationError.errors()``, locations from the body's top)
    as a 400 naming the top-level field it is in."""
    err = errors[0]
    loc = [str(x) for x in err["loc"]]
    if not loc:  # the body itself
        return ApiError(400, "the body must be a JSON object")
    where = loc[0] + "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc[1:])
    message = err["msg"] if err["type"] != "missing" else "required"
    return ApiError(400, f"'{where}': {message}", param=loc[0])


# A JSON string (its escapes whole) and the brackets that open and close arrays and objects.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def parse_json(raw: bytes) -> Any:
    """``raw`` as strict JSON: 400 for a body that is not JSON, nests arrays and objects deeper
    than :data:`MAX_JSON_DEPTH`, or holds ``NaN``, ``Infinity`` or a number past a float's range
    (which Python's ``json`` would take); 400 naming the field for a string with a lone surrogate
    (``"\\ud800"``: legal JSON, not text)."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    depth = np.cumsum(np.isin(brackets, _OPEN).astype(np.int64) - np.isin(brackets, _CLOSE))
    if depth.size and depth.max() > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body nests arrays and objects {int(depth.max())} deep; "
                            f"this server takes at most {MAX_JSON_DEPTH}")
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    found = _unholdable_at(body)
    if found is not None:
        path, why = found
        where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".") or "the body"
        raise ApiError(400, f"'{where}' {why}", param=str(path[0]) if path and isinstance(body, dict) else None)
    return body


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _unholdable_at(value: Any) -> tuple[list, str] | None:
    """The path (keys and indices) to the first string or key in ``value`` holding a lone
    surrogate, or number past a float's range (``1e400``, which Python reads as infinity), and why."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            return [], "holds a lone surrogate (\\ud800 to \\udfff), which is not text"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else ([], "is a number past a float's range")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and _SURROGATE.search(k):
            return [k.encode("utf-8", "backslashreplace").decode()], "holds a lone surrogate, which is not text"
        inner = _unholdable_at(v)
        if inner is not None:
            return [k, *inner[0]], inner[1]
    return None


def _only(value: int, kind: str = "integer") -> dict:
    """The schema of an optional number this server takes only one value of (or null)."""
    return {"anyOf": [{"type": kind, "minimum": value, "maximum": value}, {"type": "null"}]}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Closed(BaseModel):  # a grammar's fields: a key this server does not know would change the output
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Closed):
    """``response_format.json_schema``: the schema the answer keeps to (compact JSON; ``strict``
    or not, it is kept to)."""

    name: str
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Closed):
    """An answer's format (OpenAI's): free text, any JSON object, or JSON keeping to a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Closed):
    """Extension (vLLM's): the output keeps to one of a JSON schema, a regular expression, a Lark
    grammar, a list of choices, or any JSON object (none of them: free text)."""

    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    # Their ranges are SamplingParams' (hypertron.serve.types), whose message is the 400's.
    temperature: float | None = Field(None, description="at least 0 (0: greedy)")
    top_p: float | None = Field(None, description="in (0, 1]")
    top_k: int | None = Field(None, description="extension: sample from the k likeliest tokens; 0 or -1: off")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"}]})
    stop_token_ids: list[int] | None = Field(None, description="extension: token ids that end the completion "
                                                               "(not returned)")
    ignore_eos: bool | None = Field(None, description="extension: go on past the end-of-sequence token")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT, description=(
        "extension (vLLM's): the request shares cached prompt pages only with requests of the same salt"))
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = Field(None, json_schema_extra={"type": "null"})  # vLLM's old names, refused below
    guided_regex: Any = Field(None, json_schema_extra={"type": "null"})
    guided_choice: Any = Field(None, json_schema_extra={"type": "null"})
    guided_grammar: Any = Field(None, json_schema_extra={"type": "null"})
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, json_schema_extra=_only(1))
    best_of: int | None = Field(None, json_schema_extra=_only(1))
    presence_penalty: float | None = Field(None, json_schema_extra=_only(0, "number"))
    frequency_penalty: float | None = Field(None, json_schema_extra=_only(0, "number"))
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})

    @field_validator("n", "best_of")
    @classmethod
    def _one(cls, v: int | None, info) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only {info.field_name}=1 is supported")
        return v

    @field_validator("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    @classmethod
    def _old_guided(cls, v: Any, info) -> None:
        if v is not None:
            raise ValueError(f"vLLM's old name: use 'structured_outputs' with "
                             f"'{info.field_name.removeprefix('guided_')}'")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info) -> float | None:
        if v:
            raise ValueError(f"'{info.field_name}' is not supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("'logit_bias' is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Annotated[Any, WithJsonSchema({  # checked below
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                  {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                  {"type": "array", "minItems": 1, "maxItems": 1,
                   "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}}],
        "description": "text (BOS is put in front), token ids, or a list of one of those"})]
    max_tokens: int | None = Field(None, ge=1)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]
        if isinstance(v, str) or (isinstance(v, list) and all(type(t) is int for t in v)):
            return v
        if v is None:
            raise ValueError("required")
        raise ValueError("a string, a list of token ids, or a list holding exactly one of those "
                         "(n=1: one prompt per request)")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("'suffix' is not supported")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ... reach the template

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)


# ---------------------------------------------------------------------------
# Responses


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="the request's top-level field at fault, if one is")
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose keys and values the prefix cache held")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A completion, or (``stream``) one chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hypertron"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's directory (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "stopped"]


# ---------------------------------------------------------------------------
# The API's description (GET /openapi.json)

_ERRORS = {400: "a field out of range or of the wrong type (named in `param`), or a body that is not strict JSON",
           401: "no API key or a wrong one", 404: "another model's name", 413: "a body past the size limit",
           429: "the waiting queue is full (see `Retry-After`)", 500: "an internal error (a request id, no details)",
           503: "the server is stopping"}
_SSE = ("with `stream`: server-sent events, `data: {chunk}` per chunk (the same object, a chat's with `delta` "
        "for `message`), then `data: [DONE]`; an error after the first chunk is a `data: {\"error\": ...}` event")
HEALTH_RESPONSES = {200: {"model": Health, "description": "the engine loop runs"},
                    503: {"model": Health, "description": "the engine loop has stopped"}}
METRICS_RESPONSES = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                           "description": "Prometheus text exposition"}}


def responses(model: type[BaseModel], *, stream: bool = False) -> dict:
    """A /v1 route's ``responses`` for FastAPI: ``model`` as JSON (and, with ``stream``, the same
    as server-sent events), and every error in OpenAI's shape."""
    ok = {"model": model, "description": "the answer"}
    if stream:
        event = {"type": "object", "required": ["data"], "description": _SSE,  # one event, as OpenAPI 3.1 has it
                 "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"}}}
        ok["content"] = {"text/event-stream": {"schema": event}}
    codes = _ERRORS if stream else {401: _ERRORS[401], 500: _ERRORS[500]}
    return {200: ok, **{code: {"model": ErrorResponse, "description": d} for code, d in codes.items()}}


@dataclasses.dataclass(frozen=True)
class ApiLimits:
    """What the served engine and the server's settings allow, written into the API's description."""

    max_prompt_tokens: int
    max_tokens_limit: int
    max_seq_len: int
    max_top_logprobs: int
    vocab_size: int
    max_body_bytes: int


def openapi_schema(routes, limits: ApiLimits, *, model_name: str, api_key: bool) -> dict:
    """The OpenAPI description of ``routes``: the request models as the /v1 POST bodies, with this
    server's limits as ``maximum`` and descriptions."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title="hypertron", version="1", routes=routes, description=(
        f"OpenAI-compatible. Bodies: strict JSON (no NaN or Infinity, no lone surrogates), at most "
        f"{limits.max_body_bytes} bytes, arrays and objects nested at most {MAX_JSON_DEPTH} deep. A prompt: at most "
        f"{limits.max_prompt_tokens} tokens; the context (prompt and completion) {limits.max_seq_len}."))
    requests = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    _, defs = models_json_schema([(m, "validation") for m in requests.values()],
                                 ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs["$defs"])
    for path, model in requests.items():
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    completion, chat = (components["schemas"][m.__name__]["properties"] for m in requests.values())
    for props in (completion, chat):
        props["model"] |= {"enum": [model_name], "description": "the model this server serves (GET /v1/models)"}
    for prop in (completion["max_tokens"], chat["max_tokens"], chat["max_completion_tokens"]):
        _limit(prop, "maximum", limits.max_tokens_limit, f"at most {limits.max_tokens_limit} here (--max-tokens-limit)")
    for prop in (completion["logprobs"], chat["top_logprobs"]):
        _limit(prop, "maximum", limits.max_top_logprobs, f"at most {limits.max_top_logprobs} here")
    for prop in (completion["prompt"], chat["messages"]):
        prop["description"] = (prop.get("description", "") + f" At most {limits.max_prompt_tokens} tokens "
                               f"(--max-prompt-tokens); the context is {limits.max_seq_len} tokens.").strip()
    for branch in completion["prompt"]["anyOf"]:
        items = branch.get("items", {})
        for ids in (items, items.get("items", {})):
            if ids.get("type") == "integer":
                ids["maximum"] = limits.vocab_size - 1
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in schema["paths"].items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return schema


def _limit(prop: dict, key: str, value: int, description: str) -> None:
    """Set ``key`` on the integer branch of an optional integer's schema, and its description."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch[key] = value
    prop["description"] = description


async def read_request(request, model: type[BaseModel], max_body: int, model_name: str,
                       adapters=frozenset()):
    """The body as ``model``: 413 past ``max_body`` bytes, 400 for bad JSON or a schema error, 404
    for another model's name than ``model_name`` or one of ``adapters`` (a request without one,
    where ``model`` allows that, is for the model served)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_body:
        raise ApiError(413, f"request body over {max_body} bytes", code="request_too_large")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > max_body:
            raise ApiError(413, f"request body over {max_body} bytes", code="request_too_large")
    body = parse_json(bytes(raw))
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise schema_error(e.errors(include_url=False)) from None
    asked = getattr(req, "model", None)
    if asked is not None and asked != model_name and asked not in adapters:
        served = ", ".join(repr(m) for m in (model_name, *sorted(adapters)))
        raise ApiError(404, f"model {asked!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")
    return req
