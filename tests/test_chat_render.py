"""hypertron.tokenizer.render_chat against transformers' apply_chat_template, over a byte-level BPE
tokenizer trained here (both read the same tokenizer.json + tokenizer_config.json)."""

import pytest
from support.chat import (  # tests/support
    CHATML, CHATML_GENERATION, CONVERSATION, END_OF_TURN, LLAMA3, REWRITING, chat_tokenizers,
)

from hypertron.errors import DataError
from hypertron.tokenizer import ByteTokenizer, render_chat


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return chat_tokenizers(tmp_path_factory.mktemp("chat_bpe"))


def _conversations():
    """The system message and the first 1 to 4 turns, with and without the generation prompt."""
    return [(CONVERSATION[:1 + turns], prompt) for turns in range(1, 5) for prompt in (False, True)]


@pytest.mark.parametrize("template", [CHATML_GENERATION, CHATML, LLAMA3], ids=["generation", "chatml", "llama3"])
def test_ids_and_text_are_transformers(tokenizers, template):
    theirs, ours = tokenizers
    for messages, prompt in _conversations():
        rendered = render_chat(ours, messages, add_generation_prompt=prompt, template=template)
        expected = theirs.apply_chat_template(messages, chat_template=template, add_generation_prompt=prompt,
                                              tokenize=True, return_dict=True)["input_ids"]
        assert rendered.ids == expected, (len(messages), prompt)
        assert rendered.text == theirs.apply_chat_template(messages, chat_template=template,
                                                           add_generation_prompt=prompt, tokenize=False)
        assert len(rendered.assistant_mask) == len(rendered.ids)
        assert rendered.text.startswith("<|begin_of_text|>") == (template == LLAMA3)  # bos_token
    # template=None: the tokenizer's own (tokenizer_config.json), as transformers reads it too
    assert ours.chat_template == CHATML
    assert render_chat(ours, CONVERSATION).ids == theirs.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True)["input_ids"]


def test_generation_blocks_give_transformers_mask_and_the_prefix_rule_agrees(tokenizers):
    theirs, ours = tokenizers
    for messages, prompt in _conversations():
        expected = theirs.apply_chat_template(messages, chat_template=CHATML_GENERATION, add_generation_prompt=prompt,
                                              tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)["assistant_masks"]
        marked = render_chat(ours, messages, add_generation_prompt=prompt, template=CHATML_GENERATION)
        prefix = render_chat(ours, messages, add_generation_prompt=prompt, template=CHATML)
        assert marked.assistant_mask == list(expected), (len(messages), prompt)
        assert prefix.text == marked.text and prefix.assistant_mask == marked.assistant_mask


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_prefix_masks_cover_the_assistant_contents_and_end_of_turn(tokenizers, template):
    theirs, ours = tokenizers
    for messages, prompt in _conversations():
        rendered = render_chat(ours, messages, add_generation_prompt=prompt, template=template)
        runs, run = [], []
        for token, masked in zip(rendered.ids, rendered.assistant_mask, strict=True):
            if masked:
                run.append(token)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        expected = [m["content"] + END_OF_TURN[template] for m in messages if m["role"] == "assistant"]
        assert [theirs.decode(r) for r in runs] == expected, (len(messages), prompt)


def test_template_refusals_are_one_line(tokenizers):
    _, ours = tokenizers
    with pytest.raises(DataError, match=r"rewrites earlier turns.*\{% generation %\}") as e:
        render_chat(ours, CONVERSATION[:3], template=REWRITING)
    assert "\n" not in str(e.value)
    # its ids need no mask, so without one it renders
    assert render_chat(ours, CONVERSATION[:3], template=REWRITING, with_mask=False).assistant_mask is None
    with pytest.raises(DataError, match=r"^the chat template refused the messages at line 3: Unknown role: tool$"):
        render_chat(ours, [{"role": "tool", "content": "42"}], template="\n\n" + CHATML)  # the template's line
    with pytest.raises(DataError, match=r"^chat_template does not compile: .* \(line 2\)$"):
        render_chat(ours, CONVERSATION, template="ok\n{% for %}")
    with pytest.raises(DataError, match="the tokenizer byte has no chat_template"):
        render_chat(ByteTokenizer(), CONVERSATION)


def test_byte_tokens_of_non_ascii_text_are_masked_whole():
    """A byte tokenizer's offsets: every byte of a character lies in that character."""
    rendered = render_chat(ByteTokenizer(), CONVERSATION, template=CHATML)
    masked = bytes(i - 3 for i, m in zip(rendered.ids, rendered.assistant_mask, strict=True) if m).decode()
    assert masked == "".join(m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant")


def test_what_a_template_may_call_is_transformers(tokenizers):
    """tojson (no HTML escaping, its options), strftime_now, loop controls and tools render as
    transformers renders them."""
    theirs, ours = tokenizers
    template = (r"{{ strftime_now('%Y') }} {{ tools | tojson(indent=2) }}{% for m in messages %}"
                r"{% if m['role'] == 'system' %}{% continue %}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}"
                r"{{ m | tojson(sort_keys=True) }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "café<&>", "parameters": {}}}]
    rendered = render_chat(ours, CONVERSATION, template=template, tools=tools)
    assert rendered.text == theirs.apply_chat_template(CONVERSATION, chat_template=template, tools=tools,
                                                       tokenize=False)
    assert '"café<&>"' in rendered.text and rendered.text.count('"role"') == 2
