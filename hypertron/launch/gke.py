"""``hypertron cluster create | delete | list``: the ``gcloud`` and ``kubectl`` commands that make,
remove and list a GKE cluster of TPU slices.

For the same arguments they are the commands XPK 1.16 runs (``xpk cluster create --dry-run``,
recorded in ``tests/golden/launch/xpk/``): the cluster with its CPU system pool (autoscaling, the
rapid release channel, Dataplane V2 and multi-networking), a node pool of each slice's VMs
(``NAME-np-I``: the slice's machine type and topology, compact placement for a slice of several
VMs, its capacity: ``--spot``, ``--reservation`` or on demand), the credentials, JobSet's and Kueue's
releases applied server-side, and then ``hypertron cluster setup``'s objects (Kueue's queue with a
``google.com/tpu`` quota of every chip, and the priority classes) through ``kubectl apply``. What
XPK asks the server first (the GKE version, whether the cluster exists) is left to gcloud: the
cluster takes its release channel's default version. GPU clusters are Cluster Toolkit's
blueprints, as XPK makes them.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

from hypertron.errors import UserError
from hypertron.launch.machines import MACHINES, TpuSlice, tpu_slice

# The releases XPK 1.16 installs (server-side apply of their manifests).
JOBSET_MANIFESTS = "https://github.com/kubernetes-sigs/jobset/releases/download/v0.10.1/manifests.yaml"
KUEUE_MANIFESTS = "https://github.com/kubernetes-sigs/kueue/releases/download/v0.17.1/manifests.yaml"
SCOPES = "storage-full,gke-default,https://www.googleapis.com/auth/cloud-platform"


@dataclass(frozen=True)
class Command:
    """One command to run: its argv, and what it reads on stdin (a manifest) and where that comes from."""

    argv: tuple[str, ...]
    stdin: str | None = None
    stdin_from: str = ""
    # A listing that names what this command makes once it exists (and the name to look for): a
    # rerun after a failure skips what the run before made, as XPK does.
    exists: tuple[tuple[str, ...], str] | None = None

    def line(self) -> str:
        """The command as a shell line; one reading a manifest names the command that prints it."""
        return shlex.join(self.argv) + (f"  # stdin: the objects of `{self.stdin_from}`" if self.stdin_from else "")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    project: str
    zone: str
    tpu_type: str
    num_slices: int = 1
    capacity: str = "on-demand"  # on-demand | spot | reservation
    reservation: str = ""
    cpu_machine_type: str = "e2-standard-16"
    cpu_nodes: int = 6


def region(zone: str) -> str:
    """The region of a zone (``us-east5-a`` -> ``us-east5``); a region stays itself."""
    parts = zone.split("-")
    return "-".join(parts[:2]) if len(parts) > 2 else zone


def check(spec: ClusterSpec) -> TpuSlice:
    """The spec's slice type, or one line naming what is wrong."""
    if not spec.name or not spec.name[0].isalpha() or spec.name.endswith("-") or len(spec.name) > 40 or not all(
            c.isalnum() and c == c.lower() or c == "-" for c in spec.name):
        raise UserError(f"cluster name {spec.name!r}: lowercase letters, digits and '-', starting with a letter and "
                        "not ending with '-', at most 40 characters (GKE's rule)")
    for flag, value in (("--project", spec.project), ("--zone", spec.zone)):
        if not value:
            raise UserError(f"cluster create: {flag} is required")
    if len(spec.zone.split("-")) < 3:
        raise UserError(f"--zone={spec.zone}: a zone (us-east5-a), not a region: the slices' node pools are "
                        "placed in it")
    gpu = {m.name for m in MACHINES.values() if m.gpus} | {m.accelerator for m in MACHINES.values() if m.gpus}
    if spec.tpu_type in gpu or spec.tpu_type.startswith(("h100", "h200", "a100", "b200", "gb200", "nvidia")):
        raise UserError(f"--tpu-type={spec.tpu_type} is a GPU: GPU clusters (A3 Mega, A3 Ultra) are made from "
                        "Cluster Toolkit's blueprints (https://github.com/GoogleCloudPlatform/cluster-toolkit), "
                        "as XPK makes them; hypertron cluster setup then adds the queues")
    slice_ = tpu_slice(spec.tpu_type)
    if spec.num_slices < 1:
        raise UserError(f"--num-slices={spec.num_slices}: must be at least 1")
    if spec.cpu_nodes < 1:
        raise UserError(f"--default-pool-cpu-num-nodes={spec.cpu_nodes}: must be at least 1")
    if spec.capacity == "reservation" and not spec.reservation:
        raise UserError("--reservation: name the reservation")
    return slice_


def create_commands(spec: ClusterSpec, setup_manifest: str, setup_command: str) -> list[Command]:
    """Every command of ``cluster create``, in order; ``setup_manifest``: cluster setup's objects as YAML,
    which ``setup_command`` prints."""
    slice_ = check(spec)
    where, project = region(spec.zone), f"--project={spec.project}"
    cluster = ["gcloud", "beta", "container", "clusters", "create", spec.name, project, f"--region={where}",
               f"--node-locations={spec.zone}", f"--machine-type={spec.cpu_machine_type}", "--enable-autoscaling",
               "--total-min-nodes", "1", "--total-max-nodes", "1000", "--num-nodes", str(spec.cpu_nodes),
               "--autoscaling-profile=optimize-utilization", "--labels=gke_product_type=xpk",
               "--release-channel=rapid", "--enable-ip-alias", "--enable-dataplane-v2", "--enable-multi-networking",
               "--enable-dns-access", "--location-policy=BALANCED", "--scopes=storage-full,gke-default"]
    capacity = {"spot": ["--spot"], "on-demand": [],
                "reservation": ["--reservation-affinity=specific", f"--reservation={spec.reservation}"]}[spec.capacity]
    network = (["--accelerator-network-profile=auto", "--node-labels=cloud.google.com/gke-networking-dra-driver=true"]
               if slice_.machine == "tpu-v6e" else [])
    several = (["--placement-type=COMPACT", f"--tpu-topology={slice_.topology}", "--max-pods-per-node", "15"]
               if slice_.vms > 1 else [])
    pools = [Command(("gcloud", "beta", "container", "node-pools", "create", f"{spec.name}-np-{i}",
                      f"--location={where}", f"--cluster={spec.name}", project, f"--node-locations={spec.zone}",
                      f"--machine-type={slice_.machine_type}", "--host-maintenance-interval=AS_NEEDED", *capacity,
                      "--enable-gvnic", *network, f"--num-nodes={slice_.vms}", f"--scopes={SCOPES}", *several),
                     exists=(("gcloud", "beta", "container", "node-pools", "list", f"--cluster={spec.name}", project,
                              f"--location={where}", "--format=value(name)"), f"{spec.name}-np-{i}"))
             for i in range(spec.num_slices)]
    kueue_wait = ("kubectl", "wait", "deploy/kueue-controller-manager", "-n", "kueue-system",
                  "--for=condition=available", "--timeout=10m")
    return [Command(tuple(cluster), exists=(("gcloud", "container", "clusters", "list", project,
                                             f"--filter=name={spec.name}", "--format=value(name)"), spec.name)),
            *pools,
            Command(("gcloud", "container", "clusters", "get-credentials", spec.name, f"--location={where}", project)),
            Command(("kubectl", "apply", "--server-side", "--force-conflicts", "-f", JOBSET_MANIFESTS)),
            Command(("kubectl", "apply", "--server-side", "--force-conflicts", "-f", KUEUE_MANIFESTS)),
            Command(kueue_wait),
            Command(("kubectl", "apply", "--server-side", "-f", "-"), setup_manifest, setup_command)]


def delete_commands(name: str, project: str, zone: str) -> list[Command]:
    return [Command(("gcloud", "beta", "container", "clusters", "delete", name, f"--project={project}",
                     f"--location={region(zone)}", "--quiet"))]


def list_commands(project: str, zone: str) -> list[Command]:
    return [Command(("gcloud", "container", "clusters", "list", f"--project={project}",
                     f"--filter=location~{region(zone)}.*"))]


def run(commands: list[Command], what: str) -> None:
    """Run ``commands`` in order, each's output passed through; stop at the first that fails, with
    its ``ERROR:`` line (else its last). One whose ``exists`` listing names what it makes is skipped
    (a rerun after a failure goes on from there). Refused in one line when a tool is not on PATH."""
    for tool in dict.fromkeys(c.argv[0] for c in commands):
        if shutil.which(tool) is None:
            raise UserError(f"{what}: {tool} is not on PATH (the Google Cloud CLI has both gcloud and kubectl); "
                            "--dry-run prints the commands")
    for c in commands:
        if c.exists is not None:
            listing, name = c.exists
            found = subprocess.run(listing, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
            if found.returncode == 0 and name in found.stdout.split():
                print(f"{what}: {name} exists already; not made again", file=sys.stderr)
                continue
        proc = subprocess.Popen(c.argv, stdin=subprocess.PIPE if c.stdin is not None else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if c.stdin is not None:
            proc.stdin.write(c.stdin)
            proc.stdin.close()
        lines = []
        for line in proc.stderr:  # gcloud's progress goes to stderr: shown as it comes
            sys.stderr.write(line)
            lines.append(line.strip())
        if proc.wait():
            said = [line for line in lines if line]
            error = next((line for line in said if line.startswith("ERROR:")), said[-1] if said else "")
            raise UserError(f"{what}: `{shlex.join(c.argv[:6])} ...` failed (exit {proc.returncode}): {error}")
