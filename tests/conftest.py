"""Shared test machinery: the backend fixture, the leak check, markers.

``ctx`` is the fibrl context of the backend under test. Conformance tests take
``ctx`` and use ``ctx.Process``, ``ctx.Queue``, ``ctx.Pool``... so one suite
runs on every backend. Backends other than ``local`` are skipped only when
their engine is truly absent; CI sets ``CI_REQUIRE_DOCKER=1`` so that a
broken docker set-up fails instead of skipping.
"""
from __future__ import annotations

import os
import time

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


@pytest.fixture(params=BACKENDS)
def ctx(request):
    """The context of one backend; skips docker/kubernetes when their engine is absent."""
    name = request.param
    marker = {"docker": pytest.mark.docker, "kubernetes": pytest.mark.kubernetes}.get(name)
    if marker is not None:
        request.applymarker(marker)
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


@pytest.fixture
def kube_settings():
    """Config for the kubernetes backend; provided by tests/kube once it exists."""
    try:
        from tests.kube.fixtures import kube_backend_settings
    except ImportError:
        pytest.skip("the kubernetes backend and its fake API server are not available")
    return kube_backend_settings()


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


@pytest.fixture(autouse=True)
def no_leaks():
    """After each test: no child process of this test run is left (waits up to 10 s)."""
    yield
    deadline = time.monotonic() + 10
    left = _children()
    while left and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.5)
        left = _children()
    if left:
        for proc in left:
            proc.kill()
        pytest.fail(f"leaked child processes: {[(p.pid, p.cmdline()) for p in left]}")
