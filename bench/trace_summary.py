"""What a ``jax.profiler`` trace spent its time on, as text: for each ``*.xplane.pb`` under DIR,
each timeline (a GPU stream, a host thread) with events, its event count and busy time over its
span, and its costliest event names (count, mean, total).

    python bench/trace_summary.py DIR [--top N] [--host]

DIR is what ``bench/serve.py --profile --trace DIR`` (or any ``jax.profiler.trace``) wrote. By
default only device timelines list their events (the kernels); ``--host`` lists the host
threads' too (the Python frames, ``PjitFunction``, the runtime's thunks). Nothing but JAX's own
``jax.profiler.ProfileData`` reads the files, so it runs on the machine that traced (a GPU
machine has no TensorBoard) and prints what a call can bring back.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os


def summarise(path: str, top: int, host: bool) -> list[str]:
    from jax.profiler import ProfileData

    out = [f"== {path}"]
    for plane in ProfileData.from_file(path).planes:
        device = not plane.name.startswith("/host")
        for line in plane.lines:
            events = list(line.events)
            if not events:
                continue
            busy = sum(e.duration_ns for e in events)
            span = max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)
            out.append(f"{plane.name} | {line.name}: {len(events)} events, busy {busy / 1e6:.2f} ms "
                       f"over {span / 1e6:.2f} ms")
            if device or host:
                by_name = collections.defaultdict(lambda: [0, 0])
                for e in events:
                    entry = by_name[e.name[:100]]
                    entry[0] += 1
                    entry[1] += e.duration_ns
                for name, (count, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
                    out.append(f"  {count:7d} x {ns / count / 1e3:9.1f} us = {ns / 1e6:9.2f} ms  {name}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--top", type=int, default=25, help="event names listed per timeline")
    p.add_argument("--host", action="store_true", help="list the host threads' events too")
    args = p.parse_args()
    paths = sorted(glob.glob(os.path.join(args.dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise SystemExit(f"error: no *.xplane.pb under {args.dir}")
    for path in paths:
        print("\n".join(summarise(path, args.top, args.host)))


if __name__ == "__main__":
    main()
