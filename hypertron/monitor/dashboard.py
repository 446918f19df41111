"""``hypertron monitor RUN_DIR --serve``: the run on one page that updates itself.

The page (``dashboard.html``) is static; it asks ``/api/data`` every few seconds for what
:func:`data` computes from the same :class:`~hypertron.monitor.report.Report` as the terminal
report, and draws it with Plotly. Its script comes from the installed ``plotly`` package and is
served by this server: no CDN, so the page works on a cluster without internet.

Long runs stay cheap to show: the loss and throughput curves are averaged into at most
``POINTS`` points and the per-process heatmaps and the goodput breakdown into ``BINS`` time
bins, so what the page receives grows with the number of processes, not with the run's length.
"""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hypertron.monitor import stragglers
from hypertron.monitor.goodput import BADPUT, LABELS, PRODUCTIVE, RUNNING
from hypertron.monitor.report import _TITLES, MonitorError, Report, describe_metric, metric_names, to_json

POINTS, BINS = 1000, 60
PAGE = Path(__file__).with_name("dashboard.html")


def plotly_script() -> Path:
    """plotly.min.js from the installed ``plotly`` package (it is never imported)."""
    spec = importlib.util.find_spec("plotly")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "package_data" / "plotly.min.js"
        if path.is_file():
            return path
    raise MonitorError("the dashboard needs plotly's script (package_data/plotly.min.js): pip install plotly")


# --- what the page shows ----------------------------------------------------------------------

def data(report: Report, points: int = POINTS, bins: int = BINS) -> dict[str, Any]:
    """Everything the page draws, as JSON-ready values (NaN as null)."""
    out = to_json(report)
    for metric, ranks in out.get("outliers", {}).items():  # printed here, as the report prints them
        for row in (r for rows in ranks.values() for r in rows):
            row["text"] = describe_metric(metric, row["value"])
    out["status"] = report.goodput.jobs[-1].status if report.goodput else None
    out["running"] = out["status"] == RUNNING
    out["curves"] = _curves(report, points)
    g = report.goodput
    if g is None or not g.total > 0:
        return _clean(out)
    edges = np.linspace(g.start, g.end, bins + 1)
    width = float(edges[1] - edges[0])
    out["bins"] = {"start": [_clock(t) for t in edges[:-1]], "middle": [_clock(t + width / 2) for t in edges[:-1]],
                   "end": _clock(edges[-1]),
                   "width": width}
    out["heatmaps"] = {"step_time": _heatmap(report, edges, "step_times"),
                       "data_wait": _heatmap(report, edges, "data_waits")}
    out["timeline"] = _timeline(report, edges)
    out["names"] = {"causes": {k: _TITLES.get(k, k) for k in LABELS}, "metrics": metric_names()}
    return _clean(out)


def _curves(report: Report, points: int) -> dict[str, Any]:
    """Loss, eval loss, tokens/s and MFU by step, from metrics.jsonl (each job's first step,
    which holds its compile, left out of the throughput)."""
    m = report.metrics
    if m is None or not m.rows:
        return {}
    steps, evals = m["step"], ~np.isnan(m["eval_loss"])
    rows = np.flatnonzero((steps >= 0) & ~evals)
    rows = rows[_last_per_step(steps[rows])]  # a resumed run redoes steps: the latest value wins
    first = {int(j.steps[0]) for j in report.jobs.get(0, []) if len(j.steps)}
    timed = rows[~np.isin(steps[rows], list(first))]
    erows = np.flatnonzero(evals & (steps >= 0))
    erows = erows[_last_per_step(steps[erows])]
    return {
        "loss": _thin(steps[rows], m["loss"][rows], points),
        "eval_loss": _thin(steps[erows], m["eval_loss"][erows], points),
        "tokens_per_sec_per_device": _thin(steps[timed], m["tokens_per_sec_per_device"][timed], points),
        "mfu": _thin(steps[timed], 100 * m["mfu"][timed], points),
    }


def _last_per_step(steps: np.ndarray) -> np.ndarray:
    """Indices (in file order) of the last row of each distinct step."""
    _, last_from_end = np.unique(steps[::-1], return_index=True)
    return np.sort(len(steps) - 1 - last_from_end)


def _thin(x: np.ndarray, y: np.ndarray, points: int) -> dict[str, list]:
    """At most ``points`` points: consecutive buckets averaged, each at its last x."""
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order].astype(float)
    if len(x) > points:
        edges = np.linspace(0, len(x), points + 1).astype(int)
        sums = np.add.reduceat(np.where(np.isfinite(y), y, 0.0), edges[:-1])
        counts = np.add.reduceat(np.isfinite(y).astype(float), edges[:-1])
        with np.errstate(invalid="ignore", divide="ignore"):
            y = sums / counts
        x = x[edges[1:] - 1]
    return {"x": x.tolist(), "y": y.tolist()}


def _heatmap(report: Report, edges: np.ndarray, field: str) -> dict[str, Any]:
    """Mean of each process's step times (or data waits) per time bin (its steps' ends), each
    job's first step (compile, first batch) left out; rows: processes, null: no step ended then."""
    z, processes = [], sorted(report.jobs)
    for p in processes:
        jobs = [j for j in report.jobs[p] if len(j.steps) > 1]
        t = np.concatenate([j.ends[1:] for j in jobs]) if jobs else np.zeros(0)
        v = np.concatenate([getattr(j, field)[1:] for j in jobs]) if jobs else np.zeros(0)
        # Steps that ended outside process 0's span (another host's clock, or process 0 gone) are left out.
        keep = np.isfinite(v) & (t >= edges[0]) & (t <= edges[-1])
        k = np.clip(np.searchsorted(edges, t[keep], side="right") - 1, 0, len(edges) - 2)
        n = np.bincount(k, minlength=len(edges) - 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            z.append(np.bincount(k, v[keep], minlength=len(edges) - 1) / n)
    return {"processes": processes, "z": [row.tolist() for row in z]}


def _timeline(report: Report, edges: np.ndarray) -> dict[str, Any]:
    """Seconds of each cause per time bin, and the run's goodput from its start to each bin's end."""
    g = report.goodput
    per = [g.timeline.totals(a, b) for a, b in zip(edges[:-1], edges[1:])]
    causes = {k: [s[k] for s in per] for k in LABELS if any(s[k] > 0 for s in per)}
    productive = np.cumsum([s[PRODUCTIVE] for s in per])
    with np.errstate(invalid="ignore", divide="ignore"):
        goodput = 100 * productive / (edges[1:] - edges[0])
    return {"seconds": causes, "goodput": goodput.tolist(), "badput": [k for k in BADPUT if k in causes]}


def _clean(x: Any) -> Any:
    """JSON-ready: NaN and infinities as null, numpy scalars and arrays as Python ones."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def _clock(t: float) -> str:
    """Local time as Plotly reads dates, to the millisecond."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


# --- the server -------------------------------------------------------------------------------

class Source:
    """The page's data, rebuilt at most once per ``refresh`` seconds however many pages ask."""

    def __init__(self, build: Callable[[], Report], refresh: float):
        self.build, self.refresh = build, refresh
        self._lock = threading.Lock()
        self._at, self._body = -math.inf, b""

    def get(self) -> bytes:
        with self._lock:
            if time.monotonic() - self._at >= self.refresh:
                try:
                    body: dict[str, Any] = data(self.build())
                except MonitorError as e:
                    body = {"error": str(e)}
                except Exception as e:  # a file that vanished mid-read, say: shown on the page, tried again later
                    body = {"error": f"cannot read the run: {type(e).__name__}: {e}"}
                body["refresh"] = self.refresh
                self._body = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
                self._at = time.monotonic()
            return self._body


def app(run_dir: str | Path, build: Callable[[], Report], refresh: float):
    """The FastAPI application: the page, its data and its script."""
    from fastapi import FastAPI
    from fastapi.responses import FileResponse, HTMLResponse, Response
    from starlette.middleware.gzip import GZipMiddleware

    script = plotly_script()
    page = PAGE.read_text().replace("{{ config }}", json.dumps(
        {"run_dir": str(run_dir), "refresh": refresh}).replace("<", "\\u003c"))
    source = Source(build, refresh)
    api = FastAPI(title="hypertron monitor", docs_url=None, redoc_url=None, openapi_url=None)
    api.add_middleware(GZipMiddleware, minimum_size=1024)

    @api.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(page)

    @api.get("/api/data")
    def api_data() -> Response:
        return Response(source.get(), media_type="application/json", headers={"Cache-Control": "no-store"})

    @api.get("/static/plotly.min.js")
    def plotly_js() -> FileResponse:
        return FileResponse(script, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    return api


def serve(run_dir: str | Path, build: Callable[[], Report], host: str, port: int, refresh: float,
          log: Callable[[str], None] = print) -> None:
    """Serve the dashboard until interrupted; a port that cannot be bound is one line."""
    import uvicorn

    application = app(run_dir, build, refresh)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # before the URL is printed: whoever reads it can connect at once
    except OSError as e:
        sock.close()
        raise MonitorError(f"the dashboard cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = sock.getsockname()[1]
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else f"[{host}]" if family == socket.AF_INET6 else host
    log(f"dashboard of {run_dir}: http://{shown}:{bound}/ (refreshes every {refresh:g} s; Ctrl-C stops)")
    server = uvicorn.Server(uvicorn.Config(application, log_level="warning", access_log=False))
    server.run(sockets=[sock])
