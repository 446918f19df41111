"""Watching every process: the host collector, its Prometheus endpoint, straggler scores and
outliers, the live dashboard.

The end-to-end test trains with 4 real processes, one of them slowed by the documented fault
injection, while Debian's Prometheus (when installed; ``make test`` installs it as root)
scrapes each process's endpoint; headless Chromium (Debian's, installed the same way) then
loads the run's dashboard.
"""

from __future__ import annotations

import html.parser
import io
import json
import os
import shutil
import socket
import sys
import time
import urllib.parse
import urllib.request

import jax
import numpy as np
import pytest

from hypertron.config import MonitorConfig, load_config
from hypertron.launch.local import free_ports
from hypertron.monitor import stragglers
from hypertron.monitor.collector import Collector
from hypertron.train import loop as train_loop
from hypertron.train import task as train_task
from support import processes  # tests/support
from support.tiny import ONE_LAYER  # tests/support

TINY = [*ONE_LAYER, "data.source=stdlib", "train.log_every=100", "checkpoint.enabled=false"]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


# --- scores, by hand ----------------------------------------------------------------------

def test_straggler_scores_by_hand():
    # Window 4: blocks of 4 values; the floor (10 ms) hides what is under it.
    series = {0: np.full(8, 0.001), 1: np.full(8, 0.004), 2: np.full(8, 0.05),
              3: np.array([0.02] * 4 + [0.03] * 4)}
    got = {s.process: s for s in stragglers.score(series, "data_wait", window=4)}
    want = {0: (1.0, 1.0), 1: (1.0, 1.0), 2: (0.2, 1.0), 3: (0.01 / 0.03, 0.02 / 0.03)}
    for p, (relative, individual) in want.items():
        assert (got[p].relative, got[p].individual) == pytest.approx((relative, individual), rel=1e-12)
    assert [p for p, s in got.items() if s.straggler] == [2, 3]
    assert got[3].current == 0.03 and got[3].best == 0.02
    # Everyone slower than they were: no relative straggler, but each individual score says so.
    both = stragglers.score({0: np.array([0.1] * 4 + [0.2] * 4), 1: np.array([0.1] * 4 + [0.2] * 4)},
                            "data_wait", window=4)
    assert [(s.relative, s.individual, s.straggler) for s in both] == [(1.0, 0.5, True)] * 2
    # An incomplete first block is dropped; with fewer values than a window, one median of all.
    np.testing.assert_array_equal(stragglers.block_medians(np.arange(10.0), 4), [3.5, 7.5])
    np.testing.assert_array_equal(stragglers.block_medians(np.arange(3.0), 4), [1.0])


# --- the collector, alone -------------------------------------------------------------------

def test_collector_samples_the_host_and_serves_prometheus(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    port = free_ports(1)
    c = Collector(tmp_path, MonitorConfig(interval=0.05, h2d_every=2, h2d_bytes=1 << 16, port=port), process_index=0)
    c.begin(0, 10)
    for step in range(1, 11):
        c.scalars(step, {"loss": 5.0 - step / 10, "step_time": 0.01, "data_wait": 0.001 * step})
        time.sleep(0.02)
    c.scalars(10, {"loss": 1.0, "tokens": 1, "seconds": 1}, group="eval")  # not a step: ignored
    time.sleep(0.1)
    text = _get(f"http://127.0.0.1:{port}/metrics")
    c.finish("completed")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    step = families["hypertron_step"].samples[0]
    assert step.value == 10 and step.labels == {"run": tmp_path.name, "host": socket.gethostname(), "process": "0"}
    assert families["hypertron_steps"].type == "counter"
    assert families["hypertron_steps"].samples[0].value == 10  # hypertron_steps_total
    assert families["hypertron_loss"].samples[0].value == pytest.approx(4.0)  # the last step's, not the eval
    for name in ("hypertron_host_cpu_utilization_ratio", "hypertron_host_memory_used_bytes",
                 "hypertron_process_rss_bytes", "hypertron_host_to_device_seconds",
                 "hypertron_network_received_bytes"):
        assert name in families, name
    with pytest.raises(OSError):  # the endpoint is gone with the job
        _get(f"http://127.0.0.1:{port}/metrics")

    rows = [json.loads(line) for line in (tmp_path / "host_metrics.0.jsonl").read_text().splitlines()]
    assert len(rows) >= 2 and sum(r["steps"] for r in rows) == 10 and rows[-1]["step"] == 10
    assert all(0 <= r["cpu_utilization_mean"] <= r["cpu_utilization_max"] <= 1 for r in rows)
    assert all(r["rss_bytes"] > 0 and r["host_memory_used_bytes"] > 0 for r in rows)
    waits = [r["data_wait_max"] for r in rows if r["steps"]]
    assert max(waits) == pytest.approx(0.010)
    timed = [r for r in rows if r["h2d_seconds"] is not None]
    assert timed and all(r["h2d_bytes"] == 1 << 16 and r["h2d_seconds"] > 0 for r in timed)
    assert rows[0]["device_memory_used_bytes"] is None if jax.default_backend() == "cpu" else True


def test_a_metric_added_to_the_table_reaches_every_reader(tmp_path, monkeypatch):
    """One record added to ``runfiles.HOST_METRICS`` and nothing else: the collector writes it and
    serves it on /metrics, the report ranks the processes by it and prints it by its unit, and the
    dashboard's data names it and prints it the same way."""
    from prometheus_client.parser import text_string_to_metric_families
    from rich.console import Console

    from hypertron import runfiles
    from hypertron.monitor import dashboard, report as mon

    widgets = [1 << 20]  # what the sampler reads: process 0's, then process 1's
    fake = runfiles.Metric(key="widget_bytes", unit="bytes", help="a test's figure", label="widgets", outlier=True,
                           prometheus="hypertron_widget_bytes", sample=lambda: widgets[0])
    monkeypatch.setattr(runfiles, "HOST_METRICS", (*runfiles.HOST_METRICS, fake))
    t0 = time.time() - 10
    events = [{"time": t0, "event": "job_start", "step": None, "pid": 1, "host": "elsewhere", "process_count": 2},
              {"time": t0 + 1, "event": "step", "step": 1, "step_time": 1.0, "data_wait": 0.01},
              {"time": t0 + 2, "event": "job_end", "step": 1, "status": "completed", "seconds": 2.0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({**e, "process": 0}) + "\n" for e in events))
    port = free_ports(1)
    for index, value in ((0, 1 << 20), (1, 3 << 20)):
        widgets[0] = value
        c = Collector(tmp_path, MonitorConfig(interval=0.01, port=port if index == 0 else 0), process_index=index)
        c.begin(0, 1)
        deadline = time.time() + 10
        while "widget_bytes" not in c.known:  # the first sample
            assert time.time() < deadline, "no sample in 10 s"
            time.sleep(0.01)
        if index == 0:
            families = {f.name: f for f in text_string_to_metric_families(_get(f"http://127.0.0.1:{port}/metrics"))}
        c.finish("completed")

    rows = [json.loads(line) for line in (tmp_path / "host_metrics.0.jsonl").read_text().splitlines()]
    assert list(rows[0]) == ["time", "process", "step"] + [m.key for m in runfiles.sampled_metrics()]
    assert {r["widget_bytes"] for r in rows} == {1 << 20}
    family = families["hypertron_widget_bytes"]
    assert (family.type, family.documentation, family.samples[0].value) == ("gauge", "a test's figure", 1 << 20)
    rep = mon.build(tmp_path)
    assert rep.analysis.outliers["widget_bytes"] == {"mean": [(1, 3 << 20), (0, 1 << 20)],
                                                     "max": [(1, 3 << 20), (0, 1 << 20)]}
    console = Console(width=200, file=io.StringIO())
    console.print(mon.render(rep))
    (line,) = [line for line in console.file.getvalue().splitlines() if line.strip().startswith("widgets")]
    assert [cell.strip() for cell in line.split("│")] == ["widgets", "1: 3 MiB, 0: 1 MiB", "1: 3 MiB, 0: 1 MiB"]
    d = dashboard.data(rep)
    assert d["names"]["metrics"]["widget_bytes"] == "widgets"
    assert d["outliers"]["widget_bytes"]["max"][0] == {"process": 1, "value": 3 << 20, "text": "3 MiB"}


def test_a_taken_port_is_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = Collector(tmp_path, MonitorConfig(port=port), process_index=0)
        with pytest.raises(Exception, match=f"monitor.port: cannot serve process 0's metrics on 127.0.0.1:{port}"):
            c.begin(0, 1)


# --- the loop is not slowed down ------------------------------------------------------------

@pytest.mark.slow
def test_the_monitor_adds_no_fetch_and_keeps_the_next_step_queued(tmp_path, monkeypatch):
    """Step n + 1 is dispatched before step n's metrics are fetched, one fetch per step, with a
    collector sampling as often as it can (and timing a host-to-device copy at every step)."""
    calls = []
    real_get, real_make = jax.device_get, train_task.make_trainer

    def spy_get(x):
        calls.append("fetch")
        return real_get(x)

    def make(*a, **k):
        trainer = real_make(*a, **k)
        real_step = trainer.step

        def step(state, batch):
            calls.append("step")
            return real_step(state, batch)

        trainer.step = step
        return trainer

    monkeypatch.setattr(jax, "device_get", spy_get)
    monkeypatch.setattr(train_task, "make_trainer", make)  # what the language-model task builds its trainer with
    cfg = load_config(None, TINY + [f"run_dir={tmp_path}", "train.steps=6"])
    collector = Collector(tmp_path, MonitorConfig(interval=0.001, h2d_every=1, h2d_bytes=1 << 16))
    train_loop.train(cfg, trackers=[collector])
    assert calls == ["step", "step", "fetch"] + ["step", "fetch"] * 4 + ["fetch"]
    rows = [json.loads(line) for line in (tmp_path / "host_metrics.0.jsonl").read_text().splitlines()]
    assert sum(r["steps"] for r in rows) == 6 and any(r["h2d_seconds"] for r in rows)
    _check_events(tmp_path / "events.jsonl")


def _check_events(path):
    """Every event has the common fields and only those ``runfiles.EVENTS`` gives it, each of its type in
    ``runfiles.EVENT_FIELDS`` (a JSON integer where a float is said is one)."""
    from hypertron import runfiles

    for e in map(json.loads, path.read_text().splitlines()):
        assert set(runfiles.COMMON_FIELDS) <= set(e) <= {*runfiles.COMMON_FIELDS, *runfiles.EVENTS[e["event"]]}, e
        for k, v in e.items():
            want = runfiles.EVENT_FIELDS[k]
            assert isinstance(v, want) or (want is float and type(v) is int) or (k == "step" and v is None), (k, v)


# --- 4 processes, one slowed, scraped by Prometheus ------------------------------------------

SLOW_PROCESS, DELAY, PROCESSES = 2, 0.25, 4


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory):
    """A 4-process run with process 2's data loading slowed; Prometheus scrapes it when installed."""
    root = tmp_path_factory.mktemp("hosts")
    for attempt in range(3):  # a port checked free can be taken before the job binds it (other tests run beside)
        run, seen, why, job, out = _slowed_job(root / f"try{attempt}")
        if job.returncode == 0 or "Address already in use" not in out:
            break
    assert job.returncode == 0, _first_errors(out) + out[-3000:]
    return run, seen, why


def _slowed_job(root):
    """One try of :func:`slowed_run`'s job in ``root``: (run, what Prometheus saw, why it did not, the job, its output)."""
    root.mkdir()
    run, port = root / "run", free_ports(PROCESSES)
    prom, seen, why = None, {}, ""
    if shutil.which("prometheus"):
        prom_port = free_ports(1)
        targets = ", ".join(f"'127.0.0.1:{port + i}'" for i in range(PROCESSES))
        (root / "prometheus.yml").write_text(
            f"global: {{scrape_interval: 1s, scrape_timeout: 1s}}\n"
            f"scrape_configs:\n  - job_name: hypertron\n    static_configs:\n      - targets: [{targets}]\n")
        prom = processes.start(["prometheus", f"--config.file={root / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=processes.DEVNULL, stderr=open(root / "prometheus.log", "w"))
    else:
        why = "Debian's prometheus is not installed (make test installs it when run as root)"
    env = processes.fast_compile({k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"})
    env["HYPERTRON_FAULT_DATA_DELAY"] = f"{SLOW_PROCESS}:{DELAY}"
    job = processes.start(
        [sys.executable, "-m", "hypertron.cli", "launch", "local", "--processes", str(PROCESSES), "--cpu-devices", "1",
         "--", "train", *TINY, f"run_dir={run}", "train.steps=30", "monitor.interval=0.5", "monitor.h2d_every=2",
         "monitor.h2d_bytes=65536", f"monitor.port={port}"],
        env=env, stdout=processes.PIPE, stderr=processes.STDOUT, text=True)
    try:
        deadline = time.time() + 400
        while job.poll() is None and time.time() < deadline:
            if prom is not None and len(seen) < PROCESSES:
                try:
                    q = urllib.parse.quote("hypertron_step")
                    body = json.loads(_get(f"http://127.0.0.1:{prom_port}/api/v1/query?query={q}"))
                    for r in body["data"]["result"]:
                        seen[r["metric"]["process"]] = (r["metric"], float(r["value"][1]))
                except OSError:
                    pass  # Prometheus is still starting
            time.sleep(0.5)
        out = job.communicate(timeout=max(1, deadline - time.time()))[0]
    finally:
        if job.poll() is None:
            job.kill()
        if prom is not None:
            prom.terminate()
            prom.wait(10)
    return run, seen, why if prom is None else "", job, out


def _first_errors(out: str, n: int = 20) -> str:
    """The first lines of a failed job's output that say what went wrong (the processes that
    died after it print C++ traces that fill the end)."""
    said = [line for line in out.splitlines()
            if any(w in line for w in ("rror", "Traceback", "Exception", "exited", "Killed")) and " @ " not in line]
    return "first errors:\n" + "\n".join(said[:n]) + "\n...\n"


@pytest.mark.slow
def test_the_slowed_process_and_only_it_is_a_straggler(slowed_run):
    run, _, _ = slowed_run
    proc = processes.run([sys.executable, "-m", "hypertron.cli", "monitor", str(run), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # a straggler is an alarm
    report = json.loads(proc.stdout)
    assert report["stragglers"] == [SLOW_PROCESS]
    assert [p["status"] for p in report["processes"]] == ["completed"] * PROCESSES
    waits = {s["process"]: s for s in report["scores"] if s["metric"] == "data_wait"}
    assert sorted(waits) == list(range(PROCESSES))
    assert waits[SLOW_PROCESS]["current"] >= DELAY and waits[SLOW_PROCESS]["relative"] < 0.1
    assert {p for p, s in waits.items() if s["relative"] == 1.0} == set(range(PROCESSES)) - {SLOW_PROCESS}
    top = report["outliers"]["data_wait"]
    assert top["mean"][0]["process"] == top["max"][0]["process"] == SLOW_PROCESS
    assert len(top["mean"]) == PROCESSES
    assert all(f"host_metrics.{i}.jsonl" in os.listdir(run) for i in range(PROCESSES))
    assert len({s["process"] for s in report["scores"] if s["metric"] == "h2d_seconds"}) == PROCESSES
    assert [a for a in report["alarms"] if a.startswith("straggler")] and \
        all(f"process {SLOW_PROCESS}'s" in a for a in report["alarms"] if a.startswith("straggler"))


@pytest.mark.slow
def test_prometheus_scrapes_every_process(slowed_run):
    run, seen, why = slowed_run
    if why:
        pytest.skip(why)
    assert sorted(seen) == [str(i) for i in range(PROCESSES)]
    for process, (labels, step) in seen.items():
        assert labels["run"] == run.name and labels["host"] == socket.gethostname()
        assert labels["job"] == "hypertron" and 0 <= step <= 30


def test_the_fault_injection_setting(monkeypatch):
    from hypertron.config import ConfigError

    for text, want in (("2:0.25", [0, 0, 0.25]), ("*:0.1", [0.1] * 3), ("", [0] * 3), (" 0:1 ", [1, 0, 0])):
        monkeypatch.setenv(train_loop.FAULT_DATA_DELAY, text)
        assert [train_loop.data_delay(i) for i in range(3)] == want
    for bad in ("2", "x:0.1", "1:-1", "1:soon"):
        monkeypatch.setenv(train_loop.FAULT_DATA_DELAY, bad)
        with pytest.raises(ConfigError, match="HYPERTRON_FAULT_DATA_DELAY=.*expected PROCESS:SECONDS"):
            train_loop.data_delay(0)


# --- the dashboard ------------------------------------------------------------------------------


def test_thinning_averages_buckets_at_their_last_step():
    from hypertron.monitor.dashboard import _last_per_step, _thin

    x, y = np.arange(1, 11), np.array([1, 2, 3, 4, 5, 6, 7, 8, np.nan, 10.0])
    small = _thin(x, y, 20)
    assert small["x"] == list(range(1, 11)) and small["y"][:2] == [1, 2] and np.isnan(small["y"][8])
    thin = _thin(x, y, 3)  # buckets of 3, 3, 4 rows; the NaN is left out of its mean
    assert thin["x"] == [3, 6, 10] and thin["y"] == [2.0, 5.0, pytest.approx((7 + 8 + 10) / 3)]
    # A resumed run logs steps 4 and 5 again: the later rows win.
    assert _last_per_step(np.array([1, 2, 3, 4, 5, 4, 5, 6])).tolist() == [0, 1, 2, 5, 6, 7]


@pytest.mark.slow
def test_the_dashboard_data_of_the_slowed_run(slowed_run, tmp_path):
    from fastapi.testclient import TestClient

    from hypertron.monitor import dashboard, report as mon

    run, _, _ = slowed_run
    rep = mon.build(run)
    d = dashboard.data(rep, bins=12)
    assert d["curves"]["loss"]["x"] == list(range(1, 31))
    assert d["curves"]["tokens_per_sec_per_device"]["x"] == list(range(2, 31))  # step 1 compiles
    waits = d["heatmaps"]["data_wait"]
    assert waits["processes"] == list(range(PROCESSES)) and all(len(row) == 12 for row in waits["z"])
    mean = {p: np.nanmean(np.array(row, float)) for p, row in zip(waits["processes"], waits["z"])}
    assert mean[SLOW_PROCESS] >= DELAY and all(mean[p] < DELAY / 2 for p in mean if p != SLOW_PROCESS)
    # Every bin's causes add up to the bin; the line ends at the run's goodput.
    width, seconds = d["bins"]["width"], d["timeline"]["seconds"]
    np.testing.assert_allclose(np.sum(list(seconds.values()), axis=0), width, rtol=1e-4)
    assert d["timeline"]["goodput"][-1] == pytest.approx(d["goodput_percent"], rel=1e-4)
    assert d["stragglers"] == [SLOW_PROCESS] and d["status"] == "completed"

    # The server: the page, its script from the plotly package, and data that follows the files.
    live = tmp_path / "run"
    live.mkdir()
    names = sorted(p.name for p in run.iterdir() if p.suffix == ".jsonl")
    for name in names:
        lines = (run / name).read_text().splitlines(keepends=True)
        (live / name).write_text("".join(lines[: len(lines) // 2]))
    with TestClient(dashboard.app(live, lambda: mon.build(live), refresh=0.01)) as client:
        page = client.get("/")
        assert page.status_code == 200 and 'src="static/plotly.min.js"' in page.text and str(live) in page.text
        script = client.get("/static/plotly.min.js")
        assert script.status_code == 200 and "plotly" in script.text[:2000].lower()
        before = client.get("/api/data").json()
        for name in names:
            (live / name).write_text((run / name).read_text())
        time.sleep(0.02)
        after = client.get("/api/data").json()
    # (the half-written copy reads as a job whose process is gone)
    assert before["last_step"] < after["last_step"] == 30 and before["status"] == "killed"
    assert after["status"] == "completed" and after["refresh"] == 0.01


def test_serve_errors_are_one_line(tmp_path, capsys):
    from hypertron import cli

    assert cli.main(["monitor", str(tmp_path / "nope"), "--serve"]) == 2
    assert capsys.readouterr().err.strip().endswith("is not a directory")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert cli.main(["monitor", str(tmp_path), "--serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot listen on 127.0.0.1:{port}" in err
    assert cli.main(["monitor", str(tmp_path), "--serve", "--json"]) == 2
    assert "--json and --follow do not apply" in capsys.readouterr().err
    assert cli.main(["monitor", str(tmp_path), "--serve", "--refresh", "inf"]) == 2
    assert "--refresh must be in (0, 3600]" in capsys.readouterr().err
    assert cli.main(["monitor", str(tmp_path), "--serve", "--window", "soon"]) == 2  # before serving anything
    assert "--window='soon': not a duration" in capsys.readouterr().err


class _Page(html.parser.HTMLParser):
    """Each element's attributes by id, the body's, and the text of every table cell and list item."""

    def __init__(self):
        super().__init__()
        self.ids, self.body, self.cells, self._in, self._ids = {}, {}, {}, [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if "id" in attrs:
            self.ids[attrs["id"]] = attrs
        self._ids.append(attrs.get("id"))
        self._in.append(tag)

    def handle_endtag(self, tag):
        while self._in:
            self._ids.pop()
            if self._in.pop() == tag:
                break

    def handle_data(self, data):
        owner = next((i for i in reversed(self._ids) if i), None)
        if owner and self._in and self._in[-1] in ("td", "li") and data.strip():
            self.cells.setdefault(owner, []).append(data.strip())


@pytest.mark.slow
def test_headless_chromium_shows_the_dashboard_of_a_real_run(slowed_run, tmp_path, record_property):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (make test installs it when run as root)")
    run, _, _ = slowed_run
    server = processes.start([sys.executable, "-m", "hypertron.cli", "monitor", str(run), "--serve", "--port", "0",
                               "--refresh", "0.5"], stdout=processes.PIPE, stderr=processes.STDOUT, text=True)
    try:
        line = server.stdout.readline()
        assert "http://127.0.0.1:" in line, line + server.stdout.read()
        url = line.split()[3]
        # Chromium as root needs --no-sandbox; virtual time lets the page poll several times at once.
        browse = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                  f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=6000", "--window-size=1400,2600"]
        dom = processes.run(browse + ["--enable-logging=stderr", "--v=0", "--dump-dom", url],
                             capture_output=True, text=True, timeout=120)
        shot = tmp_path / "dashboard.png"
        processes.run(browse + [f"--screenshot={shot}", url], capture_output=True, timeout=120)
    finally:
        server.terminate()
        server.wait(10)
    record_property("screenshot", str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console  # the page logs nothing: no error, no warning
    page = _Page()
    page.feed(dom.stdout)
    assert int(page.body["data-updates"]) >= 2  # it updates itself
    points = {k: int(page.ids[k]["data-points"]) for k in ("loss", "throughput", "heat-step", "heat-wait", "goodput")}
    assert points["loss"] == 30 and points["throughput"] == 29, points
    assert points["heat-step"] >= PROCESSES and points["heat-wait"] >= PROCESSES and points["goodput"] > 0, points
    assert "display: none" in page.ids["banner"].get("style", "")
    assert int(page.ids["scores"]["data-rows"]) == 2 * PROCESSES
    scores = page.cells["scores"]
    assert scores.count("straggler") == 1 and scores[scores.index("straggler") - 6] == str(SLOW_PROCESS)
    outliers = page.cells["outliers"]
    assert outliers[outliers.index("data wait") + 1].startswith(f"{SLOW_PROCESS}: ")
    assert any(a.startswith(f"straggler: process {SLOW_PROCESS}'s") for a in page.cells["alarms"])
    assert page.cells["processes"].count("completed") == PROCESSES
