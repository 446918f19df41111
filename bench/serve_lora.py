"""LoRA serving: many adapters in one batch against the same server with none, and PEFT's mixed-adapter ``generate``.

    pip install -e ".[serve-bench]" peft     # the peer: torch (CPU), transformers, PEFT
    python bench/serve_lora.py [--concurrency 16] [--num-requests 64] [--max-tokens 64] [--input-len 128]
                               [--adapters 8] [--rank 8] [--targets attention all] [--repeats 3]
                               [--max-num-batched-tokens 512] [--no-peft] [--keep DIR]
                               [--model-size small|llama-1b] [--device cpu|cuda]
                               [--hypertron-args=FLAGS]

The model and prompts are ``bench/serve_http.py``'s (a random Llama in Hugging Face format with a
BPE trained on the standard library's sources; ``hypertron convert --from-hf`` makes the bundle).
Per target set (``attention``: q_proj k_proj v_proj o_proj; ``all``: the seven projections of a
layer), ``--adapters`` PEFT adapters of rank ``--rank`` (alpha twice the rank, A and B random:
``init_lora_weights=False``, B scaled by 3 so each adapter moves the logits) are saved with
``save_pretrained``.

Servers, one at a time, on 127.0.0.1 (``hypertron serve`` with ``bench/serve_http.py``'s batch and
pool settings): the base model alone, then for each target set the same server with
``--lora-modules a0=DIR ... --max-loras N --max-lora-rank R``. Each gets a warm-up run at the
largest concurrency, then per concurrency C a warm-up run and ``--repeats`` runs of ``hypertron bench
serve`` (streaming, greedy, ``--max-tokens`` tokens each, new prompts each run) whose ``--model``
is ``a0,...,a7`` (request i asks for adapter i mod N: round-robin) or the base's name; the figure
is the median output tokens/s.

PEFT's peer (``--no-peft`` skips it): ``PeftModel`` with every adapter loaded (``load_adapter``),
the same prompts in batches of C, left-padded, ``generate(adapter_names=[...], do_sample=False,
max_new_tokens=M)`` (PEFT's mixed-adapter batch: each row its adapter, round-robin), torch's
default threads, float32 (``--device cuda``: on the GPU in bfloat16, the servers' weights and pages
bfloat16 too, JAX on the GPU); its output tokens/s over ``ceil(N / C)`` batches after one warm-up batch.

Prints per target set and concurrency::

    lora targets=T adapters=8 concurrency=C tok/s=X base_tok/s=Y ratio=Z peft_tok/s=W
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_http_prefix import settle  # bench/, this directory
from serve_http_servers import Server, bench, compile_counts, counts_since, script  # bench/, this directory
from serve_model import add_model_args, build_model, write_prompts  # bench/, this directory

from hypertron.launch.local import free_ports

TARGETS = {"attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--no-peft", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--hypertron-args", default="", help="more flags for every hypertron serve, one string "
                   "(--hypertron-args=--engine-process)")
    add_model_args(p)
    return p.parse_args(argv)


def make_adapters(hf_dir: str, out: str, modules: list[str], n: int, rank: int) -> list[str]:
    import peft
    import torch
    import transformers

    paths = []
    for k in range(n):
        torch.manual_seed(100 + k)
        base = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
        model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                          init_lora_weights=False, lora_dropout=0.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(3.0)
        paths.append(os.path.join(out, f"a{k}"))
        model.save_pretrained(paths[-1])
    return paths


def measure_server(argv: list[str], port: int, models: str, prompts: dict, args, work: str, name: str) -> dict:
    """Median output tokens/s per concurrency of one server."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    out = {}
    with Server(name, argv, port, os.path.join(work, f"{name}.log"), env) as srv, \
            open(os.path.join(work, f"{name}-bench.log"), "w") as log, srv.tail_on_error():
        ready = srv.wait_ready(args.ready_timeout)
        print(f"{name}: ready in {ready:.1f} s", file=sys.stderr)
        runs = lambda run, c, n, tag: bench(srv.base_url, models, prompts[run], c, n, args.max_tokens,  # noqa: E731
                                            os.path.join(work, f"{name}-{tag}.json"), log)
        runs("warmup", max(args.concurrency), 2 * max(args.concurrency), "warmup")
        for c in args.concurrency:
            n = max(args.num_requests, 2 * c)
            runs(f"c{c}w", c, n, f"c{c}-warmup")
            settle(srv.base_url)  # the shapes the warm-ups queued compile before the clock
            before = compile_counts(srv.base_url)
            reports = [runs(f"c{c}r{i}", c, n, f"c{c}-r{i}") for i in range(args.repeats)]
            assert all(r["completed"] == n for r in reports), [r["completed"] for r in reports]
            out[c] = statistics.median(r["output_throughput"] for r in reports)
            compiles = counts_since(before, compile_counts(srv.base_url))
            print(f"  {name} c{c}: {[round(r['output_throughput'], 1) for r in reports]} tok/s, compiles in the "
                  f"measured runs {compiles}", file=sys.stderr)
    return out


def measure_peft(hf_dir: str, adapters: list[str], prompts: dict, args) -> dict:
    """PEFT's mixed-adapter generate: output tokens/s per concurrency (batch size)."""
    import math

    import peft
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    base = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(args.device)
    model = peft.PeftModel.from_pretrained(base, adapters[0], adapter_name="a0").eval()
    for k, path in enumerate(adapters[1:], 1):
        model.load_adapter(path, adapter_name=f"a{k}")
    out = {}
    for c in args.concurrency:
        with open(prompts[f"c{c}r0"]) as f:
            texts = [json.loads(line)["prompt"] for line in f]
        batches = math.ceil(max(args.num_requests, 2 * c) / c)

        def generate(batch):
            enc = tok(batch, return_tensors="pt", padding=True).to(args.device)
            names = [f"a{i % len(adapters)}" for i in range(len(batch))]
            with torch.no_grad():
                ids = model.generate(**enc, adapter_names=names, do_sample=False, max_new_tokens=args.max_tokens,
                                     min_new_tokens=args.max_tokens, pad_token_id=tok.pad_token_id)
            return (ids.shape[1] - enc["input_ids"].shape[1]) * len(batch)

        generate(texts[:c])  # warm-up
        t0, tokens = time.perf_counter(), 0
        for b in range(batches):
            tokens += generate((texts * batches)[b * c:(b + 1) * c])
        out[c] = tokens / (time.perf_counter() - t0)
        print(f"  peft c{c}: {out[c]:.1f} tok/s", file=sys.stderr)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.keep or tempfile.mkdtemp(prefix="serve_lora_")
    os.makedirs(work, exist_ok=True)
    hf_dir, run_dir = os.path.join(work, "hf"), os.path.join(work, "run")
    if not os.path.exists(run_dir):
        build_model(hf_dir, args.vocab, args.model_size)
        subprocess.run([script("hypertron"), "convert", "--from-hf", hf_dir, "--out", run_dir], check=True,
                       stdout=subprocess.DEVNULL)
    max_c = max(args.concurrency)
    runs = {"warmup": 2 * max_c, **{f"c{c}{r}": max(args.num_requests, 2 * c) for c in args.concurrency
                                    for r in ["w", *(f"r{i}" for i in range(args.repeats))]}}
    prompts = write_prompts(hf_dir, work, runs, args.input_len)
    pages = max_c * -(-(args.input_len + 1 + args.max_tokens + 16) // 16)

    def server_argv(port, *more):
        return [script("hypertron"), "serve", "--checkpoint", run_dir, "--port", str(port), "--max-slots", str(max_c),
                "--page-size", "16", "--kv-cache-dtype", "float32" if args.device == "cpu" else "auto", "--model-name", "bench",
                "--max-num-batched-tokens", str(max(args.max_num_batched_tokens, max_c)), "--num-pages",
                str(pages + 1), *shlex.split(args.hypertron_args), *more]

    port = free_ports()
    base = measure_server(server_argv(port), port, "bench", prompts, args, work, "base")
    for targets in args.targets:
        adapters = make_adapters(hf_dir, os.path.join(work, f"lora-{targets}"), TARGETS[targets], args.adapters,
                                 args.rank)
        port = free_ports()
        modules = [f"a{k}={p}" for k, p in enumerate(adapters)]
        lora = measure_server(server_argv(port, "--lora-modules", *modules, "--max-loras", str(args.adapters),
                                          "--max-lora-rank", str(args.rank)), port,
                              ",".join(f"a{k}" for k in range(args.adapters)), prompts, args, work, f"lora-{targets}")
        peft_tps = {} if args.no_peft else measure_peft(hf_dir, adapters, prompts, args)
        for c in args.concurrency:
            peft_text = f"{peft_tps[c]:.1f}" if c in peft_tps else "-"
            print(f"lora targets={targets} adapters={args.adapters} concurrency={c} tok/s={lora[c]:.1f} "
                  f"base_tok/s={base[c]:.1f} ratio={lora[c] / base[c]:.2f} peft_tok/s={peft_text}", flush=True)
    print(f"work directory: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
