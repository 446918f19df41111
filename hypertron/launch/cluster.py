"""The calls to a Kubernetes cluster, through the ``kubernetes`` client: apply the rendered
objects, and list, describe, read the logs of and delete workloads.

Nothing here runs without a kubeconfig (``$KUBECONFIG``, ``~/.kube/config``, or the pod's own
service account inside a cluster): :func:`api` says so in one line before anything is sent.
"""

from __future__ import annotations

import calendar
import json
import os
import time
from pathlib import Path

from hypertron.errors import UserError
from hypertron.launch.k8s import CONTAINER, JOBSET_API

MANAGED = "app.kubernetes.io/managed-by=hypertron"


def kubeconfig() -> str | None:
    """Where the cluster's credentials are, or None."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "in-cluster"
    for path in os.environ.get("KUBECONFIG", "").split(os.pathsep):
        if path and Path(path).is_file():
            return path
    default = Path.home() / ".kube" / "config"
    return str(default) if default.is_file() else None


def api():
    """A connected ``ApiClient``, or one line saying why there is none."""
    where = kubeconfig()
    if where is None:
        raise UserError("no kubeconfig: set $KUBECONFIG or create ~/.kube/config (for GKE: gcloud container "
                        "clusters get-credentials CLUSTER); --dry-run shows the objects without a cluster")
    from kubernetes import client, config

    try:
        if where == "in-cluster":
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=where)
    except Exception as e:  # noqa: BLE001  (the client raises its own and yaml's)
        raise UserError(f"kubeconfig {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return client.ApiClient()


def _call(what: str, fn, *args, **kwargs):
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError, ResourceNotUniqueError

    try:
        return fn(*args, **kwargs)
    except (ApiException, DynamicApiError) as e:
        try:
            detail = json.loads(e.body).get("message", "")
        except (TypeError, ValueError, AttributeError):
            detail = ""
        raise UserError(f"{what}: the cluster said {e.status} {e.reason}" + (f": {detail}" if detail else "")) from None
    except (ResourceNotFoundError, ResourceNotUniqueError):
        raise UserError(f"{what}: the cluster does not serve this kind (are JobSet and Kueue installed?)") from None
    except HTTPError as e:
        raise UserError(f"{what}: cannot reach the cluster ({type(e).__name__})") from None


def apply(objects: list[dict], create_only: bool = False) -> list[str]:
    """Server-side apply of each object in order (or create, failing on one that exists);
    returns "Kind name" per object."""
    from kubernetes.dynamic import DynamicClient

    dyn = _call("connecting", DynamicClient, api())
    done: list[tuple[object, dict]] = []
    try:
        for obj in objects:
            kind, meta = obj["kind"], obj["metadata"]
            what = f"{kind} {meta['name']}"
            resource = _call(what, dyn.resources.get, api_version=obj["apiVersion"], kind=kind)
            ns = meta.get("namespace") if resource.namespaced else None
            if create_only:
                _call(what, resource.create, body=obj, namespace=ns)
            else:
                _call(what, resource.server_side_apply, body=obj, name=meta["name"], namespace=ns,
                      field_manager="hypertron", force_conflicts=True)
            done.append((resource, obj))
    except UserError:
        if create_only:  # all or nothing: what this call created goes again
            for resource, obj in reversed(done):
                try:
                    resource.delete(name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace"))
                except Exception:  # noqa: BLE001  (the first error is the one to report)
                    pass
        raise
    return [f"{o['kind']} {o['metadata']['name']}" for _, o in done]


def _jobsets(client, namespace: str, name: str | None = None):
    from kubernetes import client as k

    group, version = JOBSET_API.split("/")
    custom = k.CustomObjectsApi(client)
    if name:
        return _call(f"JobSet {name}", custom.get_namespaced_custom_object, group, version, namespace, "jobsets", name)
    return _call("listing JobSets", custom.list_namespaced_custom_object, group, version, namespace, "jobsets",
                 label_selector=MANAGED)["items"]


def status_of(js: dict) -> str:
    conditions = {c["type"]: c for c in js.get("status", {}).get("conditions", []) if c.get("status") == "True"}
    for state in ("Completed", "Failed", "Suspended"):
        if state in conditions:
            return state
    return "Running" if js.get("status") else "Pending"


def list_workloads(namespace: str) -> list[dict]:
    rows = []
    for js in _jobsets(api(), namespace):
        meta, spec = js["metadata"], js["spec"]
        rows.append({"name": meta["name"], "recipe": meta.get("annotations", {}).get("hypertron.dev/recipe", ""),
                     "nodes": spec["replicatedJobs"][0]["template"]["spec"].get("parallelism"),
                     "status": status_of(js), "restarts": js.get("status", {}).get("restarts", 0),
                     "created": meta.get("creationTimestamp", "")})
    return rows


def describe(name: str, namespace: str) -> dict:
    from kubernetes import client as k

    client = api()
    js = _jobsets(client, namespace, name)
    pods = _call(f"pods of {name}", k.CoreV1Api(client).list_namespaced_pod, namespace,
                 label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
    return {"name": name, "status": status_of(js), "restarts": js.get("status", {}).get("restarts", 0),
            "conditions": js.get("status", {}).get("conditions", []),
            "pods": [{"name": p.metadata.name, "phase": p.status.phase, "node": p.spec.node_name,
                      "index": (p.metadata.annotations or {}).get("batch.kubernetes.io/job-completion-index")}
                     for p in pods]}


def logs(name: str, namespace: str, process: int = 0) -> str:
    from kubernetes import client as k

    client = api()
    core = k.CoreV1Api(client)
    pods = _call(f"pods of {name}", core.list_namespaced_pod, namespace,
                 label_selector=f"jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index={process}"
                 ).items
    if not pods:
        raise UserError(f"workload {name}: no pod for process {process} (yet)")
    newest = max(pods, key=lambda p: p.metadata.creation_timestamp or 0)
    return _call(f"logs of {newest.metadata.name}", core.read_namespaced_pod_log, newest.metadata.name, namespace,
                 container=CONTAINER)


def delete(name: str, namespace: str) -> list[str]:
    from kubernetes import client as k

    client = api()
    from kubernetes.client.exceptions import ApiException

    group, version = JOBSET_API.split("/")
    done = []
    for what, fn, args in ((f"JobSet {name}", k.CustomObjectsApi(client).delete_namespaced_custom_object,
                            (group, version, namespace, "jobsets", name)),
                           (f"ConfigMap {name}-recipe", k.CoreV1Api(client).delete_namespaced_config_map,
                            (f"{name}-recipe", namespace))):
        try:
            fn(*args, propagation_policy="Foreground")
            done.append(what)
        except ApiException as e:
            if e.status != 404:  # already gone is fine; anything else (403, ...) is said
                _call(what, fn, *args, propagation_policy="Foreground")
    if not done:
        raise UserError(f"no workload {name} in namespace {namespace}")
    return done


def age(created: str) -> str:
    """'3h' from an RFC 3339 time."""
    if not created:
        return ""
    t = calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    s = max(0, time.time() - t)
    return f"{s / 86400:.0f}d" if s >= 86400 else f"{s / 3600:.0f}h" if s >= 3600 else f"{s / 60:.0f}m"
