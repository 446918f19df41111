"""A real Slurm on this machine for the tests: Debian's ``slurm-wlm`` and ``munge``, started in a
temp directory on localhost (one node, ``SlurmUser=root``, ``proctrack/linuxproc``,
``task/none``), munged with its own key and socket, and ``SLURM_CONF`` for the clients; all
stopped afterwards. Nothing system-wide is read or changed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from hypertron.launch.local import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def missing() -> str | None:
    """Why Slurm cannot run here, or None."""
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return f"Debian's slurm-wlm and munge are not installed ({', '.join(absent)} missing; make test installs them as root)"
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root (SlurmUser=root)"
    return None


CONF = """\
ClusterName=hypertron-test
SlurmctldHost=localhost
SlurmctldParameters=enable_configless
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=20
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=60
MinJobAge=600
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.root / "slurm.conf"))

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (r / "munge").chmod(0o700)
        port = free_ports(2)
        (r / "slurm.conf").write_text(CONF.format(root=r, ctld_port=port, slurmd_port=port + 1))
        self._spawn(["munged", "--foreground", "--force", f"--socket={r}/munge.socket", f"--key-file={key}",
                     f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/munge/munged.log",
                     f"--seed-file={r}/munge/munged.seed"], "munged.out")
        self._wait(lambda: (r / "munge.socket").exists(), "munged's socket", timeout)
        self._spawn(["slurmctld", "-D", "-i", "-f", str(r / "slurm.conf")], "slurmctld.out")
        self._wait(lambda: self._ok(["scontrol", "ping"]) and "UP" in self._out(["scontrol", "ping"]),
                   "slurmctld", timeout)
        self._spawn(["slurmd", "-D", "-N", "localhost", "-f", str(r / "slurm.conf")], "slurmd.out")
        self._wait(lambda: self._out(["sinfo", "-h", "-o", "%T"]).strip() in ("idle", "mixed", "allocated"),
                   "the node to be idle", timeout)
        return self

    def _spawn(self, cmd: list[str], log: str) -> None:
        out = open(self.root / log, "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _out(self, cmd: list[str]) -> str:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        return r.stdout

    def _ok(self, cmd: list[str]) -> bool:
        return subprocess.run(cmd, env=self.env, capture_output=True, timeout=30).returncode == 0

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = self.logs()
                self.stop()
                raise RuntimeError(f"the test Slurm did not start ({what}):\n{logs}")
            time.sleep(0.2)

    def logs(self, chars: int = 1500) -> str:
        """The end of each daemon's log, for a failure's message."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")))

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        # Job steps and the processes they started (linuxproc tracks, it does not contain): every
        # process that inherited this Slurm's SLURM_CONF.
        import psutil

        conf = f"SLURM_CONF={self.env['SLURM_CONF']}"
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and conf in "\0".join(f"{k}={v}" for k, v in p.environ().items()):
                    p.kill()
            except (psutil.Error, OSError):
                pass
        self.procs.clear()
