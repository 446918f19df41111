"""``hypertron monitor``: a run's goodput, stragglers and hangs, on the console, as JSON or as a page."""

from __future__ import annotations

import argparse
import os
import sys

from hypertron.cli.flags import add_command, add_dataclass_flags, add_json_flag, number_arg
from hypertron.monitor.settings import ReportSettings


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``monitor`` to ``sub``."""
    mo = add_command(sub, "monitor", cmd_monitor,
                     help="goodput, badput by cause, disruptions and alarms of a training run")
    mo.add_argument("run_dir", metavar="RUN_DIR")
    add_json_flag(mo, "the report")
    mo.add_argument("--follow", nargs="?", type=number_arg(float, above=0, high=86400), const=5.0, default=None,
                    metavar="SECONDS",
                    help="refresh every SECONDS (default 5) until the run's job stops")
    mo.add_argument("--since", metavar="TIME", help="also report the window from TIME (ISO date-time, "
                    "Unix time, or a duration before now such as 2h)")
    mo.add_argument("--window", metavar="DURATION", help="the window's length (90s, 30m, 2h); alone: "
                    "the last DURATION")
    add_dataclass_flags(mo, ReportSettings)
    mo.add_argument("--serve", action="store_true",
                    help="serve a live dashboard of the run (one page, updated while it runs)")
    mo.add_argument("--host", default="127.0.0.1", help="--serve: the address to listen on (default %(default)s; "
                    "0.0.0.0 for every interface)")
    mo.add_argument("--port", type=number_arg(int), default=8090,
                    help="--serve: the port (default %(default)s; 0: any free one)")
    # a float, not number_arg: cmd_monitor's range check, (0, 3600], refuses NaN and inf naming the range
    mo.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                    help="--serve: how often the page updates (default %(default)s)")


def cmd_monitor(args: argparse.Namespace) -> int:
    """Report where a training run's time went, by ml-goodput-measurement's definitions, from its run directory:
    goodput, badput by cause, jobs, disruptions, step-time deviation, and alarms (a hung process, a NaN loss,
    loss spikes). Exit 1 when an alarm is raised. docs/monitoring.md defines every figure."""
    import time

    from hypertron.monitor import report as mon

    def build():
        now = time.time()
        return mon.build(args.run_dir, now=now, hang_factor=args.hang_factor, hang_min=args.hang_min,
                         window=mon.window_of(args.since, args.window, now),
                         straggler_threshold=args.straggler_threshold, top=args.top)

    if args.hang_factor <= 0 or args.hang_min < 0:
        raise mon.MonitorError("--hang-factor must be positive and --hang-min not negative")
    if not 0 < args.straggler_threshold <= 1 or args.top < 1:
        raise mon.MonitorError("--straggler-threshold must be in (0, 1] and --top at least 1")
    if args.serve:
        from hypertron.monitor import dashboard

        if not 0 < args.refresh <= 3600 or not 0 <= args.port <= 65535:
            raise mon.MonitorError("--refresh must be in (0, 3600] seconds and --port in 0..65535")
        mon.window_of(args.since, args.window, time.time())  # a bad --since or --window: one line now
        if args.json or args.follow is not None:
            raise mon.MonitorError("--serve shows the run on a page: --json and --follow do not apply")
        if not os.path.isdir(args.run_dir):
            raise mon.MonitorError(f"{args.run_dir} is not a directory")
        try:
            dashboard.serve(args.run_dir, build, args.host, args.port, args.refresh)
        except KeyboardInterrupt:
            pass
        return 0
    try:
        return _report(args, build)
    except mon.UnreadableFile as e:  # as an alarm: exit 1, the file named on one line
        print(f"error: {e}", file=sys.stderr)
        return 1


def _report(args: argparse.Namespace, build) -> int:
    """``monitor`` on the console: the report once (as text or JSON), or refreshed every ``--follow``
    seconds until the run's job stops; exit 1 when an alarm is raised."""
    import json
    import time

    from rich.console import Console

    from hypertron.monitor import report as mon

    if args.follow is None:
        rep = build()
        if args.json:
            print(json.dumps(mon.to_json(rep), indent=1, default=str))
        else:
            Console(soft_wrap=True).print(mon.render(rep))
        return 1 if rep.alarms else 0
    from rich.live import Live

    console = Console()
    with Live(mon.render(build()), console=console, refresh_per_second=1, screen=False) as live:
        while True:
            time.sleep(args.follow)
            rep = build()
            live.update(mon.render(rep))
            if rep.goodput is not None and rep.goodput.jobs[-1].status != mon.RUNNING:
                return 1 if rep.alarms else 0
