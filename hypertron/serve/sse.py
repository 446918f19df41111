"""Server-sent events of the OpenAI API's streamed responses: what an event leaves out, each
event's JSON, and a request's commonest event (new text alone) made from a template without a
model dumped for every token (:class:`Template`)."""

from __future__ import annotations

import json

from pydantic import BaseModel


def sse_exclude(include_usage: bool) -> set[str] | None:
    """What a streamed event leaves out: ``usage`` unless the request asked for it."""
    return None if include_usage else {"usage"}


TEXT_MARK = "hypertron-text-mark"  # stands for an event's text in a Template; JSON escapes nothing in it


class Template:
    """A request's commonest streamed event (new text alone: no log-probabilities, no finish
    reason, not the first) as the JSON before and after its text, made once from the response
    model; each such event is then ``json.dumps`` of its text between the two, the same text
    :func:`dump_event` makes, without a model built and dumped for every token."""

    def __init__(self, event: BaseModel, exclude):
        self.prefix, mark, self.suffix = dump_event(event, exclude).partition(json.dumps(TEXT_MARK))
        assert mark, "the template's event holds no text mark"

    def __call__(self, text: str) -> str:
        return self.prefix + json.dumps(text) + self.suffix


def dump_event(event: BaseModel, exclude) -> str:
    """One streamed event as JSON; a chat delta without its unset fields (``{}`` for no text)."""
    data = event.model_dump(exclude=exclude)
    for choice in data.get("choices", ()):
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return json.dumps(data)
