"""The node agent's translation of the fake kubelet's store writes into API calls.

tests/kube/node_agent.py runs the fake's kubelet code against a real API server; these
check, with a recording stand-in for ``CoreV1Api``, that a status change becomes a
``pods/status`` replace carrying the resourceVersion read, a conflict reads again, and
the kubelet's "containers gone" becomes a DELETE with grace 0 and the pod's uid as
precondition (what a kubelet sends to finalize a deleted pod).
"""
from __future__ import annotations

import copy
import json
import threading

import pytest

pytest.importorskip("kubernetes")

from tests.kube.node_agent import RemoteStore  # noqa: E402


class _Conflict(Exception):
    status = 409


class _Response:
    def __init__(self, obj: dict):
        self.data = json.dumps(obj).encode()


class _Core:
    """Holds one pod; records the writes the store makes."""

    def __init__(self, pod: dict, conflicts: int = 0):
        self.pod, self.conflicts, self.calls = pod, conflicts, []

    def read_namespaced_pod(self, name, namespace, **_):
        return _Response(self.pod)

    def replace_namespaced_pod_status(self, name, namespace, body, **_):
        self.calls.append(("replace_status", name, copy.deepcopy(body)))
        if self.conflicts:
            self.conflicts -= 1
            raise _Conflict()
        return _Response(body)

    def delete_namespaced_pod(self, name, namespace, body, **_):
        self.calls.append(("delete", name, body))


def _pod(**meta) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "resourceVersion": "7",
                         **meta},
            "spec": {"nodeName": "fibrl-node"}, "status": {"phase": "Pending"}}


def _store(core) -> RemoteStore:
    return RemoteStore(core, threading.Event())


def test_a_status_change_replaces_the_status_with_the_version_read():
    core = _Core(_pod())
    _store(core).update(("pods", "ns", "p"), lambda pod: pod["status"].update(phase="Running"))
    [(verb, name, body)] = core.calls
    assert (verb, name, body["status"]["phase"], body["metadata"]["resourceVersion"]) == \
        ("replace_status", "p", "Running", "7")


def test_a_conflict_reads_the_pod_again_and_retries():
    core = _Core(_pod(), conflicts=1)
    _store(core).update(("pods", "ns", "p"), lambda pod: pod["status"].update(phase="Running"))
    assert [c[0] for c in core.calls] == ["replace_status", "replace_status"]


def test_no_change_writes_nothing():
    core = _Core(_pod())
    _store(core).update(("pods", "ns", "p"), lambda pod: None)
    assert core.calls == []


def test_finishing_a_deleted_pod_is_a_delete_with_grace_0_and_the_uid():
    core = _Core(_pod(deletionTimestamp="2026-01-01T00:00:00Z", deletionGracePeriodSeconds=30))
    _store(core).update(("pods", "ns", "p"),
                        lambda pod: pod["metadata"].update(deletionGracePeriodSeconds=0))
    assert core.calls == [("delete", "p",
                           {"gracePeriodSeconds": 0, "preconditions": {"uid": "u-1"}})]


def test_the_node_status_is_a_complete_node_system_info():
    # the kubernetes client checks a body against the API's types before sending it:
    # a NodeSystemInfo missing a required field (bootID, machineID...) never leaves
    from kubernetes import client

    from tests.kube.node_agent import NodeAgent

    agent = NodeAgent.__new__(NodeAgent)
    agent.node_name, agent._boot_id = "n1", "b1"
    info = agent._node_info()
    names = {json_name: name for name, json_name in client.V1NodeSystemInfo.attribute_map.items()}
    client.V1NodeSystemInfo(**{names[key]: value for key, value in info.items()})
