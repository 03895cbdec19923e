"""A node agent for a real API server: the fake's kubelet on a Node of a real cluster.

Nothing here can run a real kubelet with images, so this agent stands in for one. It
registers a Node, keeps its Lease and Ready condition fresh, watches the pods the real
scheduler binds to it and runs each with :class:`tests.kube._kubelet.Kubelet` (a local
process or a docker container, exactly as the fake API server's node does). The kubelet
code reads and writes pods through :class:`RemoteApi`, which speaks to the API server
it is given: status goes to ``pods/status``, a finished deletion is the kubelet's own
``DELETE`` with grace 0 and the pod's uid as precondition. Container logs are served to
the API server (``kubectl logs``, the backend's log reads) over TLS with client
certificates, as a kubelet serves them.

Run it as ``python -m tests.kube.node_agent --kubeconfig PATH`` or in a test session
with :class:`NodeAgent` (``start()`` / ``stop()``).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import signal
import ssl
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._http import _flag, _follow, _int, _since_ns, _stamped, _tail_offset
from ._kubelet import Kubelet
from ._meta import PODS, ApiError, not_found, rfc3339
from ._runtime import docker_engine_answers
from ._settings import Settings
from ._store import WatchEvent

log = logging.getLogger("fibrl.node-agent")

HEARTBEAT_SECONDS = 10.0      # Lease renewals and Ready condition refreshes
RETRY_SECONDS = 300.0         # how long a status write retries while the API server is away
_TERMINAL = ("Succeeded", "Failed")
_READ = {"pods": "read_namespaced_pod", "secrets": "read_namespaced_secret",
         "configmaps": "read_namespaced_config_map"}


def _micro_time() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def _status(exc: Exception) -> int | None:
    return getattr(exc, "status", None)


class RemoteStore:
    """What the kubelet code asks of the fake's store (``get``, ``update``), on a real API."""

    def __init__(self, core, stopping: threading.Event):
        self.core, self._stopping = core, stopping

    def _retry(self, call):
        """``call()`` again while the API server is away (connection refused, 5xx, 429)."""
        deadline = time.monotonic() + RETRY_SECONDS
        while True:
            try:
                return call()
            except Exception as exc:  # urllib3 errors and ApiException both end here
                status = _status(exc)
                if (status is not None and status < 500 and status != 429) or time.monotonic() > deadline:
                    raise
                log.info("API server not answering (%s); retrying", exc)
                if self._stopping.wait(1.0):
                    raise

    def read(self, plural: str, namespace: str, name: str) -> dict | None:
        read = getattr(self.core, _READ[plural])
        try:
            response = self._retry(lambda: read(name, namespace, _preload_content=False, _request_timeout=10))
        except Exception as exc:
            if _status(exc) == 404:
                return None
            raise
        return json.loads(response.data)

    def get(self, key: tuple) -> dict | None:
        return self.read(*key)

    def update(self, key: tuple, mutate) -> dict | None:
        """Apply ``mutate`` to the pod and write what changed; a conflict reads again."""
        _, namespace, name = key
        while True:
            pod = self.get(key)
            if pod is None:
                return None
            before = copy.deepcopy(pod)
            mutate(pod)
            if pod == before:
                return pod
            try:
                return self._write(namespace, name, before, pod)
            except Exception as exc:
                if _status(exc) == 404:
                    return None
                if _status(exc) != 409:
                    raise

    def _write(self, namespace: str, name: str, before: dict, pod: dict) -> dict:
        meta = pod["metadata"]
        if meta.get("deletionGracePeriodSeconds") == 0 != before["metadata"].get("deletionGracePeriodSeconds"):
            # the fake's way to say "containers gone, remove it": a kubelet's final DELETE
            body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
            self._retry(lambda: self.core.delete_namespaced_pod(name, namespace, body=body, _request_timeout=10))
            return pod
        if pod["status"] != before["status"]:
            response = self._retry(lambda: self.core.replace_namespaced_pod_status(
                name, namespace, body=pod, _preload_content=False, _request_timeout=10))
            return json.loads(response.data)
        return pod


class RemoteApi:
    """The part of the fake's ``Api`` the kubelet code uses, on a real API server."""

    def __init__(self, core, node_name: str, stopping: threading.Event):
        self.core, self.node_name = core, node_name
        self.store = RemoteStore(core, stopping)

    def get(self, rt, namespace: str, name: str) -> dict:
        obj = self.store.read(rt.plural, namespace, name)
        if obj is None:
            raise not_found(rt, name)
        return obj

    def record_event(self, involved: dict, kind: str, reason: str, message: str, component: str,
                     field_path: str | None = None) -> None:
        if component != "kubelet":
            return   # the real scheduler reports its own events
        meta = involved["metadata"]
        ref = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"], "name": meta["name"],
               "uid": meta["uid"], **({"fieldPath": field_path} if field_path else {})}
        now = rfc3339()
        body = {"metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": ref, "reason": reason, "message": message, "type": kind, "count": 1,
                "source": {"component": component, "host": self.node_name},
                "firstTimestamp": now, "lastTimestamp": now}
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _request_timeout=10)
        except Exception as exc:  # an event is best effort, as in a kubelet
            log.debug("event %s for %s not recorded: %s", reason, meta["name"], exc)


class BoundScheduler:
    """The real scheduler binds pods; the kubelet code's scheduling step finds them bound."""

    predicate = None

    def try_bind(self, pod: dict) -> str | None:
        return None

    def release(self, uid: str) -> None:
        pass


class NodeAgent:
    """One Node of a real cluster, its pods run by the fake's kubelet code."""

    def __init__(self, kubeconfig: str, node_name: str = "fibrl-node", runtime: str = "process",
                 tls: tuple[str, str, str] | None = None, settings: Settings | None = None):
        from kubernetes import client, config

        self.api_client = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)
        self.node_name = node_name
        self.settings = settings or Settings(runtime=runtime, node_name=node_name, node_labels={
            "kubernetes.io/hostname": node_name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"})
        self.stopping = threading.Event()
        self._boot_id = str(uuid.uuid4())   # new per agent start, as a kubelet's after a reboot
        self.api = RemoteApi(self.core, node_name, self.stopping)
        api_port = urllib.parse.urlsplit(self.api_client.configuration.host).port or 443
        self.kubelet = Kubelet(self.api, self.settings, api_port, docker_engine_answers)
        self.kubelet.scheduler = BoundScheduler()
        self._logs = LogServer(self.kubelet, tls) if tls else None
        self._threads = [threading.Thread(target=self._watch_pods, name="node-agent watch", daemon=True),
                         threading.Thread(target=self._heartbeat, name="node-agent heartbeat", daemon=True)]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "NodeAgent":
        if self._logs:
            self._logs.start()
        self._register()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop heartbeats and containers (the Node stays, and goes NotReady)."""
        self.stopping.set()
        self.kubelet.stop(timeout)
        for thread in self._threads:
            thread.join(timeout)
        if self._logs:
            self._logs.stop()
        self.api_client.close()

    # ------------------------------------------------------------------ node and lease

    def _node_status(self) -> dict:
        now = rfc3339()
        capacity = dict(self.settings.node_capacity)
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "fibrl node agent is posting ready status",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}
        status = {"capacity": capacity, "allocatable": capacity, "conditions": [ready],
                  "addresses": [{"type": "InternalIP", "address": self.settings.pod_ip},
                                {"type": "Hostname", "address": self.node_name}],
                  "nodeInfo": self._node_info()}
        if self._logs:
            status["daemonEndpoints"] = {"kubeletEndpoint": {"Port": self._logs.port}}
        return status

    def _node_info(self) -> dict:
        # every field: the API's NodeSystemInfo requires them all (the client checks a body)
        uname = platform.uname()
        return {"kubeletVersion": "v1.20.2", "kubeProxyVersion": "v1.20.2", "operatingSystem": "linux",
                "architecture": "amd64", "containerRuntimeVersion": "fibrl-fake://1",
                "kernelVersion": uname.release, "osImage": "fibrl node agent",
                "machineID": self.node_name, "systemUUID": self.node_name, "bootID": self._boot_id}

    def _register(self) -> None:
        body = {"metadata": {"name": self.node_name, "labels": dict(self.settings.node_labels)}}
        try:
            self.core.create_node(body, _request_timeout=10)
        except Exception as exc:
            if _status(exc) != 409:
                raise
        for _ in range(10):   # the node lifecycle controller writes the new Node too
            try:
                return self._post_status(first=True)
            except Exception as exc:
                if _status(exc) != 409:
                    raise
        raise RuntimeError(f"could not post the status of Node {self.node_name}: conflicts")

    def _post_status(self, first: bool = False) -> None:
        node = json.loads(self.core.read_node(self.node_name, _preload_content=False, _request_timeout=10).data)
        old = {c["type"]: c for c in (node.get("status") or {}).get("conditions") or []}
        status = self._node_status()
        ready = status["conditions"][0]
        if not first and old.get("Ready", {}).get("status") == "True":
            ready["lastTransitionTime"] = old["Ready"].get("lastTransitionTime", ready["lastTransitionTime"])
        node["status"] = {**(node.get("status") or {}), **status}
        self.core.replace_node_status(self.node_name, node, _request_timeout=10)

    def _renew_lease(self) -> None:
        body = {"metadata": {"name": self.node_name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.node_name, "leaseDurationSeconds": 40,
                         "renewTime": _micro_time()}}
        try:
            lease = self.coordination.read_namespaced_lease(self.node_name, "kube-node-lease", _request_timeout=10)
        except Exception as exc:
            if _status(exc) != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", body, _request_timeout=10)
            return
        body["metadata"]["resourceVersion"] = lease.metadata.resource_version
        self.coordination.replace_namespaced_lease(self.node_name, "kube-node-lease", body, _request_timeout=10)

    def _heartbeat(self) -> None:
        while not self.stopping.wait(HEARTBEAT_SECONDS):
            try:
                self._renew_lease()
                self._post_status()
            except Exception as exc:  # the API server may be away for a while: try again later
                log.info("heartbeat failed: %s", exc)

    # ------------------------------------------------------------------ pods

    def _watch_pods(self) -> None:
        known: dict[str, dict] = {}
        version = None
        while not self.stopping.is_set():
            try:
                version = version or self._relist(known)
                version = self._watch_once(known, version)
            except Exception as exc:  # API server away, watch closed: list again
                log.info("pod watch ended: %s", exc)
                version = None
                self.stopping.wait(1.0)

    def _selector(self) -> str:
        return f"spec.nodeName={self.node_name}"

    def _relist(self, known: dict[str, dict]) -> str:
        listing = json.loads(self.core.list_pod_for_all_namespaces(
            field_selector=self._selector(), _preload_content=False, _request_timeout=30).data)
        seen = {pod["metadata"]["uid"]: pod for pod in listing.get("items") or []}
        for uid, pod in list(known.items()):
            if uid not in seen:
                self._deliver(known, "DELETED", pod)
        for pod in seen.values():
            self._deliver(known, "MODIFIED", pod)
        return listing["metadata"]["resourceVersion"]

    def _watch_once(self, known: dict[str, dict], version: str) -> str | None:
        response = self.core.list_pod_for_all_namespaces(
            field_selector=self._selector(), watch=True, resource_version=version, timeout_seconds=60,
            allow_watch_bookmarks=True, _preload_content=False, _request_timeout=(10, 90))
        try:
            for line in response:
                if self.stopping.is_set():
                    return version
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    return None     # 410 Gone and friends: list again
                version = obj["metadata"].get("resourceVersion") or version
                if event["type"] != "BOOKMARK":
                    self._deliver(known, event["type"], obj)
        finally:
            response.release_conn()
        return version

    def _deliver(self, known: dict[str, dict], kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            known.pop(uid, None)
        else:
            known[uid] = pod
        running = {w.uid for w in self.kubelet.workers()}
        if kind != "DELETED" and uid not in running:
            if (pod.get("status") or {}).get("phase") in _TERMINAL:
                self._finalize_finished(pod)   # ran before this agent started: nothing to run
                return
            kind = "ADDED"
        self.kubelet.on_event(WatchEvent(0, kind, PODS.plural, pod, None))

    def _finalize_finished(self, pod: dict) -> None:
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            self.api.store.update((PODS.plural, meta["namespace"], meta["name"]),
                                  lambda p: p["metadata"].update(deletionGracePeriodSeconds=0))


class LogServer:
    """The kubelet's ``/containerLogs`` endpoint, for the API server only (client certificates)."""

    def __init__(self, kubelet: Kubelet, tls: tuple[str, str, str]):
        cert, key, ca = tls
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
        handler = type("Handler", (_LogHandler,), {"kubelet": kubelet})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="node-agent logs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _LogHandler(BaseHTTPRequestHandler):
    kubelet: Kubelet
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._send(404, b"not found\n")
        query = dict(urllib.parse.parse_qsl(url.query))
        try:
            buffer = self.kubelet.logs(parts[1], parts[2], parts[3], _flag(query, "previous"))
        except ApiError as exc:
            return self._send(exc.code, exc.message.encode() + b"\n")
        data = buffer.snapshot()
        tail = _int(query, "tailLines")
        start = _tail_offset(data, tail) if tail is not None else 0
        if query.get("sinceTime"):
            start = max(start, buffer.offset_since(_since_ns(query["sinceTime"])))
        limit = _int(query, "limitBytes")
        stamps = buffer if _flag(query, "timestamps") else None
        if not _flag(query, "follow"):
            body = _stamped(stamps, start, data[start:]) if stamps else data[start:]
            return self._send(200, body[:limit] if limit else body)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in _follow(buffer, start, limit, stamps):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-name", default="fibrl-node")
    parser.add_argument("--runtime", choices=("process", "docker", "auto"), default="process")
    parser.add_argument("--tls", nargs=3, metavar=("CERT", "KEY", "CA"),
                        help="serve container logs to the API server over TLS with these")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    agent = NodeAgent(args.kubeconfig, args.node_name, args.runtime, tuple(args.tls) if args.tls else None)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    agent.start()
    log.info("node %s registered", args.node_name)
    done.wait()
    agent.stop()


if __name__ == "__main__":
    main()
