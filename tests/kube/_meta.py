"""Shared vocabulary of the fake API server: resource types, timestamps and
the ``Status`` error objects the real API server answers with.

Everything that turns into an HTTP error is raised as :class:`ApiError`,
which carries the exact ``Status`` body (and any extra headers) to send.
"""
from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass, field


def rfc3339(ts: float | None = None) -> str:
    """Seconds-precision RFC 3339 UTC time, as in ``metadata.creationTimestamp``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if ts is None else ts))


def new_uid() -> str:
    return str(uuid.uuid4())


# The alphabet apimachinery's names.SimpleNameGenerator draws from.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def generated_name(prefix: str) -> str:
    prefix = prefix[: 63 - 5]
    return prefix + "".join(random.choice(_NAME_ALPHABET) for _ in range(5))


@dataclass(frozen=True)
class ResourceType:
    """One REST resource the fake serves."""

    plural: str
    kind: str
    group: str = ""          # "" is the legacy core group
    version: str = "v1"
    namespaced: bool = True
    has_status: bool = False  # status is a subresource (PUT/PATCH of the main resource ignore it)
    # batch/v1 Jobs historically orphan their pods when no propagationPolicy is given.
    default_propagation: str = "Background"
    short_names: tuple = ()
    verbs: tuple = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``pods`` or ``jobs.batch``: how API messages name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def list_kind(self) -> str:
        return self.kind + "List"


PODS = ResourceType("pods", "Pod", has_status=True, short_names=("po",))
SECRETS = ResourceType("secrets", "Secret")
CONFIGMAPS = ResourceType("configmaps", "ConfigMap", short_names=("cm",))
EVENTS = ResourceType("events", "Event", short_names=("ev",))
JOBS = ResourceType("jobs", "Job", group="batch", has_status=True, default_propagation="Orphan")
NAMESPACES = ResourceType("namespaces", "Namespace", namespaced=False, short_names=("ns",),
                          verbs=("create", "delete", "get", "list"))

RESOURCES = {(rt.group, rt.plural): rt for rt in (PODS, SECRETS, CONFIGMAPS, EVENTS, JOBS, NAMESPACES)}


def resource_type(group: str, plural: str) -> ResourceType | None:
    return RESOURCES.get((group, plural))


# --------------------------------------------------------------------------- errors


@dataclass
class ApiError(Exception):
    """An error answered as a ``Status`` object."""

    code: int
    reason: str
    message: str
    details: dict | None = None
    headers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason}
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def success_status(rt: ResourceType, name: str, uid: str) -> dict:
    details = {"name": name, "kind": rt.plural, "uid": uid}
    if rt.group:
        details = {"name": name, "group": rt.group, "kind": rt.plural, "uid": uid}
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": details}


def _details(rt: ResourceType, name: str | None = None) -> dict:
    details = {} if name is None else {"name": name}
    if rt.group:
        details["group"] = rt.group
    details["kind"] = rt.plural
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found', _details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{rt.qualified} "{name}" already exists', _details(rt, name))


def conflict(rt: ResourceType, name: str, detail: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.qualified} "{name}": {detail}',
                    _details(rt, name))


def stale_update(rt: ResourceType, name: str) -> ApiError:
    return conflict(rt, name, "the object has been modified; please apply your changes "
                              "to the latest version and try again")


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def route_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def method_not_allowed(method: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested "
                                             "resource", {})


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def namespace_not_found(namespace: str) -> ApiError:
    return ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                    {"name": namespace, "kind": "namespaces"})


def forbidden(user: str, verb: str, rt: ResourceType, subresource: str, namespace: str | None,
              name: str | None) -> ApiError:
    """The authorizer's denial, worded like kube-apiserver's RBAC denial."""
    resource = rt.plural + (f"/{subresource}" if subresource else "")
    subject = rt.qualified + (f' "{name}"' if name else "")
    scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    message = (f'{subject} is forbidden: User "{user}" cannot {verb} resource "{resource}" '
               f'in API group "{rt.group}" {scope}')
    return ApiError(403, "Forbidden", message, _details(rt, name))


def injected(code: int, retry_after: int | None) -> ApiError:
    """A throttling/server error of the kinds client retry logic has to cope with."""
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    if code == 429:
        details = {} if retry_after is None else {"retryAfterSeconds": retry_after}
        return ApiError(429, "TooManyRequests", "Too many requests, please try again later.",
                        details, headers)
    if code == 503:
        return ApiError(503, "ServiceUnavailable", "The server is currently unable to handle the request",
                        {} if retry_after is None else {"retryAfterSeconds": retry_after}, headers)
    if code == 504:
        return ApiError(504, "Timeout", "Timeout: request did not complete within requested timeout",
                        {}, headers)
    message = "Internal error occurred: injected by the fake API server"
    return ApiError(code, "InternalError", message, {"causes": [{"message": message}]}, headers)


@dataclass(frozen=True)
class FieldError:
    """One ``details.causes`` entry of a 422 Invalid answer (field.Error in Go)."""

    kind: str   # Invalid | Required | NotSupported | Forbidden | Duplicate | TooLong
    field: str
    value: object = None
    detail: str = ""

    _REASONS = {"Invalid": "FieldValueInvalid", "Required": "FieldValueRequired",
                "NotSupported": "FieldValueNotSupported", "Forbidden": "FieldValueForbidden",
                "Duplicate": "FieldValueDuplicate", "TooLong": "FieldValueTooLong"}

    def message(self) -> str:
        value = json.dumps(self.value) if isinstance(self.value, str) else json.dumps(self.value)
        if self.kind == "Invalid":
            text = f"Invalid value: {value}"
        elif self.kind == "NotSupported":
            text = f"Unsupported value: {value}"
        elif self.kind == "Duplicate":
            text = f"Duplicate value: {value}"
        elif self.kind == "Required":
            text = "Required value"
        elif self.kind == "TooLong":
            text = "Too long"
        else:
            text = "Forbidden"
        return f"{text}: {self.detail}" if self.detail else text

    def cause(self) -> dict:
        return {"reason": self._REASONS[self.kind], "message": self.message(), "field": self.field}


def invalid(rt: ResourceType, name: str, errors: list[FieldError]) -> ApiError:
    listed = [f"{e.field}: {e.message()}" for e in errors]
    summary = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
    details = {"name": name}
    if rt.group:
        details["group"] = rt.group
    details["kind"] = rt.kind
    details["causes"] = [e.cause() for e in errors]
    kind = rt.kind if not rt.group else f"{rt.kind}.{rt.group}"
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {summary}', details)
