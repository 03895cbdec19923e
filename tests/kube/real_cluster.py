"""Prepare a real cluster for the kubernetes tests, as a user would for fibrl.

Given an admin kubeconfig (``FIBRL_TEST_KUBECONFIG``), :func:`service_account_kubeconfig`
creates the test namespace, applies ``deploy/rbac.yaml`` there, binds the launcher role
to the same ServiceAccount (the docs' ``kubectl create rolebinding ... --role=fibrl-launcher``)
and writes a kubeconfig holding that account's token. The backend then runs with exactly
the permissions deploy/rbac.yaml grants: a missing one fails a test, decided by the API
server's own RBAC authorizer.
"""
from __future__ import annotations

import base64
import os
import tempfile
import time
from pathlib import Path

import yaml

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "rbac.yaml"
ACCOUNT = "fibrl"
TOKEN_TIMEOUT = 60.0


def _create(call, *args, **kwargs) -> None:
    """``call`` creating an object; one that exists already is kept."""
    from kubernetes.client.rest import ApiException

    try:
        call(*args, **kwargs, _request_timeout=10)
    except ApiException as exc:
        if exc.status != 409:
            raise


def _apply_rbac(api, namespace: str) -> None:
    from kubernetes import client

    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    _create(core.create_namespace, {"metadata": {"name": namespace}})
    create = {"ServiceAccount": core.create_namespaced_service_account,
              "Role": rbac.create_namespaced_role, "RoleBinding": rbac.create_namespaced_role_binding}
    for doc in yaml.safe_load_all(RBAC.read_text()):
        if doc:
            _create(create[doc["kind"]], namespace, doc)
    _create(rbac.create_namespaced_role_binding, namespace, {
        "metadata": {"name": "fibrl-launcher-tests"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "fibrl-launcher"},
        "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}]})


def _token(api, namespace: str) -> tuple[str, str]:
    """The account's token and CA, once the token controller has made its Secret."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    deadline = time.monotonic() + TOKEN_TIMEOUT
    while True:
        account = core.read_namespaced_service_account(ACCOUNT, namespace, _request_timeout=10)
        for ref in account.secrets or []:
            secret = core.read_namespaced_secret(ref.name, namespace, _request_timeout=10)
            if secret.type == "kubernetes.io/service-account-token" and (secret.data or {}).get("token"):
                return base64.b64decode(secret.data["token"]).decode(), secret.data.get("ca.crt", "")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no token for ServiceAccount {namespace}/{ACCOUNT} after "
                               f"{TOKEN_TIMEOUT:.0f} s: is the controller-manager running "
                               f"(--service-account-private-key-file)?")
        time.sleep(0.5)


def service_account_kubeconfig(admin_kubeconfig: str, namespace: str) -> str:
    """Path of a kubeconfig for deploy/rbac.yaml's ServiceAccount in ``namespace``."""
    from kubernetes import config

    with config.new_client_from_config(config_file=admin_kubeconfig) as api:
        _apply_rbac(api, namespace)
        token, ca = _token(api, namespace)
        server = api.configuration.host
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fibrl",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": ACCOUNT, "user": {"token": token}}],
        "contexts": [{"name": "fibrl", "context": {"cluster": "test", "user": ACCOUNT, "namespace": namespace}}]}
    fd, path = tempfile.mkstemp(prefix="fibrl-sa-", suffix=".kubeconfig")
    with os.fdopen(fd, "w") as out:
        yaml.safe_dump(kubeconfig, out)
    return path
