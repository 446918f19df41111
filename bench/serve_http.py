"""Serving over HTTP: ``hypertron bench serve`` against ``hypertron serve`` and ``transformers serve``, one model.

    python bench/serve_http.py [--concurrency 1 4 16] [--num-requests 32] [--max-tokens 64] [--input-len 128]
                               [--warmup-requests N] [--device cpu|cuda] [--no-continuous-batching]
                               [--peer-pythonpath DIR] [--keep DIR] [--output FILE]

One model, written once in Hugging Face format into a temporary directory, nothing downloaded:

- tokenizer: byte-level BPE trained with ``tokenizers`` on the standard library's top-level
  ``*.py`` files (vocab 2,048, specials ``<pad>`` ``<s>`` ``</s>``), with a post-processor that
  puts ``<s>`` first, saved as ``tokenizer.json`` + ``tokenizer_config.json``
  (``PreTrainedTokenizerFast.save_pretrained``). transformers' ``tokenizer(prompt)`` then gives
  ``<s>`` + the ids, as hypertron's server does for a text prompt (BOS + ``encode``); the two
  reports' ``usage.prompt_tokens`` totals are compared to show it.
- weights: ``LlamaForCausalLM`` with random weights (``torch.manual_seed(0)``): hidden 256,
  4 layers, 8 heads / 4 KV heads (head_dim 32), MLP 768, max_position_embeddings 2,048,
  untied, float32 (4.2M parameters), ``save_pretrained`` (safetensors). The ``lm_head`` rows of
  the special tokens (EOS among them) and of the byte tokens that are not whole UTF-8 are zeroed:
  their logits are then 0 against ~1,900 random ones, so greedy decoding never picks them. Every
  request then generates exactly ``--max-tokens`` tokens on both servers (checked from the
  reports' ``usage.completion_tokens``), which replaces ``--ignore-eos`` (transformers' server
  answers HTTP 422 to fields outside OpenAI's schema); and every token is text of its own, so both
  servers stream text from the first token on (the load generator's TTFT is the first chunk
  with text: a random model repeating a lone UTF-8 continuation byte streams none, and its TTFT
  would be the end of the request on one server and missing on the other).
- ``hypertron convert --from-hf`` makes hypertron's model bundle (it copies the tokenizer).

Prompts: text cut from the standard library's sources at seeded random offsets, each
``--input-len`` tokens of the tokenizer (cut at a token boundary; re-encoding may differ by a
token or so), plus BOS. Every run (the warm-up and each concurrency) gets its own prompts, so no
prompt is sent twice to a server (transformers' continuous batching may share KV blocks between
prompts with a common prefix; hypertron has no prefix cache); the two servers get the same runs.

Per server, in turn: start it on 127.0.0.1 on a free port (its own process group, stopped with
SIGTERM, then SIGKILL, in a ``finally``), wait for ``GET /health`` = 200, send the warm-up
(``--warmup-requests`` at the largest concurrency; compiles and the continuous-batching manager
start there; not reported), one non-streaming greedy request for the first prompt (its text is
compared between the servers, to show they run the same model), then for each concurrency one
``hypertron bench serve --prompts FILE --concurrency C --num-requests N --max-tokens M
--temperature 0 --model NAME --output JSON``: streaming ``/v1/completions``, C requests in
flight, TTFT = first text chunk - send, TPOT = (end to end - TTFT) / (tokens - 1), throughput
over the run (see ``hypertron/serve/loadgen.py``).

- hypertron: ``hypertron serve --max-slots max(C) --page-size 16 --kv-cache-dtype float32``
  (``float32`` on CPU, where compute is float32; ``bfloat16`` with ``--device cuda``), the
  default page pool (every slot at max_seq_len), JAX on the device asked for.
- transformers: ``transformers serve HF_DIR --continuous-batching --device cpu --dtype float32``
  (``--no-continuous-batching``: one ``generate`` at a time), default continuous-batching
  settings but for its KV pool, given hypertron's (``--cb-block-size 16 --cb-num-blocks`` = slots x
  max_seq_len / 16; left alone it takes 90% of the free RAM on CPU), torch's default thread count,
  an empty ``HF_HUB_CACHE`` (its ``GET /v1/models`` lists that cache and answers 500 when there is
  none). It needs ``transformers[serving]`` (fastapi, uvicorn, pydantic, openai, accelerate); the
  script looks them up first, in the server's environment, and stops with one line (exit status 2)
  if any is missing. ``--peer-pythonpath DIR`` adds a directory holding them (e.g. ``accelerate``
  installed with ``pip install --no-deps --target DIR``) to the server's ``PYTHONPATH``.

The servers and the load generator share the machine. Prints one table per concurrency
(request throughput, output tokens/s, TTFT / TPOT mean p50 p99, end to end p50 p99, errors),
then the checks, the device, the versions and the command lines; ``--output`` writes all of it,
with both servers' full reports, as JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from typing import Self

import httpx
import numpy as np

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
SERVERS = ("hypertron", "transformers")
MAX_SEQ_LEN = 2048  # max_position_embeddings


def stdlib_files() -> list[str]:
    """The standard library's top-level ``*.py`` files, sorted."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))


def build_model(hf_dir: str, vocab: int) -> int:
    """Tokenizer (BPE trained on the stdlib) and a random Llama, in Hugging Face format, into ``hf_dir``;
    returns how many ``lm_head`` rows were zeroed."""
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
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=768, max_position_embeddings=MAX_SEQ_LEN,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype="float32")
    model = LlamaForCausalLM(cfg)
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


def write_prompts(hf_dir: str, out_dir: str, runs: dict[str, int], input_len: int, seed: int = 0) -> dict[str, str]:
    """One JSONL file per run (name -> number of prompts), prompts all distinct; returns name -> path."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    texts = []
    for path in stdlib_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    rng = np.random.default_rng(seed)
    seen, paths = set(), {}
    for name, count in runs.items():
        lines = []
        while len(lines) < count:
            text = texts[rng.integers(len(texts))]
            start = int(rng.integers(max(1, len(text) - 8 * input_len)))
            window = text[start:start + 16 * input_len]
            enc = tok.encode(window, add_special_tokens=False)
            if len(enc.ids) < input_len:
                continue
            prompt = window[:enc.offsets[input_len - 1][1]]
            if prompt in seen or any(s in prompt for s in SPECIALS):
                continue
            seen.add(prompt)
            lines.append(json.dumps({"prompt": prompt}))
        paths[name] = os.path.join(out_dir, f"prompts-{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return paths


SERVE_DEPS = ("fastapi", "uvicorn", "pydantic", "openai", "accelerate")  # transformers[serving], as its server checks


def missing_serve_deps(extra_path: str | None) -> tuple[list[str], str | None]:
    """The modules ``transformers serve`` needs that its environment (this interpreter, with
    ``extra_path`` first on ``PYTHONPATH``) cannot find, and the version of ``accelerate`` there;
    looked up in a subprocess, nothing imported."""
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, env.get("PYTHONPATH")]))
    code = ("import importlib.util, importlib.metadata as md, json, sys; "
            "missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]; "
            "print(json.dumps([missing, None if 'accelerate' in missing else md.version('accelerate')]))")
    done = subprocess.run([sys.executable, "-c", code, *SERVE_DEPS], env=env, capture_output=True, text=True,
                          check=False)
    try:
        missing, accelerate = json.loads(done.stdout)
        return missing, accelerate
    except ValueError:
        return list(SERVE_DEPS), None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(name: str) -> str:
    """A console script of this environment (beside the interpreter), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    found = beside if os.path.exists(beside) else shutil.which(name)
    if found is None:
        raise SystemExit(f"error: no '{name}' command in this environment")
    return found


class Server:
    """A server subprocess in its own process group; a context manager that always stops it."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: str, env: dict):
        self.name, self.argv, self.port, self.log_path, self.env = name, argv, port, log_path, env
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc = None

    def __enter__(self) -> Self:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``GET /health`` answered 200; raises if the process died or time ran out."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} server not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)  # the group this script created for the server
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.proc is not None:  # anything left in its group (it has no other children we know of)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.log.close()


def bench(base_url: str, model: str, prompts: str, concurrency: int, num: int, max_tokens: int, out: str,
          log) -> dict:
    """One ``hypertron bench serve`` run; its JSON report (exit status 1, no request completed, still
    writes one: its failures are shown in the table)."""
    argv = [script("hypertron"), "bench", "serve", "--base-url", base_url, "--model", model, "--prompts", prompts,
            "--concurrency", str(concurrency), "--num-requests", str(num), "--max-tokens", str(max_tokens),
            "--temperature", "0", "--output", out]
    log.flush()
    done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode not in (0, 1) or not os.path.exists(out):
        raise RuntimeError(f"hypertron bench serve exited with {done.returncode}; see {log.name}")
    with open(out) as f:
        return json.load(f)


def greedy_text(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    resp = httpx.post(f"{base_url}/v1/completions", timeout=600,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(c: int, reports: dict[str, dict], args) -> None:
    names = [n for n in SERVERS if n in reports]
    print(f"\nconcurrency {c}: {args.num_requests} requests, max_tokens {args.max_tokens}, "
          f"~{args.input_len + 1}-token prompts")
    print(f"{'':<24}" + "".join(f"{n:>14}" for n in names) + (f"{'hyp / hf':>10}" if len(names) == 2 else ""))
    rows = [("requests/s", lambda r: r["request_throughput"], ".2f"),
            ("output tokens/s", lambda r: r["output_throughput"], ".1f")]
    for metric, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
        for q in ("mean", "p50", "p99"):
            rows.append((f"{metric} {q} (ms)", lambda r, key=key, q=q: r[key][q], ".1f"))
    for q in ("p50", "p99"):
        rows.append((f"end to end {q} (ms)", lambda r, q=q: r["e2e_latency_ms"][q], ".1f"))
    for label, get, spec in rows:
        vals = [get(reports[n]) for n in names]
        ratio = f"{vals[0] / vals[1]:>10.2f}" if len(vals) == 2 and None not in vals and vals[1] else ""
        print(f"{label:<24}" + "".join(f"{fmt(v, spec):>14}" for v in vals) + ratio)
    errs = [", ".join(f"{k} x{v}" for k, v in reports[n]["errors"].items()) or "0" for n in names]
    print(f"{'errors':<24}" + "".join(f"{e:>14}" for e in errs))
    for n in names:
        if reports[n]["first_error"]:
            print(f"  {n} first error: {reports[n]['first_error']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-requests", type=int, default=32, help="per concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, before BOS")
    p.add_argument("--warmup-requests", type=int, default=None, help="default: the largest concurrency")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-continuous-batching", action="store_true", help="transformers serve without it")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--peer-pythonpath", default=None, help="prepended to transformers serve's PYTHONPATH "
                   "(a directory holding accelerate, if this environment lacks it)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--keep", default=None, help="work in this (new) directory and keep it (default: a temp dir)")
    p.add_argument("--output", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    if min(args.concurrency + [args.num_requests, args.max_tokens, args.input_len]) <= 0:
        p.error("--concurrency, --num-requests, --max-tokens and --input-len must be positive")
    accelerate = None
    if "transformers" in args.servers:
        missing, accelerate = missing_serve_deps(args.peer_pythonpath)
        if missing:
            print(f"error: transformers serve needs {', '.join(missing)} (in transformers[serving]): pip install "
                  f"{' '.join(missing)}, or give --peer-pythonpath DIR holding them", file=sys.stderr)
            return 2
        script("transformers")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped (finally)
    max_c = max(args.concurrency)
    warmup = args.warmup_requests or max_c

    import torch
    import transformers

    t_start = time.perf_counter()
    work = args.keep or tempfile.mkdtemp(prefix="serve_http_")
    os.makedirs(work, exist_ok=bool(args.keep is None))
    hf_dir, run_dir = os.path.join(work, "hf"), os.path.join(work, "run")
    banned = build_model(hf_dir, args.vocab)
    convert = [script("hypertron"), "convert", "--from-hf", hf_dir, "--out", run_dir]
    subprocess.run(convert, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = {"warmup": warmup, **{f"c{c}": args.num_requests for c in args.concurrency}}
    prompts = write_prompts(hf_dir, work, runs, args.input_len)
    with open(prompts["warmup"], encoding="utf-8") as f:
        probe = json.loads(f.readline())["prompt"]
    print(f"model and prompts ready in {time.perf_counter() - t_start:.1f} s ({work})", file=sys.stderr)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    kv, dtype = ("float32", "float32") if args.device == "cpu" else ("bfloat16", "bfloat16")
    # GET /v1/models of transformers serve lists the Hugging Face cache and fails (500, and a dropped
    # keep-alive connection) when there is none; an empty one makes it answer an empty list.
    peer_env = {**env, "HF_HUB_CACHE": os.path.join(work, "hf-cache")}
    os.makedirs(peer_env["HF_HUB_CACHE"], exist_ok=True)
    if args.peer_pythonpath:
        peer_env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.peer_pythonpath, env.get("PYTHONPATH")]))
    # transformers' continuous batching sizes its KV cache to 90% of free memory (of the RAM, on CPU:
    # tens of GB, zero-filled on the first request); it gets hypertron's pool instead: 16-token pages,
    # every slot at max_seq_len.
    pool = ["--cb-block-size", "16", "--cb-num-blocks", str(max_c * -(-MAX_SEQ_LEN // 16))]
    cb = [] if args.no_continuous_batching else ["--continuous-batching", *pool]

    def server_argv(name: str, port: int) -> tuple[list[str], str, dict]:
        if name == "hypertron":
            return ([script("hypertron"), "serve", "--checkpoint", run_dir, "--port", str(port), "--max-slots",
                     str(max_c), "--page-size", "16", "--kv-cache-dtype", kv, "--model-name", "bench"], "bench", env)
        return ([script("transformers"), "serve", hf_dir, *cb, "--device", args.device, "--dtype", dtype,
                 "--host", "127.0.0.1", "--port", str(port)], hf_dir, peer_env)

    results, texts, commands, ready_s = {}, {}, {}, {}
    for name in args.servers:
        port = free_port()
        argv_s, model, senv = server_argv(name, port)
        commands[name] = " ".join([os.path.basename(argv_s[0]), *argv_s[1:]])
        with Server(name, argv_s, port, os.path.join(work, f"{name}.log"), senv) as srv, \
                open(os.path.join(work, f"{name}-bench.log"), "w") as log:
            ready_s[name] = srv.wait_ready(args.ready_timeout)
            print(f"{name}: ready in {ready_s[name]:.1f} s; warm-up ...", file=sys.stderr)
            try:
                bench(srv.base_url, model, prompts["warmup"], max_c, warmup, args.max_tokens,
                      os.path.join(work, f"{name}-warmup.json"), log)
                texts[name] = greedy_text(srv.base_url, model, probe, args.max_tokens)
                results[name] = {}
                for c in args.concurrency:
                    t0 = time.perf_counter()
                    results[name][c] = bench(srv.base_url, model, prompts[f"c{c}"], c, args.num_requests,
                                             args.max_tokens, os.path.join(work, f"{name}-c{c}.json"), log)
                    print(f"  ... {name} concurrency {c}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            except Exception:
                print(f"{name} server log, last lines:\n{srv.tail()}", file=sys.stderr)
                raise

    for c in args.concurrency:
        print_table(c, {n: results[n][c] for n in results}, args)

    print()
    want = args.num_requests * args.max_tokens
    for c in args.concurrency:
        counts = {n: (results[n][c]["total_input_tokens"], results[n][c]["total_output_tokens"]) for n in results}
        print(f"concurrency {c}: input / output tokens " +
              ", ".join(f"{n} {i:,} / {o:,}" for n, (i, o) in counts.items()) + f" (output wanted {want:,})")
    if len(texts) == 2:
        a, b = texts.values()
        print(f"greedy completion of the first warm-up prompt: {'equal' if a == b else 'DIFFERENT'} "
              f"on both servers ({len(a)} vs {len(b)} characters)")
    print(f"hypertron: --max-slots {max_c} --page-size 16 --kv-cache-dtype {kv}; transformers: "
          f"{'continuous batching' if cb else 'no continuous batching'}, --dtype {dtype}, "
          f"torch {torch.get_num_threads()} threads (default); no ignore_eos: {banned} lm_head rows zeroed "
          f"(special tokens, EOS among them, and partial UTF-8 bytes)")
    print(f"device: {args.device} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    print(f"versions: python {platform.python_version()}, jax {version('jax')}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}"
          + (f", accelerate {accelerate} (transformers serve's)" if accelerate else ""))
    for name, cmd in commands.items():
        print(f"{name} server: {cmd.replace(work, '$WORK')}")
    print(f"load: hypertron bench serve --base-url URL --model NAME --prompts $WORK/prompts-cC.jsonl "
          f"--concurrency C --num-requests {args.num_requests} --max-tokens {args.max_tokens} --temperature 0 "
          f"--output JSON")
    print(("command: python bench/serve_http.py " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())
    elapsed = time.perf_counter() - t_start
    print(f"total {elapsed:.0f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "commands": commands, "ready_s": ready_s, "greedy_texts": texts,
                       "elapsed_s": elapsed, "versions": {"python": platform.python_version(),
                                                          "jax": version("jax"), "torch": torch.__version__,
                                                          "transformers": transformers.__version__,
                                                          "accelerate": accelerate},
                       "results": {n: {str(c): r for c, r in rs.items()} for n, rs in results.items()}}, f, indent=2)
        print(f"wrote {args.output}")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
