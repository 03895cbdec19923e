"""Shared test machinery: the backend fixture, the leak check, markers.

``ctx`` is the fibrl context of the backend under test. Conformance tests take
``ctx`` and use ``ctx.Process``, ``ctx.Queue``, ``ctx.Pool``... so one suite
runs on every backend. Backends other than ``local`` are skipped only when
their engine is truly absent; CI sets ``CI_REQUIRE_DOCKER=1`` so that a
broken docker set-up fails instead of skipping.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

import fibrl

BACKENDS = ["local", "docker", "kubernetes"]


def docker_available() -> str:
    """'' when docker tests can run, else the reason they cannot."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (pip install fibrl[docker])"
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:  # engine absent or unreachable
        return f"no docker engine reachable ({exc})"
    image = os.environ.get("FIBRL_IMAGE", "fibrl:latest")
    try:
        client.images.get(image)
    except Exception:
        return f"the worker image {image} is not built (docker/build-image.sh)"
    return ""


def _skip_or_fail(reason: str, required_env: str) -> None:
    if os.environ.get(required_env) == "1":
        pytest.fail(f"{required_env}=1 but: {reason}")
    pytest.skip(reason)


def require_module(name: str, required_env: str = "CI_REQUIRE_KUBERNETES"):
    """Import ``name``, or skip the calling test module; where ``required_env`` is 1 (CI)
    a missing module fails collection instead, so a broken install cannot pass silently."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get(required_env) == "1":
            pytest.fail(f"{required_env}=1 but {name} cannot be imported: {exc}",
                        pytrace=False)
        pytest.skip(f"{name} is not installed ({exc})", allow_module_level=True)


_MARKS = {"docker": pytest.mark.docker, "kubernetes": pytest.mark.kubernetes}


# Marks on the params (not only applied at run time) so `-m kubernetes` selects them.
@pytest.fixture(params=[pytest.param(b, marks=_MARKS.get(b, ())) for b in BACKENDS])
def ctx(request):
    """The context of one backend; skips docker/kubernetes when their engine is absent."""
    name = request.param
    settings = {"backend": name}
    if name == "docker":
        reason = docker_available()
        if reason:
            _skip_or_fail(reason, "CI_REQUIRE_DOCKER")
    elif name == "kubernetes":
        settings.update(request.getfixturevalue("kube_settings"))
    previous = fibrl.get_context().config
    fibrl.init(**settings)
    try:
        yield fibrl.get_context()
    finally:
        fibrl.init(**_as_settings(previous))


KUBE_TEST_NAMESPACE = "fibrl-test"


@dataclasses.dataclass
class KubeCluster:
    """The cluster kubernetes tests run on: the fake API server, or a real one (opt-in)."""

    kubeconfig: str
    namespace: str
    image: str
    listen_host: str
    fake: object = None         # tests.kube.fake_apiserver.FakeApiServer, None on a real cluster

    def client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)


@pytest.fixture(scope="session")
def kube_cluster():
    """A cluster for kubernetes tests, for the whole session.

    ``KUBE_TEST_KUBECONFIG=/path`` runs them on a real cluster (kind, minikube, cloud;
    see docs/kubernetes.md), with ``KUBE_TEST_NAMESPACE``, ``KUBE_TEST_IMAGE`` and
    ``KUBE_TEST_LISTEN_HOST`` (an address of this machine that pods can reach).
    Otherwise the fake API server of tests/kube runs pods as local processes.
    """
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        _skip_or_fail("the kubernetes client is not installed (pip install fibrl[kubernetes])",
                      "CI_REQUIRE_KUBERNETES")
    real = os.environ.get("KUBE_TEST_KUBECONFIG")
    if real:
        cluster = KubeCluster(real, os.environ.get("KUBE_TEST_NAMESPACE", "default"),
                              os.environ.get("KUBE_TEST_IMAGE", "fibrl:latest"),
                              os.environ.get("KUBE_TEST_LISTEN_HOST", "127.0.0.1"))
        yield cluster
        _close_kubernetes_backends()
        left = _pods_left(cluster, time.monotonic() + 60, "fibrl.backend=kubernetes")
        assert not left, f"fibrl pods left after the kubernetes tests: {left}"
        return
    _importable_tests_package()
    from tests.kube.fake_apiserver import FakeApiServer

    server = FakeApiServer(runtime="process").start()
    cluster = KubeCluster(server.write_kubeconfig(), KUBE_TEST_NAMESPACE, "fibrl:latest",
                          "127.0.0.1", server)
    try:
        yield cluster
        _close_kubernetes_backends()
        left = _pods_left(cluster, time.monotonic() + 20, "fibrl.backend=kubernetes")
        assert not left, f"fibrl pods left after the kubernetes tests: {left}"
    finally:
        _close_kubernetes_backends()
        server.stop()


@pytest.fixture
def kube_settings(kube_cluster):
    """Config of the kubernetes backend for one test; afterwards no pod of this run is left."""
    settings = {"kubernetes_kubeconfig": kube_cluster.kubeconfig,
                "kubernetes_namespace": kube_cluster.namespace, "image": kube_cluster.image,
                "listen_host": kube_cluster.listen_host}
    if kube_cluster.fake is None:   # workers that start workers need the API from their pod
        settings["kubernetes_service_account"] = os.environ.get("KUBE_TEST_SERVICE_ACCOUNT",
                                                                "fibrl")
    else:   # the fake's pods are processes of this machine: loopback reaches the parent
        settings["kubernetes_allow_loopback"] = True
    yield settings
    if kube_cluster.fake is not None:
        kube_cluster.fake.reset_hooks()
    from fibrl.popen import run_id

    left = _pods_left(kube_cluster, time.monotonic() + 20, f"fibrl.run={run_id()}")
    if left:
        pytest.fail(f"worker pods left behind in namespace {kube_cluster.namespace}: {left}")


def _pods_left(cluster: KubeCluster, deadline: float, selector: str) -> list:
    """Pods matching ``selector`` in the test namespace still there at ``deadline``."""
    from kubernetes import client

    with cluster.client() as api:
        core = client.CoreV1Api(api)
        while True:
            pods = core.list_namespaced_pod(cluster.namespace, label_selector=selector,
                                            _request_timeout=10).items
            if not pods or time.monotonic() > deadline:
                return [f"{p.metadata.name} ({p.status.phase})" for p in pods]
            time.sleep(0.2)


def _close_kubernetes_backends() -> None:
    from fibrl import backends

    for backend in list(backends._instances.values()):
        if backend.name == "kubernetes":
            backend.close()


def _importable_tests_package() -> None:
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)


def _as_settings(config) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _children() -> list:
    """Descendants of this test process, less the local fork server (it lives as
    long as the test session, like multiprocessing's forkserver)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or "fibrl.backends._zygote" in proc.cmdline():
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(proc)
    return found


def freeze(pid: int, timeout: float = 60) -> None:
    """SIGSTOP ``pid``, as a vanished node looks (no socket closes, nothing answers),
    and wait until every one of its threads has stopped: the signal lands
    asynchronously, and the kernel offers no event for it."""
    os.kill(pid, signal.SIGSTOP)
    proc, deadline = psutil.Process(pid), time.monotonic() + timeout
    while any(psutil.Process(t.id).status() != psutil.STATUS_STOPPED for t in proc.threads()):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


def wait_until(predicate, what: str, timeout: float = 60, interval: float = 0.01):
    """Wait until ``predicate()`` is true; fail naming ``what`` after ``timeout`` seconds.

    For conditions nothing signals (another process's state, a hub's internals).
    Returns the predicate's last (true) value.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _quietly(method, *args):
    """``method(*args)`` on a Process that its owner (a pool ending its workers) may
    close at any moment: a closed one has ended, so it counts as not running."""
    try:
        return method(*args)
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def no_leaks():
    """After each test: no child process of this test run is left (waits up to 10 s).

    Two views: OS descendants (local workers), and the processes fibrl still counts
    as running (containers and pods are no descendants). A test that fails while a
    worker blocks would otherwise leave that worker to multiprocessing's exit
    handler, which joins it without a timeout: the session would never end.
    """
    yield
    deadline = time.monotonic() + 10
    left = _children()
    while left and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.5)
        left = _children()
    running = fibrl.active_children()
    for proc in running:
        _quietly(proc.join, max(0.1, deadline - time.monotonic()))
    running = [proc for proc in running if _quietly(proc.is_alive)]
    for proc in running:
        _quietly(proc.kill)
        _quietly(proc.join, 10)
    for proc in left:
        proc.kill()
    if left or running:
        pytest.fail(f"leaked child processes: {[(p.pid, p.cmdline()) for p in left]}, "
                    f"still running: {running}")
