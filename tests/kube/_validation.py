"""Defaulting and validation of incoming objects, as the API server does it
before anything is stored: names, labels, pod specs, Jobs and Secrets.

``prepare_create`` and ``prepare_update`` mutate the object in place
(defaults) and raise :class:`ApiError` 422 (or 400) with the real field paths
and messages when the object would be rejected.
"""
from __future__ import annotations

import base64
import binascii
import copy
import json
import re

from kubernetes.utils import parse_quantity

from ._meta import (CONFIGMAPS, JOBS, PODS, SECRETS, ApiError, FieldError, ResourceType,
                    generated_name, invalid)

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")

MSG_SUBDOMAIN = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                 "'-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
                 "regex used for validation is "
                 "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
MSG_LABEL = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
             "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
             "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
MSG_LABEL_VALUE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' "
                   "or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
                   "'my_value',  or '12345', regex used for validation is "
                   "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
MSG_QUALIFIED = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and "
                 "end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex "
                 "used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
MSG_ENV = ("a valid environment variable name must consist of alphabetic characters, digits, '_', '-', "
           "or '.', and must not start with a digit (e.g. 'my.env-name',  or 'MY_ENV.NAME',  or "
           "'MyEnvName1', regex used for validation is '[-._a-zA-Z][-._a-zA-Z0-9]*')")
MSG_CONFIG_KEY = ("a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. "
                  "'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is "
                  "'[-._a-zA-Z0-9]+')")
MSG_POD_UPDATE = ("pod updates may not change fields other than `spec.containers[*].image`,"
                  "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
                  "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
                  "(allow it to be set to 1 if it was previously negative)")
JOB_TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


# --------------------------------------------------------------------------- names and metadata


def dns_subdomain_errors(value: str, path: str) -> list[FieldError]:
    if len(value) > 253:
        return [FieldError("Invalid", path, value, "must be no more than 253 characters")]
    if not DNS1123_SUBDOMAIN.fullmatch(value):
        return [FieldError("Invalid", path, value, MSG_SUBDOMAIN)]
    return []


def dns_label_errors(value: str, path: str) -> list[FieldError]:
    if len(value) > 63:
        return [FieldError("Invalid", path, value, "must be no more than 63 characters")]
    if not DNS1123_LABEL.fullmatch(value):
        return [FieldError("Invalid", path, value, MSG_LABEL)]
    return []


def _qualified_name_errors(key: str, path: str) -> list[FieldError]:
    prefix, _, name = key.rpartition("/")
    errors = []
    if "/" in key and (not prefix or dns_subdomain_errors(prefix, path)):
        errors.append(FieldError("Invalid", path, key, "prefix part " + MSG_SUBDOMAIN))
    if not name or len(name) > 63:
        errors.append(FieldError("Invalid", path, key, "name part must be no more than 63 characters"
                                 if name else "name part must be non-empty"))
    elif not _QUALIFIED_NAME.fullmatch(name):
        errors.append(FieldError("Invalid", path, key, MSG_QUALIFIED))
    return errors


def label_errors(labels: dict | None, path: str) -> list[FieldError]:
    errors = []
    for key, value in (labels or {}).items():
        errors += _qualified_name_errors(key, path)
        if not isinstance(value, str):
            errors.append(FieldError("Invalid", f"{path}[{key}]", value, "must be a string"))
        elif len(value) > 63:
            errors.append(FieldError("Invalid", path, value, "must be no more than 63 characters"))
        elif not _LABEL_VALUE.fullmatch(value):
            errors.append(FieldError("Invalid", path, value, MSG_LABEL_VALUE))
    return errors


def _annotation_errors(annotations: dict | None) -> list[FieldError]:
    annotations = annotations or {}
    errors = []
    for key in annotations:
        errors += _qualified_name_errors(key, "metadata.annotations")
    if sum(len(k) + len(str(v)) for k, v in annotations.items()) > 262144:
        errors.append(FieldError("TooLong", "metadata.annotations", "", "may not be more than 262144 bytes"))
    return errors


def _owner_reference_errors(refs: list | None) -> list[FieldError]:
    errors = []
    for i, ref in enumerate(refs or []):
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                errors.append(FieldError("Required", f"metadata.ownerReferences[{i}].{key}", None,
                                         f"{key} must not be empty" if key != "uid" else ""))
    if sum(1 for ref in refs or [] if ref.get("controller")) > 1:
        errors.append(FieldError("Invalid", "metadata.ownerReferences", refs,
                                 "Only one reference can have Controller set to true"))
    return errors


def resolve_name(rt: ResourceType, meta: dict) -> None:
    """Fill ``metadata.name`` from ``generateName``; 422 when neither is given."""
    if not meta.get("name") and meta.get("generateName"):
        meta["name"] = generated_name(meta["generateName"])
    if not meta.get("name"):
        raise invalid(rt, "", [FieldError("Required", "metadata.name", None,
                                          "name or generateName is required")])


def _metadata_errors(rt: ResourceType, meta: dict) -> list[FieldError]:
    name = meta.get("name", "")
    check = dns_label_errors if rt.plural == "namespaces" else dns_subdomain_errors
    return (check(name, "metadata.name") + label_errors(meta.get("labels"), "metadata.labels")
            + _annotation_errors(meta.get("annotations"))
            + _owner_reference_errors(meta.get("ownerReferences")))


# --------------------------------------------------------------------------- pods


# The API server's grammar (resource.Quantity); kubernetes.utils.parse_quantity is laxer
# (it takes "512K", which a real server refuses).
_QUANTITY = re.compile(r"^[+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                       r"([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _quantity(value, path: str, errors: list[FieldError]):
    try:
        if not _QUANTITY.match(str(value)):
            raise ValueError(value)
        return parse_quantity(value)
    except (ValueError, TypeError):
        errors.append(FieldError("Invalid", path, value,
                                 "must match the regex (\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))"
                                 "(([KMGTPE]i)|[numkMGTPE]|([eE](\\+|-)?(([0-9]+(\\.[0-9]*)?)|"
                                 "(\\.[0-9]+))))?$"))
        return None


def _resources_errors(resources: dict, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    limits = {k: _quantity(v, f"{path}.limits[{k}]", errors) for k, v in (resources.get("limits") or {}).items()}
    for key, value in (resources.get("requests") or {}).items():
        request = _quantity(value, f"{path}.requests[{key}]", errors)
        if request is not None and limits.get(key) is not None and request > limits[key]:
            errors.append(FieldError("Invalid", f"{path}.requests", value,
                                     f"must be less than or equal to {key} limit of "
                                     f"{resources['limits'][key]}"))
    return errors


def _env_errors(env: list, path: str) -> list[FieldError]:
    errors = []
    for i, var in enumerate(env or []):
        name = var.get("name", "")
        if not name:
            errors.append(FieldError("Required", f"{path}[{i}].name", None))
        elif not _ENV_NAME.fullmatch(name):
            errors.append(FieldError("Invalid", f"{path}[{i}].name", name, MSG_ENV))
        if var.get("value") and var.get("valueFrom"):
            errors.append(FieldError("Invalid", f"{path}[{i}].valueFrom", "",
                                     "may not be specified when `value` is not empty"))
    return errors


def _container_errors(container: dict, path: str) -> list[FieldError]:
    errors = []
    name = container.get("name") or ""
    errors += [FieldError("Required", f"{path}.name", None)] if not name else \
        dns_label_errors(name, f"{path}.name")
    if not container.get("image"):
        errors.append(FieldError("Required", f"{path}.image", None))
    errors += _env_errors(container.get("env"), f"{path}.env")
    errors += _resources_errors(container.get("resources") or {}, f"{path}.resources")
    return errors


def pod_spec_errors(spec: dict | None, path: str, restart_policies=("Always", "OnFailure", "Never")):
    spec = spec or {}
    containers = spec.get("containers") or []
    errors = [] if containers else [FieldError("Required", f"{path}.containers", None)]
    seen = set()
    for i, container in enumerate(containers):
        errors += _container_errors(container, f"{path}.containers[{i}]")
        if container.get("name") in seen:
            errors.append(FieldError("Duplicate", f"{path}.containers[{i}].name", container.get("name")))
        seen.add(container.get("name"))
    policy = spec.get("restartPolicy")
    if policy not in restart_policies:
        supported = ", ".join(f'"{p}"' for p in restart_policies)
        errors.append(FieldError("NotSupported", f"{path}.restartPolicy", policy,
                                 f"supported values: {supported}"))
    return errors


def _default_container(container: dict) -> None:
    image = container.get("image") or ""
    tag = image.rsplit("/", 1)[-1]
    latest = "@" not in image and (":" not in tag or tag.endswith(":latest"))
    container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
    container.setdefault("terminationMessagePath", "/dev/termination-log")
    container.setdefault("terminationMessagePolicy", "File")
    resources = container.setdefault("resources", {})
    for key, value in (resources.get("limits") or {}).items():   # requests default to limits
        resources.setdefault("requests", {}).setdefault(key, value)


def default_pod_spec(spec: dict) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for container in spec.get("containers") or []:
        _default_container(container)
    for container in spec.get("initContainers") or []:
        _default_container(container)


def _admit_pod(pod: dict) -> None:
    """What pod admission plugins add: service account, its token volume, tolerations."""
    spec = pod["spec"]
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    spec["serviceAccount"] = spec["serviceAccountName"]
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("priority", 0)
    tolerations = spec.setdefault("tolerations", [])
    for taint in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if not any(t.get("key") == taint for t in tolerations):
            tolerations.append({"key": taint, "operator": "Exists", "effect": "NoExecute",
                                "tolerationSeconds": 300})
    if spec.get("automountServiceAccountToken") is False:
        return
    volume = generated_name("kube-api-access-")
    spec.setdefault("volumes", []).append({"name": volume, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
            "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}})
    for container in spec.get("containers", []):
        container.setdefault("volumeMounts", []).append(
            {"name": volume, "readOnly": True, "mountPath": SA_MOUNT})


def qos_class(spec: dict) -> str:
    resources = [c.get("resources") or {} for c in spec.get("containers", [])]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    guaranteed = all(
        all(key in (r.get("limits") or {}) for key in ("cpu", "memory"))
        and all(parse_quantity(v) == parse_quantity((r.get("limits") or {}).get(k, v))
                for k, v in (r.get("requests") or {}).items())
        for r in resources)
    return "Guaranteed" if guaranteed else "Burstable"


def _prepare_pod(pod: dict) -> list[FieldError]:
    spec = pod.setdefault("spec", {})
    default_pod_spec(spec)
    errors = pod_spec_errors(spec, "spec")
    if not errors:
        _admit_pod(pod)
        pod["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}
    return errors


# --------------------------------------------------------------------------- jobs


def _prepare_job(job: dict) -> list[FieldError]:
    meta, spec = job["metadata"], job.setdefault("spec", {})
    template = spec.setdefault("template", {})
    template_meta = template.get("metadata") or {}
    template["metadata"] = template_meta
    uid, name = meta["uid"], meta["name"]
    controller_labels = {"batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name": name,
                         "controller-uid": uid, "job-name": name}
    if not spec.get("manualSelector"):
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        template_meta["labels"] = {**(template_meta.get("labels") or {}), **controller_labels}
    template_meta.setdefault("creationTimestamp", None)
    if not meta.get("labels"):
        meta["labels"] = dict(template_meta.get("labels") or {})
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    template_spec = template.setdefault("spec", {})
    default_pod_spec(template_spec)
    errors = pod_spec_errors(template_spec, "spec.template.spec", ("OnFailure", "Never"))
    errors += label_errors(template_meta.get("labels"), "spec.template.labels")
    for key in ("parallelism", "completions", "backoffLimit"):
        if isinstance(spec.get(key), int) and spec[key] < 0:
            errors.append(FieldError("Invalid", f"spec.{key}", spec[key],
                                     "must be greater than or equal to 0"))
    if spec["completionMode"] == "Indexed" and spec.get("completions") is None:
        errors.append(FieldError("Required", "spec.completions", None,
                                 "when completion mode is Indexed"))
    job["status"] = {}
    return errors


# --------------------------------------------------------------------------- secrets / config maps


def _decode_secret_data(data: dict) -> None:
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError, TypeError) as exc:
            raise ApiError(400, "BadRequest", 'Secret in version "v1" cannot be handled as a Secret: '
                                              f'illegal base64 data at input byte 0 (key {key!r})') from exc


def _key_errors(keys, path: str) -> list[FieldError]:
    return [FieldError("Invalid", f"{path}[{key}]", key, MSG_CONFIG_KEY)
            for key in keys if not _CONFIG_KEY.fullmatch(key)]


def _prepare_secret(secret: dict) -> list[FieldError]:
    data = secret.get("data") or {}
    _decode_secret_data(data)
    for key, value in (secret.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(value.encode()).decode()
    if data:
        secret["data"] = data
    secret.setdefault("type", "Opaque")
    errors = _key_errors(data, "data")
    if sum(len(base64.b64decode(v)) for v in data.values()) > 1024 * 1024:
        errors.append(FieldError("TooLong", "data", "", "Too long: may not be more than 1048576 bytes"))
    return errors


def _prepare_configmap(cm: dict) -> list[FieldError]:
    return _key_errors(list(cm.get("data") or {}) + list(cm.get("binaryData") or {}), "data")


_PREPARE = {PODS.plural: _prepare_pod, JOBS.plural: _prepare_job, SECRETS.plural: _prepare_secret,
            CONFIGMAPS.plural: _prepare_configmap}


def prepare_create(rt: ResourceType, obj: dict) -> None:
    """Default and validate ``obj`` (metadata already filled in); raise 422 if invalid."""
    errors = _metadata_errors(rt, obj["metadata"])
    if not errors and rt.plural in _PREPARE:
        errors += _PREPARE[rt.plural](obj)
    if errors:
        raise invalid(rt, obj["metadata"].get("name", ""), errors)


# --------------------------------------------------------------------------- updates


def _strip_mutable_pod_fields(spec: dict) -> dict:
    spec = copy.deepcopy(spec)
    for key in ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"):
        spec.pop(key, None)
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        container.pop("image", None)
    return spec


def _update_errors(rt: ResourceType, old: dict, new: dict) -> list[FieldError]:
    if rt is PODS:
        if _strip_mutable_pod_fields(old.get("spec", {})) != _strip_mutable_pod_fields(new.get("spec", {})):
            return [FieldError("Forbidden", "spec", None, MSG_POD_UPDATE)]
        return pod_spec_errors(new.get("spec"), "spec")
    if rt is JOBS:
        errors = []
        for key in ("template", "selector", "completionMode", "completions"):
            if old["spec"].get(key) != new["spec"].get(key) and not (
                    key == "template" and old["spec"].get("suspend")):
                errors.append(FieldError("Invalid", f"spec.{key}", new["spec"].get(key), "field is immutable"))
        return errors
    if rt is SECRETS:
        if old.get("immutable") and (old.get("data") != new.get("data")):
            return [FieldError("Forbidden", "data", None, "field is immutable when `immutable` is set")]
        return _prepare_secret(new)
    return []


def prepare_update(rt: ResourceType, old: dict, new: dict) -> None:
    meta = new["metadata"]
    errors = (label_errors(meta.get("labels"), "metadata.labels") + _annotation_errors(meta.get("annotations"))
              + _owner_reference_errors(meta.get("ownerReferences")) + _update_errors(rt, old, new))
    if errors:
        raise invalid(rt, meta["name"], errors)


def parse_body(raw: bytes, content_type: str = "application/json"):
    try:
        if "yaml" in content_type:
            import yaml
            return yaml.safe_load(raw.decode() or "null")
        return json.loads(raw.decode() or "null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "BadRequest", f"the body of the request could not be decoded: {exc}") from exc
