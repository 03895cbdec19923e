"""One watch per backend: every state change of its pods, from one stream.

Owns the list+watch loop of the pods a backend created (one label selector),
so status costs one long-lived request per run instead of a poll per worker.
Data flow::

    PodWatcher thread
      list pods (selector)  --> on_resync(pods, seq)    reconcile: missing pods are gone
         |  resourceVersion
         v
      watch from rv (bookmarks, server timeout ~5 min)
         |-- ADDED / MODIFIED --> on_event("MODIFIED", pod) --> KubernetesJob.on_pod
         |-- DELETED          --> on_event("DELETED", pod)  --> KubernetesJob.on_deleted
         |-- BOOKMARK         --> rv only
         |-- stream ends      --> watch again from the last rv
         |-- 410 Gone         --> list again (resync)
         '-- error / no answer --> capped jittered backoff (at least the server's
                                  Retry-After), then list again

A watch that is forbidden (RBAC) or otherwise refused for good ends the loop
through ``on_fatal``. ``ready`` is set once the first watch is established,
so the backend can report a refused watch from ``create_job``.
"""
from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from typing import Any, Callable, Optional

from .api import Api, KubeApiError, api_error, unreachable

__all__ = ["PodWatcher"]

log = logging.getLogger(__name__)

WATCH_SECONDS = 290          # server-side timeout of one watch request
_MAX_BACKOFF = 30.0
_QUIET_WARNING = 30.0        # log a warning only after this long without a watch


class _Gone(Exception):
    """The resourceVersion is too old (410): list again."""


class PodWatcher:
    """Lists and watches the pods matching ``selector`` in ``namespace``."""

    def __init__(self, api: Api, namespace: str, selector: str,
                 on_event: Callable[[str, dict], None],
                 on_resync: Callable[[list, int], None],
                 on_fatal: Callable[[KubeApiError], None],
                 sequence: Callable[[], int]) -> None:
        self.api = api
        self.namespace = namespace
        self.selector = selector
        self.ready = threading.Event()
        self.error: Optional[KubeApiError] = None
        self.lists = self.watches = 0             # requests made, for tests and debugging
        self._on_event, self._on_resync, self._on_fatal = on_event, on_resync, on_fatal
        self._sequence = sequence
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"fibrl-kube-watch-{selector}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()   # (before reading _resp: _watch stores its stream before it
        resp = self._resp  # reads _stop, so one of the two closes a stream opening now)
        if resp is not None:
            _close(resp)
        self._thread.join(5.0)

    # -- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        failures, quiet_since = 0, None
        while not self._stop.is_set():
            try:
                rv = self._list()
                while not self._stop.is_set():
                    rv = self._watch(rv)
                    failures, quiet_since = 0, None
            except _Gone:
                log.debug("watch of %s expired (410); listing again", self.selector)
            except KubeApiError as exc:
                if exc.status not in (0, 429, 500, 502, 503, 504):
                    self._fatal(exc)
                    return
                failures, quiet_since = self._pause(failures, quiet_since, exc)
            except Exception as exc:  # a dropped stream, a decoding error: list again
                failures, quiet_since = self._pause(failures, quiet_since, exc)

    def _pause(self, failures: int, quiet_since: Optional[float], exc: Exception) -> tuple:
        now = time.monotonic()
        quiet_since = quiet_since or now
        level = logging.WARNING if now - quiet_since > _QUIET_WARNING else logging.DEBUG
        delay = min(_MAX_BACKOFF, 0.5 * 2 ** failures) * random.uniform(0.5, 1.0)
        delay = max(delay, min(_MAX_BACKOFF, getattr(exc, "retry_after", 0.0)))
        log.log(level, "watch of pods %s in %s failed (%s); listing again in %.1f s",
                self.selector, self.namespace, exc, delay)
        self._stop.wait(delay)
        return failures + 1, quiet_since

    def _fatal(self, exc: KubeApiError) -> None:
        self.error = exc
        self.ready.set()
        if not self._stop.is_set():
            self._on_fatal(exc)

    def _list(self) -> str:
        seq = self._sequence()
        listing = self.api.call("list", "pods", self.api.core.list_namespaced_pod, self.namespace,
                                namespace=self.namespace, label_selector=self.selector)
        self.lists += 1
        self._on_resync(listing.get("items") or [], seq)
        return (listing.get("metadata") or {}).get("resourceVersion", "")

    def _watch(self, rv: str) -> str:
        resp = self._open(rv)
        self._resp = resp
        self.ready.set()
        try:
            if self._stop.is_set():
                # stop() came while the request was in flight: it found no stream to close,
                # and this one would be read until its next event (minutes on a quiet run)
                return rv
            return self._consume(resp, rv)
        finally:
            self._resp = None
            _close(resp)

    def _open(self, rv: str) -> Any:
        timeout = WATCH_SECONDS + random.randint(0, 20)
        self.watches += 1
        try:
            return self.api.core.list_namespaced_pod(
                self.namespace, label_selector=self.selector, watch=True, resource_version=rv,
                allow_watch_bookmarks=True, timeout_seconds=timeout, _preload_content=False,
                _request_timeout=(10, timeout + 30))
        except self.api.ApiException as exc:
            if exc.status == 410:
                raise _Gone() from exc
            raise api_error(exc, "watch", "pods", self.namespace, self.api) from exc
        except OSError as exc:
            raise unreachable(self.api.host, exc) from exc

    def _consume(self, resp: Any, rv: str) -> str:
        from kubernetes.watch.watch import iter_resp_lines

        for line in iter_resp_lines(resp):
            if self._stop.is_set():
                break
            if not line.strip():
                continue
            event = json.loads(line)
            rv = self._dispatch(event, rv)
        return rv

    def _dispatch(self, event: dict, rv: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise KubeApiError(f"watch of pods failed: {obj.get('code')} {obj.get('message')}",
                               int(obj.get("code") or 0))
        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            try:
                self._on_event(kind, obj)
            except Exception:  # one bad handler must not stop the run's only watch
                log.exception("handling a %s event of pod %s failed", kind,
                              (obj.get("metadata") or {}).get("name"))
        return rv


def _close(resp: Any) -> None:
    # shutdown() wakes a thread blocked reading the socket; close() alone does not.
    sock = getattr(getattr(resp, "connection", None), "sock", None)
    for step in ((lambda: sock.shutdown(socket.SHUT_RDWR)) if sock else None, resp.close,
                 resp.release_conn):
        try:
            if step:
                step()
        except Exception:  # closing a broken stream may fail in many urllib3 ways
            pass
