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
* Kueue's ``v1beta1`` objects against the fields Kueue documents (:data:`KUEUE_SCHEMAS`);
* what those schemas leave to the API server: every object's name, namespace, label and annotation
  keys and label values against its rules (DNS-1123 labels and subdomains and their lengths), and
  the integers the schemas type ``int32`` / ``int64`` against those ranges.

A failure is a :class:`~hypertron.errors.UserError` naming the object and the field.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from hypertron.errors import UserError

KUBERNETES = "1.32"  # the oldest version the objects must be valid for (native sidecars: 1.29+)
JOBSET_ACTIONS = ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts")
JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy")
POD_FAILURE_ACTIONS = ("FailJob", "FailIndex", "Ignore", "Count")
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # JobSet's webhook: no '-', at most 128

# The API server's rules for names (k8s.io/apimachinery/pkg/util/validation).
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")         # RFC 1123: namespaces, most names; at most 63
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")       # a Service's name (a JobSet's becomes one)
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # at most 253
_QUALIFIED = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")  # a label key's name, a label value: 63
INT32 = 2**31 - 1
INT64 = 2**63 - 1

_NAME = {"type": "string", "pattern": DNS_SUBDOMAIN.pattern, "maxLength": 253}
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


def dns_label(value: str, what: str, pattern: re.Pattern = DNS_LABEL) -> None:
    """Refuse ``value`` (named ``what``) unless it is a DNS label (RFC 1123, or RFC 1035 with ``DNS_1035_LABEL``)."""
    if not isinstance(value, str) or len(value) > 63 or not pattern.match(value):
        first = "a letter" if pattern is DNS_1035_LABEL else "a letter or digit"
        raise UserError(f"{what}={value!r}: not a DNS label (at most 63 lower-case letters, digits and '-', starting "
                        f"with {first} and ending with a letter or digit)")


def dns_subdomain(value: str, what: str) -> None:
    if not isinstance(value, str) or len(value) > 253 or not DNS_SUBDOMAIN.match(value):
        raise UserError(f"{what}={value!r}: not a DNS subdomain (at most 253 characters: DNS labels joined by '.')")


def label_key(key: str, what: str) -> None:
    """A label's or an annotation's key: an optional DNS-subdomain prefix and '/', then a name of at most
    63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit."""
    prefix, _, name = key.rpartition("/") if isinstance(key, str) else ("", "", "")
    if prefix:
        dns_subdomain(prefix, f"{what} {key!r}: its prefix")
    if len(name) > 63 or not _QUALIFIED.match(name):
        raise UserError(f"{what} {key!r}: not a label key (an optional DNS-subdomain prefix and '/', then at most 63 "
                        "letters, digits, '-', '_' and '.', starting and ending with a letter or digit)")


def label_value(value: str, what: str) -> None:
    if not isinstance(value, str) or len(value) > 63 or value and not _QUALIFIED.match(value):
        raise UserError(f"{what}={value!r}: not a label value (empty, or at most 63 letters, digits, '-', '_' and '.', "
                        "starting and ending with a letter or digit)")


def int32(value: int, what: str, low: int = 0) -> None:
    """Refuse a count outside ``low`` .. 2**31-1, the range of the schema's ``int32``."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= INT32:
        raise UserError(f"{what}={value}: must be an integer from {low} to {INT32} (an int32 in the object's schema)")


def metadata(meta: dict, where: str) -> None:
    """A metadata block: its name a DNS subdomain, its namespace a DNS label, its labels' and
    annotations' keys and its labels' values as the API server takes them."""
    if "name" in meta:
        dns_subdomain(meta["name"], f"{where}: metadata.name")
    if "namespace" in meta:
        dns_label(meta["namespace"], f"{where}: metadata.namespace")
    for key, value in (meta.get("labels") or {}).items():
        label_key(key, f"{where}: metadata.labels:")
        label_value(value, f"{where}: metadata.labels.{key}")
    for key in meta.get("annotations") or {}:
        label_key(key, f"{where}: metadata.annotations:")


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
    error = next(iter(_integers(obj["apiVersion"], obj["kind"]).iter_errors(obj)), None)
    if error is not None:
        raise UserError(f"{where} is not valid Kubernetes {KUBERNETES}: {_path(error.absolute_path)}={error.instance}: "
                        f"out of the range of its schema's {error.validator_value}")


@functools.cache
def _integers(api_version: str, kind: str):
    """A validator of the integers in kubernetes-validate's schema of a kind against their formats
    (``int32``, ``int64``), which the library leaves unchecked."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    version = [v for v in utils.all_versions() if utils.major_minor(v) <= KUBERNETES][-1]  # as validate() picks it
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = utils.schema_contents(f"{folder}/{kind.lower()}-{group}.json", KUBERNETES)
    registry = Resource.from_contents(utils.schema_contents(f"{folder}/_definitions.json", KUBERNETES)) @ (
        Resource.from_contents(schema) @ Registry())
    checker = jsonschema.FormatChecker(())
    for name, top in (("int32", INT32), ("int64", INT64)):
        checker.checks(name)(lambda v, top=top: not isinstance(v, int) or -top - 1 <= v <= top)
    return jsonschema.Draft202012Validator(schema, registry=registry, format_checker=checker)


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
    if obj.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or obj.get("kind") != "JobSet":
        raise UserError(f"{_where(obj)}: expected apiVersion jobset.x-k8s.io/v1alpha2, kind JobSet")
    spec = obj.get("spec") or {}
    dns_label(obj.get("metadata", {}).get("name"), f"{_where(obj)}: metadata.name", DNS_1035_LABEL)
    if "maxRestarts" in spec.get("failurePolicy", {}):
        int32(spec["failurePolicy"]["maxRestarts"], f"{_where(obj)}: spec.failurePolicy.maxRestarts")
    for job in spec.get("replicatedJobs", []):
        int32(job.get("replicas", 1), f"{_where(obj)}: replicated job {job.get('name')}: replicas")
        metadata(job.get("template", {}).get("spec", {}).get("template", {}).get("metadata") or {},
                 f"{_where(obj)}: replicated job {job.get('name')}: pod template")
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
    import pydantic
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

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
    """Every object, by its kind, and its metadata."""
    for obj in objects:
        metadata(obj.get("metadata") or {}, _where(obj))
        api = obj.get("apiVersion", "")
        if api.startswith("kueue.x-k8s.io/"):
            kueue(obj)
        elif api.startswith("jobset.x-k8s.io/"):
            jobset(obj)
        else:
            core(obj)
