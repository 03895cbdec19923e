"""Shared test machinery: the backend fixture, the leak check, markers.

``ctx`` is the fibrl context of the backend under test. Conformance tests take
``ctx`` and use ``ctx.Process``, ``ctx.Queue``, ``ctx.Pool``... so one suite
runs on every backend. Backends other than ``local`` are skipped only when
their engine is truly absent; CI sets ``CI_REQUIRE_DOCKER=1`` so that a
broken docker set-up fails instead of skipping.

Timings: the default run asserts what happens and in which order, with waits on
events and deadlines that only a hang reaches; where a duration is the behaviour
under test (a timeout honoured, a wake-up that must not wait for a heartbeat), the
bound is far from both the expected time and the wrong one. Checks of how fast
something runs on this machine are marked ``timing`` and run only with
``FIBRL_CHECK_TIMINGS=1`` (on a quiet machine): a loaded one fails them for no fault
of the code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import fcntl
import gc
import importlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

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


# CI (.ci/run) sets both: there, a missing engine, image or optional module is a broken
# set-up, and the tests that need it fail instead of skipping.
REQUIRE_DOCKER = "CI_REQUIRE_DOCKER"
REQUIRE_KUBERNETES = "CI_REQUIRE_KUBERNETES"


def skip_or_fail(reason: str, *required_envs: str) -> None:
    """Skip the calling test (or module) for ``reason``, or fail it where one of
    ``required_envs`` is 1. The one way a test here skips for a missing docker engine,
    kubernetes client or optional module, so that CI cannot turn green by skipping."""
    required = [env for env in required_envs if os.environ.get(env) == "1"]
    if required:
        pytest.fail(f"{required[0]}=1 (this run must have it) but: {reason}",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, *required_envs: str):
    """Import the optional module ``name``, or skip the calling test or module.

    Without ``required_envs``, both CI variables count: a fully provisioned run
    (``.ci/run``) installs every optional module (``pip install -e .[all]``).
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        skip_or_fail(f"{name} is not installed ({exc})",
                     *(required_envs or (REQUIRE_DOCKER, REQUIRE_KUBERNETES)))


# `-m quick`: the API a newcomer uses first, on the local backend: config and
# the top-level names, Process, Queue, Pipe, Pool, the executor, managers, locks,
# shared ctypes, and the quickstart example. Tests marked docker, kubernetes or
# slow are left out. README.md states how long it takes.
QUICK_MODULES = frozenset(f"tests/{path}.py" for path in (
    "unit/test_config", "unit/test_api", "unit/test_layers",
    "conformance/test_process", "conformance/test_queues", "conformance/test_pipe",
    "conformance/test_pool", "conformance/test_futures", "conformance/test_managers",
    "conformance/test_synchronize", "conformance/test_sharedctypes",
    "examples/test_examples",
))
_NOT_QUICK = ("docker", "kubernetes", "slow")

# Pure timing checks (see the module docstring) run only when this is 1. fibrl reads
# every FIBRL_* variable as a config key and refuses unknown ones, so the switch moves
# out of its way here (pytest-xdist's workers inherit the moved copy).
CHECK_TIMINGS = "FIBRL_CHECK_TIMINGS"
_TIMINGS_MOVED = "TESTS_CHECK_TIMINGS"
if CHECK_TIMINGS in os.environ:
    os.environ[_TIMINGS_MOVED] = os.environ.pop(CHECK_TIMINGS)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"timing: a pure timing check (how fast, on this machine); left out "
                   f"unless {CHECK_TIMINGS}=1")


# The conformance suite checks the multiprocessing API's semantics, which a backend
# does not change once a worker runs; what a backend does change is how a worker
# starts, what it can reach, how it ends and what crosses to it. `--matrix=core` (the
# default, what CI runs) runs every conformance test on the local backend and, on docker
# and kubernetes, the tests below, which exercise exactly that; `--matrix=full` runs every
# conformance test on every backend (about 1,250 tests in all, some three hours on two
# cores). tests/faults/ is treated the same way (its tests that take a backend as the
# `ctx` parameter; the docker- and kubernetes-only fault files always run), as are the
# backend-specific suites of tests/unit.
_FAULTS_CORE = {
    "test_pool_faults": ("test_killer_task_fails_alone",
                         "test_worker_dying_half_way_through_a_chunk_loses_nothing",
                         "test_replacement_of_a_killed_worker_runs_the_initializer"),
    "test_manager_faults": ("test_killed_server_fails_pending_and_later_calls",),
    "test_queue_faults": ("test_consumers_killed_at_random_lose_nothing",),
    "test_process_faults": ("test_daemonic_children_end_when_parent_exits",),
    "test_partitions": ("test_partition_shorter_than_parent_timeout_changes_nothing",
                        "test_partition_past_parent_timeout_loses_the_worker_once"),
}
CROSS_BACKEND = {
    "docker": {
        "test_process": "*",
        "test_newcomer": "*",
        "test_large_messages": "*",
        "test_channel": ("test_a_worker_connects_to_a_listener_by_address_and_objects_round_trip",),
        "test_pool": ("test_map_keeps_order", "test_terminate_while_workers_start"),
        "test_futures": ("test_lost_worker_is_recovered_not_broken",),
        **_FAULTS_CORE,
    },
    # the fake API server's pods are local processes: what differs from the local backend
    # is the start and the end of a worker, which test_process covers (CI runs it on the
    # real control plane too)
    "kubernetes": {
        "test_process": "*",
        "test_pool_faults": _FAULTS_CORE["test_pool_faults"][:2],
        "test_partitions": _FAULTS_CORE["test_partitions"][1:],
    },
}


def pytest_addoption(parser):
    parser.addoption("--matrix", choices=("core", "full"), default="core",
                     help="core: on docker and kubernetes, only the conformance and fault "
                          "tests that exercise the backend (tests/conftest.py CROSS_BACKEND); "
                          "full: every one of them on every backend")


def _in_matrix(item, module: str) -> bool:
    """Whether ``item`` runs under ``--matrix=core``."""
    if not module.startswith(("tests/conformance/", "tests/faults/")):
        return True
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("ctx") if callspec is not None else None
    if backend in (None, "local"):
        return True
    kept = CROSS_BACKEND.get(backend, {}).get(Path(module).stem, ())
    return kept == "*" or item.originalname in kept


# Fixtures that hand a test the fake API server (or a launcher on its hooks): a kubernetes
# test that uses one is marked ``fake_kube`` (it skips on a real cluster). CI runs those on
# the fake and every other kubernetes test on the real control plane.
_FAKE_KUBE_FIXTURES = {"fake", "fake_apiserver", "launcher"}


def pytest_collection_modifyitems(config, items):
    """Mark the quick subset (see ``QUICK_MODULES``); leave out the docker and kubernetes
    variants of conformance tests not in ``CROSS_BACKEND`` unless ``--matrix=full``, and
    the tests marked ``timing`` unless ``FIBRL_CHECK_TIMINGS=1``."""
    root = Path(str(config.rootpath))
    core = config.getoption("matrix") == "core"
    timings = os.environ.get(_TIMINGS_MOVED) == "1"
    kept, left_out = [], []
    for item in items:
        if item.get_closest_marker("timing") and not timings:
            left_out.append(item)   # deselected, not skipped: CI counts skips
            continue
        module = Path(str(item.path)).relative_to(root).as_posix()
        if item.get_closest_marker("kubernetes") and _FAKE_KUBE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.fake_kube)
        if module in QUICK_MODULES and not any(item.get_closest_marker(m) for m in _NOT_QUICK):
            item.add_marker(pytest.mark.quick)
        (kept if not core or _in_matrix(item, module) else left_out).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
    # tests that need the machine to themselves run last: under pytest-xdist they wait
    # for the others to finish (see pytest_runtest_protocol), so nothing idles for long
    items.sort(key=lambda item: item.get_closest_marker("alone") is not None)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test in turn: under pytest-xdist, waits until it may run beside the tests
    running now (``alone``), then runs within its time limit (``backstop``). One hook
    (a module keeps one function of a name: a second ``pytest_runtest_protocol`` here
    would replace the first); the outermost wrapper, so the wait is not part of the
    test's timeout."""
    with alone(item), backstop(item):
        yield


@contextlib.contextmanager
def alone(item):
    """Under pytest-xdist, a test marked ``alone`` runs with no other test beside it.

    Every test holds a shared lock on a file of this run while it runs (setup and
    teardown included); an ``alone`` test takes it exclusively. A second file is the
    turnstile that makes it writer-first: an ``alone`` test holds it while it waits, so
    no new test starts meanwhile. Without xdist (one process) there is nothing to wait
    for.
    """
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None:
        yield
        return
    turnstile, room = _run_locks(run)
    exclusive = item.get_closest_marker("alone") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    finally:
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)
        if exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)


# Per-test time limits: pytest-timeout (setup.cfg ``timeout``, sized for ordinary tests;
# ``@pytest.mark.timeout(N)`` on those that need longer) fails a test that runs past its
# limit with the stacks of every thread. It stops the test with SIGALRM, which a thread
# stuck in C code may never see: BACKSTOP_S after the limit, faulthandler writes the
# stacks to stderr and, under pytest-xdist, ends the worker (xdist names the test and
# goes on with a new worker). Without xdist that would end the whole run: it only writes.
BACKSTOP_S = 30


@contextlib.contextmanager
def backstop(item):
    limit = time_limit(item)
    if limit:
        faulthandler.dump_traceback_later(limit + BACKSTOP_S, file=sys.__stderr__,
                                          exit=hasattr(item.config, "workerinput"))
    try:
        yield
    finally:
        if limit:
            faulthandler.cancel_dump_traceback_later()


def time_limit(item) -> float:
    """The test's time limit in seconds: its ``timeout`` marker, else ``--timeout`` or
    setup.cfg's ``timeout`` (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)
    else:
        value = item.config.getoption("timeout", None) or item.config.getini("timeout")
    return float(value or 0)


_locks: dict = {}


def _run_locks(run: str) -> tuple:
    """This process's descriptors of the two lock files of test run ``run``."""
    if run not in _locks:
        base = os.path.join(tempfile.gettempdir(), f"fibrl-tests-{run}")
        _locks[run] = tuple(os.open(f"{base}.{name}", os.O_RDWR | os.O_CREAT, 0o600)
                            for name in ("turnstile", "room"))
    return _locks[run]


def pytest_report_header(config):
    if config.getoption("matrix") == "core":
        return ("conformance matrix: core (docker and kubernetes run the tests in "
                "tests/conftest.py CROSS_BACKEND; --matrix=full runs them all)")
    return "conformance matrix: full"


def pytest_sessionfinish(session, exitstatus):
    """Where ``CI_ALLOWED_SKIPS`` names a file of reasons (CI), fail the run when a test
    was skipped for another reason: a skip there hides a broken set-up."""
    path = os.environ.get("CI_ALLOWED_SKIPS")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if not path or reporter is None:
        return
    allowed = _allowed_skips(path)
    unexpected = [f"{report.nodeid}: {reason}"
                  for report in reporter.stats.get("skipped", [])
                  for reason in [_skip_reason(report)]
                  if not any(pattern.match(reason) for pattern in allowed)]
    if unexpected:
        reporter.write_line("")
        reporter.write_sep("=", "skips not allowed in CI", red=True)
        reporter.write_line(f"CI_ALLOWED_SKIPS: {len(unexpected)} test(s) skipped for a "
                            f"reason not allowed in {path} (fix the set-up, or allow the "
                            f"reason there if the skip is legitimate in CI):", red=True)
        for line in unexpected:
            reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _allowed_skips(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    return [re.compile(line) for line in lines if line and not line.startswith("#")]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.fixture(scope="session")
def docker_engine():
    """The docker SDK client of an engine that has the worker image: the one check that
    docker tests can run (skips, or fails under CI_REQUIRE_DOCKER=1, otherwise)."""
    reason = docker_available()
    if reason:
        skip_or_fail(reason, REQUIRE_DOCKER)
    from fibrl.backends import docker

    return docker.connect()


_MARKS = {"docker": pytest.mark.docker, "kubernetes": pytest.mark.kubernetes}


# Marks on the params (not only applied at run time) so `-m kubernetes` selects them.
@pytest.fixture(params=[pytest.param(b, marks=_MARKS.get(b, ())) for b in BACKENDS])
def ctx(request):
    """The context of one backend; skips docker/kubernetes when their engine is absent."""
    name = request.param
    settings = {"backend": name}
    if name == "docker":
        request.getfixturevalue("docker_engine")
    elif name == "kubernetes":
        settings.update(request.getfixturevalue("kube_settings"))
    previous = fibrl.get_context().config
    fibrl.init(**settings)
    try:
        yield fibrl.get_context()
    finally:
        fibrl.init(**_as_settings(previous))


@pytest.fixture
def configure():
    """``configure(**changes)``: ``fibrl.init`` with ``changes`` on top of the config in
    force (a ``ctx`` fixture's backend included); the config before the test comes back
    afterwards. The one way a test here switches config."""
    previous = fibrl.get_context().config

    def apply(**changes):
        return fibrl.init(**{**_as_settings(fibrl.get_context().config), **changes})

    yield apply
    fibrl.init(**_as_settings(previous))


KUBE_TEST_NAMESPACE = "fibrl-test"
# An admin kubeconfig of a real cluster (tests/kube/control-plane.sh up prints one): the
# kubernetes tests run there, the backend with the token of deploy/rbac.yaml's account.
ADMIN_KUBECONFIG = "FIBRL_TEST_KUBECONFIG"


@dataclasses.dataclass
class KubeCluster:
    """The cluster kubernetes tests run on: the fake API server, or a real one (opt-in)."""

    kubeconfig: str
    namespace: str
    image: str
    listen_host: str
    fake: object = None         # tests.kube.fake_apiserver.FakeApiServer, None on a real cluster
    admin_kubeconfig: str = ""  # what the tests' own checks use ("" : kubeconfig)

    def parent_access(self) -> list:
        """`fibrl run` options by which a launched parent reaches the API server. Pods that
        are processes of this machine (the fake's node, tests/kube/node_agent.py) get no
        service-account token file, so they read this kubeconfig (on a real plane: the
        token of deploy/rbac.yaml's account); pods of a real kubelet use that account."""
        account = ["--service-account", os.environ.get("KUBE_TEST_SERVICE_ACCOUNT", "fibrl")]
        if self.fake is not None:
            return ["--env", f"FIBRL_KUBERNETES_KUBECONFIG={self.kubeconfig}"]
        if self.listen_host in ("127.0.0.1", "::1"):
            return account + ["--env", f"FIBRL_KUBERNETES_KUBECONFIG={self.kubeconfig}"]
        return account

    def client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=self.admin_kubeconfig or self.kubeconfig)


# the fake API server kube_cluster started (session scope): see _held_by_the_process
_SESSION_API_SERVERS: list = []


@pytest.fixture(scope="session")
def kube_cluster():
    """A cluster for kubernetes tests, for the whole session.

    ``KUBE_TEST_KUBECONFIG=/path`` runs them on a real cluster (kind, minikube, cloud;
    see docs/kubernetes.md), with ``KUBE_TEST_NAMESPACE``, ``KUBE_TEST_IMAGE`` and
    ``KUBE_TEST_LISTEN_HOST`` (an address of this machine that pods can reach).
    Otherwise the fake API server of tests/kube runs pods as local processes.
    """
    require_module("kubernetes", REQUIRE_KUBERNETES)
    real = os.environ.get("KUBE_TEST_KUBECONFIG")
    admin = os.environ.get(ADMIN_KUBECONFIG)
    if real or admin:
        namespace = os.environ.get("KUBE_TEST_NAMESPACE",
                                   KUBE_TEST_NAMESPACE if admin else "default")
        if admin:
            _importable_tests_package()
            from tests.kube.real_cluster import service_account_kubeconfig

            real = service_account_kubeconfig(admin, namespace)
        cluster = KubeCluster(real, namespace, os.environ.get("KUBE_TEST_IMAGE", "fibrl:latest"),
                              os.environ.get("KUBE_TEST_LISTEN_HOST", "127.0.0.1"),
                              admin_kubeconfig=admin or "")
        HTTP_POOL_PEERS.update(_api_server_addresses(cluster))
        yield cluster
        _close_kubernetes_backends()
        left = _pods_left(cluster, time.monotonic() + 60, _session_pods())
        assert not left, f"fibrl pods left after the kubernetes tests: {left}"
        return
    _importable_tests_package()
    from tests.kube.fake_apiserver import FakeApiServer

    server = FakeApiServer(runtime="process").start()
    _SESSION_API_SERVERS.append(server)
    cluster = KubeCluster(server.write_kubeconfig(), KUBE_TEST_NAMESPACE, "fibrl:latest",
                          "127.0.0.1", server)
    HTTP_POOL_PEERS.add(f"127.0.0.1:{server.port}")
    try:
        yield cluster
        _close_kubernetes_backends()
        left = _pods_left(cluster, time.monotonic() + 20, "fibrl.backend=kubernetes")
        assert not left, f"fibrl pods left after the kubernetes tests: {left}"
    finally:
        _close_kubernetes_backends()
        server.stop()
        _SESSION_API_SERVERS.remove(server)


def _api_server_addresses(cluster: KubeCluster) -> set:
    """host:port of the API server of a real cluster, as this process's sockets name it
    (the leak check's HTTP_POOL_PEERS)."""
    import socket as socketlib
    from urllib.parse import urlsplit

    found = set()
    for kubeconfig in {cluster.kubeconfig, cluster.admin_kubeconfig} - {""}:
        from kubernetes import config

        url = urlsplit(config.new_client_from_config(config_file=kubeconfig).configuration.host)
        port = url.port or (443 if url.scheme == "https" else 80)
        with contextlib.suppress(OSError):
            for info in socketlib.getaddrinfo(url.hostname, port, type=socketlib.SOCK_STREAM):
                found.add(f"{info[4][0]}:{port}")
    return found


@pytest.fixture
def kube_settings(kube_cluster):
    """Config of the kubernetes backend for one test; afterwards no pod of this run is left."""
    settings = {"kubernetes_kubeconfig": kube_cluster.kubeconfig,
                "kubernetes_namespace": kube_cluster.namespace, "image": kube_cluster.image,
                "listen_host": kube_cluster.listen_host}
    if kube_cluster.fake is None:   # workers that start workers need the API from their pod
        settings["kubernetes_service_account"] = os.environ.get("KUBE_TEST_SERVICE_ACCOUNT",
                                                                "fibrl")
    if kube_cluster.fake is not None or kube_cluster.listen_host in ("127.0.0.1", "::1"):
        # pods that are processes of this machine (the fake's node, tests/kube/node_agent.py):
        # loopback reaches the parent
        settings["kubernetes_allow_loopback"] = True
    yield settings
    if kube_cluster.fake is not None:
        kube_cluster.fake.reset_hooks()
    from fibrl.popen import run_id

    left = _pods_left(kube_cluster, time.monotonic() + 20, f"fibrl.run={run_id()}")
    if left:
        pytest.fail(f"worker pods left behind in namespace {kube_cluster.namespace}: {left}")


def _session_pods() -> str:
    """The label selector of the fibrl pods this test session made: every fibrl pod, or
    under pytest-xdist (other sessions share a real cluster) this process's runs."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from fibrl.popen import run_id

        return f"fibrl.backend=kubernetes,fibrl.run={run_id()}"
    return "fibrl.backend=kubernetes"


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


def _close_kubernetes_backends(exclude: set = frozenset()) -> None:
    """Close the kubernetes backends fibrl keeps (one per config), less those of the
    configs in ``exclude``, and forget them: the next use of such a config connects anew.
    A backend holds threads (its creator, pod watch, deadlines) and API connections for
    as long as it is open; each test closes those it made."""
    from fibrl import backends

    for key, backend in list(backends._instances.items()):
        if backend.name == "kubernetes" and key not in exclude:
            backend.close()
            with backends._lock:
                if backends._instances.get(key) is backend:
                    del backends._instances[key]


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


def thaw(pid: int) -> None:
    """SIGCONT ``pid`` (stopped by :func:`freeze`), if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def run_process(ctx, target, *args):
    """``ctx.Process(target=target, args=args)``, started."""
    p = ctx.Process(target=target, args=args)
    p.start()
    return p


def join_all(*procs, timeout: float = 60) -> None:
    """Join each process (``timeout`` s each) and require a clean exit."""
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"


def session_pids(sid: int) -> list:
    """Pids of the processes of session ``sid`` (the program, its fork server, workers)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue   # not a process, or it ended meanwhile
        if name.isdigit() and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(name))
    return pids


def interruptible() -> None:
    """``preexec_fn`` of a program a test interrupts with SIGINT: Ctrl-C's default
    handling, whatever the test runner inherited (a job a non-interactive shell starts
    in the background ignores SIGINT, and a Python started so gets no
    KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


REPO = str(Path(__file__).resolve().parents[1])


def checkout_env(base: Optional[dict] = None, **extra: str) -> dict:
    """``base`` (default: this process's environment) with this checkout first on
    PYTHONPATH, so that a program run in a subprocess imports the fibrl under test from
    any directory, and with ``extra`` set."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def parent_env(ctx, run: str) -> dict:
    """The environment of a parent program run in a subprocess: this worktree's fibrl,
    the backend under test (FIBRL_* settings) and the run id ``run`` its workers carry."""
    config = ctx.config
    keys = ["backend", "image", "listen_host", "kubernetes_kubeconfig", "kubernetes_namespace",
            "kubernetes_allow_loopback"]
    settings = {f"FIBRL_{key.upper()}": str(getattr(config, key)) for key in keys
                if getattr(config, key)}
    return {**os.environ, **settings, "FIBRL_RUN_ID": run,
            "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def workers_of_run(ctx, run: str, request) -> list:
    """The live workers of run ``run`` on the backend under test (processes, containers
    or pods), found by the run id every worker carries."""
    backend = ctx.config.backend
    if backend == "docker":
        from fibrl.backends import docker as dockerbackend

        return dockerbackend.list_containers(run, running_only=True,
                                             client=request.getfixturevalue("docker_engine"))
    if backend == "kubernetes":
        cluster = request.getfixturevalue("kube_cluster")
        return [pod for pod in _pods_left(cluster, 0, f"fibrl.run={run}")
                if pod.endswith(("(Running)", "(Pending)"))]
    return processes_of_run(run)


def processes_of_run(run: str) -> list:
    """Pids of the live local processes that carry run id ``run`` (FIBRL_RUN_ID)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.environ().get("FIBRL_RUN_ID") == run
                    and proc.status() != psutil.STATUS_ZOMBIE):
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


@contextlib.contextmanager
def frozen(process, request):
    """Freeze the running fibrl ``process`` as each backend allows, the way a vanished
    node looks (no socket closes, nothing answers); on leaving, kill it.

    Docker: ``docker pause`` (the cgroup freezer). Local, and kubernetes on the fake
    API server (its pods are local processes): SIGSTOP of the worker's pid. A real
    cluster offers neither: the test skips there.
    """
    popen = process._popen
    if popen.config.backend == "docker":
        container = request.getfixturevalue("docker_engine").containers.get(popen.job.id)
        container.pause()
        try:
            yield
        finally:
            container.unpause()
            process.kill()
        return
    if (popen.config.backend == "kubernetes"
            and request.getfixturevalue("kube_cluster").fake is None):
        pytest.skip("needs the fake API server's pods as local processes (SIGSTOP)")
    pid = process.pid
    freeze(pid)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # reaped as soon as it is killed
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)


class PickleCanary:
    """Unpickling this creates the file at ``path``: a test that must never unpickle
    what an attacker sends checks that the file does not exist."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


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


def echo_once(address: str, secret: bytes, timeout: float, results: list) -> None:
    """Connect a channel to the echo listener at ``address``, send one frame and append
    "ok" to ``results`` when it comes back, else what went wrong (after how long)."""
    from fibrl.wire.transport import Channel

    start = time.monotonic()
    try:
        ch = Channel.connect(address, secret, timeout=timeout)
        ch.send(b"hi")
        results.append("ok" if ch.recv(timeout) == b"hi" else "wrong echo")
        ch.close()
    except Exception as exc:
        results.append(f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {exc}")


def kills_of(pool) -> list:
    """The ids of the workers ``pool``'s supervisor is asked to kill from now on, in
    order (a fault test checks that a stale worker exits by itself, unkilled)."""
    kills: list = []
    supervisor = pool._engine.supervisor
    kill = supervisor.kill
    supervisor.kill = lambda wid: (kills.append(wid), kill(wid))[1]
    return kills


def deliveries_of(result) -> list:
    """The task indexes an async pool result delivers from now on, in order, each once
    per delivery (a result delivered twice shows twice)."""
    seen: list = []
    deliver = result.sink_deliver

    def spy(index, outcomes, *args, **kwargs):
        seen.extend(range(index, index + len(outcomes)))
        return deliver(index, outcomes, *args, **kwargs)

    result.sink_deliver = spy
    return seen


def _quietly(method, *args):
    """``method(*args)`` on a Process that its owner (a pool ending its workers) may
    close at any moment: a closed one has ended, so it counts as not running."""
    try:
        return method(*args)
    except ValueError:
        return False


# --- the leak check -------------------------------------------------------------------
#
# After each test, this process's descriptors (sockets included) and Python threads must be
# exactly those it had before the test, once things settle (up to LEAK_SETTLE_S): a worker's
# sentinel pipe, an nng socket, a reader thread a test leaves behind fails it. The only
# exceptions are the resources below, which exist once per session (or in a pool of a known
# size) and are started by whichever test first needs them; each is named, bounded, and says
# why it outlives a test. Two kinds: objects fibrl keeps for the process (its hubs, fork
# servers, the docker reaper), recognised by what those objects hold while they are live
# (_held_by_the_process), and threads and sockets recognised by name or peer within a
# bound (LONG_LIVED_THREADS, LONG_LIVED_FDS). Each test closes the kubernetes backends it
# made (fibrl keeps one per config). A test that leaves something on purpose says so:
# ``@pytest.mark.leaves(threads=..., fds=..., reason=...)`` (at most that many).

LEAK_SETTLE_S = 10


def _start_nng() -> None:
    """nng makes its poller (an epoll and an eventfd descriptor) with the process's first
    socket and keeps it until exit: made here, at import, it is in every test's count."""
    import pynng

    pynng.Pair1().close()


_start_nng()


@dataclasses.dataclass(frozen=True)
class LongLived:
    """Threads or descriptors that outlive the test that started them, by design."""

    pattern: str    # matched (re.fullmatch) against a thread's name or a descriptor's text
    most: object    # how many of them may be alive at once (an int, or a function giving it)
    why: str

    def bound(self) -> int:
        return self.most() if callable(self.most) else self.most  # type: ignore[operator]

    def matches(self, text: str) -> bool:
        return re.fullmatch(self.pattern, text) is not None


def _held_by_the_process() -> tuple:
    """(descriptors, threads) of the process-wide objects a test may start on first use
    and that stay for the session: this process's hubs (its own, and one per other
    authkey it has talked to a manager with: fibrl.managers.lines), each with its timers'
    thread and its listener (accept and idle-peer threads, its gate's thread, selector,
    wake pair and listening ports, or with TLS the port nng listens on, its handshakes in
    progress: _add_handshakes), each local
    backend's fork server (its request socket and reply pipe; one backend per config),
    the session's fake API server's hang-up watcher (its thread, selector and wake pipe),
    the docker reaper's pipe (one per process), nng's own threads that ran Python
    callbacks and the stdlib multiprocessing heap's arenas. Found on the objects
    themselves, so they count only while they are live."""
    from fibrl import backends
    from fibrl.hosting import runtime

    fds: set = set()
    threads: set = set()
    lines = sys.modules.get("fibrl.managers.lines")
    hubs = [runtime.installed_hub(), *(list(lines._hubs.values()) if lines else [])]
    for hub in hubs:
        threads.add(getattr(getattr(hub, "timers", None), "_thread", None))
        listener = getattr(hub, "_listener", None)
        if listener is None:
            continue
        threads.update(getattr(listener, name, None) for name in ("_thread", "_janitor"))
        gate = getattr(listener, "_gate", None)
        if gate is not None:
            threads.add(gate._thread)
            fds.update(_fileno(obj) for obj in (gate._selector, gate._wake_r, gate._wake_w))
            fds.update(_fileno(port.sock) for port in list(gate._ports))
        else:   # TLS: nng listens on the port itself
            fds.update(_listening_fds(int(listener.address.rsplit(":", 1)[1])))
        _add_handshakes(listener, fds, threads)
    for backend in list(backends._instances.values()):
        server = getattr(backend, "_server", None)
        if server is not None and server.alive:
            fds.update((_fileno(server._requests), server._rep_r))
    for api_server in _SESSION_API_SERVERS:   # its hang-up watcher's selector and wake pipe
        hangups = api_server._http.hangups
        threads.add(hangups._thread)
        fds.update((_fileno(hangups._selector), hangups._wake_r, hangups._wake_w))
    reaper = sys.modules.get("fibrl.backends.docker.reaper")
    if reaper is not None:   # the docker reaper's pipe: it waits for this process to end
        fds.add(reaper._reapers.get(os.getpid()))
    threads.update(thread for thread in threading.enumerate()
                   if isinstance(thread, threading._DummyThread) and _in_nng(thread))
    fds.update(_stdlib_heap_fds())
    return fds - {None, -1}, threads - {None}


def _listening_fds(port: int) -> set:
    """This process's descriptors that listen on TCP ``port``."""
    return {conn.fd for conn in psutil.Process().net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port}


def _add_handshakes(listener, fds: set, threads: set) -> None:
    """Add to ``fds`` and ``threads`` what ``listener`` holds for its handshakes still in
    progress: a peer that proved the secret gets a data socket, a once-port (the gate's
    thread lists it among its ports a moment later) and a thread that waits for its
    token. The listener ends each within its auth_timeout even when the peer never comes
    (a worker killed between its handshake and its data connection: a pool's worker
    whose start returned after terminate()), so they are the listener's, not the test's."""
    for peer in list(getattr(listener, "_opening", {}).values()):
        threads.add(getattr(peer, "thread", None))
        port = getattr(peer, "port", None)
        if port is not None:
            fds.add(_fileno(port.sock))
        # its readiness pipe, if it made one (_watch: asking nng for it would make one)
        pipe = _recv_pipe(peer._sock) if getattr(peer, "_poll", None) else None
        if pipe is None:
            continue
        for name in os.listdir("/proc/self/fd"):   # both of its ends
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}") == pipe:
                    fds.add(int(name))


def _recv_pipe(sock) -> Optional[str]:
    """The ``/proc`` link (``pipe:[N]``) of nng socket ``sock``'s readiness descriptor,
    or None once the socket is closed."""
    try:
        return os.readlink(f"/proc/self/fd/{sock.recv_fd}")
    except Exception:   # pynng.Closed meanwhile, or the descriptor went with it
        return None


def _stdlib_heap_fds() -> set:
    """Descriptors of the stdlib multiprocessing heap's arenas (its file and the mmap's
    copy of it): a stdlib shared ctype made in this process keeps them until exit."""
    heap = sys.modules.get("multiprocessing.heap")
    arenas = getattr(getattr(getattr(heap, "BufferWrapper", None), "_heap", None),
                     "_arenas", [])
    files = set()
    for arena in list(arenas):
        with contextlib.suppress(OSError, AttributeError):
            files.add(os.readlink(f"/proc/self/fd/{arena.fd}"))
    found = set()
    for name in os.listdir("/proc/self/fd") if files else ():
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") in files:
                found.add(int(name))
    return found


def _in_nng(thread) -> bool:
    """Whether ``thread`` (an entry that ``threading`` makes for a thread it did not start)
    is one of nng's own threads, which run pynng's callbacks: nng keeps fixed pools of
    them for the process's life. An ended one counts too (its stale entry stays)."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm") as comm:
            return comm.read().startswith("nng:")
    except OSError:
        return True   # ended: nothing left but the entry


def _fileno(obj) -> Optional[int]:
    try:
        return obj.fileno()
    except (OSError, ValueError):   # closed meanwhile
        return None


def _fork_servers() -> int:
    from fibrl import backends

    return sum(getattr(getattr(b, "_server", None), "alive", False)
               for b in list(backends._instances.values()))


# Addresses of HTTP servers that clients of this session keep pooled connections to (the
# docker engine, the kubernetes API server): the kube_cluster fixture adds the API server's.
HTTP_POOL_PEERS: set = {"/var/run/docker.sock", "/run/docker.sock"}
# What a kept-alive pool may hold: the docker SDK's and the kubernetes client's pools are at
# most fibrl's pool_size (64) per client; the test clients' at most 10.
_HTTP_POOL_MOST = 128

LONG_LIVED_THREADS = (
    LongLived(r"fibrl-janitor", 1, "the process's janitor: started on first use, ends at exit"),
    LongLived(r"fibrl-forkserver", _fork_servers,
              "reads a local fork server's replies: one a fork server (_held_by_the_process)"),
    LongLived(r"fibrl-docker-orphans", 1, "the docker backend's one sweep of a previous run's "
                                          "containers, at its first use"),
    LongLived(r"fake-apiserver-.*|fake-controller-manager|"
              r"Thread-\d+ \(process_request_thread\)", 64,
              "the fake API server of kube_cluster (session scope), its controller thread "
              "and its threads for the clients' kept-alive connections (at most the "
              "clients' pools)"),
)

LONG_LIVED_FDS = (
    LongLived(r"socket .*(local|peer)=({http}) .*", _HTTP_POOL_MOST,
              "kept-alive connections of the docker and kubernetes HTTP clients' pools (and the "
              "fake API server's ends of them)"),
    LongLived(r"socket AF_INET6? SOCK_STREAM listening local=({http}) .*", 1,
              "the fake API server's listener (kube_cluster, session scope)"),
    LongLived(r"/.*/matplotlib/mpl-data/fonts/.*", 16,
              "font files matplotlib keeps open once it has loaded them (its font cache, for "
              "the process's life): the examples plot"),
)


def _describe_fd(fd: int, target: str) -> str:
    """What descriptor ``fd`` (``/proc`` link ``target``) is, for the leak report and the
    long-lived patterns: sockets by family, type and both addresses, anything else by its
    link."""
    import socket as socketlib

    if not target.startswith("socket:"):
        return target
    try:
        sock = socketlib.socket(fileno=os.dup(fd))
    except OSError:
        return target
    with sock:
        kind = f"{sock.family.name} {getattr(sock.type, 'name', sock.type)}"
        local = _address_text(_quiet_call(sock.getsockname))
        peer = _address_text(_quiet_call(sock.getpeername))
        listening = (sock.type == socketlib.SOCK_STREAM
                     and _quiet_call(lambda: sock.getsockopt(socketlib.SOL_SOCKET,
                                                             socketlib.SO_ACCEPTCONN)))
    if listening:
        return f"socket {kind} listening local={local} {target}"
    return f"socket {kind} local={local or '?'} peer={peer or '?'} {target}"


def _quiet_call(fn):
    try:
        return fn()
    except OSError:
        return None


def _address_text(address) -> str:
    if address is None or address in ("", b""):
        return ""
    if isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    if isinstance(address, bytes):
        return address.decode(errors="replace").lstrip("\0")
    return str(address)


@dataclasses.dataclass
class Resources:
    """A snapshot of this process's descriptors and Python threads."""

    fds: dict          # (fd, /proc link) -> description
    threads: dict      # Thread -> its name

    @classmethod
    def now(cls) -> "Resources":
        fds = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:     # the listing's own descriptor, or one closed meanwhile
                continue
            fd = int(name)
            fds[(fd, target)] = _describe_fd(fd, target)
        fds.pop(next((key for key in fds if key[1] == "/proc/self/fd"), None), None)
        return cls(fds, {thread: thread.name for thread in threading.enumerate()})


def leaked(before: Resources, after: Resources, *, held: tuple = (set(), set()),
           thread_rules=LONG_LIVED_THREADS, fd_rules=LONG_LIVED_FDS, allowed_threads: int = 0,
           allowed_fds: int = 0) -> list:
    """What ``after`` holds that ``before`` did not, less what the live process-wide
    objects hold (``held``: descriptors, threads; see ``_held_by_the_process``), the
    long-lived resources of the rules (within their bounds) and ``allowed_threads`` /
    ``allowed_fds`` (a test marked ``leaves``). Each entry reads 'thread NAME' or
    'fd N: DESCRIPTION'."""
    held_fds, held_threads = held
    http = "|".join(re.escape(peer) + r"(:\S*)?" for peer in sorted(HTTP_POOL_PEERS))
    fd_rules = [dataclasses.replace(r, pattern=r.pattern.format(http=http or "(?!)"))
                for r in fd_rules]
    new_threads = [name for thread, name in after.threads.items()
                   if thread not in before.threads and thread not in held_threads]
    new_fds = [(key, text) for key, text in after.fds.items()
               if key not in before.fds and key[0] not in held_fds]
    return (_beyond_rules([f"thread {name}" for name in new_threads], new_threads,
                          list(after.threads.values()), thread_rules, allowed_threads)
            + _beyond_rules([f"fd {key[0]}: {text}" for key, text in new_fds],
                            [text for _, text in new_fds], list(after.fds.values()), fd_rules,
                            allowed_fds))


def _beyond_rules(labels: list, texts: list, everything: list, rules, allowed: int) -> list:
    """The labels of ``texts`` that no rule excuses (a rule excuses what matches it while
    no more than its bound of ``everything`` does), less the first ``allowed`` of them."""
    left = []
    for label, text in zip(labels, texts):
        rule = next((r for r in rules if r.matches(text)), None)
        if rule is None:
            left.append(label)
            continue
        count, bound = sum(rule.matches(other) for other in everything), rule.bound()
        if count > bound:   # (the report says so: a pool that grew, not a lone leak)
            left.append(f"{label} [one of {count} open like it, bound {bound}]")
    return left[allowed:]


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After each test: no child process of this test run is left (waits up to 10 s),
    and within ``LEAK_SETTLE_S`` the process's descriptors (sockets included) and Python
    threads are exactly those of before the test, save the long-lived ones listed above.

    Two views of processes: OS descendants (local workers), and the processes fibrl
    still counts as running (containers and pods are no descendants). A test that
    fails while a worker blocks would otherwise leave that worker to multiprocessing's
    exit handler, which joins it without a timeout: the session would never end.
    """
    # Everything alive now is left out of the collections below (and of the automatic
    # ones during the test): with torch and the kubernetes client loaded, one full
    # collection of the session's objects takes 0.5-3 s, and this runs for every test.
    gc.freeze()
    marker = request.node.get_closest_marker("leaves")
    allowed = dict(marker.kwargs) if marker else {}
    before = Resources.now()
    from fibrl import backends

    cached = set(backends._instances)
    yield
    # pytest drops the test's fixture values only after the last teardown (this one): a
    # manager a fixture shut down would keep its process's sentinel open until then
    request.node.funcargs = {}
    _release_log_records(request.node)
    _no_child_left()
    _close_kubernetes_backends(exclude=cached)
    left: list = []

    def settled():
        gc.collect()   # what a thread ending meanwhile dropped (a Popen holds its sentinel)
        left[:] = leaked(before, Resources.now(), held=_held_by_the_process(),
                         allowed_threads=allowed.get("threads", 0),
                         allowed_fds=allowed.get("fds", 0))
        return not left

    if not _waited(settled, LEAK_SETTLE_S):
        pytest.fail(f"leaked (still there {LEAK_SETTLE_S} s after the test; see "
                    f"tests/conftest.py LONG_LIVED_*): " + "; ".join(map(_with_holders, left)),
                    pytrace=False)


def _release_log_records(item) -> None:
    """Let the log records pytest keeps of the test (for ``caplog``, until after this
    teardown) drop what they refer to: an exception's traceback holds its frames and their
    objects (a worker's Process, its sentinel). Their text is kept."""
    from _pytest.logging import caplog_records_key

    formatter = logging.Formatter()
    for records in item.stash.get(caplog_records_key, {}).values():
        for record in records:
            if record.exc_info:
                record.exc_text = record.exc_text or formatter.formatException(record.exc_info)
                record.exc_info = None
            if record.args:
                record.msg, record.args = record.getMessage(), None


def _with_holders(entry: str) -> str:
    """``entry`` of a leaked pipe, with the other processes that hold it (the other end)."""
    match = re.search(r"pipe:\[\d+\]", entry)
    if match is None:
        return entry
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == match.group():
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            command = f.read().replace(b"\0", b" ")[:80].decode(errors="replace")
                        holders.append(f"{pid} ({command})")
                        break
    return f"{entry} (also held by: {', '.join(holders) or 'no other process'})"


def _waited(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _no_child_left() -> None:
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
