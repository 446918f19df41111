"""Serving benchmark client: load-test any OpenAI-compatible ``/v1/completions`` server.

``hypertron bench serve`` sends streaming completion requests either on a
Poisson arrival process (``--request-rate R``; ``inf`` sends them all at once)
or with a fixed number in flight (``--concurrency N``), times every streamed
chunk, and reports throughput and the latencies serving papers quote, each as
mean / p50 / p90 / p99 in milliseconds. Per completed request, with times from
``time.perf_counter`` taken when a line of the stream arrives:

- TTFT (time to first token) = first chunk with non-empty text - request sent;
- latency (end to end) = ``[DONE]`` received (or the stream's end) - request sent;
- TPOT (time per output token) = (latency - TTFT) / (output tokens - 1), for
  requests with more than one output token;
- ITL (inter-token latency) = the gaps between consecutive non-empty text
  chunks, pooled over all requests (a server that sends several tokens in one
  chunk shows a longer ITL than TPOT);
- output tokens = ``usage.completion_tokens`` of the final usage chunk (asked
  for with ``stream_options.include_usage``), else the number of non-empty text
  chunks; input tokens = ``usage.prompt_tokens``, else the prompt's length when
  it was sent as token ids.

A request fails on a non-2xx answer, a connection or timeout error, an error
event inside the stream, a malformed chunk, or a stream that ends without
``[DONE]`` before a choice finished; failures are counted by kind, the first one's message is kept, and
they take no part in the latency figures or token totals.

Written here rather than borrowed: the known clients (vLLM's
``benchmark_serving.py``, SGLang's ``bench_serving``) ship inside their
servers' packages with torch and tokenizers behind them; this one needs only
httpx, talks to any server, ours included, and imports no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from hypertron.config import flag_field
from hypertron.errors import UserError

if TYPE_CHECKING:
    import httpx
    import numpy as np
# asyncio, httpx and numpy are imported where they are used: the CLI reads BenchSettings to make
# `bench serve`'s flags whatever the command, and every command's start would pay for them.

DEFAULT_INPUT_LEN = 128
# Random prompt streams: arrivals and prompt ids come from separate generators of one
# seed, so changing --random-input-len does not change the arrival times.
_ARRIVAL_STREAM, _PROMPT_STREAM = 0, 1


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """What ``hypertron bench serve`` was asked to do: one field per command-line option, whose
    flag (``num_requests`` is ``--num-requests``), default and help are the field's."""

    base_url: str = flag_field("http://127.0.0.1:8000", "default %(default)s", "URL")
    api_key: str | None = flag_field(None, "sent as a Bearer token (default: $OPENAI_API_KEY)", "KEY")
    model: str | None = flag_field(None, "default: the first id from GET /v1/models; A,B,...: request i asks for "
                                         "the (i mod n)-th (LoRA adapters round-robin)")
    num_requests: int = flag_field(100, "default %(default)s", "N")
    request_rate: float | None = flag_field(  # None (and no concurrency) = inf
        None, "Poisson arrivals, requests/s; inf = all at once (the default)", "R")
    concurrency: int | None = flag_field(None, "keep N requests in flight instead", "N")
    prompts: str | None = flag_field(None, 'JSONL: {"prompt": str or [token ids], "max_tokens"?: int} per line, '
                                     "cycled (default: random token-id prompts)", "FILE")
    random_input_len: int | None = flag_field(None, f"random prompt length (default {DEFAULT_INPUT_LEN})", "L")
    # ids 3..258 exist in every vocabulary hypertron ships and are not the usual special ids 0..2
    random_vocab_low: int = flag_field(3, "default %(default)s", "ID")
    random_vocab_high: int = flag_field(259, "exclusive, default %(default)s", "ID")
    max_tokens: int = flag_field(128, "per request, unless its prompts line says (default %(default)s)", "M")
    temperature: float = flag_field(0.0, "default 0 (greedy)", "T")
    ignore_eos: bool = flag_field(False, 'send "ignore_eos": true (an extension)')
    seed: int = flag_field(0, "for the arrival times and random prompts", "S")
    request_timeout: float = flag_field(  # per connect / read / write
        600.0, "seconds to connect, or between two reads of a stream (default %(default)s)", "S")
    output: str | None = flag_field(None, "write the report as JSON", "FILE")

    def validate(self) -> None:
        """Raise :class:`UserError` naming the first impossible option."""
        positive = {
            "--num-requests": self.num_requests, "--max-tokens": self.max_tokens,
            "--concurrency": self.concurrency, "--random-input-len": self.random_input_len,
            "--request-timeout": self.request_timeout,
        }
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise UserError(f"{name}={value}: must be positive")
        if self.request_rate is not None and not self.request_rate > 0:  # also refuses nan
            raise UserError(f"--request-rate={self.request_rate}: must be positive (inf = all at once)")
        if self.request_rate is not None and self.concurrency is not None:
            raise UserError("give --request-rate or --concurrency, not both")
        if self.prompts is not None and self.random_input_len is not None:
            raise UserError("give --prompts FILE or --random-input-len, not both")
        if not 0 <= self.random_vocab_low < self.random_vocab_high:
            raise UserError(f"--random-vocab-low={self.random_vocab_low}, --random-vocab-high="
                            f"{self.random_vocab_high}: need 0 <= low < high")
        if not self.temperature >= 0:
            raise UserError(f"--temperature={self.temperature}: must not be negative")
        if self.seed < 0:
            raise UserError(f"--seed={self.seed}: must not be negative")
        if not self.base_url.startswith(("http://", "https://")):
            raise UserError(f"--base-url={self.base_url}: must start with http:// or https://")
        try:
            url = urllib.parse.urlsplit(self.base_url)
            url.port  # noqa: B018 -- raises ValueError past 65535
        except ValueError as e:
            raise UserError(f"--base-url={self.base_url}: not a URL ({e})") from None
        if not url.hostname:
            raise UserError(f"--base-url={self.base_url}: names no host")
        if self.output is not None:
            out = Path(self.output)
            if out.is_dir():
                raise UserError(f"--output={self.output}: is a directory")
            if not out.absolute().parent.is_dir():
                raise UserError(f"--output={self.output}: directory {out.absolute().parent} does not exist")

    @property
    def rate(self) -> float:
        """The Poisson arrival rate in requests/s (inf = all at once); unused with concurrency."""
        return math.inf if self.request_rate is None else self.request_rate

    def to_json(self) -> dict:
        """The settings as written to the report: effective values, and never the API key."""
        d = dataclasses.asdict(self)
        d["api_key"] = "(set)" if self.api_key else None
        d["mode"] = "concurrency" if self.concurrency else "request-rate"
        d["request_rate"] = None if self.concurrency else ("inf" if math.isinf(self.rate) else self.rate)
        if self.prompts is None:
            d["random_input_len"] = self.random_input_len or DEFAULT_INPUT_LEN
        return d


@dataclass(frozen=True)
class Prompt:
    """One request's prompt: text or token ids, and its ``max_tokens``."""

    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestRecord:
    """What happened to one request; times are ``time.perf_counter`` seconds."""

    index: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty text chunk
    output_tokens: int = 0
    input_tokens: int | None = None
    status: int | None = None  # HTTP status, None when no answer came
    error_kind: str | None = None  # "HTTP 429", "ConnectError", "stream", ... None when completed
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def fail(self, kind: str, message: str) -> None:
        self.error_kind, self.error = kind, f"{kind}: {message}"


@dataclass(frozen=True)
class BenchRun:
    """A finished benchmark: the model asked for, each request's record (by index), when sending
    began (``perf_counter``; request i was due ``arrival_schedule(...)[i]`` after it) and the
    duration from then to the last request finished."""

    model: str
    records: list[RequestRecord]
    t0: float
    duration_s: float


# ---------------------------------------------------------------- workload


def arrival_schedule(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Send times [num_requests] in seconds after the start of a Poisson process of ``rate``
    requests/s: the first at 0, then exponential gaps of mean ``1 / rate``; all 0 when ``rate``
    is inf. The same seed gives the same schedule."""
    import numpy as np

    if math.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])
    gaps = rng.exponential(1.0 / rate, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def random_prompts(num: int, input_len: int, low: int, high: int, max_tokens: int, seed: int) -> list[Prompt]:
    """``num`` prompts of ``input_len`` token ids drawn uniformly from [low, high)."""
    import numpy as np

    rng = np.random.default_rng([seed, _PROMPT_STREAM])
    ids = rng.integers(low, high, size=(num, input_len))
    return [Prompt(row.tolist(), max_tokens) for row in ids]


def load_prompts(path: str, default_max_tokens: int) -> list[Prompt]:
    """Prompts of a JSONL file, one ``{"prompt": str | [int, ...], "max_tokens"?: int}`` per
    line (blank lines skipped); :class:`UserError` names the file and line of a bad one."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts {path}: cannot read it ({e})") from None
    prompts = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            prompts.append(_parse_prompt_line(line, f"{path}:{lineno}", default_max_tokens))
    if not prompts:
        raise UserError(f"--prompts {path}: no prompts in the file")
    return prompts


def _parse_prompt_line(line: str, where: str, default_max_tokens: int) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON (nested too deep)") from None
    if not isinstance(obj, dict) or "prompt" not in obj:
        raise UserError(f'{where}: expected an object with a "prompt" key')
    prompt = obj["prompt"]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise UserError(f'{where}: "prompt" must be a non-empty string or list of token ids')
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise UserError(f'{where}: "max_tokens" must be a positive integer')
    return Prompt(prompt, max_tokens)


def build_prompts(settings: BenchSettings) -> list[Prompt]:
    """The ``num_requests`` prompts to send, in order: the file's prompts cycled, or random ones."""
    n = settings.num_requests
    if settings.prompts is None:
        return random_prompts(n, settings.random_input_len or DEFAULT_INPUT_LEN, settings.random_vocab_low,
                              settings.random_vocab_high, settings.max_tokens, settings.seed)
    prompts = load_prompts(settings.prompts, settings.max_tokens)
    return [prompts[i % len(prompts)] for i in range(n)]


# ---------------------------------------------------------------- client


class _StreamError(Exception):
    """The stream carried an error event, a malformed chunk, or ended early."""


def _error_text(payload: object) -> str:
    """The message of an OpenAI-style (``{"error": {"message"}}``), FastAPI (``{"detail"}``)
    or plain error payload, on one line."""
    if isinstance(payload, dict):
        for key in ("error", "message", "detail"):
            if key in payload:
                return _error_text(payload[key])
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return " ".join(text.split())[:300] or "(empty)"


def _error_body(body: bytes) -> str:
    try:
        return _error_text(json.loads(body))
    except ValueError:
        return _error_text(body.decode("utf-8", errors="replace"))


def _describe(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


async def _read_stream(resp: httpx.Response, rec: RequestRecord) -> dict | None:
    """Read a server-sent-event completion stream up to ``[DONE]`` (or its clean end after a choice
    finished: ``transformers serve`` sends no ``[DONE]``, and the ``openai`` client accepts
    that), stamping each chunk with text into ``rec.chunk_times``; returns the last ``usage``
    object seen (None if none)."""
    usage, finished = None, False
    async for line in resp.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return usage
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise _StreamError(f"malformed chunk {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise _StreamError(f"malformed chunk {data[:200]!r}")
        if chunk.get("error") is not None or chunk.get("object") == "error":
            raise _StreamError(_error_text(chunk))
        choices = [c for c in chunk.get("choices") or () if isinstance(c, dict)]
        if any(c.get("text") for c in choices):
            rec.chunk_times.append(now)
        finished = finished or any(c.get("finish_reason") for c in choices)
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
    if finished:
        return usage
    raise _StreamError("stream ended without [DONE] before any choice finished")


async def send_request(client: httpx.AsyncClient, index: int, prompt: Prompt, body: dict) -> RequestRecord:
    """POST one streaming completion (``body`` plus this prompt) and record its timings; never
    raises for a failed request, it records the failure instead."""
    import httpx

    rec = RequestRecord(index=index)
    usage = None
    payload = {**body, "prompt": prompt.prompt, "max_tokens": prompt.max_tokens}
    rec.start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            rec.status = resp.status_code
            if not resp.is_success:
                rec.fail(f"HTTP {resp.status_code}", _error_body(await resp.aread()))
            else:
                usage = await _read_stream(resp, rec)
    except httpx.HTTPError as e:
        rec.fail(type(e).__name__, _describe(e))
    except _StreamError as e:
        rec.fail("stream", str(e))
    rec.end = time.perf_counter()
    if rec.ok:
        usage = usage or {}
        count = usage.get("completion_tokens")
        rec.output_tokens = count if isinstance(count, int) else len(rec.chunk_times)
        count = usage.get("prompt_tokens")
        rec.input_tokens = count if isinstance(count, int) else (
            len(prompt.prompt) if isinstance(prompt.prompt, list) else None)
    return rec


def api_root(base_url: str) -> str:
    """The server root: ``base_url`` without a trailing ``/`` or ``/v1``."""
    return base_url.rstrip("/").removesuffix("/v1")


async def resolve_model(client: httpx.AsyncClient, settings: BenchSettings) -> str:
    """Check the server answers (GET /v1/models) and return the model to ask for: ``--model``,
    else the first listed id. Raises :class:`UserError` when it cannot."""
    import httpx

    where = f"{api_root(settings.base_url)}/v1/models"
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise UserError(f"cannot reach the server at {settings.base_url}: {_describe(e)}") from None
    if resp.status_code in (401, 403):
        raise UserError(f"{where}: HTTP {resp.status_code} ({_error_body(resp.content)}); check --api-key")
    if settings.model:
        return settings.model
    if not resp.is_success:
        raise UserError(f"{where}: HTTP {resp.status_code} ({_error_body(resp.content)}); give --model")
    try:
        ids = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{where}: not an OpenAI model list; give --model") from None
    if not ids:
        raise UserError(f"{where}: lists no models; give --model")
    return str(ids[0])


def request_body(settings: BenchSettings, model: str) -> dict:
    """The fields every request shares (prompt and max_tokens are added per request)."""
    body = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "temperature": settings.temperature,
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True  # vLLM / SGLang / hypertron extension
    return body


async def run_benchmark(
    settings: BenchSettings, prompts: list[Prompt],
    on_done: Callable[[RequestRecord], None] | None = None,
) -> BenchRun:
    """Send ``settings.num_requests`` requests (request i gets ``prompts[i]``) on the Poisson
    schedule or at fixed concurrency; ``on_done`` is called as each one finishes."""
    import httpx

    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    # No connection cap: a pool limit would queue requests on the client and count the wait as TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=api_root(settings.base_url), headers=headers, limits=limits,
        timeout=httpx.Timeout(settings.request_timeout),
    ) as client:
        model = await resolve_model(client, settings)
        bodies = [request_body(settings, m) for m in model.split(",")]  # round-robin over several models

        async def one(i: int) -> RequestRecord:
            rec = await send_request(client, i, prompts[i], bodies[i % len(bodies)])
            if on_done is not None:
                on_done(rec)
            return rec

        t0 = time.perf_counter()
        if settings.concurrency:
            records = await _at_concurrency(one, settings.num_requests, settings.concurrency)
        else:
            records = await _on_schedule(one, arrival_schedule(settings.num_requests, settings.rate, settings.seed), t0)
    records.sort(key=lambda r: r.index)
    return BenchRun(model, records, t0, max(r.end for r in records) - t0)


async def _at_concurrency(one, num_requests: int, concurrency: int) -> list[RequestRecord]:
    """``concurrency`` workers share one iterator of indices: each sends its next request as soon
    as its last one ends, so exactly that many are in flight until the indices run out."""
    import asyncio

    indices = iter(range(num_requests))
    records: list[RequestRecord] = []

    async def worker() -> None:
        for i in indices:
            records.append(await one(i))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
    return records


async def _on_schedule(one, offsets: np.ndarray, t0: float) -> list[RequestRecord]:
    import asyncio

    tasks = []
    for i, offset in enumerate(offsets):
        delay = t0 + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------- report


def latency_stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean, p50, p90, p99 in milliseconds of durations in seconds (linear-interpolated
    percentiles, numpy's default); all None for no values."""
    import numpy as np

    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """Counts, throughput, token totals and TTFT / TPOT / ITL / end-to-end statistics (ms) of a
    run; failed requests are counted and otherwise left out."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    first = min(failed, key=lambda r: r.end) if failed else None
    return {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_input_tokens": sum(r.input_tokens or 0 for r in done),
        "total_output_tokens": out_tokens,
        "ttft_ms": latency_stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": latency_stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": latency_stats_ms([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": latency_stats_ms([r.latency for r in done]),
        "errors": dict(Counter(r.error_kind for r in failed)),
        "first_error": first.error if first else None,
    }


def make_report(settings: BenchSettings, run: BenchRun) -> dict:
    """The JSON report: when, against what, with which settings, the summary, and one entry per
    request (times in ms from the start of sending)."""
    from hypertron import __version__

    requests = [
        {
            "index": r.index, "start_ms": (r.start - run.t0) * 1e3,
            "ttft_ms": None if r.ttft is None else r.ttft * 1e3, "latency_ms": r.latency * 1e3,
            "output_tokens": r.output_tokens, "input_tokens": r.input_tokens, "status": r.status,
            "error": r.error,
        }
        for r in run.records
    ]
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hypertron_version": __version__,
        "base_url": settings.base_url,
        "model": run.model,
        "settings": settings.to_json(),
        **summarize(run.records, run.duration_s),
        "requests": requests,
    }


def print_report(report: dict, console) -> None:
    """The report as two rich tables: totals, then latencies (ms)."""
    from rich.table import Table

    s = report["settings"]
    mode = f"concurrency {s['concurrency']}" if s["mode"] == "concurrency" else f"request rate {s['request_rate']}/s"
    totals = Table(title=f"Serving benchmark: {report['model']} at {report['base_url']}", show_header=False)
    totals.add_column(style="bold")
    totals.add_column(justify="right")
    for name, value in [
        ("load", mode),
        ("completed / failed", f"{report['completed']} / {report['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{report['request_throughput']:.2f}"),
        ("output throughput (tok/s)", f"{report['output_throughput']:.1f}"),
        ("total input tokens", str(report["total_input_tokens"])),
        ("total output tokens", str(report["total_output_tokens"])),
    ]:
        totals.add_row(name, value)
    lat = Table(title="Latency (ms)")
    lat.add_column("")
    for q in ("mean", "p50", "p90", "p99"):
        lat.add_column(q, justify="right")
    for name, key in [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("end to end", "e2e_latency_ms")]:
        lat.add_row(name, *("-" if v is None else f"{v:.2f}" for v in report[key].values()))
    console.print(totals)
    console.print(lat)
    if report["failed"]:
        kinds = ", ".join(f"{k} x{n}" for k, n in report["errors"].items())
        console.print(f"failed: {kinds}; first: {report['first_error']}", markup=False, highlight=False)


def bench_serve(settings: BenchSettings) -> int:
    """``hypertron bench serve``: validate, run with a progress bar, print the tables, write the
    JSON report if asked. Returns the exit code: 0, or 1 when no request completed."""
    import asyncio

    from rich.console import Console
    from rich.progress import Progress

    settings.validate()
    prompts = build_prompts(settings)
    err = Console(stderr=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("requests", total=settings.num_requests)
        run = asyncio.run(run_benchmark(settings, prompts, on_done=lambda _: progress.advance(task)))
    report = make_report(settings, run)
    print_report(report, Console())
    if settings.output:
        Path(settings.output).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        print(f"wrote {settings.output}")
    return 0 if report["completed"] else 1
