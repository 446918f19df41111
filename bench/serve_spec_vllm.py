"""``bench/serve_spec.py --peer vllm``: vLLM's speculation (``ngram``, ``draft_model``) on the same
trained models, for the same table.

The runs are exported with ``hypertron convert --to-hf`` and given a Hugging Face tokenizer that
is hypertron's byte tokenizer (byte ``b`` is id ``b + 3``; 0, 1, 2 are pad, BOS, EOS; checked
against it here on the prompts), so that vLLM reads the same ids. One vLLM server per method
(``off``, ``ngram`` with ``prompt_lookup_min`` / ``_max`` 2 / 5 as hypertron's defaults, and
``draft_model``), float32, as many sequences as the bench's largest concurrency, prefix caching off;
acceptance from vLLM's ``vllm:spec_decode_*`` counters. vLLM is never a dependency: its own venv
(``--vllm-python``; ``bench/serve_http_vllm.py`` says how to make one).
"""

from __future__ import annotations

import json
import os
import subprocess

from serve_http_prefix import metric, scrape  # bench/, this directory
from serve_http_servers import script  # bench/, this directory

SPEC = "vllm:spec_decode_"


def export(run_dir: str, out: str) -> str:
    """``run_dir`` as a Hugging Face directory ``out`` with a byte tokenizer (once per ``out``)."""
    if not os.path.isdir(out):
        subprocess.run([script("hypertron"), "convert", "--checkpoint", run_dir, "--to-hf", out], check=True,
                       stdout=subprocess.DEVNULL)
        byte_tokenizer(out)
    return out


def byte_tokenizer(hf_dir: str) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``hf_dir``: hypertron's byte tokenizer as a
    byte-level BPE without merges (each byte one token, id ``b + 3``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hypertron.tokenizer import _byte_to_unicode

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)} | {ch: 3 + b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
                   "eos_token": "</s>", "add_bos_token": False, "model_max_length": 1 << 20}, f)


def check_ids(hf_dir: str, texts: list[str]) -> None:
    """Raise unless ``hf_dir``'s tokenizer gives the byte tokenizer's ids for ``texts``."""
    from tokenizers import Tokenizer

    from hypertron.tokenizer import get_tokenizer

    tok, ours = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")), get_tokenizer("byte")
    for text in texts:
        if tok.encode(text, add_special_tokens=True).ids != ours.encode(text):
            raise RuntimeError(f"{hf_dir}: its tokenizer's ids differ from the byte tokenizer's on {text!r}")


def argv(vllm_python: str, hf_dir: str, port: int, method: str, k: int, slots: int, draft_dir: str | None) -> list[str]:
    """vLLM's server for ``method`` (off, ngram, draft) with ``k`` speculative tokens."""
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
            "draft": {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}}.get(method)
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--served-model-name",
            "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-num-seqs", str(slots),
            "--no-enable-prefix-caching", *(["--speculative-config", json.dumps(spec)] if spec else [])]


def spec_counts(base_url: str, prefix: str = SPEC) -> tuple[float, float, float]:
    """A server's speculative counters named ``prefix...`` (vLLM's, or hypertron's of the same names):
    verify rows, tokens proposed, kept; zeros without speculation."""
    text = scrape(base_url)
    if prefix not in text:
        return (0.0, 0.0, 0.0)
    return tuple(metric(text, prefix + name + "_total") for name in ("num_drafts", "num_draft_tokens",
                                                                     "num_accepted_tokens"))
