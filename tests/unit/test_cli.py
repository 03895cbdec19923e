"""The ``fibrl`` command: run / ps / logs / stop on the fake kubernetes API server and on docker.

Each command runs as ``python -m fibrl.cli`` in a subprocess, as a user would
run it. On kubernetes the launched script is a Job whose pod (a local process
under the fake) is the parent: its workers fan out as pods with owner
references to it.
"""
from __future__ import annotations

import concurrent.futures
import io
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from conftest import wait_until
from fibrl.errors import BackendError
from fibrl.launch.build import image_tag

# One `fibrl` command: it imports the kubernetes client (5-9 s of CPU on a 2-core machine),
# and `fibrl run` waits for a parent pod that starts pods of its own; several times that
# when the machine is loaded.
TIMEOUT = 240
pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this fibrl

# Run with ``python -c``: nothing to copy into the image, even on a real cluster.
SCRIPT = textwrap.dedent("""
    import os, sys
    import fibrl

    def square(x):
        return x * x

    if __name__ == "__main__":
        print("parent pod:", os.environ.get("FIBRL_POD_NAME"), flush=True)
        with fibrl.Pool(2) as pool:
            print("squares:", pool.map(square, range(8)), flush=True)
        sys.exit(int(sys.argv[1]))
""")


def fibrl_cli(*args, timeout=TIMEOUT, cwd=None, **extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIBRL_")}
    # this checkout's fibrl, from any cwd (not an installed one)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update(extra_env)
    return subprocess.run([sys.executable, "-m", "fibrl.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def test_usage_errors_say_what_to_do():
    out = fibrl_cli("run", "--backend", "kubernetes")
    assert out.returncode == 1 and "needs the command to run after --" in out.stderr
    out = fibrl_cli("run", "--env", "NOPE", "--", "python", "-c", "pass")
    assert out.returncode == 1 and "--env 'NOPE' is not K=V" in out.stderr
    assert fibrl_cli("run", "--image", "x", "--build", "--", "true").returncode == 2


def test_run_without_a_cluster_suggests_docker_not_itself(tmp_path):
    out = fibrl_cli("run", "--", "python", "-c", "pass", HOME=str(tmp_path),
                    KUBECONFIG=str(tmp_path / "none"))
    assert out.returncode == 1
    assert "no kubernetes cluster configured" in out.stderr
    assert "launches on kubernetes (the default" in out.stderr
    assert "`fibrl run --backend docker -- python -c pass`" in out.stderr
    assert "with `fibrl run`" not in out.stderr   # not the command that just failed


def test_version():
    import fibrl

    out = fibrl_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"fibrl {fibrl.__version__}"


def test_image_tag():
    assert image_tag("reg.example/team/", "/src/My App", "ab12") == "reg.example/team/my-app:ab12"
    assert image_tag("", "/", "ab12") == "fibrl-project:ab12"


def test_build_needs_a_dockerfile(tmp_path):
    out = fibrl_cli("run", "--backend", "docker", "--build", "--", "python", "-c", "pass",
                    cwd=tmp_path)
    assert out.returncode == 1 and "needs a Dockerfile" in out.stderr


# --------------------------------------------------------------------------- kubernetes

@pytest.fixture
def kube(kube_cluster):
    """Options that point the command at the test cluster, and cleanup of its runs."""
    options = ["--kubeconfig", kube_cluster.kubeconfig, "-n", kube_cluster.namespace]
    env = ["--image", kube_cluster.image] + kube_cluster.parent_access()
    runs = []
    yield options, env, runs
    for run in runs:
        fibrl_cli("stop", run, *options)
    if kube_cluster.fake is not None:
        kube_cluster.fake.reset_hooks()


def _run_id(out):
    match = re.search(r"fibrl: run (\w+) started", out.stderr)
    assert match, out.stderr
    return match.group(1)


def _run_ids(options):
    lines = fibrl_cli("ps", *options).stdout.splitlines()[1:]
    return {line.split()[0]: line for line in lines}


def _pods(kube_cluster, run):
    from kubernetes import client

    with kube_cluster.client() as api:
        return client.CoreV1Api(api).list_namespaced_pod(
            kube_cluster.namespace, label_selector=f"fibrl.run={run}", _request_timeout=10).items


@pytest.mark.kubernetes
def test_run_follow_exits_with_the_scripts_code(kube, kube_cluster):
    options, env, runs = kube
    out = fibrl_cli("run", *options, *env, "--follow", "--", "python", "-c", SCRIPT, "3")
    run = _run_id(out)
    runs.append(run)
    assert out.returncode == 3, out.stderr
    assert "squares: [0, 1, 4, 9, 16, 25, 36, 49]" in out.stdout
    assert f"parent pod: fibrl-run-{run}-" in out.stdout
    assert run in _run_ids(options)
    logs = fibrl_cli("logs", run, *options)
    assert "squares:" in logs.stdout
    stopped = fibrl_cli("stop", run, *options)
    assert f"job/fibrl-run-{run}" in stopped.stdout
    wait_until(lambda: not _pods(kube_cluster, run), f"the pods of run {run} to go", 30)
    assert run not in _run_ids(options)


@pytest.mark.kubernetes
def test_run_detach_then_logs_follow(kube):
    options, env, runs = kube
    out = fibrl_cli("run", *options, *env, "--detach", "--", "python", "-c", SCRIPT, "0")
    assert out.returncode == 0, out.stderr
    run = out.stdout.strip()
    runs.append(run)
    def finished():
        out = fibrl_cli("logs", run, "--follow", *options)
        return out if "squares:" in out.stdout else None

    logs = wait_until(finished, f"the logs of run {run} to show its result", TIMEOUT,
                      interval=0.5)
    assert "squares: [0, 1, 4, 9, 16, 25, 36, 49]" in logs.stdout


@pytest.mark.kubernetes
@pytest.mark.fake_kube
def test_run_reports_an_image_it_cannot_pull(kube, kube_cluster):
    if kube_cluster.fake is None:
        pytest.skip("needs the fake API server's failing image pulls")
    options, env, runs = kube
    image = "registry.invalid/nobody/nothing:0"
    kube_cluster.fake.fail_image_pulls(image)
    out = fibrl_cli("run", *options, "--image", image, "--", "python", "-c", "pass")
    run = _run_id(out)
    runs.append(run)
    assert out.returncode == 1
    assert "cannot start" in out.stderr and "ImagePullBackOff" in out.stderr
    assert f"fibrl stop {run}" in out.stderr


@pytest.fixture
def launcher(kube, kube_cluster):
    """A kubernetes launcher (in this process) with kubernetes_pending_timeout=1.5 s,
    on the fake API server (its hooks play a slow registry and a full cluster)."""
    if kube_cluster.fake is None:
        pytest.skip("needs the fake API server's slow image pulls and scheduling hooks")
    from fibrl.config import Config
    from fibrl.launch.kubernetes import KubernetesLauncher

    config = Config(kubernetes_kubeconfig=kube_cluster.kubeconfig,
                    kubernetes_namespace=kube_cluster.namespace, kubernetes_pending_timeout=1.5)
    _, _, runs = kube
    return KubernetesLauncher(config), runs


def _launch(launcher, runs, image, command=("python", "-c", "print('ran')")):
    from fibrl.launch import RunRequest

    run = uuid.uuid4().hex[:12]
    runs.append(run)
    launcher.launch(RunRequest(run_id=run, command=command, image=image))
    return run


@pytest.mark.kubernetes
def test_run_waits_for_an_image_pull_longer_than_the_pending_timeout(launcher, kube_cluster):
    launcher, runs = launcher
    fake, image = kube_cluster.fake, "registry.example/big/image:1"
    fake.pull_images_slowly(image)
    run = _launch(launcher, runs, image)
    # the pull finishes at 3x kubernetes_pending_timeout: still a start, not an error
    finish = threading.Timer(4.5, fake.allow_image_pulls, args=(image,))
    finish.start()
    try:
        ended = launcher.wait(run, follow=False, out=io.BytesIO())
    finally:
        finish.cancel()
    assert finish.finished.is_set() and (ended.status, ended.reason) == (0, "")


@pytest.mark.kubernetes
def test_run_reports_an_unschedulable_pod_with_the_schedulers_reason(launcher, kube_cluster):
    launcher, runs = launcher
    message = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    kube_cluster.fake.set_unschedulable(lambda pod: message if pod["metadata"]["name"].startswith(
        "fibrl-run-") else None)
    run = _launch(launcher, runs, kube_cluster.image)
    t0 = time.monotonic()
    with pytest.raises(BackendError) as error:
        launcher.wait(run, follow=False, out=io.BytesIO())
    assert 1.5 <= time.monotonic() - t0 < 30
    text = str(error.value)
    assert "Unschedulable" in text and message in text and "created no pod" not in text
    assert "kubernetes_pending_timeout=1.5" in text and f"fibrl stop {run}" in text


@pytest.mark.kubernetes
def test_run_waits_for_a_parent_pod_the_autoscaler_makes_room_for(launcher, kube_cluster):
    launcher, runs = launcher
    fake = kube_cluster.fake
    fake.set_unschedulable(lambda pod: "0/1 nodes are available: 1 Insufficient cpu."
                           if pod["metadata"]["name"].startswith("fibrl-run-") else None)
    run = _launch(launcher, runs, kube_cluster.image)
    done = threading.Event()

    def autoscaler():   # a new TriggeredScaleUp event every 0.5 s, then the node is there
        begin = time.monotonic()
        while not done.wait(0.5):
            for pod in _pods(kube_cluster, run):
                fake.record_pod_event(kube_cluster.namespace, pod.metadata.name,
                                      "TriggeredScaleUp", "pod triggered scale-up: [{b 1->2}]")
            if time.monotonic() - begin > 4.5:   # three pending timeouts
                fake.set_unschedulable(None)

    thread = threading.Thread(target=autoscaler, daemon=True)
    thread.start()
    try:
        ended = launcher.wait(run, follow=False, out=io.BytesIO())
    finally:
        done.set()
    assert (ended.status, ended.reason) == (0, "")


@pytest.mark.kubernetes
def test_run_says_why_the_autoscaler_adds_no_node(launcher, kube_cluster):
    launcher, runs = launcher
    fake = kube_cluster.fake
    fake.set_unschedulable(lambda pod: "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    run = _launch(launcher, runs, kube_cluster.image)
    pods = wait_until(lambda: _pods(kube_cluster, run), "the run's pod", 30)
    fake.record_pod_event(kube_cluster.namespace, pods[0].metadata.name, "NotTriggerScaleUp",
                          "pod didn't trigger scale-up: 1 max node group size reached")
    with pytest.raises(BackendError) as error:
        launcher.wait(run, follow=False, out=io.BytesIO())
    assert "the cluster autoscaler adds no node for it" in str(error.value)
    assert "max node group size reached" in str(error.value)


@pytest.mark.kubernetes
def test_run_follow_resumes_a_log_stream_that_went_silent(launcher, kube_cluster, monkeypatch):
    from fibrl.launch import kubernetes as kube_launch

    launcher, runs = launcher
    monkeypatch.setattr(kube_launch, "_FOLLOW_READ_TIMEOUT", 1.0, raising=False)
    # the first stream sends two lines, then nothing, and is never closed
    kube_cluster.fake.stall_log_streams(count=1, after_lines=2)
    script = ("import time\nfor i in range(8):\n    print('line', i, flush=True)\n"
              "    time.sleep(0.3)\n")
    run = _launch(launcher, runs, kube_cluster.image, ("python", "-c", script))
    out = io.BytesIO()
    follow = concurrent.futures.ThreadPoolExecutor(1)
    try:
        ended = follow.submit(launcher.wait, run, True, out)
        try:   # an exception of the follow is raised here, with its traceback
            status = ended.result(timeout=TIMEOUT).status
        except concurrent.futures.TimeoutError:
            pytest.fail(f"--follow hung on a silent stream; it wrote {out.getvalue()!r}")
    finally:
        follow.shutdown(wait=False)
    assert status == 0
    # every line once, in order, though the resumed stream repeats the lines of the second
    # it resumes from (sinceTime has whole seconds)
    assert out.getvalue().decode().splitlines() == [f"line {i}" for i in range(8)]
    streams = [r for r in kube_cluster.fake.requests if r.path.endswith("/log")]
    assert len(streams) >= 2


@pytest.mark.kubernetes
def test_logs_follow_writes_a_last_line_without_newline(launcher, kube_cluster):
    launcher, runs = launcher
    run = _launch(launcher, runs, kube_cluster.image,
                  ("python", "-c", "import sys; print('first'); sys.stdout.write('last')"))
    out = io.BytesIO()
    assert launcher.wait(run, True, out).status == 0
    assert out.getvalue() == b"first\nlast"


# --------------------------------------------------------------------------- docker

@pytest.mark.docker
def test_docker_run_follow_ps_logs_stop(docker_engine, tmp_path):
    code = "import os; print('hello from', os.getcwd(), os.environ['FIBRL_RUN_ID']); exit(3)"
    out = fibrl_cli("run", "--backend", "docker", "--image", "fibrl:latest", "--follow", "--",
                    "python", "-c", code, cwd=tmp_path)
    run = _run_id(out)
    try:
        assert out.returncode == 3, out.stderr
        assert f"hello from {tmp_path} {run}" in out.stdout
        assert run in _run_ids(["--backend", "docker"])
        assert "hello from" in fibrl_cli("logs", run, "--backend", "docker").stdout
    finally:
        stopped = fibrl_cli("stop", run, "--backend", "docker")
    assert f"container/fibrl-run-{run}" in stopped.stdout
    assert run not in _run_ids(["--backend", "docker"])


@pytest.mark.docker
def test_docker_run_without_follow_says_how_to_follow_and_that_the_container_stays(
        docker_engine, tmp_path):
    out = fibrl_cli("run", "--backend", "docker", "--image", "fibrl:latest", "--",
                    "python", "-c", "print('quiet run')", cwd=tmp_path)
    run = _run_id(out)
    try:
        assert out.returncode == 0, out.stderr
        assert "quiet run" not in out.stdout
        assert f"`fibrl logs {run} --backend docker -f` follows its output" in out.stderr
        assert (f"exit status 0. Its container stays, with its output (`fibrl logs {run} "
                f"--backend docker`), until `fibrl stop {run} --backend docker`") in out.stderr
        assert "quiet run" in fibrl_cli("logs", run, "--backend", "docker").stdout
    finally:
        stopped = fibrl_cli("stop", run, "--backend", "docker")
    assert f"container/fibrl-run-{run}" in stopped.stdout


# The parent container starts a docker worker, then dies of SIGKILL: its reaper dies with
# the container, so `fibrl run` must remove the worker's container itself.
KILLED_PARENT = textwrap.dedent("""
    import os, signal, time, fibrl

    def report_then_wait(q):
        q.put("started")
        time.sleep(3600)

    if __name__ == "__main__":
        q = fibrl.Queue()
        fibrl.Process(target=report_then_wait, args=(q,)).start()
        print("worker", q.get(timeout=120), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)   # no cleanup of any kind
""")


@pytest.mark.docker
def test_docker_run_removes_the_workers_of_a_killed_parent(docker_engine, tmp_path):
    from fibrl.backends import docker as dockerbackend

    (tmp_path / "killed.py").write_text(KILLED_PARENT)
    out = fibrl_cli("run", "--backend", "docker", "--image", "fibrl:latest", "--follow", "--",
                    "python", "killed.py", cwd=tmp_path)
    run = _run_id(out)
    try:
        assert "worker started" in out.stdout, out.stderr
        assert out.returncode != 0
        left = [c.name for c in dockerbackend.list_containers(run)
                if c.labels.get("fibrl.role") != "parent"]
        assert not left, f"worker containers left after the parent was killed: {left}"
    finally:
        fibrl_cli("stop", run, "--backend", "docker")


@pytest.mark.docker
def test_docker_build_then_run(docker_engine, tmp_path):
    project = tmp_path / "walker"
    project.mkdir()
    (project / "Dockerfile").write_text("FROM fibrl:latest\nCOPY hello.py /opt/hello.py\n")
    (project / "hello.py").write_text("print('built and ran')\n")
    out = fibrl_cli("run", "--backend", "docker", "--build", "--follow", "--", "python",
                    "/opt/hello.py", cwd=project, timeout=300)
    run = _run_id(out)
    try:
        assert out.returncode == 0, out.stderr
        assert "built and ran" in out.stdout
        assert f"docker build -t fibrl-walker:{run}" in out.stderr
    finally:
        fibrl_cli("stop", run, "--backend", "docker")
        subprocess.run(["docker", "rmi", "-f", f"fibrl-walker:{run}"], capture_output=True,
                       timeout=60)


def test_build_loads_into_kind_or_minikube_and_knows_no_other_way():
    from fibrl.launch.build import local_cluster_loader

    assert local_cluster_loader("kind-rl") == ["kind", "load", "docker-image", "--name", "rl"]
    assert local_cluster_loader("minikube") == ["minikube", "image", "load"]
    assert local_cluster_loader("arn:aws:eks:eu-west-1:1:cluster/prod") is None


@pytest.mark.kubernetes
def test_build_without_a_registry_is_refused_before_building(kube_cluster, tmp_path):
    """The fake's kubeconfig context is neither kind nor minikube: no node could pull the
    image, so nothing is built (the Dockerfile here would fail any build)."""
    (tmp_path / "Dockerfile").write_text("FROM image.invalid/never:1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIBRL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "fibrl.cli", "run", "--kubeconfig",
                          kube_cluster.kubeconfig, "--build", "--", "python", "-c", "pass"],
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path, env=env)
    assert out.returncode == 1, out.stderr
    assert "--build has no registry" in out.stderr and "docker build" not in out.stderr
