"""The kubernetes backend: pure pieces, then pods on the fake API server (tests/kube).

Pods run as local processes of this machine. Everything is driven through
fibrl's public API and read back with the official client; the fake's test
hooks (injected 429/5xx, forbidden verbs, failing image pulls, unschedulable
pods, eviction) play the cluster's part. Hook-dependent tests are skipped on
a real cluster (KUBE_TEST_KUBECONFIG).
"""
from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import time
import uuid

import pytest
from conftest import require_module, wait_until

import fibrl
from fibrl import backends
from fibrl.backends.base import JobStatus
from fibrl.backends.kubernetes.settings import (KubeSettings, PodIdentity, cpu_quantity,
                                                label_value, memory_quantity, pod_image,
                                                pod_name)
from fibrl.config import Config
from fibrl.errors import BackendError, BackendUnavailableError, ConfigError


kubernetes = require_module("kubernetes")

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(300)]

WAIT = 60   # how long a test waits for what must happen (a loaded 2-core machine is slow)
# A worker that starts a worker first imports the kubernetes client (6-9 s of CPU on an idle
# 2-core machine, several times that under load), then waits for its own worker to connect.
NESTED_WAIT = 120
RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# --------------------------------------------------------------------------- targets

def report_pod_then_wait(out, go):
    out.put(os.environ.get("FIBRL_POD_NAME"))
    go.get(timeout=WAIT)


def sleep_forever():
    time.sleep(3600)


def exit_with(code):
    raise SystemExit(code)


def exit_with_when(go, code):
    """Exit with ``code`` once ``go`` is set (its pod stays up until the test read it)."""
    go.wait(60)
    raise SystemExit(code)


def start_grandchild(out, go):
    child = fibrl.Process(target=report_pod_then_wait, args=(out, go), daemon=True)
    child.start()
    out.put(os.environ.get("FIBRL_POD_NAME"))
    child.join(NESTED_WAIT * 2)


@fibrl.meta(cpu=0.25, memory="64m")
def metered(out, go):
    report_pod_then_wait(out, go)


# --------------------------------------------------------------------------- fixtures

@pytest.fixture
def kube_init(kube_settings):
    """``kube_init(**extra)``: a fresh kubernetes backend (own config, own watch) for the test."""
    previous = fibrl.get_context().config
    made = []

    def init(**extra):
        tag = uuid.uuid4().hex[:8]
        labels = ",".join(filter(None, [extra.pop("kubernetes_labels", ""), f"test={tag}"]))
        settings = {**kube_settings, "kubernetes_labels": labels, **extra}
        fibrl.init(backend="kubernetes", **settings)
        backend = backends.get_backend(fibrl.get_context().config)
        made.append(backend)
        return backend

    yield init
    for backend in made:
        backend.close()
    fibrl.init(**{k: getattr(previous, k) for k in Config.__dataclass_fields__})


@pytest.fixture
def fake(kube_cluster):
    if kube_cluster.fake is None:
        pytest.skip("needs the fake API server's test hooks (not a real cluster)")
    yield kube_cluster.fake
    kube_cluster.fake.reset_hooks()


@pytest.fixture
def core(kube_cluster):
    with kube_cluster.client() as api:
        yield kubernetes.client.CoreV1Api(api)


def _started(target, *args, **kwargs):
    p = fibrl.Process(target=target, args=args, **kwargs)
    p.start()
    return p


def _pod_of(p, core, namespace):
    return core.read_namespaced_pod(p._popen.job.name, namespace, _request_timeout=10)


# --------------------------------------------------------------------------- pure pieces

@pytest.mark.parametrize("name", ["Process-1", "SpawnPoolWorker-3:12", "Ünïcødé name",
                                  "", "x" * 200, "--..--", "FIBRL:worker"])
def test_pod_names_are_rfc1123_labels_and_unique(name):
    names = {pod_name(name) for _ in range(50)}
    assert len(names) == 50
    for made in names:
        assert RFC1123_LABEL.match(made) and len(made) <= 63, made


def test_label_values_are_valid():
    for text in ("Process-1:2", "-a-", "x" * 100, "ok"):
        value = label_value(text)
        assert re.match(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$", value) \
            and len(value) <= 63


@pytest.mark.parametrize("given,expected", [("512m", "512Mi"), ("2g", "2Gi"), ("1.5g", "1536Mi"),
                                            ("64mb", "64Mi"), ("512Mi", "512Mi"), ("1G", "1G"),
                                            ("1000", "1000"), ("100k", "100Ki")])
def test_memory_quantities(given, expected):
    assert memory_quantity(given) == expected


def test_cpu_quantities_and_bad_sizes():
    assert [cpu_quantity(c) for c in (0.5, 1, 2.0, 0.001)] == ["500m", "1", "2", "1m"]
    with pytest.raises(ConfigError, match="millicore"):
        cpu_quantity(0.0001)
    with pytest.raises(ConfigError, match="not a size.*512m"):
        memory_quantity("lots")
    for refused in ("512K", "1KB", "2gi", "1.5.3Mi"):    # real API servers refuse these
        with pytest.raises(ConfigError, match="'K' alone is not one"):
            memory_quantity(refused)


@pytest.mark.parametrize("key,value,match", [
    ("kubernetes_node_selector", "disktype", "name=value"),
    ("kubernetes_tolerations", "[{", "not JSON"),
    ("kubernetes_tolerations", '[{"key": "a", "colour": "red"}]', "unknown toleration field"),
    ("kubernetes_image_pull_secrets", "Bad_Name", "not a valid kubernetes object name"),
    ("kubernetes_labels", "fibrl.run=x", "fibrl's own labels"),
    ("kubernetes_labels", "team=not ok", "label value"),
    ("kubernetes_env", "FIBRL_SECRET=abc", "may not set FIBRL_SECRET"),
    ("kubernetes_namespace", "Not_A_Namespace", "not a valid namespace"),
    ("kubernetes_create_batch", 0, "must be > 0"),
])
def test_bad_kubernetes_config_names_the_key(key, value, match):
    with pytest.raises(ConfigError, match=match) as info:
        KubeSettings.from_config(Config(**{key: value}))
    assert key in str(info.value)


def test_settings_parse_the_documented_formats():
    settings = KubeSettings.from_config(Config(
        kubernetes_node_selector="disktype=ssd, zone=a", kubernetes_labels="team=rl",
        kubernetes_env="OMP_NUM_THREADS=1", kubernetes_image_pull_secrets="regcred, other",
        kubernetes_tolerations='{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}'))
    assert settings.node_selector == {"disktype": "ssd", "zone": "a"}
    assert settings.image_pull_secrets == ("regcred", "other")
    assert settings.tolerations == ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},)
    assert settings.env == {"OMP_NUM_THREADS": "1"} and settings.labels == {"team": "rl"}


def test_pod_identity_from_fibrl_env_and_service_account(tmp_path):
    env = {"FIBRL_POD_NAME": "p", "FIBRL_POD_NAMESPACE": "ns", "FIBRL_POD_UID": "u"}
    assert PodIdentity.detect(env, str(tmp_path)) == PodIdentity("p", "ns", "u", False)
    assert not PodIdentity.detect({}, str(tmp_path)).in_pod
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text("team-a\n")
    found = PodIdentity.detect({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "me"},
                               str(tmp_path))
    assert found == PodIdentity("me", "team-a", "", True)


def test_a_pod_without_the_parents_kubeconfig_uses_its_service_account(tmp_path):
    from fibrl.backends.kubernetes.api import connect

    settings = KubeSettings.from_config(Config(kubernetes_kubeconfig=str(tmp_path / "laptop")))
    with pytest.raises(BackendError, match="does not exist"):
        connect(settings, PodIdentity())
    with pytest.raises(BackendError, match="in-cluster service account"):
        connect(settings, PodIdentity("worker-pod", "ns", "uid", service_account=True))


def test_import_fibrl_and_the_backend_do_not_import_kubernetes():
    import subprocess
    import sys

    code = ("import sys, fibrl, fibrl.backends; fibrl.init(backend='kubernetes'); "
            "fibrl.backends.get_backend(fibrl.get_context().config); "   # built, not connected
            "print('kubernetes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --------------------------------------------------------------------------- pods

def test_worker_pod_spec(kube_init, core, kube_settings):
    kube_init(kubernetes_env="EXTRA_VAR=1", kubernetes_labels="team=rl")
    out, go = fibrl.Queue(), fibrl.Queue()
    p = _started(metered, out, go, name="Trainer:1")
    name = out.get(timeout=WAIT)
    pod = _pod_of(p, core, kube_settings["kubernetes_namespace"])
    assert pod.metadata.name == name and name.startswith("fibrl-trainer-1-")
    labels = pod.metadata.labels
    assert labels["fibrl.run"] == fibrl.popen.run_id() and labels["fibrl.role"] == "process"
    assert labels["fibrl.parent"] == str(os.getpid()) and labels["team"] == "rl"
    assert pod.metadata.annotations["fibrl.process-name"] == "Trainer:1"
    assert pod.spec.restart_policy == "Never" and not pod.metadata.owner_references
    container = pod.spec.containers[0]
    assert container.resources.limits == {"cpu": "250m", "memory": "64Mi"}
    assert container.resources.requests == container.resources.limits
    env = {e.name: e for e in container.env}
    assert env["FIBRL_SECRET"].value is None  # never a literal in the pod spec
    ref = env["FIBRL_SECRET"].value_from.secret_key_ref
    secret = core.read_namespaced_secret(ref.name, pod.metadata.namespace, _request_timeout=10)
    assert base64.b64decode(secret.data[ref.key]).decode() == bytes(p.authkey).hex()
    assert env["EXTRA_VAR"].value == "1"
    assert env["FIBRL_LISTEN_HOST"].value_from.field_ref.field_path == "status.podIP"
    go.put("done")
    p.join(WAIT)
    assert p.exitcode == 0


def test_one_watch_per_run_and_no_polling(kube_init, fake):
    backend = kube_init()
    before_get = fake.count_requests(verb="get", resource="pods")
    procs = [_started(exit_with, 0) for _ in range(6)]
    for p in procs:
        p.join(WAIT)
    assert [p.exitcode for p in procs] == [0] * 6
    stats = backend.stats()
    assert stats["watches"] == 1 and stats["lists"] == 1, stats
    assert fake.count_requests(verb="get", resource="pods") == before_get  # no poll per worker


def test_pods_are_created_in_waves_and_429_halves_the_wave(kube_init, fake):
    backend = kube_init(kubernetes_create_batch=4)
    first = _started(exit_with, 0)          # created inline
    fake.inject_errors(429, count=3, verb="create", resource="pods", retry_after=0)
    procs = [_started(exit_with, 0) for _ in range(12)]
    for p in [first] + procs:
        p.join(WAIT)
    assert [p.exitcode for p in procs] == [0] * 12
    assert fake.count_requests(verb="create", resource="pods", code=429) >= 3
    assert backend.stats()["waves"] >= 3
    assert backend.api.throttled >= 3


def test_api_calls_are_retried_on_5xx(kube_init, fake):
    kube_init()
    fake.inject_errors(503, count=2, verb="create", resource="secrets", retry_after=0)
    fake.inject_errors(500, count=2, verb="create", resource="pods", retry_after=0)
    p = _started(exit_with, 3)
    p.join(WAIT)
    assert p.exitcode == 3


class _Answers:
    """A stand-in for a client call: each call takes the next answer (an exception to
    raise, or a body to return)."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return type("Response", (), {"data": answer, "release_conn": lambda self: None})()


def test_a_403_right_after_the_api_server_was_unreachable_is_retried():
    """A restarted kube-apiserver 1.20 answered 403 to a create for a moment, before its
    authorizer had read the roles; the same 403 long after an outage is final."""
    from fibrl.backends.kubernetes.api import Api, KubeApiError

    nowhere = kubernetes.client.Configuration(host="http://127.0.0.1:9")   # refuses
    api = Api(kubernetes.client.ApiClient(nowhere), retry_for=20)
    forbidden = kubernetes.client.exceptions.ApiException(status=403, reason="Forbidden")
    refused = ConnectionRefusedError(111, "Connection refused")
    fn = _Answers(refused, forbidden, forbidden, b'{"kind": "Pod"}')
    assert api.call("create", "pods", fn, namespace="ns") == {"kind": "Pod"}
    assert fn.calls == 4
    api._unreachable_at -= 60   # the outage is long past: a 403 is an answer
    with pytest.raises(KubeApiError, match="forbidden"):
        api.call("create", "pods", _Answers(forbidden), namespace="ns")


@pytest.mark.parametrize("verb,resource", [("create", "pods"), ("watch", "pods"),
                                           ("create", "secrets")])
def test_forbidden_names_the_missing_permission_and_the_fix(kube_init, fake, verb, resource):
    kube_init()
    fake.forbid(verb, resource)
    p = fibrl.Process(target=exit_with, args=(0,))
    with pytest.raises(BackendError) as info:
        p.start()
    text = str(info.value)
    assert "forbidden" in text and f"{verb} {resource}" in text and "deploy/rbac.yaml" in text


def _unreachable_kubeconfig(tmp_path) -> str:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
              "users": [{"name": "u", "user": {"token": "t"}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    return str(path)


def test_no_cluster_reachable_is_reported_quickly(kube_init, tmp_path):
    path = _unreachable_kubeconfig(tmp_path)
    kube_init(kubernetes_kubeconfig=str(path))
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="no kubernetes cluster reachable at http://127.0.0.1:9"):
        fibrl.Process(target=exit_with, args=(0,)).start()
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("cluster", ["unreachable", "missing"])
def test_pool_without_a_cluster_fails_once_with_the_clear_error(kube_init, tmp_path, caplog,
                                                               monkeypatch, cluster):
    """No cluster: the pool's map raises the backend's error after one try to reach it,
    without first announcing that it goes on with fewer workers."""
    path = _unreachable_kubeconfig(tmp_path) if cluster == "unreachable" else tmp_path / "no"
    backend = kube_init(kubernetes_kubeconfig=str(path))
    tries = []
    connect = backend._connect
    monkeypatch.setattr(backend, "_connect", lambda: tries.append(1) or connect())
    expected = "no kubernetes cluster reachable" if cluster == "unreachable" else "does not exist"
    with caplog.at_level(logging.WARNING, logger="fibrl.pool"):
        with fibrl.Pool(4) as pool:
            with pytest.raises(BackendUnavailableError, match=expected):
                pool.map_async(abs, range(8)).get(timeout=WAIT * 2)
    assert len(tries) == 1
    assert "goes on with the workers it has" not in caplog.text


def test_missing_kubeconfig_says_how_to_fix(kube_init, tmp_path):
    kube_init(kubernetes_kubeconfig=str(tmp_path / "nope"))
    with pytest.raises(BackendError, match="does not exist.*kubeconfig"):
        fibrl.Process(target=exit_with, args=(0,)).start()


def test_image_pull_failure_is_reported_not_waited_on(kube_init, fake, caplog):
    image = "registry.invalid/fibrl/missing:1"
    fake.fail_image_pulls(image)
    kube_init(image=image)
    with caplog.at_level(logging.ERROR, logger="fibrl.backends.kubernetes"):
        p = _started(sleep_forever)
        p.join(WAIT)
    assert p.exitcode == 1
    reason = p._popen.job.failure_reason()
    assert "ImagePullBackOff" in reason and image in reason and "Fix" in reason
    assert any("cannot pull its image" in r.getMessage() for r in caplog.records)
    with pytest.raises(BackendError, match="cannot pull its image"):
        fibrl.Process(target=sleep_forever).start()   # the next one fails at once


def _waiting_pod(reason):
    return {"status": {"phase": "Pending", "containerStatuses": [
        {"name": "worker",
         "state": {"waiting": {"reason": reason, "message": "registry said no"}}}]}}


@pytest.mark.parametrize("reason,stuck,fatal", [
    ("ErrImagePull", True, False),          # retried by the kubelet: bounded by the timer
    ("ImagePullBackOff", False, True),
    ("CreateContainerConfigError", True, False),
    ("ContainerCreating", False, False),    # pulling or creating: waited for
])
def test_waiting_reasons_that_end_or_bound_a_start(reason, stuck, fatal):
    from fibrl.backends.kubernetes.job import fatal_waiting, stuck_pending

    assert bool(stuck_pending(_waiting_pod(reason))) is stuck
    assert bool(fatal_waiting(_waiting_pod(reason))) is fatal
    if stuck:
        assert stuck_pending(_waiting_pod(reason)) == f"{reason}: registry said no"


def test_unschedulable_pod_reports_the_schedulers_reason(kube_init):
    kube_init(kubernetes_node_selector="disktype=nonexistent", kubernetes_pending_timeout=1.5)
    p = _started(sleep_forever)
    wait_until(lambda: "Unschedulable" in p._popen.job.logs(), "the scheduler's reason", WAIT)
    p.join(WAIT)
    assert p.exitcode == 1
    reason = p._popen.job.failure_reason()
    # the scheduler's own words: 1.20 says "didn't match Pod's node affinity", later
    # versions "didn't match Pod's node affinity/selector"
    assert "Unschedulable" in reason \
        and re.search(r"didn.t match Pod.s node affinity", reason), reason
    assert "kubernetes_pending_timeout" in reason


def test_unschedulable_pod_is_reported_not_killed_with_the_default_timeouts(kube_init, caplog):
    """Both timeouts scaled down together from their defaults (start_timeout, which counts
    from the pod's Running phase, is the shorter): the scheduler's reason, not a lost worker."""
    defaults = Config()
    scale = 1.5 / defaults.kubernetes_pending_timeout
    kube_init(kubernetes_node_selector="disktype=nonexistent",
              kubernetes_pending_timeout=defaults.kubernetes_pending_timeout * scale,
              start_timeout=defaults.start_timeout * scale)
    with caplog.at_level(logging.ERROR, logger="fibrl.popen"):
        p = _started(sleep_forever)
        p.join(WAIT)
    assert p.exitcode == 1, p._popen.job.failure_reason()   # -9: killed as "did not connect"
    reason = p._popen.job.failure_reason()
    assert "Unschedulable" in reason and "kubernetes_pending_timeout" in reason
    assert not [r for r in caplog.records if "did not connect back" in r.getMessage()]


def test_a_pod_that_never_runs_ends_after_start_plus_pending_timeout(kube_init, fake,
                                                                     kube_settings):
    """A pull that never ends is no Unschedulable pod and reports no error: the start
    still ends, once start_timeout + kubernetes_pending_timeout pass with no new pull event
    (the pull's one Pulling event bought it one more such period), saying what it saw."""
    fake.pull_images_slowly(pod_image(kube_settings["image"]))
    kube_init(start_timeout=1.0, kubernetes_pending_timeout=1.0)
    begin = time.monotonic()
    p = _started(sleep_forever)
    p.join(WAIT)
    reason = p._popen.job.failure_reason()
    assert p.exitcode == 1, reason
    assert "did not start running within" in reason, reason
    assert "kubernetes_pending_timeout = 2 s with no progress since" in reason, reason
    assert 3.5 < time.monotonic() - begin < 30   # (about 4 s; 17 s seen on a loaded machine)


def _keep_recording(fake, namespace, name, reason, message, until, interval=0.4):
    """Record ``reason`` about pod ``name`` every ``interval`` s until ``until`` is set."""
    def loop():
        while not until.wait(interval):
            try:
                fake.record_pod_event(namespace, name, reason, message)
            except Exception:   # the pod is not there yet, or gone
                pass

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_a_pod_waiting_for_a_new_node_is_waited_for(kube_init, fake, kube_settings):
    """Unschedulable, but the cluster autoscaler keeps saying it adds a node: the pending
    timeout starts over on each new TriggeredScaleUp event instead of failing the pod."""
    namespace = kube_settings["kubernetes_namespace"]
    fake.set_unschedulable(lambda pod: "0/1 nodes are available: 1 Insufficient cpu."
                           if pod["spec"]["containers"][0]["name"] == "worker" else None)
    kube_init(kubernetes_pending_timeout=_PENDING_S, start_timeout=_CONNECT_S)
    _outlasts_the_start_limit(fake, namespace, "TriggeredScaleUp",
                              "pod triggered scale-up: [{pool-b 1->2 (max: 5)}]",
                              release=lambda: fake.set_unschedulable(None))  # the node joined


# start_timeout counts from Running: a worker process on a loaded machine needed more
# than 4 s to connect back. The limit of a pod that never runs is start_timeout +
# kubernetes_pending_timeout: each new event restarts it, and events come every 0.4 s,
# read by a backend that a loaded machine can keep waiting for a second or two.
_CONNECT_S = 10.0
_PENDING_S = 3.0


def _outlasts_the_start_limit(fake, namespace, reason, message, release) -> None:
    """A worker whose pod keeps getting event ``reason`` lives through two start limits
    (start_timeout + kubernetes_pending_timeout each: 9 pending timeouts); after
    ``release()`` it runs and exits cleanly."""
    out, go = fibrl.Queue(), fibrl.Queue()
    p = _started(report_pod_then_wait, out, go)
    done = threading.Event()
    _keep_recording(fake, namespace, p._popen.job.name, reason, message, done)
    try:
        time.sleep(2 * (_CONNECT_S + _PENDING_S) + 1.0)
        assert p._popen.job.status() is not JobStatus.FAILED, p._popen.job.failure_reason()
        release()
        assert out.get(timeout=WAIT)
    finally:
        done.set()
        go.put(1)
    p.join(WAIT)
    assert p.exitcode == 0, p._popen.job.failure_reason()


def test_a_pod_the_autoscaler_will_not_place_says_why(kube_init, fake, kube_settings):
    namespace = kube_settings["kubernetes_namespace"]
    fake.set_unschedulable(lambda pod: "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    kube_init(kubernetes_pending_timeout=1.0)
    p = _started(sleep_forever)
    wait_until(lambda: "Unschedulable" in p._popen.job.logs(), "the scheduler's reason", WAIT)
    fake.record_pod_event(namespace, p._popen.job.name, "NotTriggerScaleUp",
                          "pod didn't trigger scale-up: 2 node(s) didn't match Pod's node "
                          "affinity/selector", kind="Normal")
    p.join(WAIT)
    reason = p._popen.job.failure_reason()
    assert p.exitcode == 1, reason
    assert "Unschedulable" in reason and "the cluster autoscaler adds no node" in reason
    assert "didn't trigger scale-up" in reason


def test_an_image_pull_in_progress_extends_the_start_limit(kube_init, fake, kube_settings):
    """A pull that the kubelet reports (Pulling, then Pulled) outlasts start_timeout +
    kubernetes_pending_timeout; each new pull event restarts that limit."""
    namespace, image = kube_settings["kubernetes_namespace"], pod_image(kube_settings["image"])
    fake.pull_images_slowly(image)
    kube_init(start_timeout=_CONNECT_S, kubernetes_pending_timeout=_PENDING_S)
    _outlasts_the_start_limit(fake, namespace, "Pulling", f'Pulling image "{image}"',
                              release=lambda: fake.allow_image_pulls(image))


def test_listen_ports_are_validated():
    from fibrl.backends.kubernetes.settings import port_range

    assert port_range("30000-30099") == (30000, 30099) and port_range("") is None
    for bad in ("30099-30000", "80", "30000-70000", "a-b", "30000,30001"):
        with pytest.raises(ConfigError, match="kubernetes_listen_ports"):
            port_range(bad)


def test_choose_port_takes_a_free_port_of_the_range_or_says_none_is_left():
    import socket as socket_
    from fibrl.backends.kubernetes.settings import choose_port

    with socket_.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BackendError, match=f"every port of kubernetes_listen_ports={port}"):
            choose_port("127.0.0.1", (port, port))
    with socket_.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert choose_port("127.0.0.1", (port, port)) == port


def test_a_parent_listening_outside_the_port_range_is_refused(kube_init):
    backend = kube_init(kubernetes_listen_ports="31300-31309")
    with pytest.raises(BackendError, match="outside kubernetes_listen_ports=31300-31309"):
        backend._check_port(40000)
    backend._check_port(31305)


LISTEN_PORTS_SCRIPT = """
import sys, fibrl
from fibrl.hosting.runtime import installed_hub

def echo(q):
    q.put("hello")

if __name__ == "__main__":
    fibrl.init(backend="kubernetes", kubernetes_listen_ports=sys.argv[1], **SETTINGS)
    q = fibrl.Queue()                 # the hub listens here, before any worker
    p = fibrl.Process(target=echo, args=(q,))
    p.start()
    print(q.get(timeout=60), installed_hub().address.rsplit(":", 1)[1], flush=True)
    p.join(60)
    sys.exit(p.exitcode)
"""


def test_the_parent_listens_on_a_port_of_kubernetes_listen_ports(kube_settings, tmp_path):
    """A NetworkPolicy admitting only this range lets the workers in: the parent's hub
    listens on a port of it even when a Queue made it listen before the first worker."""
    import subprocess
    import sys

    script = tmp_path / "ports.py"
    script.write_text(LISTEN_PORTS_SCRIPT.replace("**SETTINGS", f"**{kube_settings!r}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIBRL_")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(script), "31200-31299"], capture_output=True,
                         text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    word, port = out.stdout.split()
    assert word == "hello" and 31200 <= int(port) <= 31299


def test_evicted_pod_says_evicted(kube_init, fake, kube_settings):
    kube_init()
    out, go = fibrl.Queue(), fibrl.Queue()
    p = _started(report_pod_then_wait, out, go)
    fake.evict_pod(kube_settings["kubernetes_namespace"], out.get(timeout=WAIT))
    p.join(WAIT)
    assert p.exitcode != 0
    assert p._popen.job.failure_reason().startswith("Evicted")


def test_pod_deleted_by_someone_else_is_a_lost_worker(kube_init, core, kube_settings):
    kube_init()
    out, go = fibrl.Queue(), fibrl.Queue()
    p = _started(report_pod_then_wait, out, go)
    core.delete_namespaced_pod(out.get(timeout=WAIT), kube_settings["kubernetes_namespace"],
                               grace_period_seconds=0, _request_timeout=10)
    p.join(WAIT)
    assert p.exitcode == -9      # grace period 0: SIGKILL
    assert "deleted by someone else" in p._popen.job.failure_reason()


def test_terminate_before_the_pod_exists(kube_init):
    kube_init()
    _started(exit_with, 0).join(WAIT)        # later pods are queued, not created inline
    procs = [_started(sleep_forever) for _ in range(5)]
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(WAIT)
    assert [p.exitcode for p in procs] == [-15] * 5


@pytest.mark.timeout(400)
def test_worker_pods_of_a_pod_carry_an_owner_reference(kube_init, core, kube_settings):
    kube_init()
    namespace = kube_settings["kubernetes_namespace"]
    out, go = fibrl.Queue(), fibrl.Queue()
    p = _started(start_grandchild, out, go)
    names = {out.get(timeout=NESTED_WAIT), out.get(timeout=NESTED_WAIT)}
    child = p._popen.job.name
    (grandchild,) = names - {child}
    refs = core.read_namespaced_pod(grandchild, namespace,
                                    _request_timeout=10).metadata.owner_references
    owner = core.read_namespaced_pod(child, namespace, _request_timeout=10)
    assert [(r.kind, r.name, r.uid) for r in refs] == [("Pod", child, owner.metadata.uid)]
    core.delete_namespaced_pod(child, namespace, _request_timeout=10)   # the parent pod goes ...
    wait_until(lambda: grandchild not in _pod_names(core, namespace),   # ... and its workers go
               f"worker pod {grandchild} to go with its owner pod", WAIT)
    p.join(WAIT)


def _pod_names(core, namespace):
    return {pod.metadata.name for pod in core.list_namespaced_pod(namespace,
                                                                  _request_timeout=10).items}


def test_close_removes_the_runs_pods_and_secret(kube_init, core, kube_settings):
    backend = kube_init()
    namespace = kube_settings["kubernetes_namespace"]
    p = _started(sleep_forever, daemon=True)
    selector = f"fibrl.owner={backend.token}"
    assert core.list_namespaced_secret(namespace, label_selector=selector).items
    backend.close()
    p.join(WAIT)
    assert p.exitcode == -9
    assert p._popen.job.failure_reason() == ""    # its own kill, not "deleted by someone else"
    assert not core.list_namespaced_secret(namespace, label_selector=selector).items
    wait_until(lambda: not core.list_namespaced_pod(namespace, label_selector=selector,
                                                    _request_timeout=10).items,
               "the closed backend's pods to be deleted", WAIT)


def test_close_deletes_its_pods_concurrently(kube_init, fake, kube_settings):
    """At exit every pod is deleted at once (at most kubernetes_create_batch requests in
    flight), not one after another: each delete here takes 0.5 s."""
    backend = kube_init(kubernetes_create_batch=4)
    processes = [_started(sleep_forever, daemon=True) for _ in range(4)]
    names = {f"{kube_settings['kubernetes_namespace']}/{p._popen.job.name}" for p in processes}
    wait_until(lambda: names <= set(fake.running_pods()), "the four pods to run", WAIT)
    delays = fake.slow_requests("delete", "pods", 0.5)
    backend.close()
    for p in processes:
        p.join(WAIT)
    assert [p.exitcode for p in processes] == [-9] * 4
    assert delays.max_in_flight >= 2, "close() deleted its pods one after another"


@pytest.mark.fake_kube
def test_watch_recovers_from_410_and_from_failed_lists(kube_cluster):
    if kube_cluster.fake is None:
        pytest.skip("needs a fake API server with a tiny watch history")
    from tests.kube.fake_apiserver import FakeApiServer
    from fibrl.backends.kubernetes.api import Api, connect
    from fibrl.backends.kubernetes.watch import PodWatcher

    with FakeApiServer(history_limit=3) as server:   # its own: a tiny watch history
        settings = KubeSettings.from_config(Config(kubernetes_kubeconfig=server.write_kubeconfig()))
        api = Api(connect(settings, PodIdentity()))
        events, lists = [], []
        release = threading.Event()

        def on_resync(pods, seq):
            lists.append(len(pods))
            events.extend("LISTED" for _ in pods)
            release.wait(WAIT)     # hold the first list while the history moves on

        with server.api_client() as client:   # a real cluster's resourceVersion is never "0"
            kubernetes.client.CoreV1Api(client).create_namespaced_secret(
                "w", {"metadata": {"name": "first"}}, _request_timeout=10)
        server.inject_errors(503, count=2, verb="list", resource="pods", retry_after=0)
        watcher = PodWatcher(api, "w", "app=x", lambda kind, pod: events.append(kind),
                             on_resync, lambda exc: None, lambda: 0)
        watcher.start()
        try:
            wait_until(lambda: lists, "the first list", WAIT)
            with server.api_client() as client:
                for i in range(10):      # 10 events: the listed resourceVersion is now too old
                    kubernetes.client.CoreV1Api(client).create_namespaced_secret(
                        "w", {"metadata": {"name": f"s{i}"}}, _request_timeout=10)
            release.set()
            assert watcher.ready.wait(WAIT)
            wait_until(lambda: len(lists) >= 2, "a new list (resync) after the 410", WAIT)
            with server.api_client() as client:
                kubernetes.client.CoreV1Api(client).create_namespaced_pod("w", {
                    "metadata": {"name": "p", "labels": {"app": "x"}},
                    "spec": {"containers": [{"name": "c", "image": "i",
                                             "command": ["python", "-c", "pass"]}]}},
                    _request_timeout=10)
            # from the watch, or from a resync when the tiny history overflowed
            wait_until(lambda: events, "an event of the new pod", WAIT)
        finally:
            watcher.stop()
            api.client.close()   # its kept-alive connections to this test's own server


@pytest.mark.fake_kube
def test_oomkilled_pod_is_reported(kube_init):
    """Pods as docker containers of the worker image, with a memory limit python cannot
    start in. Needs its own fake API server: one whose runtime is docker."""
    if os.environ.get("KUBE_TEST_KUBECONFIG") or os.environ.get("FIBRL_TEST_KUBECONFIG"):
        pytest.skip("uses the fake API server's docker runtime")
    from conftest import skip_or_fail, docker_available

    missing = docker_available()
    if missing:
        skip_or_fail(missing, "CI_REQUIRE_DOCKER")
    from tests.kube.fake_apiserver import FakeApiServer

    # pods of the stock image run fibrl:<version>: the node has it, as the local build
    local = os.environ.get("FIBRL_IMAGE", "fibrl:latest")
    with FakeApiServer(runtime="docker",
                       node_images={f"fibrl:{fibrl.__version__}": local}) as server:
        backend = kube_init(kubernetes_kubeconfig=server.write_kubeconfig(), memory="12m")
        p = _started(exit_with, 0)
        p.join(90)
        job = p._popen.job
        ended, reason, logs = p.exitcode, job.failure_reason(), job.logs()
        backend.close()       # while its API server still answers
    assert ended == -9, f"exit code {ended}, reason {reason!r}, logs {logs!r}"
    assert reason == "OOMKilled"


# --------------------------------------------------------------------------- a real cluster's rules

def _namespace(core, **labels):
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"metadata": {"name": name, "labels": labels}}, _request_timeout=10)
    return name


def test_workers_run_in_a_namespace_enforcing_restricted_pod_security(kube_init, core, fake):
    namespace = _namespace(core, **{"pod-security.kubernetes.io/enforce": "restricted"})
    try:
        kube_init(kubernetes_namespace=namespace)
        p = _started(exit_with, 3)
        p.join(WAIT)
        assert p.exitcode == 3, p._popen.job.failure_reason()
    finally:
        core.delete_namespace(namespace, _request_timeout=10)


def test_a_service_mesh_sidecar_does_not_hide_the_workers_exit(kube_init, core, fake):
    """istio injects a container that never exits: the worker's own status ends the job."""
    namespace = _namespace(core, **{"istio-injection": "enabled"})
    try:
        kube_init(kubernetes_namespace=namespace, kubernetes_mesh_annotations="")
        go = fibrl.Event()
        p = _started(exit_with_when, go, 3)
        # read while the worker runs: once it exits, its pod is deleted (under load,
        # before a read after join() got to it)
        pod = wait_until(lambda: _running_pod(core, p._popen.job.name, namespace),
                         "the worker's pod to run")
        assert [c.name for c in pod.status.container_statuses] == ["istio-proxy", "worker"]
        go.set()
        p.join(WAIT)
        assert p.exitcode == 3, p._popen.job.failure_reason()
        kube_init(kubernetes_namespace=namespace)     # default: opted out of the mesh
        q = _started(exit_with, 0)
        q.join(WAIT)
        assert q.exitcode == 0
    finally:
        core.delete_namespace(namespace, _request_timeout=10)


def _running_pod(core, name, namespace):
    from kubernetes.client.exceptions import ApiException

    try:
        pod = core.read_namespaced_pod(name, namespace, _request_timeout=10)
    except ApiException as exc:
        if exc.status == 404:
            return None   # not created yet (pods are created in the background)
        raise
    return pod if pod.status.phase == "Running" and pod.status.container_statuses else None


def test_pod_security_denial_is_not_reported_as_missing_rbac():
    from fibrl.backends.kubernetes.api import api_error

    class Denied:
        status, reason = 403, "Forbidden"
        body = json.dumps({"message": 'pods "w" is forbidden: violates PodSecurity '
                                      '"restricted:latest": runAsNonRoot != true (pod or '
                                      'container "worker" must set securityContext.runAsNonRoot'
                                      '=true)'})
    text = str(api_error(Denied(), "create", "pods", "ns", api=None))
    assert "admission control refused it, not RBAC" in text
    assert "kubernetes_run_as_user" in text and "rbac.yaml" not in text


def test_pull_policy_always_pulls_an_image_the_registry_lacks(kube_init, fake):
    kube_init(kubernetes_image_pull_policy="Always")
    p = _started(exit_with, 0)
    p.join(WAIT)
    assert p.exitcode == 1
    assert "cannot pull its image" in p._popen.job.failure_reason()
    assert "kubernetes_image_pull_policy" in p._popen.job.failure_reason()


def test_a_parent_outside_the_cluster_may_not_listen_on_loopback(kube_init, fake):
    kube_init(kubernetes_allow_loopback=False)
    with pytest.raises(BackendError, match="dial 127.0.0.1 inside its own pod") as info:
        _started(exit_with, 0)
    assert "listen_host" in str(info.value) and "kubernetes_allow_loopback" in str(info.value)


@pytest.mark.timeout(400)
@pytest.mark.fake_kube
def test_workers_start_workers_on_an_ipv6_pod_network(kube_init):
    """Pods get IP ::1; a worker that starts a worker listens on it (tcp://[::1]:port).
    Needs its own fake API server: one whose pods have an IPv6 address."""
    if os.environ.get("KUBE_TEST_KUBECONFIG") or os.environ.get("FIBRL_TEST_KUBECONFIG"):
        pytest.skip("sets the fake API server's pod IP")
    from tests.kube.fake_apiserver import FakeApiServer

    with FakeApiServer(pod_ip="::1") as server:
        backend = kube_init(kubernetes_kubeconfig=server.write_kubeconfig())
        out, go = fibrl.Queue(), fibrl.Queue()
        p = _started(start_grandchild, out, go)
        names = {out.get(timeout=NESTED_WAIT), out.get(timeout=NESTED_WAIT)}
        go.put(None)
        p.join(WAIT)
        backend.close()
    assert len(names) == 2 and p.exitcode == 0


def test_a_job_refused_by_pod_security_is_reported_at_once(kube_cluster, core, fake):
    """The Job is admitted, its pod is not: `fibrl run` reads the Job's FailedCreate event."""
    from fibrl.launch.kubernetes import KubernetesLauncher, job_name

    namespace = _namespace(core, **{"pod-security.kubernetes.io/enforce": "restricted"})
    run = uuid.uuid4().hex[:12]
    try:
        with kube_cluster.client() as api:
            kubernetes.client.BatchV1Api(api).create_namespaced_job(namespace, {
                "metadata": {"name": job_name(run)},
                "spec": {"backoffLimit": 0, "template": {
                    "metadata": {"labels": {"fibrl.run": run, "fibrl.role": "parent"}},
                    "spec": {"restartPolicy": "Never", "containers": [{
                        "name": "main", "image": "python:3.11", "command": ["python"]}]}}}},
                _request_timeout=10)
        launcher = KubernetesLauncher(Config(kubernetes_kubeconfig=kube_cluster.kubeconfig,
                                             kubernetes_namespace=namespace,
                                             kubernetes_pending_timeout=40))
        begin = time.monotonic()
        with pytest.raises(BackendError) as info:
            launcher.wait(run, False, None)
        assert time.monotonic() - begin < 20
        assert "violates PodSecurity" in str(info.value) and "not RBAC" not in str(info.value)
        assert "kubernetes_run_as_user" in str(info.value)
    finally:
        core.delete_namespace(namespace, _request_timeout=10)


def test_a_slow_delete_does_not_hold_up_the_watch(kube_init, fake, kube_settings):
    """The watch deletes a pod that cannot pull its image; while that delete is retried
    (the API server answers 503), another pod's exit still arrives at once."""
    kube_init()
    out, go = fibrl.Queue(), fibrl.Queue()
    ok = _started(report_pod_then_wait, out, go)
    out.get(timeout=WAIT)
    fake.fail_image_pulls(pod_image(kube_settings["image"]))   # from now on, for new pods
    # 40 refusals, each asking for a second's wait: the delete retries for 40 s or more
    fake.inject_errors(503, count=40, verb="delete", resource="pods", retry_after=1)
    try:
        bad = _started(sleep_forever)
        wait_until(lambda: fake.count_requests("delete", "pods", 503),
                   "the first refused delete", WAIT)
        go.put(None)
        code = ok._popen.job.wait(25)
        refused = fake.count_requests("delete", "pods", 503)
    finally:
        fake.reset_hooks()   # the delete goes through on its next try
    assert code == 0, "the worker's exit waited for another pod's delete"
    assert refused < 40, "the delete was no longer being retried when the exit came"
    bad.join(WAIT)
    ok.join(WAIT)


def test_the_watch_waits_as_long_as_the_server_asks(kube_cluster, fake):
    from fibrl.backends.kubernetes.api import Api, connect
    from fibrl.backends.kubernetes.watch import PodWatcher

    settings = KubeSettings.from_config(Config(kubernetes_kubeconfig=kube_cluster.kubeconfig))
    # a namespace of its own: the backend's watchers of other tests' pods neither take
    # the injected error nor add to the count
    space = "retry-after"
    before = fake.count_requests("watch", "pods", namespace=space)
    # 500, not 503 or 429: urllib3 itself retries those when they carry Retry-After
    fake.inject_errors(500, count=1, verb="watch", resource="pods", retry_after=3,
                       namespace=space)
    api = Api(connect(settings, PodIdentity()))
    watcher = PodWatcher(api, space, "app=retry-after", lambda kind, pod: None,
                         lambda pods, seq: None, lambda exc: None, lambda: 0)
    begin = time.monotonic()
    watcher.start()
    try:
        wait_until(lambda: fake.count_requests("watch", "pods", namespace=space) >= before + 2,
                   "the watch after the refused one", WAIT)
        assert fake.count_requests("watch", "pods", 500, namespace=space) == 1
        assert time.monotonic() - begin >= 2.5, "Retry-After: 3 was not honoured"
    finally:
        watcher.stop()
        api.client.close()


def test_stop_while_the_watch_request_is_in_flight_ends_the_watch(kube_cluster, fake):
    # stop() finds no stream to close while the watch request is still unanswered; the
    # stream that comes afterwards must not be read on (until its next event or bookmark,
    # a minute on a quiet run)
    from fibrl.backends.kubernetes.api import Api, connect
    from fibrl.backends.kubernetes.watch import PodWatcher

    settings = KubeSettings.from_config(Config(kubernetes_kubeconfig=kube_cluster.kubeconfig))
    fake.slow_requests("watch", "pods", 2.0)
    api = Api(connect(settings, PodIdentity()))
    watcher = PodWatcher(api, "stop-in-flight", "app=stop-in-flight", lambda kind, pod: None,
                         lambda pods, seq: None, lambda exc: None, lambda: 0)
    watcher.start()
    try:
        wait_until(lambda: watcher.watches >= 1, "the watch request", WAIT)
        watcher.stop()   # (waits up to 5 s for its thread)
        wait_until(lambda: not watcher._thread.is_alive(), "the watch thread's end", 10)
    finally:
        watcher.stop()
        api.client.close()
