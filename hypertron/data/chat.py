"""Fine-tuning examples: a conversation (or a prompt and its completion) -> token ids and the mask
of the tokens that carry loss.

The mask is per token of ``ids`` (``mask[i] == 1``: token ``i`` is a target the loss counts),
before the shift that makes each token the target of the one before it; :func:`hypertron.data.
packing.pack_rows` does that shift. The ids and the assistant mask come from the one chat renderer,
:func:`hypertron.tokenizer.render_chat`, so training sees the text that serving renders.

``loss_on``, as TRL's ``SFTTrainer`` has it: ``assistant`` (``assistant_only_loss``: the assistant's
tokens, from ``{% generation %}`` blocks or prefix rendering), ``completion``
(``completion_only_loss``: what follows the prompt) or ``all`` (every token but the first, which
nothing predicts).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypertron.errors import DataError
from hypertron.tokenizer import Tokenizer, render_chat


def chat_example(tokenizer: Tokenizer, messages: Sequence[dict], *, loss_on: str = "assistant",
                 template: str | None = None) -> tuple[list[int], list[int]]:
    """``messages`` rendered with ``template`` (None: the tokenizer's) -> ``(ids, loss_mask)``, two
    lists of the same length: the assistant's tokens (``loss_on="assistant"``) or all of them
    (``"all"``). A :class:`DataError` for a message that is not a ``{role, content}`` mapping, and
    for what :func:`render_chat` refuses."""
    _check_loss_on(loss_on, ("assistant", "all"))
    check_messages(messages)
    rendered = render_chat(tokenizer, list(messages), template=template, with_mask=loss_on == "assistant")
    mask = rendered.assistant_mask if loss_on == "assistant" else [1] * len(rendered.ids)
    return rendered.ids, mask


def prompt_completion_example(tokenizer: Tokenizer, prompt: str | Sequence[dict], completion: str | Sequence[dict],
                              *, loss_on: str = "completion",
                              template: str | None = None) -> tuple[list[int], list[int]]:
    """A prompt and its completion -> ``(ids, loss_mask)``, as TRL's prompt-completion format.

    Strings: ``encode(prompt) + encode(completion) + [eos]`` (bos in front when the tokenizer has
    one). Message lists: the prompt rendered with the generation prompt, and prompt + completion
    rendered whole; the completion is what the whole adds (a template that rewrites the prompt is
    refused). ``loss_on="completion"`` masks the completion (with its eos), ``"all"`` every token.
    """
    _check_loss_on(loss_on, ("completion", "all"))
    if isinstance(prompt, str) and isinstance(completion, str):
        head = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(prompt)
        tail = tokenizer.encode(completion) + ([] if tokenizer.eos_id is None else [tokenizer.eos_id])
        ids = head + tail
    elif not isinstance(prompt, str) and not isinstance(completion, str):
        check_messages(prompt, "prompt")
        check_messages(completion, "completion")
        head = render_chat(tokenizer, list(prompt), add_generation_prompt=True, template=template,
                           with_mask=False).ids
        ids = render_chat(tokenizer, list(prompt) + list(completion), template=template, with_mask=False).ids
        if ids[:len(head)] != head:
            raise DataError("the chat template renders the prompt differently once a completion follows it, "
                            "so the completion's tokens cannot be found")
    else:
        raise DataError("prompt and completion must both be strings or both be message lists")
    mask = [1] * len(ids) if loss_on == "all" else [0] * len(head) + [1] * (len(ids) - len(head))
    return ids, mask


def check_messages(messages, field: str = "messages") -> None:
    """A :class:`DataError` naming the first message that is not a mapping with ``role`` and
    ``content`` (``messages[2] has no 'role'``); an assistant's tool call may have no content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise DataError(f"{field} must be a list of {{role, content}} messages, not {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{field}[{i}] must be a {{role, content}} mapping, not {type(message).__name__}")
        if "role" not in message:
            raise DataError(f"{field}[{i}] has no 'role'")
        if "content" not in message and "tool_calls" not in message:  # a tool call may come without content
            raise DataError(f"{field}[{i}] has no 'content'")


def _check_loss_on(loss_on: str, allowed: tuple[str, ...]) -> None:
    if loss_on not in allowed:
        raise DataError(f"loss_on={loss_on!r}: must be one of {', '.join(allowed)} for this format")
