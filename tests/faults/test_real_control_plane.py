"""What only a real control plane shows: its controllers, its RBAC authorizer, its messages.

These run when the kubernetes tests run on a real cluster (``FIBRL_TEST_KUBECONFIG``,
tests/kube/control-plane.sh in CI) and are skipped on the fake API server, which
implements none of it from the real code. Every wait is a watch or a bounded poll.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import wait_until

import fibrl
from fibrl.config import Config
from fibrl.errors import BackendError

pytestmark = pytest.mark.kubernetes

WAIT = 90.0   # controllers act within seconds; a loaded CI machine gets room


@pytest.fixture
def real(kube_cluster):
    if kube_cluster.fake is not None:
        pytest.skip("needs a real control plane (FIBRL_TEST_KUBECONFIG)")
    return kube_cluster


@pytest.fixture
def admin(real):
    from kubernetes import client

    with real.client() as api:
        yield client.CoreV1Api(api), client.BatchV1Api(api)


def _wait_gone(read, what: str) -> None:
    from kubernetes.client.rest import ApiException

    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            read(_request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(0.2)
    pytest.fail(f"{what} still there after {WAIT:.0f} s")


def test_ttl_controller_removes_a_finished_job_and_its_pod(real, admin):
    core, batch = admin
    name = f"ttl-{time.monotonic_ns() % 10**8}"
    job = {"metadata": {"name": name},
           "spec": {"ttlSecondsAfterFinished": 0, "backoffLimit": 0, "template": {"spec": {
               "restartPolicy": "Never",
               "containers": [{"name": "main", "image": "python:3.11-slim",
                               "command": ["python", "-c", "print('done')"]}]}}}}
    batch.create_namespaced_job(real.namespace, job, _request_timeout=10)
    # the Job controller made the pod, the scheduler bound it, the node agent ran it,
    # the Job controller saw it succeed and the TTL controller deleted the Job
    _wait_gone(lambda **kw: batch.read_namespaced_job(name, real.namespace, **kw), f"Job {name}")
    deadline = time.monotonic() + WAIT
    while core.list_namespaced_pod(real.namespace, label_selector=f"job-name={name}",
                                   _request_timeout=10).items:
        assert time.monotonic() < deadline, f"pods of Job {name} outlived it (garbage collector)"
        time.sleep(0.2)


def test_garbage_collector_deletes_what_an_object_owns(real, admin):
    core, _ = admin
    name = f"owner-{time.monotonic_ns() % 10**8}"
    owner = core.create_namespaced_config_map(real.namespace, {"metadata": {"name": name}},
                                              _request_timeout=10)
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": owner.metadata.uid}
    core.create_namespaced_secret(real.namespace,
                                  {"metadata": {"name": name, "ownerReferences": [ref]},
                                   "stringData": {"k": "v"}}, _request_timeout=10)
    core.delete_namespaced_config_map(name, real.namespace, _request_timeout=10)
    _wait_gone(lambda **kw: core.read_namespaced_secret(name, real.namespace, **kw),
               f"Secret {name}")


def test_the_backends_account_has_only_what_rbac_yaml_grants(real):
    # the backend's kubeconfig holds deploy/rbac.yaml's ServiceAccount token; the real
    # RBAC authorizer refuses what the Roles there do not list
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    from tests.kube.rbac_audit import PROBE_AGENT

    with config.new_client_from_config(config_file=real.kubeconfig) as api:
        api.user_agent = PROBE_AGENT   # rbac_audit.py: not calls of the backend
        core = client.CoreV1Api(api)
        core.list_namespaced_pod(real.namespace, _request_timeout=10)   # granted
        with pytest.raises(ApiException) as denied:
            core.read_namespaced_secret("anything", real.namespace, _request_timeout=10)
        assert denied.value.status == 403
        assert f"system:serviceaccount:{real.namespace}:fibrl" in denied.value.body
        with pytest.raises(ApiException) as denied:
            core.list_node(_request_timeout=10)
        assert denied.value.status == 403


def test_the_node_agents_node_is_ready_with_a_fresh_lease(real):
    from kubernetes import client

    with real.client() as api:
        nodes = client.CoreV1Api(api).list_node(_request_timeout=10).items
        ready = [n.metadata.name for n in nodes
                 if any(c.type == "Ready" and c.status == "True"
                        for c in n.status.conditions or [])]
        assert ready, f"no Ready node among {[n.metadata.name for n in nodes]}"
        lease = client.CoordinationV1Api(api).read_namespaced_lease(ready[0], "kube-node-lease",
                                                                   _request_timeout=10)
        assert lease.spec.holder_identity == ready[0] and lease.spec.renew_time is not None


# -- what the API server refuses, and the API server away ------------------------------

CONTROL_PLANE = Path(__file__).resolve().parents[1] / "kube" / "control-plane.sh"
OUTAGE = 30.0   # seconds the API server is away


def _control(*args: str) -> None:
    """tests/kube/control-plane.sh ARGS (stop-one/crash-one/start-one NAME), on the plane
    `up` made."""
    done = subprocess.run(["bash", str(CONTROL_PLANE), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"control-plane.sh {' '.join(args)}: {done.stderr[-2000:]}"


@pytest.fixture
def backend_init(real, kube_settings):
    """``backend_init(**extra)``: the kubernetes backend on the real plane, for this test."""
    previous = fibrl.get_context().config

    def init(**extra) -> None:
        fibrl.init(backend="kubernetes", **{**kube_settings, **extra})

    yield init
    fibrl.init(**{k: getattr(previous, k) for k in Config.__dataclass_fields__})


def square(x: int) -> int:
    return x * x


def test_a_pod_the_api_server_refuses_is_reported_with_its_message(backend_init):
    """A ServiceAccount that does not exist: the fake API server runs such a pod; the real
    one's ServiceAccount admission refuses it, and the start says so in the server's words."""
    backend_init(kubernetes_service_account="no-such-account")
    proc = fibrl.Process(target=os.getpid)
    begin = time.monotonic()
    with pytest.raises(BackendError) as info:
        proc.start()
    assert time.monotonic() - begin < 30
    assert 'serviceaccount "no-such-account" not found' in str(info.value)


@pytest.mark.alone
# the 30 s outage, the API server's restart and a pod started after it: 45-55 s alone on
# a quiet machine, past the default 60 s limit on a loaded one
@pytest.mark.timeout(180)
def test_workers_keep_working_while_the_api_server_is_away(backend_init):
    """The API server stopped for 30 s mid-run: running workers keep computing (they talk
    to the parent directly), a start made meanwhile waits and then succeeds once it is
    back."""
    backend_init()
    with fibrl.Pool(2) as pool:
        assert pool.map(square, range(8)) == [x * x for x in range(8)]
        _control("stop-one", "kube-apiserver")
        stopped = time.monotonic()
        started: dict = {}

        def start_one() -> None:
            try:
                proc = fibrl.Process(target=os.getpid)
                proc.start()
                proc.join(300)
                started["exitcode"] = proc.exitcode
            except BaseException as exc:   # reported by the test below
                started["error"] = exc

        late = threading.Thread(target=start_one)
        try:
            late.start()
            rounds = 0
            while time.monotonic() - stopped < OUTAGE:
                assert pool.map(square, range(20)) == [x * x for x in range(20)]
                rounds += 1
                time.sleep(1.0)
            assert rounds >= 5
            assert late.is_alive() and not started, f"a start finished without the API: {started}"
        finally:
            _control("start-one", "kube-apiserver")
        late.join(300)
        assert started == {"exitcode": 0}, started
        assert pool.map(square, range(8)) == [x * x for x in range(8)]


# -- the node away ----------------------------------------------------------------------

def report_then_sleep(out) -> None:
    out.put(os.getpid())
    time.sleep(3600)


def _node_ready(core) -> dict:
    """``{node name: (Ready condition status, taint keys)}`` of every node."""
    return {n.metadata.name: (next((c.status for c in n.status.conditions or []
                                    if c.type == "Ready"), None),
                              sorted(t.key for t in n.spec.taints or []))
            for n in core.list_node(_request_timeout=10).items}


@pytest.mark.alone
@pytest.mark.timeout(600)
def test_a_worker_whose_node_goes_away_is_ended_and_a_new_one_waits_for_a_node(
        backend_init, admin):
    """The node agent crashed with its pods' processes (a machine that lost power): nothing
    reports their exit, and the API server shows them Running. The parent hears the worker's
    connection end; after the backend's silent_exit_s (60 s) with no exit reported it deletes
    the pod, and join() returns -9. The controller-manager marks the node NotReady (its 40 s
    grace); a worker started then waits in Pending and runs once the node is back."""
    from fibrl.backends.kubernetes import KubernetesBackend

    core, _ = admin
    backend_init(kubernetes_pending_timeout=600.0)
    out = fibrl.Queue()
    lost = fibrl.Process(target=report_then_sleep, args=(out,))
    lost.start()
    out.get(timeout=WAIT)
    (node,) = _node_ready(core)
    stopped = time.monotonic()
    _control("crash-one", "node-agent")
    try:
        lost.join(KubernetesBackend.silent_exit_s + WAIT)
        ended_after = time.monotonic() - stopped
        assert lost.exitcode == -signal.SIGKILL, f"exit code {lost.exitcode}"
        assert ended_after >= KubernetesBackend.silent_exit_s - 1
        wait_until(lambda: _node_ready(core)[node][0] != "True", f"node {node} NotReady",
                   40 + WAIT, interval=0.5)
        late = fibrl.Process(target=report_then_sleep, args=(out,))
        late.start()
        time.sleep(5)
        assert late.exitcode is None and out.empty(), "a worker ran on a node that is away"
    finally:
        _control("start-one", "node-agent")
    wait_until(lambda: _node_ready(core)[node] == ("True", []), f"node {node} Ready again",
               WAIT, interval=0.5)
    out.get(timeout=WAIT + 60)   # the worker started while the node was away now runs
    late.kill()
    late.join(WAIT)
