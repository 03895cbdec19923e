"""The fake's etcd: objects keyed by (resource, namespace, name), one global
monotonically increasing resourceVersion, and a bounded history of watch
events.

Every write bumps the resourceVersion, stamps it into the stored object,
appends a :class:`WatchEvent` to the history, hands the event to the
``on_event`` callback (the controller queue) and wakes blocked watchers.
Stored objects are never mutated in place: writers get a private copy and
the result replaces the old dict, so events can share the snapshots.
"""
from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

Key = tuple  # (resource plural, namespace or "", name)


@dataclass(frozen=True)
class WatchEvent:
    rv: int
    type: str            # ADDED | MODIFIED | DELETED
    resource: str
    obj: dict            # state after the change (the last state for DELETED)
    old: dict | None     # state before the change


class Expired(Exception):
    """The requested resourceVersion is older than the kept history."""

    def __init__(self, requested: int, oldest: int):
        super().__init__(f"too old resource version: {requested} ({oldest})")
        self.requested, self.oldest = requested, oldest


class Store:
    def __init__(self, history_limit: int = 1000, on_event: Callable[[WatchEvent], None] | None = None):
        self._cond = threading.Condition()
        self._objects: dict[Key, dict] = {}
        self._history: deque[WatchEvent] = deque()
        self._history_limit = history_limit
        # As etcd, which starts at revision 1: a list of an empty cluster says "1", never "0"
        # (a watch from "0" means "from any state, with the current objects first").
        self._compacted_rv = 1     # newest resourceVersion dropped from the history
        self._rv = 1
        self._closed = False
        self._on_event = on_event or (lambda event: None)

    # ------------------------------------------------------------------ reads

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def get(self, key: Key) -> dict | None:
        with self._cond:
            obj = self._objects.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, resource: str, namespace: str | None = None) -> tuple[list[dict], int]:
        """Deep copies of the resource's objects (sorted by namespace/name) and the current rv."""
        with self._cond:
            items = [copy.deepcopy(obj) for (res, ns, _), obj in sorted(self._objects.items())
                     if res == resource and (namespace is None or ns == namespace)]
            return items, self._rv

    def namespaces(self) -> set[str]:
        with self._cond:
            return {ns for (_, ns, _) in self._objects if ns}

    def keys(self, resource: str | None = None) -> list[Key]:
        with self._cond:
            return [key for key in self._objects if resource is None or key[0] == resource]

    # ------------------------------------------------------------------ writes

    def create(self, key: Key, obj: dict) -> dict | None:
        """Store a new object; ``None`` if the key is taken."""
        with self._cond:
            if key in self._objects:
                return None
            return self._commit(key, "ADDED", copy.deepcopy(obj), None)

    def update(self, key: Key, mutate: Callable[[dict], dict | None]) -> dict | None:
        """Apply ``mutate`` to a private copy (it may return a replacement).

        Returns the new state, or ``None`` if the object does not exist. An
        object whose deletion was requested is removed once it has no
        finalizers left and its grace period is over.
        """
        with self._cond:
            old = self._objects.get(key)
            if old is None:
                return None
            new = copy.deepcopy(old)
            new = mutate(new) or new
            if new == old:
                return copy.deepcopy(old)
            if _deletion_complete(new):
                return self._commit(key, "DELETED", new, old)
            return self._commit(key, "MODIFIED", new, old)

    def remove(self, key: Key) -> dict | None:
        with self._cond:
            old = self._objects.get(key)
            if old is None:
                return None
            return self._commit(key, "DELETED", copy.deepcopy(old), old)

    def _commit(self, key: Key, kind: str, new: dict, old: dict | None) -> dict:
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            del self._objects[key]
        else:
            self._objects[key] = new
        event = WatchEvent(self._rv, kind, key[0], new, old)
        self._history.append(event)
        while len(self._history) > self._history_limit:
            self._compacted_rv = self._history.popleft().rv
        self._on_event(event)
        self._cond.notify_all()
        return copy.deepcopy(new)

    # ------------------------------------------------------------------ watch

    def events_after(self, rv: int, deadline: float,
                     cancelled: threading.Event | None = None) -> list[WatchEvent] | None:
        """Events newer than ``rv``, blocking until there are some.

        Returns ``[]`` at the deadline, ``None`` once the store is closed or ``cancelled``
        is set (then :meth:`wake` ends the wait), and raises :class:`Expired` when events
        after ``rv`` were already dropped.
        """
        with self._cond:
            while True:
                if self._closed or (cancelled is not None and cancelled.is_set()):
                    return None
                if rv < self._compacted_rv:
                    raise Expired(rv, self._history[0].rv if self._history else self._rv)
                newer = _tail_after(self._history, rv)
                if newer:
                    return newer
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)

    def wake(self) -> None:
        """Make every :meth:`events_after` waiting now check its ``cancelled`` again."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _tail_after(history: deque, rv: int) -> list[WatchEvent]:
    newer = []
    for event in reversed(history):
        if event.rv <= rv:
            break
        newer.append(event)
    newer.reverse()
    return newer


def _deletion_complete(obj: dict) -> bool:
    meta = obj["metadata"]
    return bool(meta.get("deletionTimestamp")) and not meta.get("finalizers") \
        and not meta.get("deletionGracePeriodSeconds")
