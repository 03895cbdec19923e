"""Tests of the fake Kubernetes API server (tests/kube), driven only through
the official ``kubernetes`` client, plus a shape check against hand-written
responses of the real API (tests/kube/fixtures).

Pods run as local processes. Every wait is a watch bounded by
``timeout_seconds`` and ``_request_timeout``.
"""
from __future__ import annotations

import base64
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import require_module, wait_until

require_module("kubernetes")
from kubernetes import client, config, watch  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

try:
    import tests.kube.conftest_plugin  # noqa: F401
except ModuleNotFoundError:   # "tests" is not a package on sys.path: use this checkout's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kube.conftest_plugin import (fake_apiserver, fake_apiserver_docker, fake_kube,  # noqa: F401,E402
                                        fake_kubeconfig, kube_api_client, kube_namespace)
from tests.kube.fake_apiserver import FakeApiServer, docker_leaked_containers  # noqa: E402

pytestmark = [pytest.mark.kubernetes, pytest.mark.fake_kube]

FIXTURES = Path(__file__).resolve().parents[1] / "kube" / "fixtures"
IMAGE = "python:3.11-slim"
WAIT = 15           # seconds any single wait may take
PULL_FAILS = "registry.invalid/never:1"


# --------------------------------------------------------------------------- helpers


def pod_body(code: str = "print('hi')", name: str | None = None, restart: str = "Never", **extra) -> dict:
    meta = {"name": name} if name else {"generateName": "p-"}
    meta.update(extra.pop("metadata", {}))
    container = {"name": "main", "image": extra.pop("image", IMAGE), "command": ["python", "-c", code]}
    container.update(extra.pop("container", {}))
    return {"metadata": meta, "spec": {"restartPolicy": restart, "containers": [container], **extra}}


def wait_for(list_func, read_func, namespace: str, name: str, done, timeout: float = WAIT):
    """Read the object, then watch it from that resourceVersion until ``done(obj)``."""
    obj = read_func(name, namespace, _request_timeout=5)
    if done(obj):
        return obj
    stream = watch.Watch()
    for event in stream.stream(list_func, namespace, field_selector=f"metadata.name={name}",
                               resource_version=obj.metadata.resource_version, timeout_seconds=timeout,
                               _request_timeout=timeout + 5):
        if event["type"] != "DELETED" and done(event["object"]):
            stream.stop()
            return event["object"]
    raise AssertionError(f"{name}: condition not reached within {timeout}s")


def wait_pod(v1, namespace: str, name: str, done, timeout: float = WAIT):
    return wait_for(v1.list_namespaced_pod, v1.read_namespaced_pod, namespace, name, done, timeout)


def phase_in(*phases):
    return lambda pod: pod.status.phase in phases


def wait_gone(list_func, read_func, namespace: str, name: str, timeout: float = WAIT) -> None:
    try:
        obj = read_func(name, namespace, _request_timeout=5)
    except ApiException as exc:
        assert exc.status == 404
        return
    stream = watch.Watch()
    for event in stream.stream(list_func, namespace, field_selector=f"metadata.name={name}",
                               resource_version=obj.metadata.resource_version, timeout_seconds=timeout,
                               _request_timeout=timeout + 5):
        if event["type"] == "DELETED":
            stream.stop()
            return
    raise AssertionError(f"{name} still exists after {timeout}s")


def error_of(call, *args, **kwargs) -> tuple[int, dict, dict]:
    with pytest.raises(ApiException) as info:
        call(*args, _request_timeout=5, **kwargs)
    return info.value.status, json.loads(info.value.body), dict(info.value.headers or {})


@pytest.fixture
def v1(kube_api_client):
    return client.CoreV1Api(kube_api_client)


@pytest.fixture
def batch(kube_api_client):
    return client.BatchV1Api(kube_api_client)


# --------------------------------------------------------------------------- metadata and errors


def test_kubeconfig_is_loadable_by_the_official_loader(fake_apiserver, fake_kubeconfig):
    configuration = client.Configuration()
    config.load_kube_config(config_file=fake_kubeconfig, client_configuration=configuration)
    with client.ApiClient(configuration) as api:
        assert client.VersionApi(api).get_code(_request_timeout=5).major == "1"
    contexts, active = config.list_kube_config_contexts(config_file=fake_kubeconfig)
    assert active["context"]["namespace"] == "default"


def test_wrong_token_is_unauthorized(fake_apiserver):
    configuration = client.Configuration()
    configuration.host, configuration.api_key = fake_apiserver.url, {"authorization": "Bearer nope"}
    with client.ApiClient(configuration) as api:
        status, body, _ = error_of(client.CoreV1Api(api).list_namespaced_pod, "default")
    assert (status, body["reason"]) == (401, "Unauthorized")


def test_create_get_list_metadata(v1, kube_namespace, fake_kube):
    fake_kube.fail_image_pulls(PULL_FAILS)   # keep the pod from running: only metadata matters here
    created = v1.create_namespaced_pod(kube_namespace, pod_body(
        image=PULL_FAILS, metadata={"labels": {"app": "a"}, "annotations": {"note": "x"}}), _request_timeout=5)
    meta = created.metadata
    assert re.fullmatch(r"p-[bcdfghjklmnpqrstvwxz2456789]{5}", meta.name)
    assert meta.generate_name == "p-" and meta.namespace == kube_namespace
    assert uuid.UUID(meta.uid).version == 4
    assert int(meta.resource_version) > 0
    assert created.status.phase == "Pending"
    assert (meta.labels, meta.annotations) == ({"app": "a"}, {"note": "x"})
    timestamp = raw(v1.read_namespaced_pod, meta.name, kube_namespace)[1]["metadata"]["creationTimestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", timestamp)
    listing = v1.list_namespaced_pod(kube_namespace, _request_timeout=5)
    assert [p.metadata.name for p in listing.items] == [meta.name]
    assert int(listing.metadata.resource_version) >= int(meta.resource_version)


def test_error_status_bodies(v1, kube_namespace, fake_kube):
    fake_kube.fail_image_pulls(PULL_FAILS)
    status, body, _ = error_of(v1.read_namespaced_pod, "missing", kube_namespace)
    assert status == 404 and body == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'pods "missing" not found', "reason": "NotFound",
        "details": {"name": "missing", "kind": "pods"}, "code": 404}

    v1.create_namespaced_pod(kube_namespace, pod_body(name="taken", image=PULL_FAILS), _request_timeout=5)
    status, body, _ = error_of(v1.create_namespaced_pod, kube_namespace, pod_body(name="taken", image=PULL_FAILS))
    assert (status, body["reason"], body["message"]) == (409, "AlreadyExists", 'pods "taken" already exists')
    assert body["details"] == {"name": "taken", "kind": "pods"}

    status, body, _ = error_of(v1.create_namespaced_pod, kube_namespace, pod_body(name="Bad_Name"))
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["message"].startswith('Pod "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": '
                                      'a lowercase RFC 1123 subdomain')
    assert body["details"]["causes"][0]["field"] == "metadata.name"

    no_image = pod_body(name="noimage")
    no_image["spec"]["containers"][0]["image"] = ""
    status, body, _ = error_of(v1.create_namespaced_pod, kube_namespace, no_image)
    assert status == 422 and "spec.containers[0].image: Required value" in body["message"]

    status, body, _ = error_of(v1.create_namespaced_pod, kube_namespace,
                               pod_body(metadata={"labels": {"bad": "has space"}}))
    assert status == 422 and body["details"]["causes"][0]["field"] == "metadata.labels"


def test_label_and_field_selectors(v1, kube_namespace, fake_kube):
    fake_kube.fail_image_pulls(PULL_FAILS)
    for name, labels in (("a", {"app": "x", "tier": "web"}), ("b", {"app": "y", "tier": "db"}), ("c", {"app": "z"})):
        v1.create_namespaced_pod(kube_namespace, pod_body(name=name, image=PULL_FAILS, metadata={"labels": labels}),
                                 _request_timeout=5)

    def names(**selectors):
        return sorted(p.metadata.name for p in v1.list_namespaced_pod(kube_namespace, _request_timeout=5,
                                                                      **selectors).items)

    assert names(label_selector="app=x") == ["a"]
    assert names(label_selector="app==y") == ["b"]
    assert names(label_selector="app!=x") == ["b", "c"]
    assert names(label_selector="app in (x, z)") == ["a", "c"]
    assert names(label_selector="app notin (x,z)") == ["b"]
    assert names(label_selector="tier") == ["a", "b"]
    assert names(label_selector="!tier") == ["c"]
    assert names(label_selector="app,tier=db") == ["b"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.name!=b") == ["a", "c"]
    assert names(field_selector=f"metadata.namespace={kube_namespace},status.phase=Pending") == ["a", "b", "c"]
    assert names(field_selector="status.phase=Running") == []
    status, body, _ = error_of(v1.list_namespaced_pod, kube_namespace, field_selector="spec.bogus=1")
    assert (status, body["reason"], body["message"]) == (400, "BadRequest", "field label not supported: spec.bogus")
    page = v1.list_namespaced_pod(kube_namespace, limit=2, _request_timeout=5)
    rest = v1.list_namespaced_pod(kube_namespace, limit=2, _continue=page.metadata._continue, _request_timeout=5)
    assert [p.metadata.name for p in page.items + rest.items] == ["a", "b", "c"]
    assert page.metadata.remaining_item_count == 1 and not rest.metadata._continue


# --------------------------------------------------------------------------- watch


def test_watch_from_resource_version_and_timeout(v1, kube_namespace):
    # a real cluster's resourceVersion is never "0" (which a watch reads as "any version")
    v1.create_namespaced_config_map(kube_namespace, {"metadata": {"generateName": "rv-"}},
                                    _request_timeout=5)
    start = v1.list_namespaced_secret(kube_namespace, _request_timeout=5).metadata.resource_version
    v1.create_namespaced_secret(kube_namespace, {"metadata": {"name": "s"}, "stringData": {"k": "v"}},
                                _request_timeout=5)
    v1.patch_namespaced_secret("s", kube_namespace, {"metadata": {"labels": {"x": "1"}}}, _request_timeout=5)
    v1.delete_namespaced_secret("s", kube_namespace, _request_timeout=5)
    began = time.monotonic()
    events = [(e["type"], e["object"].metadata.name) for e in watch.Watch().stream(
        v1.list_namespaced_secret, kube_namespace, resource_version=start, timeout_seconds=1, _request_timeout=10)]
    assert events == [("ADDED", "s"), ("MODIFIED", "s"), ("DELETED", "s")]
    assert time.monotonic() - began < 5     # the server closed the stream at timeoutSeconds


def test_watch_selector_transitions_and_bookmark(v1, kube_namespace):
    start = v1.list_namespaced_config_map(kube_namespace, _request_timeout=5).metadata.resource_version
    v1.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}}, _request_timeout=5)
    v1.patch_namespaced_config_map("cm", kube_namespace, {"metadata": {"labels": {"on": "yes"}}}, _request_timeout=5)
    v1.patch_namespaced_config_map("cm", kube_namespace, {"metadata": {"labels": {"on": None}}}, _request_timeout=5)
    stream = watch.Watch()
    events = [e["type"] for e in stream.stream(v1.list_namespaced_config_map, kube_namespace, label_selector="on=yes",
                                               resource_version=start, timeout_seconds=1,
                                               allow_watch_bookmarks=True, _request_timeout=10)]
    assert events == ["ADDED", "DELETED", "BOOKMARK"]


def test_watch_too_old_resource_version_is_410():
    # its own server: a history of 3 events (the session's is long)
    with FakeApiServer(history_limit=3) as server, server.api_client() as api:
        v1 = client.CoreV1Api(api)
        first = v1.create_namespaced_secret("default", {"metadata": {"generateName": "s-"}}, _request_timeout=5)
        for _ in range(5):
            v1.create_namespaced_secret("default", {"metadata": {"generateName": "s-"}}, _request_timeout=5)
        stream = watch.Watch().stream(v1.list_namespaced_secret, "default", timeout_seconds=2, _request_timeout=10,
                                      resource_version=first.metadata.resource_version)
        with pytest.raises(ApiException) as info:
            next(stream)
        assert info.value.status == 410 and "too old resource version" in info.value.reason
        response = v1.list_namespaced_secret("default", watch=True, timeout_seconds=1, resource_version="1",
                                             _preload_content=False, _request_timeout=10)
        event = json.loads(response.data.splitlines()[0])
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert event["object"]["reason"] == "Expired"


def test_a_watch_ends_on_the_server_as_soon_as_its_client_hangs_up():
    # as a real API server's: the fake's went on waiting for its next event or bookmark
    # (here none comes before the watch's 290 s), holding its thread and connection
    with FakeApiServer(bookmark_interval=0) as server, server.api_client() as api:
        response = client.CoreV1Api(api).list_namespaced_pod(
            "default", watch=True, timeout_seconds=290, allow_watch_bookmarks=True,
            _preload_content=False, _request_timeout=10)
        assert len(server._http._connections) == 1
        response.close()
        wait_until(lambda: not server._http._connections, "the server's end of the watch", WAIT)


# --------------------------------------------------------------------------- pods really run


def test_pod_runs_to_success_with_logs(v1, kube_namespace):
    pod = v1.create_namespaced_pod(kube_namespace, pod_body("print('hi')"), _request_timeout=5)
    name = pod.metadata.name
    done = wait_pod(v1, kube_namespace, name, phase_in("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded"
    state = done.status.container_statuses[0].state.terminated
    assert (state.exit_code, state.reason) == (0, "Completed")
    assert done.status.pod_ip == "127.0.0.1" and done.spec.node_name
    assert {c.type: c.status for c in done.status.conditions}["PodScheduled"] == "True"
    assert v1.read_namespaced_pod_log(name, kube_namespace, _request_timeout=5) == "hi\n"
    follow = v1.read_namespaced_pod_log(name, kube_namespace, follow=True, _preload_content=False,
                                        _request_timeout=10)
    assert follow.data == b"hi\n"
    assert v1.read_namespaced_pod_status(name, kube_namespace, _request_timeout=5).status.phase == "Succeeded"


def test_follow_streams_while_running(v1, kube_namespace):
    code = "import sys; print('one', flush=True); sys.stdin.read() if False else __import__('time').sleep(0.5); print('two')"
    pod = v1.create_namespaced_pod(kube_namespace, pod_body(code), _request_timeout=5)
    name = pod.metadata.name
    wait_pod(v1, kube_namespace, name, phase_in("Running", "Succeeded"))
    lines = list(watch.Watch().stream(v1.read_namespaced_pod_log, name, kube_namespace, _request_timeout=10))
    assert lines == ["one", "two"]
    assert v1.read_namespaced_pod_log(name, kube_namespace, tail_lines=1, _request_timeout=5) == "two\n"


def test_pod_exit_code_three_fails(v1, kube_namespace):
    pod = v1.create_namespaced_pod(kube_namespace, pod_body("import sys; sys.exit(3)"), _request_timeout=5)
    done = wait_pod(v1, kube_namespace, pod.metadata.name, phase_in("Succeeded", "Failed"))
    state = done.status.container_statuses[0].state.terminated
    assert (done.status.phase, state.exit_code, state.reason) == ("Failed", 3, "Error")


def test_env_from_secret_and_downward_api(v1, kube_namespace):
    v1.create_namespaced_secret(kube_namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}},
                                _request_timeout=5)
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
           {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "GREETING", "value": "hello $(TOKEN)"}]
    code = "import os; print(os.environ['TOKEN'], os.environ['POD'], os.environ['GREETING'], os.getcwd())"
    pod = v1.create_namespaced_pod(kube_namespace, pod_body(code, container={"env": env}), _request_timeout=5)
    wait_pod(v1, kube_namespace, pod.metadata.name, phase_in("Succeeded", "Failed"))
    log = v1.read_namespaced_pod_log(pod.metadata.name, kube_namespace, _request_timeout=5)
    assert log == f"s3cret {pod.metadata.name} hello s3cret {os.getcwd()}\n"


def test_missing_secret_keeps_pod_waiting(v1, kube_namespace):
    env = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]
    pod = v1.create_namespaced_pod(kube_namespace, pod_body(container={"env": env}), _request_timeout=5)

    def waiting(p):
        return p.status.container_statuses and p.status.container_statuses[0].state.waiting
    done = wait_pod(v1, kube_namespace, pod.metadata.name, waiting)
    assert done.status.container_statuses[0].state.waiting.reason == "CreateContainerConfigError"
    assert done.status.container_statuses[0].state.waiting.message == 'secret "absent" not found'


def test_delete_running_pod_stops_its_process(v1, kube_namespace, fake_kube):
    pod = v1.create_namespaced_pod(kube_namespace, pod_body("import time; time.sleep(60)"), _request_timeout=5)
    name = pod.metadata.name
    wait_pod(v1, kube_namespace, name, phase_in("Running"))
    assert f"{kube_namespace}/{name}" in fake_kube.running_pods()
    deleted = v1.delete_namespaced_pod(name, kube_namespace, _request_timeout=5)
    assert deleted.metadata.deletion_timestamp is not None
    assert deleted.metadata.deletion_grace_period_seconds == 30
    wait_gone(v1.list_namespaced_pod, v1.read_namespaced_pod, kube_namespace, name)
    assert f"{kube_namespace}/{name}" not in fake_kube.running_pods()


def test_deletion_reaching_the_kubelet_after_the_pod_ended_completes(v1, kube_namespace, fake_kube):
    """A graceful delete accepted while the pod still looked Running, but seen
    by the kubelet only after its containers ended, must still remove the pod
    (the garbage collector's cascade races a worker exiting on its own)."""
    from tests.kube._meta import PODS, rfc3339
    from tests.kube._api import Api
    pod = v1.create_namespaced_pod(kube_namespace, pod_body("pass"), _request_timeout=5)
    name = pod.metadata.name
    wait_pod(v1, kube_namespace, name, phase_in("Succeeded"))
    marked = fake_kube.store.update(Api.key(PODS, kube_namespace, name), lambda obj: obj["metadata"].update(
        deletionTimestamp=rfc3339(time.time() + 30), deletionGracePeriodSeconds=30))
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 30
    wait_gone(v1.list_namespaced_pod, v1.read_namespaced_pod, kube_namespace, name, timeout=10)


def test_unschedulable_pod_stays_pending(v1, kube_namespace):
    pod = pod_body(container={"resources": {"requests": {"cpu": "1000"}}})
    created = v1.create_namespaced_pod(kube_namespace, pod, _request_timeout=5)

    def unschedulable(p):
        return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in p.status.conditions or [])
    done = wait_pod(v1, kube_namespace, created.metadata.name, unschedulable)
    condition = next(c for c in done.status.conditions if c.type == "PodScheduled")
    assert condition.status == "False" and condition.message.startswith("0/1 nodes are available: 1 Insufficient cpu.")
    assert done.status.phase == "Pending" and not done.spec.node_name


def test_image_pull_failure_backs_off(v1, kube_namespace, fake_kube):
    fake_kube.fail_image_pulls("registry.invalid/nope:1")
    created = v1.create_namespaced_pod(kube_namespace, pod_body(image="registry.invalid/nope:1"), _request_timeout=5)

    def reason(p):
        statuses = p.status.container_statuses or []
        return statuses[0].state.waiting.reason if statuses and statuses[0].state.waiting else None
    wait_pod(v1, kube_namespace, created.metadata.name, lambda p: reason(p) == "ErrImagePull")
    done = wait_pod(v1, kube_namespace, created.metadata.name, lambda p: reason(p) == "ImagePullBackOff")
    assert done.status.phase == "Pending"
    status, body, _ = error_of(v1.read_namespaced_pod_log, created.metadata.name, kube_namespace)
    assert status == 400 and "is waiting to start" in body["message"]


def test_eviction_fails_the_pod(v1, kube_namespace, fake_kube):
    pod = v1.create_namespaced_pod(kube_namespace, pod_body("import time; time.sleep(60)"), _request_timeout=5)
    wait_pod(v1, kube_namespace, pod.metadata.name, phase_in("Running"))
    fake_kube.evict_pod(kube_namespace, pod.metadata.name)
    done = wait_pod(v1, kube_namespace, pod.metadata.name, lambda p: p.status.reason == "Evicted"
                    and p.status.container_statuses[0].state.terminated)
    assert done.status.phase == "Failed" and "low on resource" in done.status.message


# --------------------------------------------------------------------------- deletion and garbage collection


def owned_by(owner) -> dict:
    return {"ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner.metadata.name,
                                 "uid": owner.metadata.uid}]}


def test_delete_cascades_to_dependents(v1, kube_namespace):
    owner = v1.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "owner"}}, _request_timeout=5)
    v1.create_namespaced_secret(kube_namespace, {"metadata": {"name": "child", **owned_by(owner)}}, _request_timeout=5)
    pod = v1.create_namespaced_pod(kube_namespace, pod_body("import time; time.sleep(60)", metadata=owned_by(owner)),
                                   _request_timeout=5)
    wait_pod(v1, kube_namespace, pod.metadata.name, phase_in("Running"))
    v1.delete_namespaced_config_map("owner", kube_namespace, propagation_policy="Background", _request_timeout=5)
    wait_gone(v1.list_namespaced_secret, v1.read_namespaced_secret, kube_namespace, "child")
    wait_gone(v1.list_namespaced_pod, v1.read_namespaced_pod, kube_namespace, pod.metadata.name)


def test_orphan_and_foreground_deletion(v1, kube_namespace):
    owner = v1.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "o1"}}, _request_timeout=5)
    v1.create_namespaced_secret(kube_namespace, {"metadata": {"name": "kept", **owned_by(owner)}}, _request_timeout=5)
    v1.delete_namespaced_config_map("o1", kube_namespace, propagation_policy="Orphan", _request_timeout=5)
    wait_gone(v1.list_namespaced_config_map, v1.read_namespaced_config_map, kube_namespace, "o1")
    assert v1.read_namespaced_secret("kept", kube_namespace, _request_timeout=5).metadata.owner_references is None

    owner = v1.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "o2"}}, _request_timeout=5)
    v1.create_namespaced_secret(kube_namespace, {"metadata": {"name": "dep", **owned_by(owner)}}, _request_timeout=5)
    v1.delete_namespaced_config_map("o2", kube_namespace, propagation_policy="Foreground", _request_timeout=5)
    wait_gone(v1.list_namespaced_config_map, v1.read_namespaced_config_map, kube_namespace, "o2")
    status, _, _ = error_of(v1.read_namespaced_secret, "dep", kube_namespace)
    assert status == 404


def test_patch_update_conflict_and_status_subresource(v1, kube_namespace, fake_kube):
    fake_kube.fail_image_pulls(PULL_FAILS)
    pod = v1.create_namespaced_pod(kube_namespace, pod_body(name="pp", image=PULL_FAILS), _request_timeout=5)
    patched = v1.patch_namespaced_pod("pp", kube_namespace, {"metadata": {"labels": {"a": "b"}}}, _request_timeout=5)
    assert patched.metadata.labels == {"a": "b"}
    assert int(patched.metadata.resource_version) > int(pod.metadata.resource_version)
    body = v1.api_client.sanitize_for_serialization(pod)   # carries the old resourceVersion
    body["metadata"]["labels"] = {"c": "d"}
    status, error, _ = error_of(v1.replace_namespaced_pod, "pp", kube_namespace, body)
    assert (status, error["reason"]) == (409, "Conflict")
    assert "the object has been modified" in error["message"]
    ignored = v1.patch_namespaced_pod("pp", kube_namespace, {"status": {"phase": "Succeeded"}}, _request_timeout=5)
    assert ignored.status.phase == "Pending"    # status changes go through /status only


# --------------------------------------------------------------------------- jobs


def job_body(code: str, completions: int = 1, parallelism: int = 1, backoff_limit: int = 0) -> dict:
    return {"metadata": {"generateName": "job-"}, "spec": {
        "completions": completions, "parallelism": parallelism, "backoffLimit": backoff_limit,
        "template": {"spec": {"restartPolicy": "Never", "containers": [
            {"name": "main", "image": IMAGE, "command": ["python", "-c", code]}]}}}}


def job_done(job) -> bool:
    return any(c.type in ("Complete", "Failed") and c.status == "True" for c in job.status.conditions or [])


def test_job_runs_completions_one_at_a_time(v1, batch, kube_namespace):
    job = batch.create_namespaced_job(kube_namespace, job_body("print('done')", completions=2, backoff_limit=1),
                                      _request_timeout=5)
    name, most_active = job.metadata.name, 0

    def done_tracking_parallelism(observed) -> bool:
        nonlocal most_active
        most_active = max(most_active, observed.status.active or 0)
        return job_done(observed)
    done = wait_for(batch.list_namespaced_job, batch.read_namespaced_job, kube_namespace, name,
                    done_tracking_parallelism)
    assert most_active <= 1
    assert [c.type for c in done.status.conditions] == ["SuccessCriteriaMet", "Complete"]
    assert (done.status.succeeded, done.status.failed, done.status.active) == (2, None, None)
    pods = v1.list_namespaced_pod(kube_namespace, label_selector=f"job-name={name}", _request_timeout=5).items
    assert len(pods) == 2 and all(p.status.phase == "Succeeded" for p in pods)
    for pod in pods:
        assert pod.metadata.labels["controller-uid"] == job.metadata.uid
        ref = pod.metadata.owner_references[0]
        assert (ref.kind, ref.name, ref.uid, ref.controller) == ("Job", name, job.metadata.uid, True)


def test_job_backoff_limit_exceeded(batch, v1, kube_namespace):
    job = batch.create_namespaced_job(kube_namespace, job_body("raise SystemExit(1)", backoff_limit=1),
                                      _request_timeout=5)
    done = wait_for(batch.list_namespaced_job, batch.read_namespaced_job, kube_namespace, job.metadata.name, job_done)
    failed = next(c for c in done.status.conditions if c.type == "Failed")
    assert (failed.reason, done.status.failed) == ("BackoffLimitExceeded", 2)
    pods = v1.list_namespaced_pod(kube_namespace, label_selector=f"job-name={job.metadata.name}", _request_timeout=5)
    assert sorted(p.status.phase for p in pods.items) == ["Failed", "Failed"]


def test_job_delete_background_removes_pods_default_orphans(batch, v1, kube_namespace):
    kept = batch.create_namespaced_job(kube_namespace, job_body("import time; time.sleep(60)"), _request_timeout=5)
    gone = batch.create_namespaced_job(kube_namespace, job_body("import time; time.sleep(60)"), _request_timeout=5)
    pods = {}
    for job in (kept, gone):
        wait_for(batch.list_namespaced_job, batch.read_namespaced_job, kube_namespace, job.metadata.name,
                 lambda j: j.status.ready == 1)
        listed = v1.list_namespaced_pod(kube_namespace, label_selector=f"job-name={job.metadata.name}",
                                        _request_timeout=5).items
        pods[job.metadata.name] = listed[0].metadata.name
    _, _, headers = batch.delete_namespaced_job_with_http_info(kept.metadata.name, kube_namespace,
                                                               _request_timeout=5)
    assert "child pods are preserved by default" in headers["Warning"]
    batch.delete_namespaced_job(gone.metadata.name, kube_namespace, propagation_policy="Background",
                                _request_timeout=5)
    wait_gone(v1.list_namespaced_pod, v1.read_namespaced_pod, kube_namespace, pods[gone.metadata.name])
    orphan = v1.read_namespaced_pod(pods[kept.metadata.name], kube_namespace, _request_timeout=5)
    assert orphan.status.phase == "Running"


# --------------------------------------------------------------------------- faults and RBAC


def test_injected_429_and_500(v1, kube_namespace, fake_kube):
    fake_kube.inject_errors(429, count=1, verb="create", resource="secrets", retry_after=0)
    status, body, headers = error_of(v1.create_namespaced_secret, kube_namespace, {"metadata": {"name": "s"}})
    assert (status, body["reason"], headers.get("Retry-After")) == (429, "TooManyRequests", "0")
    v1.create_namespaced_secret(kube_namespace, {"metadata": {"name": "s"}}, _request_timeout=5)  # next one passes

    before = fake_kube.count_requests(verb="get", resource="secrets")
    fake_kube.inject_errors(429, count=2, verb="get", resource="secrets", retry_after=0)
    assert v1.read_namespaced_secret("s", kube_namespace, _request_timeout=5).metadata.name == "s"
    assert fake_kube.count_requests(verb="get", resource="secrets") - before == 3   # urllib3 honoured Retry-After

    fake_kube.inject_errors(500, count=1, resource="secrets", retry_after=None)
    status, body, _ = error_of(v1.list_namespaced_secret, kube_namespace)
    assert (status, body["reason"]) == (500, "InternalError")


def test_forbidden_has_the_real_message(v1, kube_namespace, fake_kube):
    fake_kube.forbid("create", "pods")
    status, body, _ = error_of(v1.create_namespaced_pod, kube_namespace, pod_body())
    assert (status, body["reason"]) == (403, "Forbidden")
    assert body["message"] == (f'pods is forbidden: User "system:serviceaccount:default:fibrl" cannot create '
                               f'resource "pods" in API group "" in the namespace "{kube_namespace}"')
    fake_kube.forbid("get", "pods/log")
    status, body, _ = error_of(v1.read_namespaced_pod_log, "x", kube_namespace)
    assert status == 403 and body["message"].startswith('pods "x" is forbidden') and '"pods/log"' in body["message"]


# --------------------------------------------------------------------------- shape against real responses


NOT_EMULATED = {"managedFields"}   # server-side field ownership is not tracked by the fake


def assert_same_shape(expected, actual, path: str = "$") -> None:
    """Every key of the fixture exists in the fake's answer, recursively, with the same JSON type."""
    if expected is None:
        return
    assert type(actual) is type(expected) or {type(actual), type(expected)} <= {int, float}, \
        f"{path}: fixture has {type(expected).__name__}, fake has {type(actual).__name__}"
    if isinstance(expected, dict):
        for key, value in expected.items():
            if key in NOT_EMULATED:
                continue
            assert key in actual, f"{path}.{key} missing in the fake's answer"
            assert_same_shape(value, actual[key], f"{path}.{key}")
    elif isinstance(expected, list) and expected and actual:
        for i, item in enumerate(expected):
            match = _counterpart(item, actual, i)
            assert match is not None, f"{path}[{i}] has no counterpart in the fake's answer"
            assert_same_shape(item, match, f"{path}[{i}]")


def _counterpart(item, candidates: list, index: int):
    """The fake's list entry to compare with: same condition type, else same name, else same position."""
    if isinstance(item, dict) and "type" in item:
        return next((c for c in candidates if isinstance(c, dict) and c.get("type") == item["type"]), None)
    if isinstance(item, dict) and "name" in item:
        same = next((c for c in candidates if isinstance(c, dict) and c.get("name") == item["name"]), None)
        if same is not None:
            return same
    return candidates[min(index, len(candidates) - 1)]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def raw(call, *args, **kwargs) -> tuple[int, dict]:
    response = call(*args, _preload_content=False, _request_timeout=10, **kwargs)
    return response.status, json.loads(response.data)


def raw_error(call, *args, **kwargs) -> dict:
    return error_of(call, *args, **kwargs)[1]


def test_responses_have_the_real_api_shape(v1, batch, kube_namespace, fake_kube):
    pod = v1.create_namespaced_pod(kube_namespace, pod_body(metadata={"labels": {"app": "hello"}}), _request_timeout=5)
    wait_pod(v1, kube_namespace, pod.metadata.name, phase_in("Succeeded"))
    assert_same_shape(fixture("pod_get.json"), raw(v1.read_namespaced_pod, pod.metadata.name, kube_namespace)[1])
    listing = raw(v1.list_namespaced_pod, kube_namespace)[1]
    assert_same_shape(fixture("pod_list.json"), listing)
    assert "kind" not in listing["items"][0]    # list items carry no kind/apiVersion on a real server
    stream = v1.list_namespaced_pod(kube_namespace, watch=True, timeout_seconds=1, _preload_content=False,
                                    _request_timeout=10)
    assert_same_shape(fixture("watch_event.json"), json.loads(stream.data.splitlines()[0]))

    fake_kube.fail_image_pulls(PULL_FAILS)
    v1.create_namespaced_pod(kube_namespace, pod_body(name="taken", image=PULL_FAILS), _request_timeout=5)
    assert_same_shape(fixture("status_404.json"), raw_error(v1.read_namespaced_pod, "missing", kube_namespace))
    assert_same_shape(fixture("status_409.json"), raw_error(
        v1.create_namespaced_pod, kube_namespace, pod_body(name="taken", image=PULL_FAILS)))
    assert_same_shape(fixture("status_422.json"), raw_error(
        v1.create_namespaced_pod, kube_namespace, pod_body(name="Bad_Name")))
    fake_kube.forbid("create", "pods")
    assert_same_shape(fixture("status_403.json"), raw_error(v1.create_namespaced_pod, kube_namespace, pod_body()))

    job = batch.create_namespaced_job(kube_namespace, job_body("pass", completions=2, backoff_limit=2),
                                      _request_timeout=5)
    wait_for(batch.list_namespaced_job, batch.read_namespaced_job, kube_namespace, job.metadata.name, job_done)
    assert_same_shape(fixture("job_get.json"), raw(batch.read_namespaced_job, job.metadata.name, kube_namespace)[1])


def test_expired_watch_event_shape():
    # its own server: a history of 1 event (the session's is long)
    with FakeApiServer(history_limit=1) as server, server.api_client() as api:
        v1 = client.CoreV1Api(api)
        for _ in range(3):
            v1.create_namespaced_secret("default", {"metadata": {"generateName": "s-"}}, _request_timeout=5)
        stream = v1.list_namespaced_secret("default", watch=True, resource_version="1", timeout_seconds=1,
                                           _preload_content=False, _request_timeout=10)
        assert_same_shape(fixture("watch_error_410.json"), json.loads(stream.data.splitlines()[0]))


# --------------------------------------------------------------------------- cleanup


def test_stop_kills_every_process():
    # its own server: the test stops it
    server = FakeApiServer().start()
    with server.api_client() as api:
        v1 = client.CoreV1Api(api)
        pod = v1.create_namespaced_pod("default", pod_body("import os, time; print(os.getpid(), flush=True); "
                                                           "time.sleep(60)"), _request_timeout=5)
        wait_pod(v1, "default", pod.metadata.name, phase_in("Running"))
        lines = watch.Watch().stream(v1.read_namespaced_pod_log, pod.metadata.name, "default", _request_timeout=10)
        pid = int(next(lines))
    server.stop()
    assert server.running_pods() == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_docker_mode_runs_a_container(fake_apiserver_docker):
    image = os.environ.get("FIBRL_IMAGE", "fibrl:latest")
    from tests.kube._runtime import docker_image_exists
    if not docker_image_exists(image):
        from conftest import skip_or_fail

        skip_or_fail(f"image {image} is not present locally (docker/build-image.sh)",
                      "CI_REQUIRE_DOCKER")
    with fake_apiserver_docker.api_client() as api:
        v1 = client.CoreV1Api(api)
        # IfNotPresent: a :latest image is pulled (and fails) under the default policy, Always
        pod = v1.create_namespaced_pod("default", pod_body("print('from docker')", image=image,
                                                           container={"imagePullPolicy": "IfNotPresent"}),
                                       _request_timeout=5)
        done = wait_pod(v1, "default", pod.metadata.name, phase_in("Succeeded", "Failed"), timeout=60)
        assert done.status.phase == "Succeeded"
        assert done.status.container_statuses[0].container_id.startswith("docker://")
        assert v1.read_namespaced_pod_log(pod.metadata.name, "default", _request_timeout=5) == "from docker\n"
        v1.delete_namespaced_pod(pod.metadata.name, "default", _request_timeout=5)
        wait_gone(v1.list_namespaced_pod, v1.read_namespaced_pod, "default", pod.metadata.name)
    assert docker_leaked_containers(fake_apiserver_docker.settings.instance) == []


def test_docker_containers_get_no_swap_beyond_their_memory_limit():
    """As the kubelet does: a container over its limit is OOM-killed, it does not swap."""
    from tests.kube._runtime import ContainerConfig, DockerContainer

    limit = 12 * 2 ** 20
    args = DockerContainer(ContainerConfig("ns/p", "c", "img", ["python"], None, {}, None,
                                           memory_limit=limit))._run_args()
    assert args[args.index("--memory") + 1] == str(limit)
    assert args[args.index("--memory-swap") + 1] == str(limit)


# --------------------------------------------------------------------------- as strict as a cluster


def _labelled_namespace(v1, **labels) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    v1.create_namespace({"metadata": {"name": name, "labels": labels}}, _request_timeout=5)
    return name


def test_quantities_follow_the_api_servers_grammar(v1, kube_namespace):
    """Only k / Ki are kilo: "512K" is refused as a real API server refuses it."""
    status, body, _ = error_of(v1.create_namespaced_pod, kube_namespace,
                               pod_body(container={"resources": {"limits": {"memory": "512K"}}}))
    assert status == 422 and "must match the regex" in body["message"]
    for good in ("512Ki", "512k", "1e3", "1.5Gi", "100m"):
        v1.create_namespaced_pod(kube_namespace, pod_body(
            container={"resources": {"limits": {"cpu": "100m", "memory": good}}}),
            dry_run="All", _request_timeout=5)


def test_restricted_pod_security_refuses_pods_that_do_not_meet_it(v1):
    namespace = _labelled_namespace(v1, **{"pod-security.kubernetes.io/enforce": "restricted"})
    try:
        status, body, _ = error_of(v1.create_namespaced_pod, namespace, pod_body())
        assert status == 403
        assert 'violates PodSecurity "restricted:latest"' in body["message"]
        assert "runAsNonRoot != true" in body["message"]
        secure = pod_body(securityContext={"runAsNonRoot": True, "runAsUser": 1000,
                                           "seccompProfile": {"type": "RuntimeDefault"}},
                          container={"securityContext": {"allowPrivilegeEscalation": False,
                                                         "capabilities": {"drop": ["ALL"]}}})
        v1.create_namespaced_pod(namespace, secure, _request_timeout=5)
    finally:
        v1.delete_namespace(namespace, _request_timeout=5)


def test_pull_policy_always_fails_for_an_image_only_on_the_node(v1, kube_namespace):
    """fibrl:latest defaults to Always: pulled again from a registry that lacks it."""
    pod = v1.create_namespaced_pod(kube_namespace, pod_body(image="fibrl:latest"), _request_timeout=5)
    assert pod.spec.containers[0].image_pull_policy == "Always"
    wait_pod(v1, kube_namespace, pod.metadata.name, lambda p: any(
        cs.state.waiting and cs.state.waiting.reason in ("ErrImagePull", "ImagePullBackOff")
        for cs in p.status.container_statuses or []))
    loaded = v1.create_namespaced_pod(kube_namespace, pod_body(
        image="fibrl:latest", container={"imagePullPolicy": "IfNotPresent"}), _request_timeout=5)
    done = wait_pod(v1, kube_namespace, loaded.metadata.name, phase_in("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded"


def test_istio_injection_adds_a_sidecar_that_never_exits(v1):
    namespace = _labelled_namespace(v1, **{"istio-injection": "enabled"})
    try:
        pod = v1.create_namespaced_pod(namespace, pod_body(name="w", container={"name": "worker"}),
                                       _request_timeout=5)
        assert [c.name for c in pod.spec.containers] == ["worker", "istio-proxy"]
        # the worker ends, the sidecar runs on (it may start after the worker ended)
        done = wait_pod(v1, namespace, "w", lambda p: {
            cs.name: ("ended" if cs.state.terminated else "running" if cs.state.running else "")
            for cs in p.status.container_statuses or []} == {"worker": "ended",
                                                             "istio-proxy": "running"})
        assert [cs.name for cs in done.status.container_statuses] == ["istio-proxy", "worker"]
        assert done.status.phase == "Running"          # the sidecar still runs
        opted_out = v1.create_namespaced_pod(namespace, pod_body(
            metadata={"annotations": {"sidecar.istio.io/inject": "false"}}), _request_timeout=5)
        assert [c.name for c in opted_out.spec.containers] == ["main"]
    finally:
        v1.delete_namespace(namespace, _request_timeout=5)


def test_pod_ip_is_configurable_to_ipv6():
    # its own server: pods with IP ::1
    with FakeApiServer(pod_ip="::1") as server, server.api_client() as api:
        v1 = client.CoreV1Api(api)
        body = pod_body("import os; print(os.environ['IP'])")
        body["spec"]["containers"][0]["env"] = [{"name": "IP", "valueFrom": {"fieldRef": {
            "fieldPath": "status.podIP"}}}]
        pod = v1.create_namespaced_pod("default", body, _request_timeout=5)
        done = wait_pod(v1, "default", pod.metadata.name, phase_in("Succeeded", "Failed"))
        assert done.status.pod_ip == "::1"
        assert v1.read_namespaced_pod_log(pod.metadata.name, "default", _request_timeout=5) == "::1\n"


def test_quiet_watches_get_periodic_bookmarks():
    # its own server: a bookmark every 0.3 s (the session's: every minute)
    with FakeApiServer(bookmark_interval=0.3) as server, server.api_client() as api:
        v1 = client.CoreV1Api(api)
        rv = v1.list_namespaced_pod("default", _request_timeout=5).metadata.resource_version
        begin = time.monotonic()
        events = [e["type"] for e in watch.Watch().stream(
            v1.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=3,
            allow_watch_bookmarks=True, _request_timeout=15)]
        assert time.monotonic() - begin >= 2.9
        assert events.count("BOOKMARK") >= 3   # about 10 on a quiet machine


def test_a_too_large_resource_version_is_refused_with_retry_after(v1, kube_namespace):
    """As an API server whose watch cache lags behind (after a failover) answers."""
    current = int(v1.list_namespaced_pod(kube_namespace, _request_timeout=5).metadata.resource_version)
    status, body, headers = error_of(v1.list_namespaced_pod, kube_namespace, watch=True,
                                     resource_version=str(current + 1000), timeout_seconds=1)
    assert status == 504 and "Too large resource version" in body["message"]
    assert body["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"
    assert headers.get("Retry-After") == "1"


def test_a_watcher_that_does_not_read_is_closed_and_can_watch_again():
    """As a real API server forces an unresponsive watcher closed: once more events than
    its buffer piled up behind writes the client did not read, the stream ends (no ERROR);
    a watch from the last resourceVersion the client got sees the rest."""
    with FakeApiServer(watcher_buffer=5) as server, server.api_client() as api:
        v1 = client.CoreV1Api(api)
        rv = v1.list_namespaced_secret("default", _request_timeout=5).metadata.resource_version
        resp = v1.list_namespaced_secret("default", watch=True, resource_version=rv,
                                         timeout_seconds=60, _preload_content=False,
                                         _request_timeout=(5, 60))
        blob = base64.b64encode(os.urandom(300_000)).decode()   # ~400 KB an event
        for i in range(40):   # ~16 MB: far more than the socket buffers hold
            v1.create_namespaced_secret("default", {"metadata": {"name": f"big-{i}"},
                                                    "data": {"k": blob}}, _request_timeout=10)
        begin = time.monotonic()
        names = []
        for line in watch.watch.iter_resp_lines(resp):   # now read it all
            event = json.loads(line)
            assert event["type"] == "ADDED", event["type"]
            names.append(event["object"]["metadata"]["name"])
            last = event["object"]["metadata"]["resourceVersion"]
        assert time.monotonic() - begin < 30, "the stream was not closed"
        assert server.api.slow_watchers_closed >= 1 and len(names) < 40
        assert names == [f"big-{i}" for i in range(len(names))]
        rest = [e["object"].metadata.name for e in watch.Watch().stream(
            v1.list_namespaced_secret, "default", resource_version=last, timeout_seconds=1,
            _request_timeout=10)]
        assert names + rest == [f"big-{i}" for i in range(40)]
