"""Kubernetes faults: a worker pod deleted mid-map, a parent killed outside and inside the cluster.

On the fake API server pods are local processes of this test run, so the
``no_leaks`` check also proves the workers' processes ended; ``kube_settings``
checks that no pod of the run is left after each test.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from conftest import require_module, wait_until

import fibrl
from fibrl.popen import run_id


kubernetes = require_module("kubernetes")

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(240)]

TIMEOUT = 120
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this fibrl
TERMINAL = ("Succeeded", "Failed")

PARENT = textwrap.dedent("""
    import sys, time
    import fibrl

    def sleep():
        time.sleep(3600)

    if __name__ == "__main__":
        where = {}   # `fibrl run` sets the backend and namespace in the environment
        if len(sys.argv) > 1:
            where = dict(backend="kubernetes", kubernetes_kubeconfig=sys.argv[1],
                         kubernetes_namespace=sys.argv[2], kubernetes_allow_loopback=True)
        fibrl.init(heartbeat_interval=0.5, parent_timeout=3, **where)
        kids = [fibrl.Process(target=sleep, daemon=d) for d in (True, False)]
        for kid in kids:
            kid.start()
        print(" ".join(kid._popen.job.name for kid in kids), flush=True)
        time.sleep(3600)
""")


def slow_square(x):
    time.sleep(0.03)
    return x * x


@pytest.fixture
def core(kube_cluster):
    with kube_cluster.client() as api:
        yield kubernetes.client.CoreV1Api(api)


@pytest.fixture
def kube_ctx(kube_settings):
    previous = fibrl.get_context().config
    fibrl.init(backend="kubernetes", **kube_settings)
    yield fibrl.get_context()
    fibrl.init(**{k: getattr(previous, k) for k in previous.__dataclass_fields__})


def _pods(core, namespace, selector):
    return core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=10).items


def _read_line(proc, timeout):
    """A line of ``proc``'s stdout, or "" after ``timeout`` (its children may hold the pipe)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def _workers(core, namespace, run, phase=None):
    return [p for p in _pods(core, namespace, f"fibrl.run={run}")
            if p.metadata.labels.get("fibrl.role") != "parent"
            and phase in (None, p.status.phase)]


def _fibrl_cli(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIBRL_")}
    return subprocess.run([sys.executable, "-m", "fibrl.cli", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env)


def test_deleting_a_worker_pod_mid_map_loses_nothing(kube_ctx, core, kube_settings):
    namespace = kube_settings["kubernetes_namespace"]
    items = list(range(300))
    with kube_ctx.Pool(2) as pool:
        results = pool.imap(slow_square, items, chunksize=3)
        first = [results.next(TIMEOUT) for _ in range(12)]     # work is under way
        running = wait_until(lambda: [p for p in _pods(core, namespace, f"fibrl.run={run_id()}")
                                      if p.status.phase == "Running"], "running worker pods",
                             TIMEOUT)
        core.delete_namespaced_pod(running[0].metadata.name, namespace, grace_period_seconds=0,
                                   _request_timeout=10)
        rest = [results.next(TIMEOUT) for _ in items[len(first):]]
        assert first + rest == [x * x for x in items]
        assert pool._engine.service.stats["lost"] >= 1, "the deleted pod's worker was not lost"


def test_workers_exit_when_the_parent_outside_the_cluster_is_killed(kube_cluster, core, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    run = uuid.uuid4().hex[:12]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIBRL_")}
    env["FIBRL_RUN_ID"] = run
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    parent = subprocess.Popen([sys.executable, str(script), kube_cluster.kubeconfig,
                               kube_cluster.namespace], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=tmp_path)
    try:
        names = _read_line(parent, TIMEOUT).split()
        assert len(names) == 2, "the parent did not start its two workers"
        wait_until(lambda: all(p.status.phase == "Running"
                          for p in _pods(core, kube_cluster.namespace, f"fibrl.run={run}")),
              "both workers running", TIMEOUT)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        parent.stdout.close()
    wait_until(lambda: all(p.status.phase in TERMINAL
                      for p in _pods(core, kube_cluster.namespace, f"fibrl.run={run}")),
          "the workers to notice their parent is gone", timeout=30)
    stopped = _fibrl_cli("stop", run, "--kubeconfig", kube_cluster.kubeconfig,
                         "-n", kube_cluster.namespace)
    assert {f"pod/{n}" for n in names} <= set(stopped.stdout.split()), stopped.stderr
    assert any(line.startswith("secret/") for line in stopped.stdout.split())
    wait_until(lambda: not _pods(core, kube_cluster.namespace, f"fibrl.run={run}"),
               "pods deleted", TIMEOUT)


def test_killing_the_parent_pod_takes_its_workers(kube_cluster, core):
    options = ["--kubeconfig", kube_cluster.kubeconfig, "-n", kube_cluster.namespace]
    access = kube_cluster.parent_access()
    out = _fibrl_cli("run", *options, "--detach", "--image", kube_cluster.image, *access,
                     "--", "python", "-c", PARENT)
    assert out.returncode == 0, out.stderr
    run = out.stdout.strip()
    namespace = kube_cluster.namespace
    try:
        workers = wait_until(lambda: len(_workers(core, namespace, run, "Running")) == 2
                        and _workers(core, namespace, run), "two running worker pods", TIMEOUT)
        (parent,) = _pods(core, namespace, f"fibrl.run={run},fibrl.role=parent")
        assert {r.uid for w in workers for r in w.metadata.owner_references} \
            == {parent.metadata.uid}
        assert {w.spec.service_account_name for w in workers} == {parent.spec.service_account_name}
        core.delete_namespaced_pod(parent.metadata.name, namespace, grace_period_seconds=0,
                                   _request_timeout=10)
        wait_until(lambda: not _workers(core, namespace, run),
              "the cluster to delete the workers of the deleted parent pod", timeout=30)
        wait_until(lambda: not core.list_namespaced_secret(
            namespace, label_selector=f"fibrl.run={run}", _request_timeout=10).items,
              "the cluster to delete the run's Secret (owned by the parent pod)", timeout=30)
    finally:
        _fibrl_cli("stop", run, *options)
    wait_until(lambda: not _pods(core, namespace, f"fibrl.run={run}"), "no pod of the run left",
               TIMEOUT)
