"""``hypertron monitor``: a run's goodput, stragglers and hangs, on the console, as JSON or as a page."""

from __future__ import annotations

import argparse
import os


def cmd_monitor(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console

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
