"""The OpenAI-compatible API's requests and responses, as pydantic models.

Requests are validated strictly (a JSON string is not a number, a number not a boolean) against
what the schema says by itself: types, ``max_tokens >= 1``, ``temperature >= 0``, ``0 < top_p <=
1``, ``n == 1``, stop strings. :func:`schema_error` turns pydantic's first error into an
OpenAI-shaped 400 naming the field (``param``). What depends on the model being served (a prompt
longer than it takes, ids past its vocabulary, ``max_tokens`` over the limit, more
log-probabilities than it computes, another model's name) is checked by the server against the
engine's limits, with the same error shape. Fields OpenAI defines that this server ignores are
accepted and ignored (``user``, ``metadata``, ...); ``suffix``, penalties and ``logit_bias`` are
refused when they would change the output.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


def schema_error(e: ValidationError) -> ApiError:
    """The first of pydantic's errors as a 400 naming the top-level field it is in."""
    err = e.errors(include_url=False)[0]
    loc = [str(x) for x in err["loc"]]
    if not loc:  # the body itself
        return ApiError(400, "the body must be a JSON object")
    where = loc[0] + "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc[1:])
    message = err["msg"] if err["type"] != "missing" else "required"
    return ApiError(400, f"'{where}': {message}", param=loc[0])


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension: 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool | None = None  # extension
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n", "best_of")
    @classmethod
    def _one(cls, v: int | None, info) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only {info.field_name}=1 is supported")
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

    prompt: Any  # a string, token ids, or a list of one of those (checked below)
    max_tokens: int | None = Field(None, ge=1)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None

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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
