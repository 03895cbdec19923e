"""Check deploy/rbac.yaml against what fibrl's account did on the real control plane.

The kubernetes tests on the real plane (tests/kube/control-plane.sh) run the backend with
deploy/rbac.yaml's ServiceAccount, so a permission it lacks fails a test (403). This
checks the other direction, from the API server's audit log of that run:

* every (apiGroup, resource, subresource, verb) the Roles of deploy/rbac.yaml grant was
  used by the account at least once, unless a ``# used by:`` note in rbac.yaml names it
  and says who uses it (a grant the tests do not reach);
* every request the account made is one those Roles grant (a request the authorizer
  refused, or one allowed by something other than rbac.yaml, is a finding). A refusal
  of a request the Roles grant and the authorizer allowed at other times in the run is
  not: right after the API server starts (the outage tests restart it) its authorizer
  refuses everything until it has read the Roles, and the backend retries.

The tests bind both Roles to the one account (tests/kube/real_cluster.py), so a grant
counts as used when the account used it, whichever Role the request came under.
Requests made on purpose to be refused (tests that prove a permission is absent) send
the user agent :data:`PROBE_AGENT` and are left out. Non-resource requests (discovery:
``/api``, ``/version``) are granted to every authenticated user by Kubernetes itself.

A note, anywhere in rbac.yaml::

    # used by: <Role> <verb> <resource>[/<subresource>][.<apiGroup>] -- <who, and why no test reaches it>

Usage (CI runs it after the real-plane tests and ``control-plane.sh down``)::

    python tests/kube/rbac_audit.py [--audit-log PATH] [--rbac deploy/rbac.yaml]

Exits 0 when nothing is found, 1 with the findings listed, 2 when it cannot check (no
audit log, or no request of the account in it: the real-plane tests did not run).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
RBAC = REPO / "deploy" / "rbac.yaml"
ACCOUNT = "fibrl"
PROBE_AGENT = "fibrl-tests/rbac-probe"
_NOTE = re.compile(r"^\s*#\s*used by:(.*)$")
_NOTE_BODY = re.compile(r"^\s*(\S+)\s+(\S+)\s+(\S+)\s+--\s+(\S.*)$")


@dataclass(frozen=True, order=True)
class Grant:
    """One permission: what RBAC checks a request against."""

    group: str
    resource: str
    subresource: str
    verb: str

    def __str__(self) -> str:
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{self.verb} {resource}{'.' + self.group if self.group else ''}"


# What Kubernetes' own bootstrap policy grants every authenticated user (ClusterRole
# system:basic-user): a client may ask what it is allowed, whatever its Roles say.
GRANTED_TO_EVERYONE = frozenset({
    Grant("authorization.k8s.io", "selfsubjectaccessreviews", "", "create"),
    Grant("authorization.k8s.io", "selfsubjectrulesreviews", "", "create"),
})


def parse_target(verb: str, target: str) -> Grant:
    """``get``, ``pods/log`` -> Grant("", "pods", "log", "get"); ``jobs.batch`` -> group batch."""
    name, _, group = target.partition(".")
    resource, _, subresource = name.partition("/")
    return Grant(group, resource, subresource, verb)


def role_grants(text: str) -> tuple[dict, list]:
    """{Role name: set of Grant} of the Roles in ``text`` (YAML), and findings about rules
    that cannot be checked (wildcards, resourceNames, non-resource URLs)."""
    roles: dict = {}
    findings = []
    for doc in yaml.safe_load_all(text):
        if not doc or doc.get("kind") not in ("Role", "ClusterRole"):
            continue
        name = doc["metadata"]["name"]
        grants = roles.setdefault(name, set())
        for index, rule in enumerate(doc.get("rules") or []):
            where = f"{doc['kind']} {name}, rule {index + 1}"
            if rule.get("resourceNames") or rule.get("nonResourceURLs"):
                findings.append(f"{where}: resourceNames / nonResourceURLs are not checked "
                                f"here; list plain resources")
            for field in ("apiGroups", "resources", "verbs"):
                if "*" in (rule.get(field) or []):
                    findings.append(f"{where}: wildcard in {field}: name each one, so the "
                                    f"Role stays least-privilege and checkable")
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    for verb in rule.get("verbs") or []:
                        grants.add(parse_target(verb, f"{resource}.{group}" if group
                                                else resource))
    return roles, findings


def notes(text: str, roles: dict) -> tuple[dict, list]:
    """{(Role, Grant): reason} of the ``# used by:`` notes, and findings about notes that
    are malformed or name no grant of that Role."""
    found: dict = {}
    findings = []
    for number, line in enumerate(text.splitlines(), 1):
        note = _NOTE.match(line)
        if not note:
            continue
        body = _NOTE_BODY.match(note.group(1))
        if not body:
            findings.append(f"rbac.yaml line {number}: a `# used by:` note reads "
                            f"`# used by: <Role> <verb> <resource>[/<sub>][.<group>] -- <who>`,"
                            f" not {line.strip()!r}")
            continue
        role, verb, target, reason = body.groups()
        grant = parse_target(verb, target)
        if grant not in roles.get(role, ()):
            findings.append(f"rbac.yaml line {number}: the note names `{grant}` of Role "
                            f"{role}, which that Role does not grant: drop the note")
            continue
        found[(role, grant)] = reason
    return found, findings


@dataclass(frozen=True)
class Call:
    grant: Grant
    decision: str     # the authorizer's: "allow" or "forbid" ("" when not recorded)
    code: int
    uri: str


def account_calls(lines: Iterable[str], account: str) -> tuple[list, int]:
    """The account's resource requests in audit log ``lines`` (JSON, one event a line,
    stage ResponseComplete), and how many of its requests were left out (probes,
    non-resource requests)."""
    calls, left_out = [], 0
    user = re.compile(rf"^system:serviceaccount:[^:]+:{re.escape(account)}$")
    for line in lines:
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("stage") not in ("ResponseComplete", "Panic"):
            continue
        if not user.match((event.get("user") or {}).get("username", "")):
            continue
        ref = event.get("objectRef")
        if ref is None or (event.get("userAgent") or "").startswith(PROBE_AGENT):
            left_out += 1
            continue
        grant = Grant(ref.get("apiGroup", ""), ref.get("resource", ""),
                      ref.get("subresource", ""), event["verb"])
        annotations = event.get("annotations") or {}
        calls.append(Call(grant, annotations.get("authorization.k8s.io/decision", ""),
                          (event.get("responseStatus") or {}).get("code", 0),
                          event.get("requestURI", "")))
    return calls, left_out


def check(rbac_text: str, calls: list) -> list:
    """The findings: unused grants without a note, calls rbac.yaml does not grant."""
    roles, findings = role_grants(rbac_text)
    justified, note_findings = notes(rbac_text, roles)
    findings += note_findings
    granted = set().union(*roles.values()) if roles else set()
    used = {call.grant for call in calls}
    for role in sorted(roles):
        for grant in sorted(roles[role] - used):
            if (role, grant) not in justified:
                findings.append(f"Role {role} grants `{grant}`, which the account never "
                                f"used: remove it, or say who uses it in a note "
                                f"`# used by: {role} {grant.verb} "
                                f"{_target(grant)} -- <who>`")
    refused: dict = {}
    for call in calls:
        # the authorizer's word: a 403 it allowed is admission's (a pod that breaks a policy)
        if call.decision == "forbid" or (not call.decision and call.code == 403):
            refused.setdefault(call.grant, call)
        elif call.grant not in granted and call.grant not in GRANTED_TO_EVERYONE:
            findings.append(f"the account's `{call.grant}` ({call.uri}) was allowed, but "
                            f"no Role of rbac.yaml grants it: something else does")
    allowed = {call.grant for call in calls
               if call.decision == "allow" or (not call.decision and call.code != 403)}
    for grant, call in sorted(refused.items()):
        if grant in granted and grant in allowed:
            continue   # refused while the restarted API server had not read the Roles yet
        findings.append(f"the account's `{grant}` ({call.uri}) was refused (403): grant it "
                        f"in rbac.yaml, or stop making the call")
    return sorted(set(findings))


def _target(grant: Grant) -> str:
    return str(grant).split(" ", 1)[1]


def audit_files(path: str) -> list:
    """The log and its rotated backups (``audit-<time>.log``), oldest first."""
    stem, ext = os.path.splitext(path)
    return sorted(glob.glob(f"{glob.escape(stem)}-*{ext}")) + [path]


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    state = os.environ.get("FIBRL_KUBE_STATE", "/tmp/fibrl-kube-plane")
    parser.add_argument("--audit-log", default=os.path.join(state, "audit.log"),
                        help="the API server's audit log (control-plane.sh audit-log)")
    parser.add_argument("--rbac", default=str(RBAC), help="the Roles to check")
    parser.add_argument("--account", default=ACCOUNT, help="the ServiceAccount's name")
    args = parser.parse_args(argv)
    if not os.path.exists(args.audit_log):
        print(f"rbac-audit: no audit log at {args.audit_log}: run the real-plane tests "
              f"(tests/kube/control-plane.sh up) first", file=sys.stderr)
        return 2
    calls, left_out = [], 0
    for path in audit_files(args.audit_log):
        with open(path) as lines:
            more, skipped = account_calls(lines, args.account)
        calls += more
        left_out += skipped
    if not calls:
        print(f"rbac-audit: {args.audit_log} holds no request of ServiceAccount "
              f"{args.account}: did the real-plane tests run?", file=sys.stderr)
        return 2
    findings = check(Path(args.rbac).read_text(), calls)
    kinds = sorted({str(call.grant) for call in calls})
    print(f"rbac-audit: {len(calls)} requests of ServiceAccount {args.account} "
          f"({len(kinds)} kinds: {', '.join(kinds)}; {left_out} probes and discovery "
          f"requests left out)", file=sys.stderr)
    for finding in findings:
        print(f"rbac-audit: FINDING: {finding}", file=sys.stderr)
    if not findings:
        print(f"rbac-audit: {args.rbac} grants exactly what the account used", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
