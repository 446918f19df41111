"""Kubernetes objects for a recipe, as plain dicts: a training workload (a ConfigMap holding the
resolved recipe and a JobSet that runs it) and a cluster's queueing objects (Kueue's
ResourceFlavor, ClusterQueue and LocalQueue, and five PriorityClasses).

The workload is a JobSet (``jobset.x-k8s.io/v1alpha2``) of one replicated job of ``nodes`` pods,
one ``hypertron train`` process per node, joined by ``jax.distributed``:

* **gang restart**: the job has ``backoffLimit: 0`` and its pods ``restartPolicy: Never``, so
  any failed pod fails the job, and JobSet restarts the whole set (``failurePolicy.maxRestarts``
  times): a lone recreated pod could not rejoin ``jax.distributed``. A ``podFailurePolicy``
  fails the job *by that policy* when the training container exits with a code outside
  :data:`RESTART_CODES` (a config error, a crash), and the JobSet's rule turns that reason into
  ``FailJobSet``: no restart for a mistake that would repeat. SIGTERM (a preemption, an
  eviction) makes ``hypertron train`` save a checkpoint and exit with
  ``train.preempt_exit_code``, set here to :data:`PREEMPT_EXIT_CODE`, in the restart set, so the
  run is restarted and resumes instead of being counted done;
* **addresses**: JobSet's own DNS hostnames (``network.enableDNSHostnames``): pod ``j`` of job
  ``i`` is ``<jobset>-<job>-<i>-<j>.<jobset>``, so the coordinator is pod 0's
  ``<jobset>-workers-0-0.<jobset>:6002``; each process's id is its job completion index, read from
  the pod's annotation into ``JAX_PROCESS_ID`` (:mod:`hypertron.parallel.distributed`);
* **queueing**: the Kueue queue label and the pod's priority class;
* **storage**: the run directory is on shared storage (a PVC, or a Cloud Storage bucket through
  the GCS FUSE CSI driver), because a restart on a node's disk would lose every checkpoint.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import yaml

from hypertron.errors import UserError
from hypertron.launch.machines import PRIORITIES, Machine
from hypertron.launch.recipes import PREEMPT_EXIT_CODE, Recipe
from hypertron.launch.validate import DNS_1035_LABEL, DNS_SUBDOMAIN, dns_label, int32

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
KUEUE_API = "kueue.x-k8s.io/v1beta1"
JOB = "workers"                   # the replicated job's name (part of every pod's host name)
TPU_JOB = "slice-job"             # XPK's, one replica a TPU slice
MEGASCALE_PORT = 8080             # multislice traffic between the slices (XPK's)
TPU_RUNTIME_PORT = 8471           # the TPU runtime's, between a slice's VMs
JOB_INDEX = "metadata.labels['jobset.sigs.k8s.io/job-index']"
CONTAINER = "train"
PORT = 6002                       # the coordinator's port on pod 0 (XPK's and gpu-recipes')
# Exit codes that restart the gang: a preemption, and death by a signal (128 + n: killed past the
# grace period or by the OOM killer, or aborted when a peer vanished from jax.distributed), as XPK.
# Any other (2: a config mistake, 1: an uncaught error) would repeat: the JobSet fails.
RESTART_CODES = (PREEMPT_EXIT_CODE, *range(129, 256))
GRACE_SECONDS = 300               # SIGTERM to SIGKILL: time to write a checkpoint
# A pod's name, <jobset>-<job>-<i>-<j>-<5 random characters>, must be a DNS label (63): JobSet
# refuses a JobSet whose pods' names could pass it, so the host name part has 57.
HOSTNAME_LIMIT = 57
RUN_MOUNT = "/mnt/run"
RECIPE_MOUNT = "/etc/hypertron"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
GPU = "nvidia.com/gpu"
TPU = "google.com/tpu"


@dataclass(frozen=True)
class Workload:
    name: str
    recipe: Recipe
    image: str
    storage: str                  # pvc:NAME, NAME (a PVC) or gs://BUCKET
    priority: str = "medium"
    max_restarts: int = 3
    queue: str = "hypertron"
    namespace: str = "default"

    @property
    def nodes(self) -> int:
        return self.recipe.nodes

    @property
    def run_dir(self) -> str:
        return f"{RUN_MOUNT}/{self.name}"


def shape(w: Workload) -> tuple[str, int, int]:
    """``(job name, replicas, pods a replica)``: one job of a pod a node, or on TPUs XPK's
    ``slice-job`` of a replica a slice, a pod a VM."""
    if w.recipe.machine.tpus:
        slices = w.recipe.cfg.launch.slices
        return TPU_JOB, slices, w.nodes // slices
    return JOB, 1, w.nodes


def check(w: Workload) -> None:
    """Every mistake that can be caught before submission, one line each."""
    job, replicas, pods = shape(w)
    last_host = f"{w.name}-{job}-{replicas - 1}-{pods - 1}"
    dns_label(w.name, "workload name", DNS_1035_LABEL)  # the JobSet's Service is named after it
    dns_label(w.namespace, "--namespace")
    int32(w.nodes, "--nodes", low=1)  # the Job's parallelism
    if len(last_host) > HOSTNAME_LIMIT:
        raise UserError(f"workload name {w.name!r} is too long: its pods' host names ({last_host!r}, "
                        f"{len(last_host)} characters, and 6 more for the pod's suffix) must be at most "
                        f"{HOSTNAME_LIMIT}; use at most "
                        f"{HOSTNAME_LIMIT - len(last_host) + len(w.name)} characters")
    if w.priority not in PRIORITIES:
        raise UserError(f"--priority={w.priority!r}: one of {', '.join(PRIORITIES)}")
    int32(w.max_restarts, "--max-restarts")
    dns_label(w.queue, "--queue")  # a LocalQueue's name and a label's value
    if w.recipe.processes_per_node != 1:
        raise UserError(f"recipe {w.recipe.name}: launch.processes_per_node={w.recipe.processes_per_node}, but a "
                        "Kubernetes workload runs one process per pod (node); set it to 1")
    if not w.image.strip() or any(c.isspace() for c in w.image):
        raise UserError("--image: give the container image that has hypertron installed (or set $HYPERTRON_IMAGE)")
    storage_volume(w.storage)


def storage_volume(storage: str) -> tuple[dict, dict]:
    """(the volume, pod annotations it needs) of ``--storage``."""
    if storage.startswith("gs://"):
        bucket = storage[len("gs://"):].strip("/")
        if not bucket or "/" in bucket:
            raise UserError(f"--storage={storage!r}: give a bucket, gs://BUCKET")
        return ({"name": "run", "csi": {"driver": "gcsfuse.csi.storage.gke.io",
                                        "volumeAttributes": {"bucketName": bucket, "mountOptions": "implicit-dirs"}}},
                {"gke-gcsfuse/volumes": "true"})
    claim = storage.removeprefix("pvc:")
    if not claim or len(claim) > 253 or not DNS_SUBDOMAIN.match(claim):
        raise UserError(f"--storage={storage!r}: a PersistentVolumeClaim name (pvc:NAME) or a bucket (gs://BUCKET); "
                        "the run directory must outlive a pod, so a node's disk will not do")
    return {"name": "run", "persistentVolumeClaim": {"claimName": claim}}, {}


def run_config(w: Workload) -> str:
    """The recipe as the pods run it (:meth:`Recipe.run_config`), the run directory on the shared volume."""
    return w.recipe.run_config(w.run_dir, "hypertron workload create")


def coordinator(name: str) -> str:
    return f"{name}-{JOB}-0-0.{name}:{PORT}"


def container_env(w: Workload) -> list[dict]:
    """``jax.distributed``'s coordinator, process count and id; on TPUs, where JAX finds a GKE slice's
    processes itself (the TPU webhook's ``TPU_WORKER_*``), the multislice variables from the
    JobSet's own fields: slice 0's first pod, the slice count, this replica's job index, the port.
    Then the recipe's environment."""
    if w.recipe.machine.tpus:
        _, slices, _ = shape(w)
        env = [{"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{w.name}-{TPU_JOB}-0-0.{w.name}"},
               {"name": "MEGASCALE_NUM_SLICES", "value": str(slices)},
               {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}},
               {"name": "MEGASCALE_PORT", "value": str(MEGASCALE_PORT)}]
    else:
        env = [{"name": "JAX_COORDINATOR_ADDRESS", "value": coordinator(w.name)},
               {"name": "JAX_NUM_PROCESSES", "value": str(w.nodes)},
               {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}}]
    return env + [{"name": k, "value": v} for k, v in w.recipe.env().items()]


def _tpu(w: Workload) -> dict:
    """What a TPU slice adds to a pod (XPK's workload): the slice's node pool by accelerator and
    topology, its chips, the host's network (the TPU runtime and multislice ports), privileged,
    the TPU taint tolerated; the JobSet's pods of one slice placed on one node pool."""
    from hypertron.launch.machines import tpu_slice

    m, slice_ = w.recipe.machine, tpu_slice(w.recipe.cfg.launch.tpu_type)
    return {
        "pod": {"nodeSelector": {"cloud.google.com/gke-tpu-accelerator": m.accelerator,
                                 "cloud.google.com/gke-tpu-topology": slice_.topology},
                "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
                "tolerations": [{"key": TPU, "operator": "Exists", "effect": "NoSchedule"}]},
        "resources": {"limits": {TPU: str(slice_.chips // slice_.vms)}},
        "ports": [{"containerPort": TPU_RUNTIME_PORT, "name": "tpu-runtime"},
                  {"containerPort": MEGASCALE_PORT, "name": "megascale"}],
        "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
    }


def _network(m: Machine) -> dict:
    """What the machine's network adds to a pod: annotations, init containers, volumes, the
    training container's mounts, whether it runs privileged, and a script its command sources."""
    libs = {"name": "nvidia-libraries", "mountPath": "/usr/local/nvidia"}
    libs_volume = {"name": "nvidia-libraries", "hostPath": {"path": "/home/kubernetes/bin/nvidia"}}
    if m.network == "tcpxo":  # A3 Mega: GPUDirect-TCPXO over 8 NICs on networks vpc1..vpc8
        interfaces = [{"interfaceName": "eth0", "network": "default"}] + [
            {"interfaceName": f"eth{i}", "network": f"vpc{i}"} for i in range(1, 9)]
        devices = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm",
                                                           "/dev/dmabuf_import_helper"]
        daemon = {  # the receive-datapath manager, a native sidecar for the pod's life
            "name": "tcpxo-daemon", "restartPolicy": "Always",
            "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.12",
            "command": ["/bin/sh", "-c", "chmod 755 /fts/entrypoint_rxdm_container.sh; "
                        "/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics=8 --uid= --alsologtostderr"],
            "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
            "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
            "volumeMounts": [libs, {"name": "sys", "mountPath": "/hostsysfs"},
                             {"name": "proc-sys", "mountPath": "/hostprocsysfs"}],
        }
        return {
            "annotations": {"devices.gke.io/container.tcpxo-daemon": "".join(f"- path: {d}\n" for d in devices),
                            "networking.gke.io/default-interface": "eth0",
                            "networking.gke.io/interfaces": json.dumps(interfaces, separators=(",", ":"))},
            "init": [daemon],
            "volumes": [libs_volume, {"name": "sys", "hostPath": {"path": "/sys"}},
                        {"name": "proc-sys", "hostPath": {"path": "/proc/sys"}},
                        {"name": "aperture-devices", "hostPath": {"path": "/dev/aperture_devices"}}],
            # NCCL's FasTrak plugin reads the NICs' aperture devices (host device files), as XPK's container does
            "mounts": [libs, {"name": "aperture-devices", "mountPath": "/dev/aperture_devices"}], "privileged": True,
        }
    if m.network == "rdma":  # A3 Ultra: GPUDirect-RDMA over 8 RoCE NICs, NCCL's gIB plugin
        interfaces = [{"interfaceName": "eth0", "network": "default"}, {"interfaceName": "eth1", "network": "gvnic-1"}] \
            + [{"interfaceName": f"eth{i + 2}", "network": f"rdma-{i}"} for i in range(8)]
        return {
            "annotations": {"networking.gke.io/default-interface": "eth0",
                            "networking.gke.io/interfaces": json.dumps(interfaces, separators=(",", ":"))},
            "volumes": [libs_volume, {"name": "gib", "hostPath": {"path": "/home/kubernetes/bin/gib"}}],
            "mounts": [libs, {"name": "gib", "mountPath": "/usr/local/gib"}],
            "source": "/usr/local/gib/scripts/set_nccl_env.sh",  # the plugin's own NCCL settings
        }
    return {}


def jobset(w: Workload) -> dict:
    m = w.recipe.machine
    volume, annotations = storage_volume(w.storage)
    net = _network(m)
    tpu = _tpu(w) if m.tpus else {}
    net_annotations, init = net.get("annotations", {}), net.get("init", [])
    resources = tpu.get("resources") or ({"limits": {GPU: str(m.gpus)}} if m.gpus else {"requests": {"cpu": "1"}})
    job, replicas, pods = shape(w)
    command = ["hypertron", "train", f"{RECIPE_MOUNT}/recipe.yaml"]
    if "source" in net:  # exec: SIGTERM reaches hypertron, and its exit code is the container's
        command = ["/bin/sh", "-c", f". {net['source']} && exec {' '.join(command)}"]
    container = {
        "name": CONTAINER, "image": w.image, "command": command,
        "env": container_env(w),
        "ports": tpu.get("ports", [{"containerPort": PORT, "name": "coordinator"}]),
        "resources": resources,
        "volumeMounts": [{"name": "recipe", "mountPath": RECIPE_MOUNT, "readOnly": True},
                         {"name": "run", "mountPath": RUN_MOUNT},
                         {"name": "dshm", "mountPath": "/dev/shm"}] + net.get("mounts", []),
        **({"securityContext": {"privileged": True}} if net.get("privileged") or tpu else {}),
    }
    pod_spec = {
        "restartPolicy": "Never",
        "priorityClassName": w.priority,
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        **({"nodeSelector": {"cloud.google.com/gke-accelerator": m.accelerator},
            "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]} if m.gpus else {}),
        **tpu.get("pod", {}),
        **({"initContainers": init} if init else {}),
        "containers": [container],
        "volumes": [{"name": "recipe", "configMap": {"name": f"{w.name}-recipe"}}, volume,
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}] + net.get("volumes", []),
    }
    pod_meta = {"annotations": {**annotations, **net_annotations}} if annotations or net_annotations else {}
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet",
        "metadata": {"name": w.name, "namespace": w.namespace,
                     "labels": {"kueue.x-k8s.io/queue-name": w.queue, "app.kubernetes.io/managed-by": "hypertron"},
                     "annotations": {"hypertron.dev/recipe": w.recipe.name, **tpu.get("annotations", {})}},
        "spec": {
            "failurePolicy": {"maxRestarts": w.max_restarts, "rules": [
                {"name": "NoRestartOnPodFailurePolicy", "action": "FailJobSet",
                 "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "replicatedJobs": [{"name": job, "replicas": replicas, "template": {"spec": {
                "parallelism": pods, "completions": pods, "completionMode": "Indexed", "backoffLimit": 0,
                "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                    "containerName": CONTAINER, "operator": "NotIn", "values": list(RESTART_CODES)}}]},
                "template": {**({"metadata": pod_meta} if pod_meta else {}), "spec": pod_spec},
            }}}],
        },
    }


def workload_objects(w: Workload) -> list[dict]:
    check(w)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{w.name}-recipe", "namespace": w.namespace,
                               "labels": {"app.kubernetes.io/managed-by": "hypertron"}},
                  "data": {"recipe.yaml": run_config(w)}}
    return [config_map, jobset(w)]


def pod_environment(js: dict, index: int, job: int = 0) -> dict[str, str]:
    """The training container's environment in pod ``index`` of replica ``job`` of a rendered
    JobSet, as the kubelet would set it: literal values, the completion index and job index for
    their fields, ``$(VAR)`` references to earlier variables."""
    spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == CONTAINER]
    env: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda g: env.get(g.group(1), g.group(0)), e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == COMPLETION_INDEX:
            env[e["name"]] = str(index)
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == JOB_INDEX:
            env[e["name"]] = str(job)
        else:
            raise ValueError(f"cannot evaluate {e}")
    return env


def cluster_objects(m: Machine, nodes: int, queue: str = "hypertron", namespace: str = "default",
                    per_node: int | None = None) -> list[dict]:
    """Kueue's ResourceFlavor for the machine, a ClusterQueue with a quota of ``nodes`` of them
    (``per_node`` devices each, default the machine's), the LocalQueue workloads name, and the five
    PriorityClasses."""
    int32(nodes, "--nodes", low=1)
    dns_label(queue, "--queue")
    dns_label(namespace, "--namespace")
    resource, default = (GPU, m.gpus) if m.gpus else (TPU, m.tpus) if m.tpus else ("cpu", 1)
    per_node = per_node or default
    label = "cloud.google.com/gke-tpu-accelerator" if m.tpus else "cloud.google.com/gke-accelerator"
    flavor = {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": m.name},
              "spec": {"nodeLabels": {label: m.accelerator}} if m.accelerator else {}}
    cluster_queue = {
        "apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": f"{queue}-cluster"},
        "spec": {"namespaceSelector": {}, "queueingStrategy": "BestEffortFIFO",
                 "resourceGroups": [{"coveredResources": [resource], "flavors": [
                     {"name": m.name, "resources": [{"name": resource, "nominalQuota": nodes * per_node}]}]}],
                 "preemption": {"reclaimWithinCohort": "Never", "withinClusterQueue": "LowerPriority"}}}
    local_queue = {"apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": queue, "namespace": namespace},
                   "spec": {"clusterQueue": f"{queue}-cluster"}}
    classes = [{"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                "value": value, "globalDefault": False, "preemptionPolicy": "PreemptLowerPriority",
                "description": f"hypertron workloads, {name} priority"} for name, value in PRIORITIES.items()]
    return [flavor, cluster_queue, local_queue, *classes]


class _Dumper(yaml.SafeDumper):
    """Block style, but a list of short scalars on one line ([42, 129, ...]), a multi-line string
    as a literal block, and no anchors (every object reads on its own)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


def _list(dumper: yaml.SafeDumper, data: list):
    flow = all(isinstance(v, (int, float, str)) and not isinstance(v, str) or isinstance(v, str) and len(v) < 40
               and "\n" not in v for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow and bool(data))


_Dumper.add_representer(list, _list)
_Dumper.add_representer(str, _str)


def to_yaml(objects: list[dict]) -> str:
    return "".join("---\n" + yaml.dump(o, Dumper=_Dumper, sort_keys=False, width=100) for o in objects)
