"""``hypertron launch local``: N processes of one job on this machine, for tests and for people
without a cluster.

Each process is ``python -m hypertron.cli COMMAND...`` with ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, which is all
:mod:`hypertron.parallel.distributed` needs; the coordinator listens on
127.0.0.1 only. Process 0 writes to the launcher's stdout and stderr as it
is; the others' lines go to stderr prefixed with ``[process i]`` (they print
only warnings and errors). With ``--gpus`` (or the ``CUDA_VISIBLE_DEVICES`` the launcher
was started with), each process gets its own contiguous slice of the GPUs in its
``CUDA_VISIBLE_DEVICES``. With ``--recipe``, the recipe gives the command (``train``
on it), the processes (its nodes x processes per node) and their environment. SIGTERM
is passed on to every process, so a preemption drill works as on a cluster;
a Ctrl-C reaches them from the terminal. When one process fails the others are stopped, and the launcher
exits with the failing process's code.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

from hypertron.errors import UserError

# How long the other processes get to notice a failed peer and exit on their own.
_GRACE_SECONDS = 15.0
# The most processes (and GPUs) one machine is asked to run: far past any machine's accelerators, and
# a bound on what a typo (--processes 10000) would fork. docs/launch.md says it.
MAX_PROCESSES = 256


def _ephemeral_start() -> int:
    """Where the kernel starts handing out ports for ``bind(0)`` and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int = 1, host: str = "127.0.0.1") -> int:
    """A port p with p .. p+n-1 free on ``host`` (checked, then released), below the kernel's
    ephemeral range: a port the kernel hands out (another ``bind(0)``, any connection's local end)
    can be taken again before the process meant to listen on it starts, and one lost port ends a
    whole multi-process job."""
    rng = random.Random()
    top = _ephemeral_start()
    for _ in range(100):
        base = rng.randrange(max(1024, top // 2), top - n)
        socks = []
        try:
            for i in range(n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise OSError(f"no {n} consecutive free ports below {top} on {host}")


def gpu_slices(gpus: list[str], processes: int) -> list[str]:
    """Each process's ``CUDA_VISIBLE_DEVICES``: the GPUs split into equal contiguous slices."""
    if len(gpus) % processes:
        raise UserError(f"{len(gpus)} GPUs ({','.join(gpus)}) do not split evenly over {processes} processes")
    per = len(gpus) // processes
    return [",".join(gpus[i * per:(i + 1) * per]) for i in range(processes)]


def parse_gpus(value: str | None, environ=os.environ) -> list[str]:
    """``--gpus``: a count (``8``: GPUs 0..7) or a list (``0,1,2,3``); else the launcher's own
    ``CUDA_VISIBLE_DEVICES``; else none (no splitting)."""
    if value is None:
        value = environ.get("CUDA_VISIBLE_DEVICES", "")
    elif value.strip().isdigit():  # a count
        if not 1 <= int(value) <= MAX_PROCESSES:
            raise UserError(f"--gpus={value}: from 1 to {MAX_PROCESSES}")
        return [str(i) for i in range(int(value))]
    value = value.strip()
    if not value:
        return []
    ids = [v.strip() for v in value.split(",") if v.strip()]
    if not ids or len(set(ids)) != len(ids):
        raise UserError(f"--gpus={value!r}: a count (8) or a list of distinct GPU ids (0,1,2,3)")
    return ids


def process_env(base: dict, index: int, count: int, port: int, cpu_devices: int | None,
                extra: dict | None = None, gpus: str | None = None) -> dict:
    env = dict(base)
    env.update(extra or {})
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(count), JAX_PROCESS_ID=str(index))
    if cpu_devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cpu_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def launch_recipe(name: str, overrides: list[str], gpus: str | None = None) -> int:
    """``train`` on a recipe, as its processes on this machine, with its environment."""
    from hypertron.launch import recipes

    r = recipes.load(name, None, overrides)
    if r.processes > MAX_PROCESSES:
        raise UserError(f"recipe {r.name}: {r.processes} processes ({r.nodes} nodes x {r.processes_per_node}) are "
                        f"more than the {MAX_PROCESSES} launch local runs on one machine")
    return launch_local(["train", str(recipes.path_of(name)), *overrides], r.processes, env=r.env(), gpus=gpus)


def launch_local(command: list[str], processes: int, cpu_devices: int | None = None, env: dict | None = None,
                 gpus: str | None = None) -> int:
    """Run ``hypertron COMMAND...`` as ``processes`` cooperating processes; returns the exit code."""
    if not 1 <= processes <= MAX_PROCESSES:
        raise UserError(f"--processes={processes}: must be from 1 to {MAX_PROCESSES} (processes on this machine)")
    if cpu_devices is not None and cpu_devices < 1:
        raise UserError(f"--cpu-devices={cpu_devices}: must be at least 1")
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError("launch local: give the command after --, e.g. -- train recipes/demo.yaml")
    found = [] if cpu_devices else parse_gpus(gpus)
    slices = gpu_slices(found, processes) if found and processes > 1 else [None] * processes
    port = free_ports()
    procs = []
    extra = env
    for i in range(processes):
        env = process_env(os.environ, i, processes, port, cpu_devices, extra, slices[i])
        # Process 0 writes to this terminal directly; the others through _pump, prefixed.
        piped = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) if i else {}
        procs.append(subprocess.Popen([sys.executable, "-m", "hypertron.cli", *command], env=env, **piped))
    pumps = [threading.Thread(target=_pump, args=(p, i), daemon=True) for i, p in enumerate(procs) if i]
    for t in pumps:
        t.start()
    # SIGTERM is passed on. A Ctrl-C reaches the children from the terminal (they share its
    # process group), so the launcher only waits for them rather than sending a second one.
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, _: _forward(procs, signum)),
                signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, _: None)}
    try:
        code = _wait(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for t in pumps:
            t.join(timeout=5)
    return code


def _pump(proc: subprocess.Popen, index: int) -> None:
    for line in proc.stdout:
        if line.startswith("[Gloo] Rank "):  # connection chatter of JAX's CPU collectives
            continue
        sys.stderr.write(f"[process {index}] {line}")
        sys.stderr.flush()


def _forward(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)


def _wait(procs: list[subprocess.Popen]) -> int:
    """Wait for all; after the first failure give the rest a grace period, then stop them.

    Returns the exit code of the process that failed first (a signal ``n`` as ``128 + n``), or 0.
    """
    failed_at, first_failure = None, 0
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
            first_failure = next(c for c in codes if c not in (None, 0))
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_SECONDS:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    if not first_failure:
        first_failure = next((c for c in codes if c != 0), 0)
    return 128 - first_failure if first_failure < 0 else first_failure
