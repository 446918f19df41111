"""Chat templates, a conversation and a byte-level BPE tokenizer trained on the spot, shared by the
tests of chat rendering (test_chat_render) and of fine-tuning data (test_sft)."""

from __future__ import annotations

import json
from pathlib import Path

from hypertron.tokenizer import get_tokenizer

# ChatML with the assistant's content and end-of-turn in generation blocks (as TRL's templates mark
# them): the same text as CHATML below, so its mask is transformers' and the prefix rule's both.
CHATML_GENERATION = (
    r"{% for m in messages %}{% if m['role'] == 'assistant' %}"
    r"{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    r"{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CHATML = (
    r"{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    r"{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama 3's own template, less its date and tool preamble.
LLAMA3 = (
    r"{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    r"'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    r"{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# The number of messages up front: a longer conversation rewrites the shorter one's first line.
REWRITING = r"""{{ 'turns: ' ~ (messages | length) ~ '\n' }}""" + CHATML

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>"]
END_OF_TURN = {CHATML_GENERATION: "<|im_end|>", CHATML: "<|im_end|>", LLAMA3: "<|eot_id|>"}
CORPUS = ["Hello there, how are you today?", "I am fine, thank you. What about you?",
          "The quick brown fox jumps over the lazy dog.", "Tell me a story about a café in Zürich, 日本語 too."]
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "Tell me a story about a café."},
    {"role": "assistant", "content": "A fox 🦊 in Zürich drank café au lait, 日本語 too."},
]


def chat_tokenizers(directory: Path):
    """(transformers' tokenizer, hypertron's) of one byte-level BPE trained and saved in ``directory``; its
    tokenizer_config.json carries CHATML as the chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 8, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML}))
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                                chat_template=CHATML), get_tokenizer(str(directory))
