"""The check of deploy/rbac.yaml against an audit log (tests/kube/rbac_audit.py), on
audit events written here: what it counts as used, refused, unused or justified."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("yaml")
try:
    from tests.kube import rbac_audit as audit
except ModuleNotFoundError:   # "tests" is not a package on sys.path: use this checkout's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.kube import rbac_audit as audit

ROLE = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: parent}
rules:
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["create", "watch"]
  - apiGroups: [""]
    resources: ["pods/log"]
    verbs: ["get"]
  - apiGroups: ["batch"]
    resources: ["jobs"]
    verbs: ["delete"]
"""
USER = "system:serviceaccount:ns:fibrl"


def event(verb, resource, subresource="", group="", user=USER, decision="allow", code=200,
          agent="OpenAPI-Generator/python", stage="ResponseComplete", ref=True):
    found = {"stage": stage, "verb": verb, "user": {"username": user}, "userAgent": agent,
             "requestURI": f"/{resource}", "responseStatus": {"code": code},
             "annotations": {"authorization.k8s.io/decision": decision}}
    if ref:
        found["objectRef"] = {"resource": resource, "namespace": "ns"}
        if subresource:
            found["objectRef"]["subresource"] = subresource
        if group:
            found["objectRef"]["apiGroup"] = group
    return json.dumps(found)


ALL_USED = [event("create", "pods"), event("watch", "pods"),
            event("get", "pods", "log"), event("delete", "jobs", group="batch")]


def findings(lines, rbac=ROLE):
    calls, _ = audit.account_calls(lines, "fibrl")
    return audit.check(rbac, calls)


def test_every_grant_used_and_nothing_else_is_clean():
    assert findings(ALL_USED) == []


def test_an_unused_grant_is_a_finding_naming_it_and_the_note_that_would_justify_it():
    found = findings(ALL_USED[1:])
    assert len(found) == 1
    assert "Role parent grants `create pods`, which the account never used" in found[0]
    assert "`# used by: parent create pods -- <who>`" in found[0]


def test_a_note_justifies_an_unused_grant_and_a_subresource_and_group_parse():
    noted = ROLE + ("# used by: parent get pods/log -- `fibrl logs`\n"
                    "# used by: parent delete jobs.batch -- `fibrl stop`\n")
    assert findings(ALL_USED[:2], noted) == []
    assert len(findings(ALL_USED[:2])) == 2


def test_a_note_naming_no_grant_or_malformed_is_a_finding():
    found = findings(ALL_USED, ROLE + "# used by: parent list secrets -- nobody\n"
                                      "# used by: parent get pods/log\n")
    assert any("names `list secrets` of Role parent, which that Role does not grant" in f
               for f in found)
    assert any("line 15: a `# used by:` note reads" in f for f in found)


def test_a_refused_call_and_one_granted_elsewhere_are_findings():
    found = findings(ALL_USED + [event("get", "secrets", decision="forbid", code=403),
                                 event("list", "nodes")])
    assert any("`get secrets` (/secrets) was refused (403)" in f for f in found)
    assert any("`list nodes` (/nodes) was allowed, but no Role of rbac.yaml grants it" in f
               for f in found)


def test_a_call_the_authorizer_allowed_and_admission_refused_is_no_finding():
    assert findings(ALL_USED + [event("create", "pods", code=403)]) == []
    assert findings(ALL_USED + [event("get", "secrets", decision="", code=403)]) != []


def test_a_granted_call_refused_only_while_the_api_server_restarted_is_no_finding():
    # a restarted API server refuses everything until its authorizer has read the Roles
    assert findings(ALL_USED + [event("watch", "pods", decision="forbid", code=403)]) == []
    assert findings(ALL_USED + [event("watch", "pods", decision="", code=403)]) == []
    # refused every time it was made: the grant does not reach the account
    never = [line for line in ALL_USED if '"watch"' not in line]
    found = findings(never + [event("watch", "pods", decision="forbid", code=403)])
    assert any("`watch pods` (/pods) was refused (403)" in f for f in found)


def test_probes_other_accounts_other_stages_and_discovery_are_left_out():
    others = [event("get", "secrets", decision="forbid", code=403, agent=audit.PROBE_AGENT),
              event("list", "nodes", user="system:serviceaccount:ns:default"),
              event("list", "nodes", user="system:serviceaccount:ns:fibrl-other"),
              event("list", "nodes", stage="ResponseStarted"),
              event("get", "api", ref=False),
              event("create", "selfsubjectaccessreviews", group="authorization.k8s.io")]
    assert findings(ALL_USED + others) == []


def test_wildcards_are_findings():
    wild = ROLE.replace('verbs: ["delete"]', 'verbs: ["*"]')
    assert any("wildcard in verbs" in f for f in findings(ALL_USED, wild))


def test_the_shipped_rbac_yaml_parses_into_the_grants_it_lists():
    roles, found = audit.role_grants(audit.RBAC.read_text())
    assert found == []
    assert audit.Grant("", "pods", "log", "get") in roles["fibrl-parent"]
    assert audit.Grant("batch", "jobs", "", "create") in roles["fibrl-launcher"]
    _, note_findings = audit.notes(audit.RBAC.read_text(), roles)
    assert note_findings == []


def test_main_exit_codes(tmp_path, capsys):
    rbac = tmp_path / "rbac.yaml"
    rbac.write_text(ROLE)
    log = tmp_path / "audit.log"
    assert audit.main(["--audit-log", str(log), "--rbac", str(rbac)]) == 2   # no log
    log.write_text(event("list", "nodes", user="someone") + "\n")
    assert audit.main(["--audit-log", str(log), "--rbac", str(rbac)]) == 2   # no call
    log.write_text("\n".join(ALL_USED[1:]) + "\n")
    assert audit.main(["--audit-log", str(log), "--rbac", str(rbac)]) == 1
    (tmp_path / "audit-2026-01-01T00-00-00.000.log").write_text(ALL_USED[0] + "\n")  # rotated
    assert audit.main(["--audit-log", str(log), "--rbac", str(rbac)]) == 0
    assert "grants exactly what the account used" in capsys.readouterr().err
