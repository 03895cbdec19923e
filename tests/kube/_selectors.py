"""Label and field selectors, parsed once and matched against stored objects.

Label selectors follow apimachinery's grammar: comma-separated requirements
``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k``,
``k>1``/``k<1``. Field selectors accept ``=``, ``==`` and ``!=`` on the fields
each resource supports; any other field is a 400, as on a real server.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ._meta import ResourceType, bad_request

_KEY = r"(?:[A-Za-z0-9.\-]+/)?[A-Za-z0-9](?:[A-Za-z0-9_.\-]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[A-Za-z0-9_.\-]*[A-Za-z0-9])?)?"
_SET_REQ = re.compile(rf"^\s*({_KEY})\s+(in|notin)\s*\(([^()]*)\)\s*$")
_CMP_REQ = re.compile(rf"^\s*({_KEY})\s*(==|=|!=|>|<)\s*({_VALUE})\s*$")
_EXISTS_REQ = re.compile(rf"^\s*(!?)\s*({_KEY})\s*$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str            # in, notin, exists, !, gt, lt
    values: tuple = ()

    def matches(self, labels: dict) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        try:
            number = int(value) if present else None
        except ValueError:
            return False
        if number is None:
            return False
        bound = int(self.values[0])
        return number > bound if self.op == "gt" else number < bound


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``( ... )``."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _parse_requirement(text: str, selector: str) -> Requirement:
    if match := _SET_REQ.match(text):
        values = tuple(v.strip() for v in match.group(3).split(",") if v.strip())
        if not values and match.group(2) == "in":
            raise bad_request("unable to parse requirement: values: Invalid value: \"\": "
                              "for 'in', 'notin' operators, values set can't be empty")
        return Requirement(match.group(1), match.group(2), values)
    if match := _CMP_REQ.match(text):
        key, op, value = match.groups()
        if op in ("==", "="):
            return Requirement(key, "in", (value,))
        if op == "!=":
            return Requirement(key, "notin", (value,))
        if not re.fullmatch(r"-?[0-9]+", value):
            raise bad_request("unable to parse requirement: for 'Gt', 'Lt' operators, "
                              "the value must be an integer")
        return Requirement(key, "gt" if op == ">" else "lt", (value,))
    if match := _EXISTS_REQ.match(text):
        return Requirement(match.group(2), "!" if match.group(1) else "exists")
    raise bad_request(f"unable to parse requirement: found '{text.strip()}', expected: "
                      f"label selector in \"{selector}\"")


class LabelSelector:
    def __init__(self, text: str | None):
        text = (text or "").strip()
        self.requirements = [] if not text else [
            _parse_requirement(part, text) for part in _split_top_level(text)]

    def matches(self, obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(req.matches(labels) for req in self.requirements)


def selector_from_match_labels(match_labels: dict) -> LabelSelector:
    selector = LabelSelector(None)
    selector.requirements = [Requirement(k, "in", (v,)) for k, v in sorted(match_labels.items())]
    return selector


# --------------------------------------------------------------------------- fields


def _path(*keys: str) -> Callable[[dict], str]:
    def get(obj: dict) -> str:
        for key in keys:
            obj = obj.get(key) if isinstance(obj, dict) else None
        if obj is None:
            return ""
        if isinstance(obj, bool):
            return "true" if obj else "false"
        return str(obj)
    return get


_COMMON_FIELDS = {"metadata.name": _path("metadata", "name"),
                  "metadata.namespace": _path("metadata", "namespace")}

_FIELDS = {
    "pods": {
        "spec.nodeName": _path("spec", "nodeName"),
        "spec.restartPolicy": _path("spec", "restartPolicy"),
        "spec.schedulerName": _path("spec", "schedulerName"),
        "spec.serviceAccountName": _path("spec", "serviceAccountName"),
        "spec.hostNetwork": lambda o: "true" if (o.get("spec") or {}).get("hostNetwork") else "false",
        "status.phase": _path("status", "phase"),
        "status.podIP": _path("status", "podIP"),
        "status.nominatedNodeName": _path("status", "nominatedNodeName"),
    },
    "secrets": {"type": _path("type")},
    "jobs": {"status.successful": lambda o: str((o.get("status") or {}).get("succeeded", 0))},
    "events": {
        "involvedObject.kind": _path("involvedObject", "kind"),
        "involvedObject.name": _path("involvedObject", "name"),
        "involvedObject.namespace": _path("involvedObject", "namespace"),
        "involvedObject.uid": _path("involvedObject", "uid"),
        "reason": _path("reason"),
        "type": _path("type"),
    },
    "namespaces": {"status.phase": _path("status", "phase")},
}


class FieldSelector:
    def __init__(self, rt: ResourceType, text: str | None):
        supported = {**_COMMON_FIELDS, **_FIELDS.get(rt.plural, {})}
        self.terms: list[tuple[Callable[[dict], str], bool, str]] = []
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            match = re.fullmatch(r"([A-Za-z0-9_.\-\[\]']+)\s*(==|=|!=)\s*(.*)", part)
            if not match:
                raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
            name, op, value = match.groups()
            if name not in supported:
                raise bad_request(f'field label not supported: {name}')
            self.terms.append((supported[name], op != "!=", value.strip()))

    def matches(self, obj: dict) -> bool:
        return all((get(obj) == value) == equal for get, equal, value in self.terms)


@dataclass
class Selectors:
    labels: LabelSelector
    fields: FieldSelector

    @classmethod
    def parse(cls, rt: ResourceType, label_text: str | None, field_text: str | None) -> "Selectors":
        return cls(LabelSelector(label_text), FieldSelector(rt, field_text))

    def matches(self, obj: dict | None) -> bool:
        return obj is not None and self.labels.matches(obj) and self.fields.matches(obj)


__all__ = ["FieldSelector", "LabelSelector", "Selectors", "selector_from_match_labels"]
