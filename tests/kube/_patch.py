"""The three PATCH flavours the API server accepts.

* ``application/merge-patch+json``: RFC 7386 (maps merge, ``null`` deletes,
  lists are replaced);
* ``application/strategic-merge-patch+json``: like merge patch, but the lists
  Kubernetes declares with a merge key (containers by ``name``, conditions by
  ``type`` ...) are merged item by item, ``finalizers`` are unioned, and the
  ``$patch: delete`` / ``$deleteFromPrimitiveList/<key>`` directives work;
* ``application/json-patch+json``: RFC 6902 operations.
"""
from __future__ import annotations

import copy

from ._meta import ApiError, bad_request

# patchMergeKey of the list fields fibrl-style clients patch (from the Go types).
_MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
    "conditions": "type", "ownerReferences": "uid", "containerStatuses": "name",
    "initContainerStatuses": "name", "imagePullSecrets": "name", "hostIPs": "ip", "podIPs": "ip",
}
_UNION_LISTS = {"finalizers"}


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _merge_keyed_list(target: list, patch: list, key: str) -> list:
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {key}")
        index = next((i for i, old in enumerate(result) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
        elif index is None:
            result.append(strategic_merge_patch({}, item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def strategic_merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [v for v in result.get(name) or [] if v not in value]
        elif key.startswith("$") or key == "$patch":
            continue
        elif value is None:
            result.pop(key, None)
        elif key in _UNION_LISTS and isinstance(value, list):
            old = list(result.get(key) or [])
            result[key] = old + [v for v in value if v not in old]
        elif key in _MERGE_KEYS and isinstance(value, list):
            result[key] = _merge_keyed_list(result.get(key) or [], value, _MERGE_KEYS[key])
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"the server rejected our request due to an error in our request: "
                          f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc, parts: list[str]):
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _json_patch_op(doc, op: dict):
    parts = _pointer(op.get("path", ""))
    if not parts:
        raise bad_request("the server rejected our request: patching the whole document is unsupported")
    parent, last = _parent(doc, parts), parts[-1]
    kind = op.get("op")
    if kind in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, value)
            else:
                parent[index] = value
        else:
            if kind == "replace" and last not in parent:
                raise KeyError(last)
            parent[last] = value
    elif kind == "remove":
        if isinstance(parent, list):
            parent.pop(int(last))
        else:
            del parent[last]
    elif kind == "test":
        current = parent[int(last)] if isinstance(parent, list) else parent[last]
        if current != op.get("value"):
            raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our "
                                           f"request: testing value {op.get('path')} failed")
    elif kind in ("move", "copy"):
        source = _pointer(op["from"])
        src_parent = _parent(doc, source)
        value = src_parent[int(source[-1])] if isinstance(src_parent, list) else src_parent[source[-1]]
        if kind == "move":
            _json_patch_op(doc, {"op": "remove", "path": op["from"]})
        _json_patch_op(doc, {"op": "add", "path": op["path"], "value": copy.deepcopy(value)})
    else:
        raise bad_request(f"Unexpected kind: {kind}")


def json_patch(target: dict, operations) -> dict:
    if not isinstance(operations, list):
        raise bad_request("the server rejected our request due to an error in our request: "
                          "json patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        try:
            _json_patch_op(doc, op)
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our "
                                           f"request: {op.get('op')} operation does not apply: "
                                           f"doc is missing path: {op.get('path')!r} ({exc})") from exc
    return doc


def apply_patch(target: dict, content_type: str, patch) -> dict:
    kind = content_type.split(";")[0].strip().lower()
    if kind == "application/json-patch+json":
        return json_patch(target, patch)
    if kind == "application/merge-patch+json":
        return merge_patch(target, patch)
    if kind in ("application/strategic-merge-patch+json", "application/apply-patch+yaml"):
        return strategic_merge_patch(target, patch)
    raise ApiError(415, "UnsupportedMediaType", 'the body of the request was in an unknown format - '
                                                'accepted media types include: application/json-patch+json, '
                                                'application/merge-patch+json, '
                                                'application/apply-patch+yaml, '
                                                'application/strategic-merge-patch+json')
