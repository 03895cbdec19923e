"""Every manifest fibrl generates or ships, validated against the official schemas.

``kubernetes-validate`` in strict mode (unknown fields are errors) for the
oldest and the newest kubernetes version fibrl supports; and deploy/rbac.yaml
grants exactly what the backend asks for.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require_module

from fibrl.backends import JobSpec
from fibrl.backends.kubernetes.api import OPTIONAL_PERMISSIONS, REQUIRED_PERMISSIONS
from fibrl.backends.kubernetes.manifests import (launcher_job, owner_reference,
                                                 secret_manifest, worker_pod)
from fibrl.backends.kubernetes.settings import (NEWEST_KUBERNETES, OLDEST_KUBERNETES,
                                                KubeSettings, PodIdentity, pod_name)
from fibrl.config import Config
from fibrl.errors import ConfigError


kubernetes_validate = require_module("kubernetes_validate")
yaml = require_module("yaml")

VERSIONS = [OLDEST_KUBERNETES, NEWEST_KUBERNETES]
RBAC = Path(__file__).resolve().parents[2] / "deploy" / "rbac.yaml"

FULL = KubeSettings.from_config(Config(
    kubernetes_namespace="team-a", kubernetes_service_account="fibrl",
    kubernetes_node_selector="disktype=ssd,cloud.google.com/gke-accelerator=nvidia-l4",
    kubernetes_tolerations='[{"key": "nvidia.com/gpu", "operator": "Exists", '
                           '"effect": "NoSchedule"}, {"key": "spot", "operator": "Equal", '
                           '"value": "true", "effect": "NoExecute", "tolerationSeconds": 60}]',
    kubernetes_image_pull_secrets="regcred", kubernetes_labels="team=rl,app.example.com/part=x",
    kubernetes_env="OMP_NUM_THREADS=1,EMPTY="))
BARE = KubeSettings.from_config(Config())


def _spec(**kw):
    base = dict(command=("python", "-m", "fibrl.bootstrap", "tcp://10.0.0.7:41234", "handover-3"),
                image="fibrl:latest",
                env={"FIBRL_SECRET": "ab" * 32, "FIBRL_RUN_ID": "3f2a9c01be77"},
                labels={"fibrl.run": "3f2a9c01be77", "fibrl.parent": "4242",
                        "fibrl.role": "process"},
                name="SpawnPoolWorker-1:3", workdir="/app")
    base.update(kw)
    return JobSpec(**base)


def _pod(settings, spec, owner=True):
    labels = dict(spec.labels, **{"fibrl.owner": "0a1b2c3d4e5f", "fibrl.backend": "kubernetes"})
    parent = owner_reference(PodIdentity("fibrl-run-3f2a-x1", "team-a",
                                         "0b5ad1f2-5c3e-4c57-9f3e-8d2b6a7c9e10"))
    return worker_pod(spec, settings, name=pod_name(spec.name), namespace="team-a",
                      image=spec.image, secret_name="fibrl-3f2a9c01be77-0123456789",
                      labels=labels, owner=parent if owner else None, workdir=spec.workdir)


MANIFESTS = {
    "worker pod, every option": lambda: _pod(FULL, _spec(cpu=1.5, memory="2g", gpu=1)),
    "worker pod, defaults": lambda: _pod(BARE, _spec(workdir=""), owner=False),
    "worker pod, meta resources": lambda: _pod(BARE, _spec(cpu=0.25, memory="512Mi")),
    "secret": lambda: secret_manifest(
        "fibrl-3f2a9c01be77-0123456789", "team-a", "ab" * 32,
        {"fibrl.run": "3f2a9c01be77", "fibrl.owner": "0a1b2c3d4e5f", "fibrl.backend": "kubernetes"},
        owner_reference(PodIdentity("p", "team-a", "u-1"))),
    "launcher job, every option": lambda: launcher_job(
        name="fibrl-run-3f2a9c01be77", namespace="team-a", run_id="3f2a9c01be77",
        image="registry.example.com/rl/walker:3f2a9c01be77",
        command=("python", "train.py", "--steps", "100"), env={"WANDB_MODE": "offline"},
        settings=FULL, service_account="fibrl", cpu=4, memory="16g", gpu=2),
    "launcher job, defaults": lambda: launcher_job(
        name="fibrl-run-ab", namespace="default", run_id="ab", image="fibrl:latest",
        command=("python", "train.py"), env={}, settings=BARE, service_account=""),
}


def _rbac_documents():
    return [doc for doc in yaml.safe_load_all(RBAC.read_text()) if doc]


def test_supported_versions_are_shipped_by_kubernetes_validate():
    shipped = {v.rsplit(".", 1)[0] for v in kubernetes_validate.utils.all_versions()}
    assert set(VERSIONS) <= shipped, sorted(shipped)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("which", sorted(MANIFESTS))
def test_generated_manifests_are_valid(which, version):
    kubernetes_validate.validate(MANIFESTS[which](), version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_shipped_rbac_manifest_is_valid(version):
    documents = _rbac_documents()
    assert {d["kind"] for d in documents} == {"ServiceAccount", "Role", "RoleBinding"}
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)


def test_strict_validation_catches_a_bad_field():
    pod = MANIFESTS["worker pod, defaults"]()
    pod["spec"]["restartPolice"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, NEWEST_KUBERNETES, strict=True)


def _granted(role):
    granted = set()
    for rule in role["rules"]:
        for resource in rule["resources"]:
            granted |= {(verb, resource) for verb in rule["verbs"]}
    return granted


def test_parent_role_grants_exactly_what_the_backend_needs():
    role = next(d for d in _rbac_documents()
                if d["kind"] == "Role" and d["metadata"]["name"] == "fibrl-parent")
    assert _granted(role) == set(REQUIRED_PERMISSIONS) | set(OPTIONAL_PERMISSIONS)
    # workers run as this account: it must not read the namespace's Secrets
    assert not {("get", "secrets"), ("list", "secrets"), ("watch", "secrets")} & _granted(role)
    binding = next(d for d in _rbac_documents() if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == "fibrl-parent"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fibrl"}]


def test_launcher_role_covers_run_ps_logs_stop():
    role = next(d for d in _rbac_documents()
                if d["kind"] == "Role" and d["metadata"]["name"] == "fibrl-launcher")
    needed = {("create", "jobs"), ("list", "jobs"), ("delete", "jobs"), ("get", "jobs"),
              ("list", "pods"), ("watch", "pods"), ("delete", "pods"), ("get", "pods/log"),
              ("list", "secrets"), ("delete", "secrets")}
    assert needed <= _granted(role)


def test_worker_pod_carries_what_the_design_requires():
    pod = MANIFESTS["worker pod, every option"]()
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "Pod"
    assert container["resources"]["limits"] == {"cpu": "1500m", "memory": "2Gi",
                                                "nvidia.com/gpu": "1"}
    secret = [e for e in container["env"] if e["name"] == "FIBRL_SECRET"]
    assert secret == [{"name": "FIBRL_SECRET", "valueFrom": {"secretKeyRef": {
        "name": "fibrl-3f2a9c01be77-0123456789", "key": "secret"}}}]
    assert "ab" * 32 not in str(pod)
    assert pod["spec"]["nodeSelector"]["disktype"] == "ssd"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["labels"]["team"] == "rl"


@pytest.mark.parametrize("which", sorted(k for k in MANIFESTS if k != "secret"))
def test_pods_meet_the_restricted_pod_security_standard(which):
    """A namespace enforcing "restricted" admits every pod fibrl makes (the fake's checks)."""
    from tests.kube._admission import restricted_violations

    obj = MANIFESTS[which]()
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "Job" else obj["spec"]
    assert restricted_violations(spec) == []
    assert spec["securityContext"]["runAsUser"] == 10001      # numeric, as the image's USER
    assert {c["imagePullPolicy"] for c in spec["containers"]} == {"IfNotPresent"}


def test_pods_opt_out_of_mesh_sidecars_and_jobs_expire():
    pod = MANIFESTS["worker pod, defaults"]()
    job = MANIFESTS["launcher job, defaults"]()
    for notes in (pod["metadata"]["annotations"],
                  job["spec"]["template"]["metadata"]["annotations"]):
        assert notes["sidecar.istio.io/inject"] == "false"
        assert notes["linkerd.io/inject"] == "disabled"
    assert job["spec"]["ttlSecondsAfterFinished"] == 3600


def test_pull_policy_user_and_annotations_are_configurable():
    settings = KubeSettings.from_config(Config(
        kubernetes_image_pull_policy="Always", kubernetes_run_as_user=0,
        kubernetes_mesh_annotations="", kubernetes_job_ttl=60))
    pod = _pod(settings, _spec())
    assert pod["spec"]["containers"][0]["imagePullPolicy"] == "Always"
    assert "runAsUser" not in pod["spec"]["securityContext"]        # the image's own USER
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert set(pod["metadata"]["annotations"]) == {"fibrl.process-name"}
    job = launcher_job(name="j", namespace="d", run_id="ab", image="i:1", command=("python",),
                       env={}, settings=settings, service_account="")
    assert job["spec"]["ttlSecondsAfterFinished"] == 60
    with pytest.raises(ConfigError, match="kubernetes_image_pull_policy"):
        KubeSettings.from_config(Config(kubernetes_image_pull_policy="Sometimes"))


def test_rbac_documents_binding_the_parent_role_to_a_person():
    """A parent on a laptop needs the parent role bound to its user, not only the launcher's."""
    text = RBAC.read_text()
    assert "--role=fibrl-parent --user=" in text
    assert "--role=fibrl-launcher --user=" in text


def test_pods_of_the_stock_image_run_a_versioned_tag_and_are_not_pulled_again():
    """``:latest`` would make kubernetes' default pull policy Always: an image loaded into
    the nodes (kind load) would be pulled again from a registry that lacks it."""
    import fibrl
    from fibrl.backends.kubernetes.settings import KubeSettings, pod_image
    from fibrl.config import Config

    config = Config()
    assert pod_image(config.image) == f"fibrl:{fibrl.__version__}"
    assert pod_image("registry.example/me/walker:1") == "registry.example/me/walker:1"
    assert KubeSettings.from_config(config).image_pull_policy == "IfNotPresent"
