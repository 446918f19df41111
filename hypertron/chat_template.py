"""Chat templates: messages -> the text and token ids a chat model reads, and which of those
tokens are the assistant's (the ones fine-tuning puts loss on).

The one renderer that training and serving share; callers reach it as
:func:`hypertron.tokenizer.render_chat`. It imports only :mod:`hypertron.errors` (and jinja2), so it
sits on the ground floor beside the tokenizer that re-exports it; the tokenizer it is given is
any :class:`hypertron.tokenizer.Tokenizer`.

Templates are Jinja, rendered as transformers' ``apply_chat_template`` renders them: an
``ImmutableSandboxedEnvironment`` (templates come from the Hub: untrusted code) with
``trim_blocks``, ``lstrip_blocks`` and loop controls; ``tojson`` without HTML escaping;
``raise_exception(message)``; ``strftime_now(format)``; the variables ``messages``, ``tools``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``. The ids are those of the whole
rendered text, encoded without the tokenizer's own special tokens (``apply_chat_template(
tokenize=True)``'s ids).

The assistant mask: a template with ``{% generation %}`` ... ``{% endgeneration %}`` blocks marks
the characters its blocks render (transformers' ``return_assistant_tokens_mask``). A template
without them (Llama 3's, ChatML) gets it by prefix rendering: assistant message ``i`` is what
``messages[:i+1]`` adds to ``messages[:i]`` rendered with the generation prompt, less trailing
whitespace (the newline a template puts between turns is not the model's to say). Either way a
token is masked when its characters (:meth:`Tokenizer.encode_offsets`) overlap a marked span. A
template whose rendering of a shorter conversation is not a prefix of the longer one's (it rewrites
earlier turns, as templates that drop old reasoning do) has no such mask and is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

from hypertron.errors import DataError

_RECORDER = "_hypertron_generation_spans"  # the per-render variable the generation blocks write to


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: ``ids`` [n] encode ``text``; ``assistant_mask`` [n] is 1 on the
    assistant's tokens, 0 elsewhere (None when the caller asked for no mask)."""

    ids: list[int]
    assistant_mask: list[int] | None
    text: str


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and whether it marks its assistant text with generation blocks."""

    source: str
    compiled: object  # a jinja2.Template
    has_generation: bool


class _Spans:
    """What one render's generation blocks record: the length of the text rendered so far (the
    render loop adds each chunk) and the [start, end) character spans of the blocks."""

    def __init__(self):
        self.length, self.spans = 0, []


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> ChatTemplate:
    """``source`` compiled in the sandbox; a :class:`DataError` ``chat_template does not compile:
    ...`` (with the line) for one that does not."""
    import jinja2

    env = _environment()
    try:
        tree = env.parse(source)
        compiled = env.from_string(tree)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"chat_template does not compile: {e.message} (line {e.lineno})") from None
    except jinja2.TemplateError as e:
        raise DataError(f"chat_template does not compile: {e}") from None
    has_generation = any(isinstance(block.call, jinja2.nodes.ExtensionAttribute) and block.call.name == "_record"
                         for block in tree.find_all(jinja2.nodes.CallBlock))
    return ChatTemplate(source, compiled, has_generation)


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False,
                template: str | None = None, tools: list[dict] | None = None,
                with_mask: bool = True) -> RenderedChat:
    """``messages`` rendered with ``template`` (Jinja source; None: ``tokenizer.chat_template``)
    and encoded by ``tokenizer``, with the assistant mask unless ``with_mask`` is False (see the
    module docstring). Raises :class:`DataError` for a tokenizer without a template, a template
    that does not compile, one that refuses the messages (``raise_exception``'s text), and, for a
    mask by prefix rendering, one that rewrites earlier turns."""
    if template is None:
        template = tokenizer.chat_template
        if template is None:
            raise DataError(f"the tokenizer {tokenizer.name} has no chat_template (tokenizer_config.json)")
    chat = compile_chat_template(template)
    variables = {"tools": tools, **_special_tokens(tokenizer)}
    text, spans = _render(chat, messages, add_generation_prompt, variables)
    if not with_mask:
        return RenderedChat(tokenizer.encode(text), None, text)
    if not chat.has_generation:
        spans = _prefix_spans(chat, messages, text, variables)
    ids, offsets = tokenizer.encode_offsets(text)
    return RenderedChat(list(ids), _mask(offsets, spans), text)


def _render(chat: ChatTemplate, messages: list[dict], add_generation_prompt: bool,
            variables: dict) -> tuple[str, list[tuple[int, int]]]:
    """The text and its generation blocks' [start, end) spans."""
    import jinja2

    recorder, chunks = _Spans(), []
    try:
        for chunk in chat.compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **variables, **{_RECORDER: recorder}):
            chunks.append(chunk)
            recorder.length += len(chunk)
    except jinja2.TemplateError as e:
        raise DataError(f"the chat template refused the messages{_template_line(e)}: {e}") from None
    return "".join(chunks), recorder.spans


def _template_line(error: BaseException) -> str:
    """`` at line N``: where in the template ``error`` was raised (Jinja gives its traceback the
    template's lines), or "" if no frame of it is the template's."""
    line, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return "" if line is None else f" at line {line}"


def _prefix_spans(chat: ChatTemplate, messages: list[dict], text: str, variables: dict) -> list[tuple[int, int]]:
    """Each assistant message's span in ``text``: what it adds to the conversation before it
    rendered with the generation prompt, less trailing whitespace."""
    spans = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        before, _ = _render(chat, messages[:i], True, variables)
        after, _ = _render(chat, messages[:i + 1], False, variables)
        if not (after.startswith(before) and text.startswith(after)):
            raise DataError(f"the chat template rewrites earlier turns (the rendering of messages[:{i}] is not a "
                            f"prefix of the longer conversation's), so its assistant tokens cannot be found: "
                            "mark them with {% generation %} ... {% endgeneration %}")
        spans.append((len(before), len(before) + len(after[len(before):].rstrip())))
    return spans


def _mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose [start, end) characters overlap a span (an empty token: whose start
    lies in one)."""
    return [int(any(a < e and max(b, a + 1) > s for s, e in spans if e > s)) for a, b in offsets]


def _special_tokens(tokenizer) -> dict:
    return {key: "" if i is None else tokenizer.token_text(i)
            for key, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))}


@functools.cache
def _environment():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        """``{% generation %}body{% endgeneration %}`` renders its body and records where it lies."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            recorder = jinja2.nodes.Name(_RECORDER, "load")
            return jinja2.nodes.CallBlock(self.call_method("_record", [recorder]), [], [], body).set_lineno(lineno)

        def _record(self, recorder, caller):
            text = caller()
            if isinstance(recorder, _Spans):  # the body's text follows all that was yielded before it
                recorder.spans.append((recorder.length, recorder.length + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=time.strftime)
    return env
