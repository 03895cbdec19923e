"""The docker backend's pure pieces (names, exit codes, container settings) and its errors.

Tests marked ``docker`` need the engine and the worker image; the others need only the
docker SDK (they never reach an engine).
"""
import io
import logging
import os
import re
import socket
import subprocess
import sys
import tarfile

import pytest

import fibrl
from fibrl.backends import JobSpec
from fibrl.config import Config
from fibrl.errors import BackendError

from conftest import REQUIRE_DOCKER, require_module, skip_or_fail

docker_sdk = require_module("docker", REQUIRE_DOCKER)
from fibrl.backends import docker as dockerbackend  # noqa: E402

VALID_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]+$")


@pytest.fixture
def docker_init(configure):
    """``docker_init(**settings)``: configure(backend="docker", **settings)."""
    return lambda **settings: configure(backend="docker", **settings)


# -- names ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,start", [
    ("Process-1", "fibrl-process-1-"),
    ("Process-1:2", "fibrl-process-1-2-"),
    ("my worker #3 (gpu)", "fibrl-my-worker-3-gpu-"),
    ("fibrl-worker", "fibrl-worker-"),
    ("::", "fibrl-worker-"),
    ("", "fibrl-worker-"),
    ("Ünïcødé", "fibrl-n-c-d-"),
])
def test_container_names_are_valid_and_readable(name, start):
    result = dockerbackend.container_name(name)
    assert result.startswith(start)
    assert VALID_NAME.match(result), result
    assert len(result) <= 60


def test_container_names_are_unique_and_bounded():
    names = {dockerbackend.container_name("Process-1") for _ in range(200)}
    assert len(names) == 200
    long = dockerbackend.container_name("x" * 500 + "-" * 10)
    assert VALID_NAME.match(long) and len(long) <= 60
    assert dockerbackend.container_name("P", suffix="abc") == "fibrl-p-abc"


# -- exit codes ----------------------------------------------------------------------

@pytest.mark.parametrize("status,code", [
    (0, 0), (1, 1), (2, 2), (127, 127), (128, 128),
    (137, -9), (143, -15), (139, -11), (129, -1), (192, -64), (193, 193), (255, 255),
])
def test_exit_status_mapping(status, code):
    assert dockerbackend.exit_code(status) == code


# -- what a container gets -------------------------------------------------------------

def _spec(**changes):
    base = dict(command=("python", "-m", "fibrl.bootstrap", "tcp://127.0.0.1:1", "h-1"),
                env={"FIBRL_SECRET": "ab", "FIBRL_RUN_ID": "r1"},
                labels={"fibrl.run": "r1", "fibrl.parent": "1", "fibrl.role": "process"},
                name="Process-1", workdir="/work/project")
    base.update(changes)
    return JobSpec(**base)


def _kwargs(spec=None, **config):
    backend = dockerbackend.DockerBackend(Config(backend="docker", **config))
    return backend._container_kwargs(spec or _spec(), "fibrl:latest")


def test_secret_goes_to_the_workers_stdin_then_it_closes():
    written = []

    class Attached:   # what docker's attach_socket returns: a SocketIO around a socket
        closed = 0

        def __init__(self):
            self._sock = self

        def sendall(self, data):
            written.append(data)

        def close(self):
            Attached.closed += 1

    from fibrl.backends.docker.backend import _hand_secret

    _hand_secret(Attached(), "ab12")
    assert written == [b"ab12\n"] and Attached.closed == 2


def test_container_defaults_host_network_readonly_cwd_and_labels():
    kw = _kwargs()
    assert kw["network_mode"] == "host"
    assert kw["volumes"] == {"/work/project": {"bind": "/work/project", "mode": "ro"}}
    assert kw["working_dir"] == "/work/project"
    assert kw["command"] == ["python", "-m", "fibrl.bootstrap", "tcp://127.0.0.1:1", "h-1"]
    # the secret is written to stdin once started: not in the environment docker
    # inspect shows, nor in a file of the container's layer on the host's disk
    assert kw["environment"] == {"FIBRL_SECRET_STDIN": "1", "FIBRL_RUN_ID": "r1"}
    assert kw["stdin_open"] is True
    assert kw["labels"]["fibrl.backend"] == "docker"
    assert kw["labels"]["fibrl.run"] == "r1" and kw["labels"]["fibrl.role"] == "process"
    assert kw["labels"]["fibrl.host"] == socket.gethostname()
    assert kw["labels"]["fibrl.pidns"] == dockerbackend.pid_namespace() != ""
    assert kw["auto_remove"] is False and kw["init"] is True
    assert kw["user"] == f"{os.getuid()}:{os.getgid()}"
    assert kw["security_opt"] == ["no-new-privileges"]
    for absent in ("privileged", "cap_add", "nano_cpus", "mem_limit", "device_requests"):
        assert absent not in kw


# -- parents that are gone: the reaper and orphan collection -----------------------------

def test_pid_namespace_is_this_machines_boot_and_namespace():
    namespace = dockerbackend.pid_namespace()
    with open("/proc/sys/kernel/random/boot_id") as handle:
        assert namespace.startswith(handle.read().strip() + "-")
    assert namespace.rsplit("-", 1)[1] == str(os.stat("/proc/self/ns/pid").st_ino)


class _Container:
    def __init__(self, cid, parent, namespace):
        self.id = cid
        self.labels = {"fibrl.parent": str(parent), "fibrl.pidns": namespace}


class _Engine:
    """Stands in for the SDK client: serves containers.list(), records removals."""

    def __init__(self, containers):
        self._containers = containers
        self.containers = self.api = self
        self.removed = []

    def list(self, all=False, filters=None, ignore_removed=False):
        return self._containers

    def remove_container(self, cid, force=False):
        self.removed.append(cid)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("here", ["boot-1234", ""])   # "": no /proc, as on Docker Desktop
def test_orphans_are_collected_only_in_this_pid_namespace(monkeypatch, here):
    monkeypatch.setattr(dockerbackend.housekeeping, "pid_namespace", lambda: here)
    dead = _dead_pid()
    engine = _Engine([_Container("mine-dead", dead, here),
                      _Container("mine-alive", os.getpid(), here),
                      _Container("other-namespace", dead, "boot-9999")])
    dockerbackend.collect_orphans(engine)
    assert engine.removed == ["mine-dead"]


REAPED_PARENT = """
import sys, time
from fibrl.backends import docker
docker.start_reaper()
print("ready", flush=True)
time.sleep(120)
"""


def _reapers_of(pid):
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(arg.endswith("_docker_reaper.py") for arg in cmdline) and str(pid) in cmdline:
            found.append(proc)
    return found


def test_reaper_is_detached_and_exits_after_its_parent_is_killed(tmp_path):
    import subprocess
    import sys

    import psutil

    # an engine that does not answer: the reaper only gets as far as connecting
    env = dict(os.environ, DOCKER_HOST=f"unix://{tmp_path}/absent.sock")
    parent = subprocess.Popen([sys.executable, "-c", REAPED_PARENT], env=env, text=True,
                              stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline().strip() == "ready"
        reapers = _reapers_of(parent.pid)
        assert len(reapers) == 1, "one reaper per parent process"
        assert reapers[0].ppid() != parent.pid   # not its child: survives it
        parent.kill()
        parent.wait(30)
        gone, alive = psutil.wait_procs(reapers, timeout=30)
        assert not alive, "the reaper outlived its parent's death by 30 s"
    finally:
        parent.kill()
        parent.wait(30)
        parent.stdout.close()


def test_reaper_gives_up_quietly_when_the_engine_is_gone_too(tmp_path, monkeypatch):
    from fibrl.backends import _docker_reaper

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/absent.sock")
    _docker_reaper._reap(os.getpid(), dockerbackend.pid_namespace(), 0.1)   # no exception
    with pytest.raises(SystemExit, match="usage"):
        _docker_reaper._arguments(["not-a-pid", "ns", "5"])


def test_mount_and_workdir_options():
    assert _kwargs(docker_mount_readonly=False)["volumes"]["/work/project"]["mode"] == "rw"
    kw = _kwargs(docker_mount_cwd=False)
    assert kw["volumes"] == {} and kw["working_dir"] is None
    assert _kwargs(docker_workdir="/app")["working_dir"] == "/app"
    extra = _kwargs(_spec(volumes=(("/data", "/mnt/data", True),)))
    assert extra["volumes"]["/data"] == {"bind": "/mnt/data", "mode": "ro"}


def test_resources_map_to_docker_limits():
    kw = _kwargs(_spec(cpu=1.5, memory="256m", gpu=2))
    assert kw["nano_cpus"] == 1_500_000_000
    assert kw["mem_limit"] == kw["memswap_limit"] == "256m"  # no swap, so OOM kills
    (request,) = kw["device_requests"]
    assert request["Count"] == 2 and request["Capabilities"] == [["gpu"]]


def test_refuses_to_mount_the_host_root():
    with pytest.raises(BackendError, match="root directory.*docker_mount_cwd=False"):
        _kwargs(_spec(workdir="/"))


def test_non_host_network_with_loopback_listener_is_explained():
    backend = dockerbackend.DockerBackend(Config(backend="docker", docker_network="bridge"))
    with pytest.raises(BackendError, match="cannot reach.*docker_network='host'"):
        backend.create_job(_spec())


def test_unusable_image_messages_name_cause_and_fix():
    err = dockerbackend.backend._unusable_image("img", "/w", 1, "ModuleNotFoundError: No "
                                                "module named 'fibrl'")
    assert "fibrl is not installed" in str(err) and "docker/build-image.sh" in str(err)
    assert "No module named 'fibrl'" in str(err) and "exit code 1" in str(err)
    err = dockerbackend.backend._unusable_image("img", "/w", 127, "exec python failed")
    assert "no `python`" in str(err)


# -- errors from a real (or absent) engine ----------------------------------------------

@pytest.fixture
def closed_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "docker.sock")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.close()  # the file stays; connecting to it is refused
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    return path


def test_unreachable_engine_is_explained(closed_socket):
    with pytest.raises(BackendError) as info:
        dockerbackend.connect()
    text = str(info.value)
    assert closed_socket in text and "DOCKER_HOST" in text and "start dockerd" in text
    assert isinstance(info.value.__cause__, docker_sdk.errors.DockerException)


def test_unreachable_engine_fails_process_start(closed_socket, docker_init):
    docker_init(image="fibrl-unreachable-test:0")  # a config of its own: a fresh backend
    p = fibrl.Process(target=os.getpid)
    with pytest.raises(BackendError, match="cannot reach the docker engine"):
        p.start()


@pytest.mark.docker
def test_missing_image_is_explained(docker_engine, docker_init):
    docker_init(image="fibrl-no-such-image:0")
    p = fibrl.Process(target=os.getpid)
    with pytest.raises(BackendError, match=r"fibrl-no-such-image:0.*does not exist.*"
                                           r"docker/build-image.sh.*image="):
        p.start()


@pytest.mark.docker
def test_image_without_fibrl_is_explained(docker_engine, docker_init, tmp_path, monkeypatch):
    base = "python:3.11-slim"
    try:
        docker_engine.images.get(base)
    except docker_sdk.errors.ImageNotFound:
        # .ci/run builds it (docker/build-base.sh): absent there means a broken set-up
        skip_or_fail(f"{base} is not on this engine (docker/build-base.sh makes it)",
                     REQUIRE_DOCKER)
    monkeypatch.chdir(tmp_path)  # so the mounted directory provides no fibrl either
    docker_init(image=base)
    with pytest.raises(BackendError, match=r"(?s)cannot run fibrl workers.*fibrl is not "
                                           r"installed.*No module named 'fibrl'"):
        fibrl.Process(target=os.getpid).start()
    assert not dockerbackend.list_containers(run="no-such-run", client=docker_engine)


@pytest.fixture
def image_without_python(docker_engine):
    tag = "fibrl-test-nopython:latest"
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tarfile.TarInfo("etc/hostname")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"none\n"))
    docker_engine.api.import_image_from_data(data.getvalue(), repository=tag.split(":")[0],
                                         tag="latest")
    yield tag
    docker_engine.images.remove(tag, force=True)


@pytest.mark.docker
def test_image_without_python_is_explained(image_without_python, docker_init):
    docker_init(image=image_without_python)
    with pytest.raises(BackendError, match=r"(?s)cannot (run fibrl workers|start a worker).*"
                                           r"python"):
        fibrl.Process(target=os.getpid).start()


@pytest.mark.docker
def test_cpu_count_is_the_engines(docker_engine):
    backend = dockerbackend.DockerBackend(Config(backend="docker"))
    assert backend.cpu_count() == docker_engine.info()["NCPU"]


# An entrypoint that lets the image probe (python -c ...) through but ends a worker
# (python -m fibrl.bootstrap ...) before it connects back, saying why on stderr.
REFUSING_ENTRYPOINT = b"""#!/bin/sh
if [ "$2" = "-m" ]; then
    echo "refusing to start the worker: simulated broken entrypoint" >&2
    exit 3
fi
exec "$@"
"""


def _add(tar, name, data, mode=0o644):
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def refusing_image(docker_engine):
    """The worker image with an entrypoint that makes workers exit before connecting."""
    tag = "fibrl-test-refusing:latest"
    base = os.environ.get("FIBRL_IMAGE", "fibrl:latest")
    dockerfile = (f"FROM {base}\nCOPY refuse.sh /usr/local/bin/refuse.sh\n"
                  f'ENTRYPOINT ["/usr/local/bin/refuse.sh"]\n').encode()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        _add(tar, "Dockerfile", dockerfile)
        _add(tar, "refuse.sh", REFUSING_ENTRYPOINT, mode=0o755)
    context.seek(0)
    docker_engine.images.build(fileobj=context, custom_context=True, tag=tag, rm=True,
                           forcerm=True, timeout=300)
    yield tag
    docker_engine.images.remove(tag, force=True)


@pytest.mark.docker
def test_container_that_exits_before_connecting_back_shows_its_logs(refusing_image,
                                                                     docker_init, caplog):
    docker_init(image=refusing_image)
    with caplog.at_level(logging.ERROR, logger="fibrl.popen"):
        p = fibrl.Process(target=os.getpid)
        p.start()
        p.join(60)
    assert p.exitcode == 3
    errors = [r.getMessage() for r in caplog.records
              if "ended before it connected back" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    assert "exit code 3" in errors[0] and "simulated broken entrypoint" in errors[0]
    assert "simulated broken entrypoint" in p._popen.job.logs()


OUTSIDE_SCRIPT = """
import fibrl

class Box:
    def __init__(self, value):
        self.value = value

def square(box):
    return Box(box.value * box.value)

if __name__ == "__main__":
    fibrl.init(backend="docker")
    with fibrl.Pool(2) as pool:
        print(sorted(box.value for box in pool.map(square, [Box(i) for i in range(5)])))
"""


@pytest.mark.timeout(240)   # 15-60 s measured on a loaded two-core machine
@pytest.mark.docker
def test_main_script_outside_the_mounted_directory(docker_engine, tmp_path):
    """Only the working directory is mounted: a script run from elsewhere is rebuilt in
    the container from the source the parent sends, so its functions and classes
    unpickle there as with spawn."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "work").mkdir()
    script = tmp_path / "scripts" / "main.py"
    script.write_text(OUTSIDE_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path / "work",
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[0, 1, 4, 9, 16]"


# -- an exiting program abandons starts -----------------------------------------------

class _SlowProbe:
    """A probe container that never ends: each wait times out as the SDK's does."""

    def wait(self, timeout):
        import requests
        import time

        time.sleep(timeout)
        raise requests.exceptions.ReadTimeout("read timed out")


def test_an_exiting_program_stops_waiting_for_the_image_probe():
    """Ctrl-C while the first worker's image probe runs: the interpreter joins the
    starter threads before exiting, and used to wait the probe out (10-30 s on a loaded
    machine, up to start_timeout)."""
    import threading
    import time

    backend = dockerbackend.DockerBackend(Config(backend="docker", start_timeout=60))
    threading.Timer(0.3, backend.abandon_starts).start()
    start = time.monotonic()
    with pytest.raises(BackendError, match="program is exiting"):
        backend._wait_for_probe(_SlowProbe())
    assert time.monotonic() - start < 20   # (start_timeout is 60)
    with pytest.raises(BackendError, match="program is exiting"):
        backend._refuse_if_abandoned()   # and no new start begins


def test_a_probe_that_outlasts_start_timeout_still_fails_as_before():
    import requests

    backend = dockerbackend.DockerBackend(Config(backend="docker", start_timeout=1))
    with pytest.raises(requests.exceptions.ReadTimeout):
        backend._wait_for_probe(_SlowProbe())
