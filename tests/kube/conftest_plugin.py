"""pytest fixtures for tests that talk to the fake Kubernetes API server.

Use them either by importing into a test module::

    from tests.kube.conftest_plugin import fake_kube, kube_api_client, kube_namespace  # noqa: F401

or for a whole tree with ``pytest_plugins = ["tests.kube.conftest_plugin"]`` in a
top-level conftest.py.

* ``fake_apiserver`` (session): the suite's one fake API server (``kube_cluster`` in
  tests/conftest.py), running pods as local processes; its tests are skipped when the
  suite runs against a real cluster (KUBE_TEST_KUBECONFIG);
* ``fake_kube``: the same server, with its test hooks (forbidden rules, injected
  errors, failing images, scheduling predicate) reset after the test;
* ``fake_kubeconfig`` (session): path of a kubeconfig pointing at it;
* ``fake_kubeconfig_env``: that path exported as ``$KUBECONFIG`` for the test;
* ``kube_api_client``: a ``kubernetes.client.ApiClient`` for it (global config untouched);
* ``kube_namespace``: a fresh namespace name; its objects are deleted afterwards;
* ``fake_apiserver_docker`` (session): a server running pods as docker containers;
  skipped when no docker engine answers (a failure under CI_REQUIRE_DOCKER=1). It is a
  second server only because its runtime option differs.
"""
from __future__ import annotations

import uuid

import pytest

from .fake_apiserver import FakeApiServer, docker_engine_answers


@pytest.fixture(scope="session")
def fake_apiserver(kube_cluster):
    if kube_cluster.fake is None:
        pytest.skip("tests of the fake API server itself do not run against a real cluster")
    return kube_cluster.fake


@pytest.fixture
def fake_kube(fake_apiserver):
    yield fake_apiserver
    fake_apiserver.reset_hooks()


@pytest.fixture(scope="session")
def fake_kubeconfig(fake_apiserver) -> str:
    return fake_apiserver.write_kubeconfig()


@pytest.fixture
def fake_kubeconfig_env(fake_kubeconfig, monkeypatch) -> str:
    monkeypatch.setenv("KUBECONFIG", fake_kubeconfig)
    return fake_kubeconfig


@pytest.fixture
def kube_api_client(fake_apiserver):
    client = fake_apiserver.api_client()
    yield client
    client.close()


@pytest.fixture
def kube_namespace(fake_apiserver) -> str:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    yield namespace
    from kubernetes import client
    with fake_apiserver.api_client() as api:
        client.CoreV1Api(api).delete_namespace(namespace, _request_timeout=10)


@pytest.fixture(scope="session")
def fake_apiserver_docker():
    if not docker_engine_answers():
        from conftest import skip_or_fail

        skip_or_fail("no docker engine answers", "CI_REQUIRE_DOCKER")
    server = FakeApiServer(runtime="docker").start()
    from conftest import HTTP_POOL_PEERS   # its kept-alive connections outlive a test

    HTTP_POOL_PEERS.add(f"127.0.0.1:{server.port}")
    yield server
    server.stop()
