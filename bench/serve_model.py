"""The model and prompts of ``bench/serve_http.py``, in Hugging Face format: a byte-level BPE
tokenizer trained on the standard library's top-level ``*.py`` files, a random ``LlamaForCausalLM``
whose unstreamable tokens greedy decoding never picks, and distinct prompts cut from the same
sources (see that script's docstring). Nothing is downloaded."""

from __future__ import annotations

import glob
import json
import os

import numpy as np

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
MAX_SEQ_LEN = 4096  # max_position_embeddings: room for the interference workload's long prompts


def stdlib_files() -> list[str]:
    """The standard library's top-level ``*.py`` files, sorted."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))


# The random Llama's shape by --model-size: the bench's small model (CPU), and hypertron's ``llama-1b``
# preset (1.1B, the GPU campaign's model; saved in bfloat16) for issue 38's and 49's GPU runs.
MODEL_SIZES = {
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 768, "dtype": "float32"},
    "llama-1b": {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 16, "num_key_value_heads": 4,
                 "intermediate_size": 5632, "dtype": "bfloat16"},
}


def add_model_args(p) -> None:
    """The model's flags: ``--vocab`` (the BPE's size) and ``--model-size`` (:data:`MODEL_SIZES`)."""
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--model-size", choices=list(MODEL_SIZES), default="small", help="the random Llama's shape")


def build_model(hf_dir: str, vocab: int, size: str = "small") -> int:
    """Tokenizer (BPE trained on the stdlib) and a random Llama of :data:`MODEL_SIZES` ``size``, in
    Hugging Face format, into ``hf_dir``; returns how many ``lm_head`` rows were zeroed."""
    import torch
    import transformers
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    transformers.utils.logging.disable_progress_bar()
    tok.train(stdlib_files(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(hf_dir)

    torch.manual_seed(0)
    shape = dict(MODEL_SIZES[size])
    dtype = shape.pop("dtype")
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), **shape, max_position_embeddings=MAX_SEQ_LEN,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype=dtype)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    banned = unstreamable_ids(tok)
    with torch.no_grad():  # greedy never picks these: see the module docstring
        model.lm_head.weight[banned] = 0.0
    model.save_pretrained(hf_dir)
    return len(banned)


def unstreamable_ids(tok) -> list[int]:
    """Ids that do not decode to text on their own: the special tokens (EOS among them) and the byte
    tokens that are not whole UTF-8 (a lone continuation byte, a lead byte without its tail)."""
    return [i for i in range(tok.get_vocab_size())
            if tok.id_to_token(i) in SPECIALS or "\ufffd" in tok.decode([i]) or not tok.decode([i])]


def write_prompts(hf_dir: str, out_dir: str, runs: dict[str, int | tuple[int, int]], input_len: int,
                  seed: int = 0) -> dict[str, str]:
    """One JSONL file per run (name -> number of prompts, or (number, tokens) for another length than
    ``input_len``), prompts all distinct; returns name -> path."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    texts = []
    for path in stdlib_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    rng = np.random.default_rng(seed)
    seen, paths = set(), {}
    for name, count in runs.items():
        count, n_tokens = count if isinstance(count, tuple) else (count, input_len)
        lines = []
        while len(lines) < count:
            text = texts[rng.integers(len(texts))]
            start = int(rng.integers(max(1, len(text) - 8 * n_tokens)))
            window = text[start:start + 16 * n_tokens]
            enc = tok.encode(window, add_special_tokens=False)
            if len(enc.ids) < n_tokens:
                continue
            prompt = window[:enc.offsets[n_tokens - 1][1]]
            if prompt in seen or any(s in prompt for s in SPECIALS):
                continue
            seen.add(prompt)
            lines.append(json.dumps({"prompt": prompt}))
        paths[name] = os.path.join(out_dir, f"prompts-{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return paths
