"""Every object checked before anything is applied, strictly: an unknown field is an error, not
something the API server drops.

* core kinds (ConfigMap, PriorityClass, and each JobSet's job template as a ``batch/v1`` Job)
  against Kubernetes' own schemas with ``kubernetes-validate`` in strict mode, for
  :data:`KUBERNETES`;
* the JobSet through the typed ``jobset.x-k8s.io/v1alpha2`` models of ``kubeflow-trainer-api``,
  with a round trip (everything in ``d`` comes back from ``from_dict(d).to_dict()`` unchanged:
  ``from_dict`` silently drops unknown keys; what the models add are their defaults),
  and the enumerations neither checks (failure-policy actions and reasons, pod-failure-policy
  operators);
* Kueue's ``v1beta1`` objects against the fields Kueue documents (:data:`KUEUE_SCHEMAS`).

A failure is a :class:`~hypertron.errors.UserError` naming the object and the field.
"""

from __future__ import annotations

import re
from typing import Any

from hypertron.errors import UserError

KUBERNETES = "1.32"  # the oldest version the objects must be valid for (native sidecars: 1.29+)
JOBSET_ACTIONS = ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts")
JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy")
POD_FAILURE_ACTIONS = ("FailJob", "FailIndex", "Ignore", "Count")
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # JobSet's webhook: no '-', at most 128

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "additionalProperties": False, "required": ["name"],
         "properties": {"name": _NAME, "namespace": _NAME, "labels": _STRINGS, "annotations": _STRINGS}}
_QUANTITY = {"type": ["string", "integer", "number"]}
_TOLERATION = {"type": "object", "additionalProperties": False, "properties": {
    k: {"type": "string"} for k in ("key", "operator", "value", "effect")} | {"tolerationSeconds": {"type": "integer"}}}


def _kind(kind: str, spec: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "kueue.x-k8s.io/v1beta1"}, "kind": {"const": kind},
                           "metadata": _META,
                           "spec": {"type": "object", "additionalProperties": False, "required": list(required),
                                    "properties": spec}}}


_STOP = {"enum": ["None", "Hold", "HoldAndDrain"]}
# The fields of Kueue's v1beta1 API reference (kueue.sigs.k8s.io/docs/reference/kueue.v1beta1).
KUEUE_SCHEMAS: dict[str, dict] = {
    "ResourceFlavor": _kind("ResourceFlavor", {
        "nodeLabels": _STRINGS, "nodeTaints": {"type": "array", "items": {"type": "object"}},
        "tolerations": {"type": "array", "items": _TOLERATION}, "topologyName": {"type": "string"}}),
    "ClusterQueue": _kind("ClusterQueue", {
        "cohort": {"type": "string"},
        "namespaceSelector": {"type": "object"},
        "queueingStrategy": {"enum": ["BestEffortFIFO", "StrictFIFO"]},
        "resourceGroups": {"type": "array", "maxItems": 16, "items": {
            "type": "object", "additionalProperties": False, "required": ["coveredResources", "flavors"],
            "properties": {
                "coveredResources": {"type": "array", "minItems": 1, "maxItems": 16, "items": {"type": "string"}},
                "flavors": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
                    "type": "object", "additionalProperties": False, "required": ["name", "resources"],
                    "properties": {"name": _NAME, "resources": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["name", "nominalQuota"],
                        "properties": {"name": {"type": "string"}, "nominalQuota": _QUANTITY,
                                       "borrowingLimit": _QUANTITY, "lendingLimit": _QUANTITY}}}}}}}}},
        "preemption": {"type": "object", "additionalProperties": False, "properties": {
            "reclaimWithinCohort": {"enum": ["Never", "LowerPriority", "Any"]},
            "withinClusterQueue": {"enum": ["Never", "LowerPriority", "LowerOrNewerEqualPriority"]},
            "borrowWithinCohort": {"type": "object"}}},
        "flavorFungibility": {"type": "object"},
        "admissionChecks": {"type": "array", "items": {"type": "string"}},
        "stopPolicy": _STOP,
        "fairSharing": {"type": "object"}}),
    "LocalQueue": _kind("LocalQueue", {"clusterQueue": _NAME, "stopPolicy": _STOP, "fairSharing": {"type": "object"}},
                        required=("clusterQueue",)),
}


def _where(obj: dict) -> str:
    return f"{obj.get('kind', '?')} {obj.get('metadata', {}).get('name', '?')}"


def _path(parts) -> str:
    return ".".join(str(p) for p in parts) or "(top)"


def core(obj: dict, where: str = "") -> None:
    """A built-in kind against Kubernetes' schema, strictly; ``where`` names it in a message."""
    import kubernetes_validate

    where = where or _where(obj)
    try:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise UserError(f"{where} is not valid Kubernetes {KUBERNETES}: {_path(e.path)}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise UserError(f"{where}: no Kubernetes schema for it ({e.message})") from None


def kueue(obj: dict) -> None:
    import jsonschema

    schema = KUEUE_SCHEMAS.get(obj.get("kind", ""))
    if schema is None:
        raise UserError(f"{_where(obj)}: not a Kueue kind hypertron renders ({', '.join(KUEUE_SCHEMAS)})")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(obj))
    if error is not None:
        raise UserError(f"{_where(obj)} is not a valid Kueue object: {_path(error.absolute_path)}: {error.message}")


def jobset(obj: dict) -> None:
    """The enumerations, each job template as a ``batch/v1`` Job against Kubernetes' schema
    (whose messages give the whole path), then the JobSet through the typed models with a round
    trip."""
    import pydantic
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    if obj.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or obj.get("kind") != "JobSet":
        raise UserError(f"{_where(obj)}: expected apiVersion jobset.x-k8s.io/v1alpha2, kind JobSet")
    spec = obj.get("spec") or {}
    for i, rule in enumerate(spec.get("failurePolicy", {}).get("rules", [])):
        at = f"{_where(obj)}: spec.failurePolicy.rules.{i}"
        if rule.get("action") not in JOBSET_ACTIONS:
            raise UserError(f"{at}.action={rule.get('action')!r}: one of {', '.join(JOBSET_ACTIONS)}")
        if not RULE_NAME.match(rule.get("name", "")) or len(rule["name"]) > 128:
            raise UserError(f"{at}.name={rule.get('name')!r}: letters, digits, '_', ',' and ':', starting with a "
                            "letter, at most 128 (JobSet's rule)")
        for reason in rule.get("onJobFailureReasons", []):
            if reason not in JOB_FAILURE_REASONS:
                raise UserError(f"{at}.onJobFailureReasons: {reason!r} is not one of {', '.join(JOB_FAILURE_REASONS)}")
    for job in spec.get("replicatedJobs", []):
        template = job.get("template", {})
        for j, rule in enumerate(template.get("spec", {}).get("podFailurePolicy", {}).get("rules", [])):
            if rule.get("action") not in POD_FAILURE_ACTIONS:
                raise UserError(f"{_where(obj)}: replicated job {job['name']}: podFailurePolicy.rules.{j}.action="
                                f"{rule.get('action')!r}: one of {', '.join(POD_FAILURE_ACTIONS)}")
            codes = rule.get("onExitCodes")
            if codes and (codes.get("operator") not in ("In", "NotIn") or not codes.get("values")
                          or len(codes["values"]) > 255 or 0 in codes["values"] and codes["operator"] == "In"):
                raise UserError(f"{_where(obj)}: replicated job {job['name']}: podFailurePolicy.rules.{j}.onExitCodes: "
                                "operator In or NotIn, 1 to 255 values, and never In with 0")
        as_job = {"apiVersion": "batch/v1", "kind": "Job",
                  "metadata": {"name": f"{obj['metadata']['name']}-{job['name']}", **template.get("metadata", {})},
                  "spec": template.get("spec", {})}
        core(as_job, f"{_where(obj)}: replicated job {job['name']}, as a batch/v1 Job,")
    try:
        back = JobsetV1alpha2JobSet.from_dict(obj).to_dict()
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        raise UserError(f"{_where(obj)} is not a valid JobSet: {_path(first['loc'])}: {first['msg']}") from None
    lost = _lost(obj, back)
    if lost is not None:
        raise UserError(f"{_where(obj)} is not a valid JobSet: {lost} is not a field of jobset.x-k8s.io/v1alpha2 "
                        "(or not of its type): the typed models dropped or changed it")


def _lost(a: Any, b: Any, at: str = "") -> str | None:
    """The first path of ``a`` that ``b`` lacks or holds another value at (keys ``b`` adds, the
    models' defaults, are not losses), or None."""
    if isinstance(a, dict):
        if not isinstance(b, dict):
            return at.rstrip(".") or "(top)"
        for k, v in a.items():
            if k not in b:
                return f"{at}{k}"
            if (found := _lost(v, b[k], f"{at}{k}.")) is not None:
                return found
        return None
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return at.rstrip(".") or "(top)"
        for i, (x, y) in enumerate(zip(a, b)):
            if (found := _lost(x, y, f"{at}{i}.")) is not None:
                return found
        return None
    return None if a == b and type(a) is type(b) else at.rstrip(".") or "(top)"


def check(objects: list[dict]) -> None:
    """Every object, by its kind."""
    for obj in objects:
        api = obj.get("apiVersion", "")
        if api.startswith("kueue.x-k8s.io/"):
            kueue(obj)
        elif api.startswith("jobset.x-k8s.io/"):
            jobset(obj)
        else:
            core(obj)
