"""HTTP front end: URL routing, authentication, fault injection, the RBAC
simulation and response writing (JSON bodies, chunked watch/log streams).

A request goes: handler thread -> :meth:`Router.handle` -> resolve the
path into a :class:`RequestInfo` (verb, resource, namespace, name,
subresource) -> bearer token check (401) -> injected faults (429/5xx) ->
forbidden rules (403) -> the :class:`Api` verb or the kubelet's logs ->
a :class:`Response` the handler writes.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import selectors
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator
from urllib.parse import parse_qsl, urlsplit

from ._api import Api, DeleteOptions
from ._kubelet import Kubelet
from ._meta import (PODS, RESOURCES, ApiError, ResourceType, bad_request, forbidden, injected,
                    method_not_allowed, route_not_found, unauthorized)
from ._selectors import Selectors
from ._settings import Settings
from ._validation import parse_body

log = logging.getLogger(__name__)


@dataclass
class Response:
    code: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict = field(default_factory=dict)
    stream: Iterator[bytes] | None = None     # chunked when set
    on_hangup: Callable[[], None] | None = None   # a stream's end, when its client hangs up


# What a 1.20 API server negotiates for pods/log (it answers with the plain log text
# whatever was accepted): an Accept header that names none of these gets 406.
_SERVED_MEDIA_TYPES = ("application/json", "application/yaml", "application/vnd.kubernetes.protobuf")


def _check_accept(accept: str) -> None:
    wanted = [part.split(";")[0].strip() for part in accept.split(",") if part.strip()]
    if not wanted or any(w in ("*/*", "application/*") or w in _SERVED_MEDIA_TYPES
                         for w in wanted):
        return
    raise ApiError(406, "NotAcceptable", "only the following media types are accepted: "
                                        + ", ".join(_SERVED_MEDIA_TYPES))


def json_response(code: int, obj, headers: dict | None = None) -> Response:
    return Response(code, json.dumps(obj).encode(), headers=headers or {})


@dataclass(frozen=True)
class RequestInfo:
    verb: str                   # get list watch create update patch delete deletecollection
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str = ""

    @property
    def resource(self) -> str:
        return self.rt.plural + (f"/{self.subresource}" if self.subresource else "")


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    verb: str
    resource: str
    namespace: str | None
    code: int


@dataclass
class Fault:
    code: int
    remaining: int
    verb: str | None
    resource: str | None
    retry_after: int | None
    namespace: str | None = None

    def matches(self, info: RequestInfo) -> bool:
        return (self.verb in (None, info.verb)) and (self.resource in (None, info.resource, info.rt.plural)) \
            and self.namespace in (None, info.namespace)


class Policy:
    """Test hooks that change answers: forbidden (verb, resource) pairs and injected faults."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.forbidden: set[tuple[str, str, str | None]] = set()
        self.faults: list[Fault] = []

    def check(self, info: RequestInfo, user: str) -> None:
        with self._lock:
            fault = next((f for f in self.faults if f.remaining > 0 and f.matches(info)), None)
            if fault:
                fault.remaining -= 1
                self.faults = [f for f in self.faults if f.remaining > 0]
            denied = any(verb == info.verb and resource == info.resource and ns in (None, info.namespace)
                         for verb, resource, ns in self.forbidden)
        if fault:
            raise injected(fault.code, fault.retry_after)
        if denied:
            raise forbidden(user, info.verb, info.rt, info.subresource, info.namespace, info.name)

    def allowed(self, verb: str, resource: str, namespace: str | None) -> bool:
        with self._lock:
            return not any(v == verb and r == resource and ns in (None, namespace) for v, r, ns in self.forbidden)

    def forbid(self, verb: str, resource: str, namespace: str | None) -> None:
        with self._lock:
            self.forbidden.add((verb, resource, namespace))

    def add_fault(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self.forbidden.clear()
            self.faults.clear()


def _flag(query: dict, name: str) -> bool:
    return str(query.get(name, "")).lower() in ("true", "1")


def _int(query: dict, name: str) -> int | None:
    if query.get(name) in (None, ""):
        return None
    try:
        return int(query[name])
    except ValueError:
        raise bad_request(f"invalid value for {name}: {query[name]!r}") from None


_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def resolve(method: str, path: str, query: dict) -> RequestInfo | None:
    """The resource a URL names, as kube-apiserver's RequestInfoResolver does."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return None
    watch = _flag(query, "watch")
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    rt = RESOURCES.get((group, rest[0]))
    if rt is None:
        return None
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else ""
    if method == "GET":
        verb = "get" if name else ("watch" if watch else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS.get(method, method.lower())
    return RequestInfo(verb, rt, namespace, name, subresource)


# --------------------------------------------------------------------------- discovery


def _api_resources(group: str, version: str) -> dict:
    resources = []
    for rt in RESOURCES.values():
        if rt.group != group:
            continue
        resources.append({"name": rt.plural, "singularName": rt.kind.lower(), "namespaced": rt.namespaced,
                          "kind": rt.kind, "verbs": list(rt.verbs), **({"shortNames": list(rt.short_names)}
                                                                         if rt.short_names else {})})
        if rt.has_status:
            resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": True,
                              "kind": rt.kind, "verbs": ["get", "patch", "update"]})
        if rt is PODS:
            resources += [{"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
                           "verbs": ["get"]},
                          {"name": "pods/eviction", "singularName": "", "namespaced": True, "group": "policy",
                           "version": "v1", "kind": "Eviction", "verbs": ["create"]}]
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version, "resources": resources}


def _api_groups() -> dict:
    def group(name: str) -> dict:
        version = {"groupVersion": f"{name}/v1", "version": "v1"}
        return {"name": name, "versions": [version], "preferredVersion": version}
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [group("batch"), group("authorization.k8s.io")]}


ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
VERSION = {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fibrl-fake", "gitCommit": "0" * 40,
           "gitTreeState": "clean", "buildDate": "2025-04-23T00:00:00Z", "goVersion": "go1.24.2",
           "compiler": "gc", "platform": "linux/amd64"}


# --------------------------------------------------------------------------- router


class Router:
    def __init__(self, api: Api, kubelet: Kubelet, settings: Settings, policy: Policy, port: int):
        self.api, self.kubelet, self.settings, self.policy = api, kubelet, settings, policy
        self._port = port
        self.requests: deque[RequestRecord] = deque(maxlen=10000)
        self.stalls = LogStalls()
        self.delays = Delays()

    def handle(self, method: str, target: str, headers, body: bytes) -> Response:
        url = urlsplit(target)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        info = None
        try:
            self._authenticate(headers)
            static = self._static(method, url.path)
            if static is not None:
                return static
            if url.path.rstrip("/") == ACCESS_REVIEWS:
                if method != "POST":
                    raise method_not_allowed(method)
                return self.access_review(body)
            info = resolve(method, url.path, query)
            if info is None:
                raise route_not_found()
            self.policy.check(info, self.settings.user)
            self.delays.hold(info)
            response = self._dispatch(method, info, query, headers, body)
        except ApiError as exc:
            response = json_response(exc.code, exc.status(), exc.headers)
        self.requests.append(RequestRecord(method, url.path, info.verb if info else "",
                                           info.resource if info else "", info.namespace if info else None,
                                           response.code))
        return response

    def _authenticate(self, headers) -> None:
        if self.settings.require_token and headers.get("Authorization") != f"Bearer {self.settings.token}":
            raise unauthorized()

    def _static(self, method: str, path: str) -> Response | None:
        path = path.rstrip("/") or "/"
        if path in ("/healthz", "/readyz", "/livez"):
            return Response(200, b"ok", "text/plain; charset=utf-8")
        if path == "/version":
            return json_response(200, VERSION)
        if path == "/api":
            return json_response(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self._port}"}]})
        if path == "/apis":
            return json_response(200, _api_groups())
        if path == "/api/v1":
            return json_response(200, _api_resources("", "v1"))
        if path == "/apis/batch/v1":
            return json_response(200, _api_resources("batch", "v1"))
        if path == "/apis/authorization.k8s.io/v1":
            return json_response(200, {"kind": "APIResourceList", "apiVersion": "v1",
                                       "groupVersion": "authorization.k8s.io/v1", "resources": [
                                           {"name": "selfsubjectaccessreviews", "singularName": "",
                                            "namespaced": False, "kind": "SelfSubjectAccessReview",
                                            "verbs": ["create"]}]})
        return None

    def _dispatch(self, method: str, info: RequestInfo, query: dict, headers, body: bytes) -> Response:
        if info.subresource == "log":
            _check_accept(headers.get("Accept", ""))
            return self._logs(info, query)
        if info.subresource == "eviction":
            return self._evict(info, body)
        if info.subresource not in ("", "status") or (info.subresource and not info.rt.has_status):
            raise route_not_found()
        if info.rt.namespaced and info.namespace is None and info.verb not in ("list", "watch"):
            raise route_not_found()
        handler = getattr(self, f"_{info.verb}", None)
        if handler is None:
            raise method_not_allowed(method)
        content_type = headers.get("Content-Type") or "application/json"
        return handler(info, query, parse_body(body, content_type) if body else None, content_type)

    # ------------------------------------------------------------------ verbs

    def _get(self, info, query, body, content_type) -> Response:
        return json_response(200, self.api.get(info.rt, info.namespace, info.name))

    def _selectors(self, info, query) -> Selectors:
        return Selectors.parse(info.rt, query.get("labelSelector"), query.get("fieldSelector"))

    def _list(self, info, query, body, content_type) -> Response:
        listing = self.api.list(info.rt, info.namespace, self._selectors(info, query),
                                _int(query, "limit"), query.get("continue"))
        return json_response(200, listing)

    def _watch(self, info, query, body, content_type) -> Response:
        hung_up = threading.Event()
        events = self.api.watch(info.rt, info.namespace, self._selectors(info, query), query.get("resourceVersion"),
                                _int(query, "timeoutSeconds"), _flag(query, "allowWatchBookmarks"),
                                _flag(query, "sendInitialEvents"), cancelled=hung_up)

        def end() -> None:   # as a real API server's watch ends with its client's connection
            hung_up.set()
            self.api.wake_watches()

        return Response(200, stream=(json.dumps(e).encode() + b"\n" for e in events), on_hangup=end)

    def _create(self, info, query, body, content_type) -> Response:
        if info.name:
            raise method_not_allowed("POST")
        if info.rt.namespaced and info.namespace is None:
            raise route_not_found()
        created = self.api.create(info.rt, info.namespace, body, dry_run=bool(query.get("dryRun")))
        return json_response(201, created)

    def _update(self, info, query, body, content_type) -> Response:
        return json_response(200, self.api.replace(info.rt, info.namespace, info.name, body, info.subresource))

    def _patch(self, info, query, body, content_type) -> Response:
        code, obj = self.api.patch(info.rt, info.namespace, info.name, body, content_type, info.subresource,
                                   query.get("fieldManager"))
        return json_response(code, obj)

    def _delete(self, info, query, body, content_type) -> Response:
        code, obj, headers = self.api.delete(info.rt, info.namespace, info.name, DeleteOptions.parse(query, body))
        return json_response(code, obj, headers)

    def _deletecollection(self, info, query, body, content_type) -> Response:
        listing = self.api.delete_collection(info.rt, info.namespace, self._selectors(info, query),
                                             DeleteOptions.parse(query, body))
        return json_response(200, listing)

    # ------------------------------------------------------------------ subresources

    def _logs(self, info: RequestInfo, query: dict) -> Response:
        if info.rt is not PODS or info.verb != "get":
            raise route_not_found()
        buffer = self.kubelet.logs(info.namespace, info.name, query.get("container"), _flag(query, "previous"))
        data = buffer.snapshot()
        tail = _int(query, "tailLines")
        start = _tail_offset(data, tail) if tail is not None else 0
        if query.get("sinceTime"):
            start = max(start, buffer.offset_since(_since_ns(query["sinceTime"])))
        limit = _int(query, "limitBytes")
        stamps = buffer if _flag(query, "timestamps") else None
        if not _flag(query, "follow"):
            body = _stamped(stamps, start, data[start:]) if stamps else data[start:]
            return Response(200, body[:limit] if limit else body, "text/plain")
        stall = self.stalls.take()
        return Response(200, content_type="text/plain",
                        stream=_follow(buffer, start, limit, stamps, stall))

    def _evict(self, info: RequestInfo, body: bytes) -> Response:
        if info.rt is not PODS or info.verb != "create":
            raise route_not_found()
        eviction = parse_body(body) or {}
        self.api.delete(PODS, info.namespace, info.name, DeleteOptions.parse({}, eviction.get("deleteOptions")))
        return json_response(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                   "code": 201})

    def access_review(self, body: bytes) -> Response:
        review = parse_body(body) or {}
        attrs = (review.get("spec") or {}).get("resourceAttributes") or {}
        resource = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
        allowed = self.policy.allowed(attrs.get("verb", ""), resource, attrs.get("namespace"))
        return json_response(201, {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                                   "metadata": {"creationTimestamp": None}, "spec": review.get("spec") or {},
                                   "status": {"allowed": allowed}})


def _tail_offset(data: bytes, lines: int) -> int:
    if lines <= 0:
        return len(data)
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        end = data.rfind(b"\n", 0, end)
        if end < 0:
            return 0
    return end + 1


def _since_ns(text: str) -> int:
    """A ``sinceTime`` query value (RFC 3339, seconds or finer) in ns since the epoch."""
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$", text)
    if not match:
        raise bad_request(f'parsing time "{text}" as RFC 3339: cannot parse')
    zone = "+00:00" if match.group(3) == "Z" else match.group(3)
    seconds = int(dt.datetime.fromisoformat(match.group(1) + zone).timestamp())
    return seconds * 10 ** 9 + int((match.group(2) or "0").ljust(9, "0"))


def _nano_stamp(ns: int) -> bytes:
    """RFC3339Nano, as the kubelet prefixes lines with ``timestamps=true``."""
    seconds, nanos = divmod(ns, 10 ** 9)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    fraction = f"{nanos:09d}".rstrip("0")
    return f"{text}{'.' + fraction if fraction else ''}Z ".encode()


def _stamped(buffer, offset: int, data: bytes) -> bytes:
    """``data`` (which starts at line start ``offset``) with each line's timestamp in front."""
    out, position = bytearray(), 0
    while position < len(data):
        end = data.find(b"\n", position)
        end = len(data) if end < 0 else end + 1
        out += _nano_stamp(buffer.line_stamp(offset + position)) + data[position:end]
        position = end
    return bytes(out)


class Delays:
    """Requests held for a while before they are answered (a slow API server, an admission
    webhook taking its time), counting how many of them were in flight at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[tuple[str, str, float]] = []
        self.in_flight = self.max_in_flight = 0

    def add(self, verb: str, resource: str, seconds: float) -> None:
        with self._lock:
            self._rules.append((verb, resource, seconds))
            self.max_in_flight = 0

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def hold(self, info: "RequestInfo") -> None:
        with self._lock:
            seconds = next((s for verb, resource, s in self._rules
                            if verb == info.verb and resource == info.resource), None)
            if seconds is None:
                return
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(seconds)
        finally:
            with self._lock:
                self.in_flight -= 1


class LogStalls:
    """Followed log streams that go silent after some lines without closing (a stream a
    proxy or a NAT dropped without telling either end)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[int] = deque()
        self.released = threading.Event()

    def add(self, count: int, after_lines: int) -> None:
        with self._lock:
            self.released.clear()
            self._pending.extend([after_lines] * count)

    def take(self) -> "tuple[int, threading.Event] | None":
        with self._lock:
            return (self._pending.popleft(), self.released) if self._pending else None

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()
        self.released.set()


def _follow(buffer, offset: int, limit: int | None, stamps=None,
            stall: "tuple[int, threading.Event] | None" = None) -> Iterator[bytes]:
    sent = lines = 0
    while True:
        chunk, ended = buffer.read_from(offset)
        if ended:
            return
        if stamps is not None or stall is not None:   # whole lines only
            cut = chunk.rfind(b"\n") + 1
            if not cut:
                if not buffer.read_from(offset + len(chunk))[1]:
                    time.sleep(0.01)
                    continue
                cut = len(chunk)
            chunk = chunk[:cut]
            if stall is not None:
                keep = chunk.split(b"\n")[: max(stall[0] - lines, 0)]
                if len(keep) < chunk.count(b"\n"):
                    chunk = b"".join(line + b"\n" for line in keep)
                    if chunk:
                        yield _stamped(stamps, offset, chunk) if stamps is not None else chunk
                    stall[1].wait()   # silent, never closed: the client must notice
                    return
                lines += chunk.count(b"\n")
        start, offset = offset, offset + len(chunk)
        if stamps is not None:
            chunk = _stamped(stamps, start, chunk)
        if limit:
            chunk = chunk[: limit - sent]
        sent += len(chunk)
        if chunk:
            yield chunk
        if limit and sent >= limit:
            return


# --------------------------------------------------------------------------- server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "HttpServer"

    def do_GET(self) -> None:
        self._serve()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self._write(self.server.router.handle(self.command, self.path, self.headers, body))

    def _start(self, response: Response) -> None:
        self.send_response(response.code)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Audit-Id", str(uuid.uuid4()))
        for key, value in response.headers.items():
            self.send_header(key, value)

    def _write(self, response: Response) -> None:
        self._start(response)
        if response.stream is None:
            self.send_header("Content-Length", str(len(response.body)))
            self.end_headers()
            self.wfile.write(response.body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        if response.on_hangup is not None:
            self.server.hangups.watch(self.connection, response.on_hangup)
        watched = response.on_hangup is not None
        try:
            for chunk in response.stream:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            # Unwatched before the last chunk: once its client has that, it may send its
            # next request on this connection, which is no hang-up.
            watched = False
            if response.on_hangup is not None and self.server.hangups.forget(self.connection):
                self.close_connection = True
            else:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            if watched:
                # (before the connection closes: its descriptor number may be reused)
                self.server.hangups.forget(self.connection)
                self.close_connection = True
            response.stream.close()


class Hangups:
    """Notices the clients that hang up on a stream the server is still sending (a watch
    that waits for events writes nothing, so it would not see its client go until its next
    event or bookmark, a minute later) and calls that stream's ``on_hangup``. One thread
    for the server; a stream's client sends nothing more once the stream began, so its
    connection turning readable means it closed (or broke)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._gone: set = set()   # connections found hung up, until forgotten
        self._thread = threading.Thread(target=self._run, name="fake-apiserver-hangups",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, conn: socket.socket, on_hangup: Callable[[], None]) -> None:
        with self._lock:
            if not self._closed:
                self._selector.register(conn, selectors.EVENT_READ, on_hangup)
        self._wake()

    def forget(self, conn: socket.socket) -> bool:
        """Stop watching ``conn``; True if its client had hung up."""
        with self._lock:
            if self._closed:
                return True
            try:
                self._selector.unregister(conn)
            except (KeyError, ValueError):   # found readable already (ValueError: closed)
                if conn in self._gone:
                    self._gone.discard(conn)
                    return True
                return not isinstance(conn, socket.socket) or conn.fileno() < 0
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(5)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass   # a wake-up is pending anyway

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
            for key, _ in self._selector.select():
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                with self._lock:
                    if self._closed or self._selector.get_map().get(key.fd) is not key:
                        continue   # forgotten meanwhile: its stream ended by itself
                    self._selector.unregister(key.fileobj)
                if _hung_up(key.fileobj):
                    with self._lock:
                        self._gone.add(key.fileobj)
                    key.data()
                # (else it sent more: no longer watched, its stream ends as it would have)


def _hung_up(conn: socket.socket) -> bool:
    """Whether the client of ``conn``, which is readable, closed it (or it broke)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.router: Router | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.hangups = Hangups()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fake-apiserver-http", daemon=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> None:
        self.hangups.start()
        self._thread.start()

    def process_request(self, request, client_address) -> None:
        with self._lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def stop(self) -> None:
        self.shutdown()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.server_close()
        self._thread.join(timeout=5)
        self.hangups.close()
