"""REST semantics on top of the :class:`Store`: what each verb does to an
object, independent of HTTP.

create (generateName, uid, timestamps, defaulting, validation), get, list
(selectors, pagination), watch (resourceVersion, 410, selector
transitions, bookmarks), update/patch (optimistic concurrency, the status
subresource split), delete (grace periods, propagation finalizers, the
``Store`` removing the object once its finalizers are gone) and the
synthetic namespaces view. The HTTP layer and the controllers both call it.
"""
from __future__ import annotations

import base64
import copy
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from ._meta import (EVENTS, JOBS, NAMESPACES, PODS, RESOURCES, ApiError, FieldError, ResourceType,
                    already_exists, bad_request, conflict, invalid, namespace_not_found, new_uid, not_found,
                    rfc3339, stale_update, success_status)
from ._admission import admit_pod
from ._patch import apply_patch
from ._selectors import Selectors
from ._settings import Settings
from ._store import Expired, Store, WatchEvent
from ._validation import dns_label_errors, prepare_create, prepare_update, resolve_name

log = logging.getLogger(__name__)

_META_ORDER = ("name", "generateName", "namespace", "uid", "resourceVersion", "generation",
               "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
               "annotations", "ownerReferences", "finalizers")
JOB_ORPHAN_WARNING = ('299 - "child pods are preserved by default when jobs are deleted; set '
                      'propagationPolicy=Background to remove them or set propagationPolicy=Orphan to '
                      'suppress this warning"')


def canonical(obj: dict) -> dict:
    """Key order of the real API's JSON: kind, apiVersion, metadata, ..., status."""
    meta = obj.get("metadata") or {}
    ordered_meta = {k: meta[k] for k in _META_ORDER if k in meta}
    ordered_meta.update({k: v for k, v in meta.items() if k not in ordered_meta})
    head = {k: obj[k] for k in ("kind", "apiVersion") if k in obj}
    head["metadata"] = ordered_meta
    rest = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion", "metadata", "status")}
    tail = {"status": obj["status"]} if "status" in obj else {}
    return {**head, **rest, **tail}


@dataclass
class DeleteOptions:
    grace_period: int | None = None
    propagation: str | None = None
    preconditions: dict | None = None
    dry_run: bool = False

    @classmethod
    def parse(cls, query: dict, body: dict | None) -> "DeleteOptions":
        body = body or {}
        grace = query.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        policy = query.get("propagationPolicy", body.get("propagationPolicy"))
        orphan = query.get("orphanDependents", body.get("orphanDependents"))
        if policy is None and orphan is not None:
            policy = "Orphan" if str(orphan).lower() == "true" else "Background"
        if policy not in (None, "Orphan", "Background", "Foreground"):
            raise invalid(ResourceType("deleteoptions", "DeleteOptions", group="meta.k8s.io"), "", [
                FieldError("NotSupported", "propagationPolicy", policy,
                           'supported values: "Foreground", "Background", "Orphan", "nil"')])
        dry_run = query.get("dryRun", body.get("dryRun"))
        return cls(None if grace is None else int(grace), policy, body.get("preconditions"),
                   bool(dry_run))


def _int_rv(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise bad_request(f'invalid resource version "{text}"') from None


class Api:
    def __init__(self, store: Store, settings: Settings):
        self.store = store
        self.settings = settings
        self.slow_watchers_closed = 0
        self._created_namespaces: dict[str, dict] = {}

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def key(rt: ResourceType, namespace: str | None, name: str) -> tuple:
        return (rt.plural, namespace or "", name)

    def check_namespace(self, namespace: str) -> None:
        if dns_label_errors(namespace, "metadata.namespace"):
            raise namespace_not_found(namespace)
        if self.settings.strict_namespaces and namespace not in self.known_namespaces():
            raise namespace_not_found(namespace)

    def namespace_labels(self, namespace: str) -> dict:
        """Labels of a created namespace (admission reads them); {} for the synthetic ones."""
        created = self._created_namespaces.get(namespace) or {}
        return dict((created.get("metadata") or {}).get("labels") or {})

    def known_namespaces(self) -> set[str]:
        return set(self.settings.namespaces) | set(self._created_namespaces) | self.store.namespaces()

    # ------------------------------------------------------------------ create / read

    def create(self, rt: ResourceType, namespace: str | None, body, dry_run: bool = False) -> dict:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        if rt is NAMESPACES:
            return self._create_namespace(body)
        obj = copy.deepcopy(body)
        meta = obj.get("metadata") or {}
        obj.update(kind=rt.kind, apiVersion=rt.api_version, metadata=meta)
        if meta.get("namespace") not in (None, "", namespace):
            raise bad_request("the namespace of the provided object does not match the namespace sent "
                              "on the request")
        if meta.get("resourceVersion"):
            raise ApiError(500, "InternalError", "Internal error occurred: resourceVersion should not be "
                                                 "set on objects to be created")
        self.check_namespace(namespace)
        for _ in range(5):   # a generated name may collide
            created = self._try_create(rt, namespace, copy.deepcopy(obj), dry_run)
            if created is not None:
                return created
        raise already_exists(rt, meta.get("name") or meta.get("generateName", ""))

    def _try_create(self, rt: ResourceType, namespace: str, obj: dict, dry_run: bool) -> dict | None:
        meta = obj["metadata"]
        for transient in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink", "managedFields"):
            meta.pop(transient, None)
        had_name = bool(meta.get("name"))
        resolve_name(rt, meta)
        meta.update(namespace=namespace, uid=new_uid(), creationTimestamp=rfc3339())
        if rt is JOBS:
            meta["generation"] = 1
        prepare_create(rt, obj)
        if rt is PODS:
            admit_pod(obj, self.namespace_labels(namespace))
        obj = canonical(obj)
        if dry_run:
            return obj
        created = self.store.create(self.key(rt, namespace, meta["name"]), obj)
        if created is None and had_name:
            raise already_exists(rt, meta["name"])
        return created

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict:
        if rt is NAMESPACES:
            return self._get_namespace(name)
        obj = self.store.get(self.key(rt, namespace, name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def list(self, rt: ResourceType, namespace: str | None, selectors: Selectors,
             limit: int | None = None, continue_token: str | None = None) -> dict:
        if rt is NAMESPACES:
            items, rv = self._list_namespaces(), self.store.resource_version
        else:
            items, rv = self.store.list(rt.plural, namespace)
        items = [obj for obj in items if selectors.matches(obj)]
        meta: dict = {"resourceVersion": str(rv)}
        if continue_token:
            start = json.loads(base64.b64decode(continue_token))["start"]
            items = [obj for obj in items if _sort_key(obj) > start]
        if limit and len(items) > limit:
            last = _sort_key(items[limit - 1])
            token = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": last})
            meta.update({"continue": base64.b64encode(token.encode()).decode(),
                         "remainingItemCount": len(items) - limit})
            items = items[:limit]
        for obj in items:
            obj.pop("kind", None)
            obj.pop("apiVersion", None)
        return {"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": items}

    # ------------------------------------------------------------------ watch

    def watch(self, rt: ResourceType, namespace: str | None, selectors: Selectors, resource_version: str | None,
              timeout: float | None, bookmarks: bool = False, initial_events: bool | None = None,
              cancelled: threading.Event | None = None) -> Iterator[dict]:
        """Watch events as dicts ``{"type", "object"}``, ending at the timeout, or as soon as
        ``cancelled`` is set and :meth:`wake_watches` is called (its client hung up).

        A resourceVersion newer than the store's is refused at once (504, as an API
        server whose cache lags behind, after a failover, refuses it); with ``bookmarks``
        a BOOKMARK is sent every ``settings.bookmark_interval`` seconds of quiet.
        """
        if resource_version not in (None, "", "0") and not initial_events:
            current = self.store.resource_version
            if _int_rv(resource_version) > current:
                raise ApiError(504, "Timeout", f"Too large resource version: "
                                               f"{_int_rv(resource_version)}, current: {current}",
                               {"causes": [{"reason": "ResourceVersionTooLarge",
                                            "message": "Too large resource version"}],
                                "retryAfterSeconds": 1}, {"Retry-After": "1"})
        return self._watch_events(rt, namespace, selectors, resource_version, timeout, bookmarks,
                                  initial_events, cancelled)

    def wake_watches(self) -> None:
        """Make the watches waiting for events check whether they were cancelled."""
        self.store.wake()

    def _watch_events(self, rt: ResourceType, namespace: str | None, selectors: Selectors,
                      resource_version: str | None, timeout: float | None, bookmarks: bool,
                      initial_events: bool | None,
                      cancelled: threading.Event | None) -> Iterator[dict]:
        deadline = time.monotonic() + (self.settings.watch_default_timeout if timeout is None else timeout)
        if resource_version in (None, "", "0") or initial_events:
            items, cursor = self.store.list(rt.plural, namespace)
            for obj in items:
                if selectors.matches(obj):
                    yield {"type": "ADDED", "object": obj}
            if initial_events and bookmarks:
                yield self._bookmark(rt, cursor, {"k8s.io/initial-events-end": "true"})
        else:
            cursor = _int_rv(resource_version)
        interval = self.settings.bookmark_interval
        opened = self.store.resource_version
        while True:
            wake = min(deadline, time.monotonic() + interval) if bookmarks and interval else deadline
            try:
                events = self.store.events_after(cursor, wake, cancelled)
            except Expired as exc:
                yield {"type": "ERROR", "object": ApiError(410, "Expired", str(exc)).status()}
                return
            if events is None:
                return
            if not events:
                if bookmarks:   # the last version delivered: nothing newer was there
                    yield self._bookmark(rt, cursor, None)
                if time.monotonic() >= deadline:
                    return
                continue
            batch = [(e.rv, _translate(rt, namespace, selectors, e)) for e in events]
            # what happened since the watch began (the history it asked for is replayed
            # as fast as the client reads, as from the watch cache)
            behind = sum(1 for rv, translated in batch if translated and rv > opened)
            if self.settings.watcher_buffer and behind > self.settings.watcher_buffer:
                # more than its buffer piled up while the last writes to it blocked
                log.info("forcing watcher close due to unresponsiveness: %s behind by %d events",
                         rt.plural, behind)
                self.slow_watchers_closed += 1
                return
            for rv, translated in batch:
                cursor = rv
                if translated:
                    yield translated

    @staticmethod
    def _bookmark(rt: ResourceType, rv: int, annotations: dict | None) -> dict:
        meta = {"resourceVersion": str(rv), "creationTimestamp": None}
        if annotations:
            meta["annotations"] = annotations
        return {"type": "BOOKMARK", "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}}

    # ------------------------------------------------------------------ update / patch

    def replace(self, rt: ResourceType, namespace: str, name: str, body, subresource: str = "") -> dict:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise bad_request("the name of the object (%s) does not match the name on the URL (%s)"
                              % (body_name, name))
        return self._write(rt, namespace, name, lambda current: copy.deepcopy(body), subresource)

    def patch(self, rt: ResourceType, namespace: str, name: str, patch, content_type: str,
              subresource: str = "", field_manager: str | None = None) -> tuple[int, dict]:
        if "apply-patch" in content_type:
            if not field_manager:
                raise invalid(ResourceType("patchoptions", "PatchOptions", group="meta.k8s.io"), "", [
                    FieldError("Required", "fieldManager", None, "is required for apply patch")])
            if self.store.get(self.key(rt, namespace, name)) is None and not subresource:
                body = copy.deepcopy(patch)
                body.setdefault("metadata", {})["name"] = name
                return 201, self.create(rt, namespace, body)
        obj = self._write(rt, namespace, name,
                          lambda current: apply_patch(current, content_type, patch), subresource)
        return 200, obj

    def _write(self, rt: ResourceType, namespace: str, name: str, compute, subresource: str) -> dict:
        def mutate(current: dict) -> dict:
            wanted = compute(copy.deepcopy(current))
            if not isinstance(wanted, dict):
                raise bad_request("the body of the request must be a JSON object")
            rv = (wanted.get("metadata") or {}).get("resourceVersion")
            if rv and rv != current["metadata"]["resourceVersion"]:
                raise stale_update(rt, name)
            new = _merge_for_subresource(rt, current, wanted, subresource)
            _keep_server_metadata(rt, current, new)
            prepare_update(rt, current, new)
            return canonical(new)

        result = self.store.update(self.key(rt, namespace, name), mutate)
        if result is None:
            raise not_found(rt, name)
        return result

    # ------------------------------------------------------------------ delete

    def delete(self, rt: ResourceType, namespace: str | None, name: str,
               options: DeleteOptions) -> tuple[int, dict, dict]:
        """Returns (HTTP code, body, extra headers)."""
        if rt is NAMESPACES:
            return 200, self._delete_namespace(name), {}
        key = self.key(rt, namespace, name)
        current = self.store.get(key)
        if current is None:
            raise not_found(rt, name)
        _check_preconditions(rt, current, options.preconditions)
        headers = {"Warning": JOB_ORPHAN_WARNING} if rt is JOBS and options.propagation is None else {}
        if options.dry_run:
            return 200, current, headers
        policy = options.propagation or rt.default_propagation
        finalizer = {"Orphan": "orphan", "Foreground": "foregroundDeletion"}.get(policy)
        grace = self._grace_period(rt, current, options)
        if not finalizer and not grace and not current["metadata"].get("finalizers"):
            result, removed = self.store.remove(key) or current, True
        else:
            result = self.store.update(key, lambda obj: _mark_deleted(obj, finalizer, grace)) or current
            removed = self.store.get(key) is None
        if rt is PODS or not removed:
            return 200, result, headers
        return 200, success_status(rt, name, current["metadata"]["uid"]), headers

    def delete_collection(self, rt: ResourceType, namespace: str | None, selectors: Selectors,
                          options: DeleteOptions) -> dict:
        deleted = []
        for obj in self.list(rt, namespace, selectors)["items"]:
            try:
                deleted.append(self.delete(rt, namespace, obj["metadata"]["name"], options)[1])
            except ApiError as exc:
                if exc.code != 404:
                    raise
        items = [obj for obj in deleted if obj.get("kind") != "Status"]
        return {"kind": rt.list_kind, "apiVersion": rt.api_version,
                "metadata": {"resourceVersion": str(self.store.resource_version)}, "items": items}

    def _grace_period(self, rt: ResourceType, pod: dict, options: DeleteOptions) -> int:
        if rt is not PODS:
            return 0
        spec, phase = pod.get("spec") or {}, (pod.get("status") or {}).get("phase")
        if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
            return 0
        grace = options.grace_period
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return max(int(grace), 0)

    # ------------------------------------------------------------------ events (core/v1)

    def record_event(self, involved: dict, kind: str, reason: str, message: str, component: str,
                     field_path: str | None = None) -> None:
        if not self.settings.record_events:
            return
        meta = involved["metadata"]
        ref = {"kind": involved.get("kind", "Pod"), "namespace": meta["namespace"], "name": meta["name"],
               "uid": meta["uid"], "apiVersion": involved.get("apiVersion", "v1"),
               "resourceVersion": meta.get("resourceVersion", "")}
        if field_path:
            ref["fieldPath"] = field_path
        now = rfc3339()
        event = {"metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
                 "involvedObject": ref, "reason": reason, "message": message,
                 "source": {"component": component}, "firstTimestamp": now, "lastTimestamp": now,
                 "count": 1, "type": kind, "eventTime": None, "reportingComponent": component,
                 "reportingInstance": self.settings.node_name if component == "kubelet" else ""}
        try:
            self.create(EVENTS, meta["namespace"], event)
        except ApiError:
            pass

    # ------------------------------------------------------------------ namespaces (synthetic)

    def _namespace_object(self, name: str, phase: str = "Active") -> dict:
        stored = self._created_namespaces.get(name)
        if stored is not None:
            return {**copy.deepcopy(stored), "status": {"phase": phase}}
        return {"kind": "Namespace", "apiVersion": "v1", "metadata": {
            "name": name, "uid": new_uid(), "resourceVersion": "1", "creationTimestamp": rfc3339(0),
            "labels": {"kubernetes.io/metadata.name": name}},
            "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": phase}}

    def _get_namespace(self, name: str) -> dict:
        self.check_namespace(name)
        return self._namespace_object(name)

    def _list_namespaces(self) -> list[dict]:
        return [self._namespace_object(name) for name in sorted(self.known_namespaces())]

    def _create_namespace(self, body: dict) -> dict:
        meta = copy.deepcopy(body.get("metadata") or {})
        resolve_name(NAMESPACES, meta)
        errors = dns_label_errors(meta["name"], "metadata.name")
        if errors:
            raise invalid(NAMESPACES, meta["name"], errors)
        if meta["name"] in self.known_namespaces():
            raise already_exists(NAMESPACES, meta["name"])
        labels = {**(meta.get("labels") or {}), "kubernetes.io/metadata.name": meta["name"]}
        meta.update(uid=new_uid(), resourceVersion=str(self.store.resource_version),
                    creationTimestamp=rfc3339(), labels=labels)
        self._created_namespaces[meta["name"]] = {"kind": "Namespace", "apiVersion": "v1", "metadata": meta,
                                                  "spec": {"finalizers": ["kubernetes"]}}
        return self._namespace_object(meta["name"])

    def _delete_namespace(self, name: str) -> dict:
        obj = self._get_namespace(name)
        by_plural = {rt.plural: rt for rt in RESOURCES.values()}
        for plural, namespace, obj_name in self.store.keys():
            if namespace == name:
                try:
                    self.delete(by_plural[plural], namespace, obj_name, DeleteOptions(propagation="Background"))
                except ApiError:
                    pass
        self._created_namespaces.pop(name, None)
        obj["status"] = {"phase": "Terminating"}
        return obj


# --------------------------------------------------------------------------- helpers


def _sort_key(obj: dict) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"


def _translate(rt: ResourceType, namespace: str | None, selectors: Selectors, event: WatchEvent) -> dict | None:
    """A store event as this watcher sees it (objects entering/leaving its selector)."""
    if event.resource != rt.plural:
        return None
    if namespace and event.obj["metadata"].get("namespace") != namespace:
        return None
    now, before = selectors.matches(event.obj), selectors.matches(event.old)
    if event.type == "ADDED":
        kind = "ADDED" if now else None
    elif event.type == "DELETED":
        kind = "DELETED" if now or before else None
    else:
        kind = {(True, True): "MODIFIED", (True, False): "ADDED", (False, True): "DELETED"}.get((now, before))
    return {"type": kind, "object": copy.deepcopy(event.obj)} if kind else None


def _merge_for_subresource(rt: ResourceType, current: dict, wanted: dict, subresource: str) -> dict:
    if subresource == "status":
        new = copy.deepcopy(current)
        new["status"] = wanted.get("status", current.get("status"))
        return new
    new = copy.deepcopy(wanted)
    new["kind"], new["apiVersion"] = rt.kind, rt.api_version
    if rt.has_status:
        new["status"] = copy.deepcopy(current.get("status"))
        if new["status"] is None:
            new.pop("status")
    return new


def _keep_server_metadata(rt: ResourceType, current: dict, new: dict) -> None:
    meta, old = new.setdefault("metadata", {}), current["metadata"]
    for key in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                "deletionGracePeriodSeconds", "generateName", "generation"):
        if key in old:
            meta[key] = old[key]
        else:
            meta.pop(key, None)
    meta.pop("resourceVersion", None)
    meta["resourceVersion"] = old["resourceVersion"]
    added = set(meta.get("finalizers") or []) - set(old.get("finalizers") or [])
    if old.get("deletionTimestamp") and added:
        raise invalid(rt, old["name"], [FieldError("Forbidden", "metadata.finalizers", None,
                                                   "no new finalizers can be added if the object is "
                                                   "being deleted, found new finalizers " +
                                                   json.dumps(sorted(added)))])
    if rt is JOBS and current.get("spec") != new.get("spec"):
        meta["generation"] = old.get("generation", 1) + 1


def _check_preconditions(rt: ResourceType, current: dict, preconditions: dict | None) -> None:
    meta = current["metadata"]
    for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
        wanted = (preconditions or {}).get(field)
        if wanted and wanted != meta[field]:
            raise conflict(rt, meta["name"], f"Precondition failed: {label} in precondition: {wanted}, "
                                             f"{label} in object meta: {meta[field]}")


def _mark_deleted(obj: dict, finalizer: str | None, grace: int) -> dict:
    meta = obj["metadata"]
    if finalizer and finalizer not in (meta.get("finalizers") or []):
        meta["finalizers"] = (meta.get("finalizers") or []) + [finalizer]
    if not meta.get("deletionTimestamp"):
        meta["deletionTimestamp"] = rfc3339(time.time() + grace)
        meta["deletionGracePeriodSeconds"] = grace
    elif grace < meta.get("deletionGracePeriodSeconds", 0):
        meta["deletionGracePeriodSeconds"] = grace
    return canonical(obj)
