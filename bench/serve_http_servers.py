"""The processes of ``bench/serve_http.py``: the servers it measures (each in its own process group,
always stopped), what ``transformers serve`` needs, ``hypertron bench serve`` runs, and what a
running server says (its compile counts, a greedy completion)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Self

import httpx

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

    @contextlib.contextmanager
    def tail_on_error(self):
        """Shows the server's last log lines on stderr when the block raises (and re-raises)."""
        try:
            yield
        except Exception:
            print(f"{self.name} server log, last lines:\n{self.tail()}", file=sys.stderr)
            raise

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


def compile_counts(base_url: str) -> dict[str, float]:
    """hypertron's ``hypertron_step_compiles_total`` by mode (sync: a step waited for a compile;
    background; padded: steps run padded to a larger compiled shape), from ``/metrics``."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m: float(v) for m, v in re.findall(r'^hypertron_step_compiles_total\{mode="(\w+)"\} (\S+)$', text, re.M)}


def step_times(base_url: str) -> dict[str, float]:
    """hypertron's serving loop so far, from ``/metrics``: ``turns``, their ``seconds``, and the
    seconds of each phase (``hypertron_step_phase_seconds``, hypertron.serve.metrics.STEP_PHASES)."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {p: float(v) for p, v in re.findall(r'^hypertron_step_phase_seconds_sum\{phase="(\w+)"\} (\S+)$', text, re.M)}
    for key, metric in (("turns", "step_seconds_count"), ("seconds", "step_seconds_sum"),
                        ("ttft_n", "time_to_first_token_seconds_count"), ("ttft_s", "time_to_first_token_seconds_sum")):
        found = re.search(rf"^hypertron_{metric} (\S+)$", text, re.M)
        out[key] = float(found.group(1)) if found else 0.0
    return out


def step_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two :func:`step_times`: ``turns``, and the mean turn and each phase in ms a turn;
    ``server_ttft``: the mean time to first token the server saw (submit to the first token reaching
    the request's event loop, ms), the rest of the client's TTFT being HTTP and the event loop."""
    since = {k: v - before.get(k, 0.0) for k, v in after.items()}
    turns, ttft_n, ttft_s = since.pop("turns", 0), since.pop("ttft_n", 0), since.pop("ttft_s", 0)
    out = {k: 1e3 * v / max(turns, 1) for k, v in since.items()}
    return {"turns": turns, **out, "server_ttft": 1e3 * ttft_s / max(ttft_n, 1)}


def breakdown_line(b: dict[str, float]) -> str:
    """A :func:`step_breakdown` in words."""
    phases = ", ".join(f"{p} {v:.2f}" for p, v in b.items() if p not in ("turns", "seconds", "server_ttft"))
    return (f"hypertron's serving loop in the measured runs: {b['turns']:.0f} turns of {b['seconds']:.2f} ms on "
            f"average: {phases} (ms a turn; hypertron_step_phase_seconds); mean TTFT the server saw "
            f"{b.get('server_ttft', 0.0):.1f} ms (submit to first token)")


def counts_since(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {m: int(after.get(m, 0) - before.get(m, 0)) for m in ("sync", "background", "padded")}


def greedy_text(base_url: str, model: str, prompt: str, max_tokens: int) -> str:
    resp = httpx.post(f"{base_url}/v1/completions", timeout=600,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]
