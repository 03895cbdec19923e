#!/usr/bin/env bash
# A real Kubernetes control plane for the test suite, on 127.0.0.1 only.
#
#   tests/kube/control-plane.sh build   fetch Debian's kubernetes source and build the binaries
#   tests/kube/control-plane.sh up      build (or reuse) them, start etcd, kube-apiserver,
#                                       kube-controller-manager and kube-scheduler, wait until
#                                       ready; the last line printed is the admin kubeconfig path
#   tests/kube/control-plane.sh down    stop exactly what `up` started
#   tests/kube/control-plane.sh stop-one NAME    stop one of them (kube-apiserver, node-agent, ...)
#   tests/kube/control-plane.sh crash-one NAME   SIGKILL one of them and every process under it,
#                                       as a machine that loses power (node-agent: its pods too)
#   tests/kube/control-plane.sh start-one NAME   start it again with the command `up` gave it
#                                       (kube-apiserver: and wait until it is ready)
#                                       (the tests of outages use these)
#   tests/kube/control-plane.sh audit-log  print the path of the API server's audit log
#
# The API server keeps an audit log (JSON lines, $FIBRL_KUBE_STATE/audit.log, kept after
# `down`): every request of a service account outside kube-system, at Metadata level (who,
# verb, resource, answer; no bodies). tests/kube/rbac_audit.py compares the requests of
# deploy/rbac.yaml's account with what that file grants.
#
# The binaries come from Debian bookworm's `kubernetes` source package (its tarball keeps
# vendor/, so it builds offline with Debian's Go) and are cached outside the repository under
# $FIBRL_KUBE_CACHE/<source version>/bin, so a machine that built them once reuses them.
# The source is fetched through a private apt configuration: the system's sources stay as
# they are. State (certificates, etcd data, logs, pids) lives under $FIBRL_KUBE_STATE.
set -euo pipefail

KUBE_SRC_VERSION=${FIBRL_KUBE_SRC_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}
CACHE=${FIBRL_KUBE_CACHE:-/var/cache/fibrl-kube}
STATE=${FIBRL_KUBE_STATE:-/tmp/fibrl-kube-plane}
BIN=$CACHE/$KUBE_SRC_VERSION/bin
READY_TIMEOUT=${FIBRL_KUBE_READY_TIMEOUT:-300}   # the API server alone took 140 s on a loaded 2-core machine
# start-one kube-apiserver waits this long for it (its data is there already: a restart is
# quicker than the first start); under the 120 s the outage tests give one call of this script
RESTART_TIMEOUT=${FIBRL_KUBE_RESTART_TIMEOUT:-100}
BUILD_PACKAGES="golang-go golang-github-modern-go-reflect2-dev dpkg-dev"
RUN_PACKAGES="etcd-server openssl curl"
COMPONENTS="kube-apiserver kube-controller-manager kube-scheduler"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
NODE_NAME=${FIBRL_KUBE_NODE_NAME:-fibrl-node}

log() { echo "control-plane: $*" >&2; }
took() { log "$1 after $((SECONDS - UP_START)) s"; }   # a phase of `up` done
die() { log "error: $*"; exit 1; }

need_packages() {  # need_packages PACKAGE...: install the missing ones (as root)
    local missing="" p
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
    [ -z "$missing" ] && return 0
    [ "$(id -u)" = 0 ] || die "missing Debian packages:$missing (install them: apt-get install$missing)"
    log "installing$missing"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >&2
}

# apt with a sources list of its own (a bookworm deb-src line) and its own package lists.
private_apt() {
    local dir=$CACHE/apt
    mkdir -p "$dir/lists/partial"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main" \
        > "$dir/sources.list"
    "$@" -o Dir::Etc::SourceList="$dir/sources.list" -o Dir::Etc::SourceParts=/nonexistent \
        -o Dir::State::Lists="$dir/lists"
}

fetch_source() {  # $1: work dir; leaves the unpacked tree at $1/kubernetes
    local work=$1
    if [ ! -f "$work/kubernetes/go.mod" ]; then
        log "fetching the kubernetes $KUBE_SRC_VERSION source package (private apt config)"
        private_apt apt-get update -q >&2
        (cd "$work" && private_apt apt-get source -q --download-only "kubernetes=$KUBE_SRC_VERSION" >&2)
        rm -rf "$work/kubernetes"
        (cd "$work" && dpkg-source -x --no-check kubernetes_*.dsc kubernetes >&2)
    fi
}

# The vendored reflect2 1.0.1 breaks on Go >= 1.18; Debian's 1.0.2 replaces it.
replace_reflect2() {
    local src=$1/vendor/github.com/modern-go/reflect2
    local deb=/usr/share/gocode/src/github.com/modern-go/reflect2
    [ -d "$deb" ] || die "$deb not found (package golang-github-modern-go-reflect2-dev)"
    rm -rf "$src" && cp -r "$deb" "$src"
}

# pkg/generated/openapi is not in the tarball: generate it from the +k8s:openapi-gen tags
# the way the upstream Makefile does, with openapi-gen built from vendor/.
generate_openapi() {
    local src=$1 gopath=$2
    [ -f "$src/pkg/generated/openapi/zz_generated.openapi.go" ] && return 0
    log "generating pkg/generated/openapi"
    (cd "$gopath/src/k8s.io/kubernetes" && go build -o "$gopath/bin/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen)
    local dirs
    dirs=$(cd "$gopath/src/k8s.io/kubernetes" && set +o pipefail &&
        find -L pkg cmd plugin vendor -name '*.go' -not -path 'vendor/k8s.io/code-generator/*' \
            -not -path 'vendor/k8s.io/sample-apiserver/*' -print0 2>/dev/null |
        xargs -0 grep -l '^// *+k8s:openapi-gen=' | xargs -n1 dirname | LC_ALL=C sort -u |
        sed 's,^,k8s.io/kubernetes/,' | paste -sd, -)
    [ -n "$dirs" ] || die "no package with a +k8s:openapi-gen tag found"
    (cd "$gopath/src/k8s.io/kubernetes" && "$gopath/bin/openapi-gen" --logtostderr \
        -i "$dirs" -p k8s.io/kubernetes/pkg/generated/openapi -O zz_generated.openapi \
        -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt -r "$gopath/openapi-violations.report" >&2)
}

build() {
    local have=1
    for c in $COMPONENTS; do [ -x "$BIN/$c" ] || have=0; done
    [ "$have" = 1 ] && return 0
    need_packages $BUILD_PACKAGES $RUN_PACKAGES
    local work=$CACHE/$KUBE_SRC_VERSION/work
    mkdir -p "$work" "$BIN"
    fetch_source "$work"
    local gopath=$work/gopath src=$work/kubernetes
    mkdir -p "$gopath/src/k8s.io" "$gopath/bin"
    ln -sfn "$src" "$gopath/src/k8s.io/kubernetes"
    export GOPATH=$gopath GO111MODULE=off GOFLAGS= GOCACHE=$CACHE/gocache CGO_ENABLED=0
    replace_reflect2 "$src"
    generate_openapi "$src" "$gopath"
    log "building $COMPONENTS (go build -p 2, tags providerless)"
    local pkgs="" c
    for c in $COMPONENTS; do pkgs="$pkgs ./cmd/$c"; done
    (cd "$gopath/src/k8s.io/kubernetes" && go build -p "${FIBRL_KUBE_BUILD_JOBS:-2}" -tags providerless \
        -ldflags "-s -w -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitVersion=v1.20.2 -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitMajor=1 -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitMinor=20" \
        -o "$BIN/" $pkgs >&2)
    for c in $COMPONENTS; do [ -x "$BIN/$c" ] || die "build did not produce $BIN/$c"; done
    log "binaries in $BIN"
}


free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# P-256 keys: ten RSA 2048 keys took 14 s of a loaded 2-core machine, these take none
ec_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# cert NAME CN [O] [SAN]: a key and a certificate signed by the plane's own CA.
cert() {
    local name=$1 cn=$2 org=${3:-} san=${4:-} pki=$STATE/pki subj="/CN=$2"
    [ -n "$org" ] && subj="/O=$org/CN=$cn"
    ec_key "$pki/$name.key"
    openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' > "$pki/$name.ext"
    [ -n "$san" ] && echo "subjectAltName=$san" >> "$pki/$name.ext"
    openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 30 -sha256 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
}

make_pki() {
    local pki=$STATE/pki
    mkdir -p "$pki" && chmod 700 "$STATE" "$pki"
    ec_key "$pki/ca.key"
    openssl req -x509 -new -key "$pki/ca.key" -subj "/CN=fibrl-test-ca" \
        -days 30 -sha256 -out "$pki/ca.crt" 2>/dev/null
    cert etcd etcd "" "IP:127.0.0.1,DNS:localhost"
    cert etcd-client kube-apiserver-etcd-client
    cert apiserver kube-apiserver "" \
        "IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
    cert kubelet-client kube-apiserver-kubelet-client system:masters
    cert admin admin system:masters
    cert controller-manager system:kube-controller-manager
    cert scheduler system:kube-scheduler
    cert node-agent "system:node:${NODE_NAME:-fibrl-node}" system:nodes "IP:127.0.0.1,DNS:localhost"
    ec_key "$pki/sa.key"   # service-account tokens are then signed ES256
    openssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
}

kubeconfig() {  # kubeconfig NAME: a kubeconfig for certificate NAME
    local pki=$STATE/pki
    cat > "$STATE/$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: fibrl-test
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$pki/ca.crt"}
users:
- name: $1
  user: {client-certificate: "$pki/$1.crt", client-key: "$pki/$1.key"}
contexts:
- name: $1@fibrl-test
  context: {cluster: fibrl-test, user: $1, namespace: default}
current-context: $1@fibrl-test
KC
    chmod 600 "$STATE/$1.kubeconfig"
}

start() {  # start NAME COMMAND...: run in the background, its pid recorded for `down`
    local name=$1; shift
    mkdir -p "$STATE/commands" && printf '%s\0' "$@" > "$STATE/commands/$name"
    (cd "$REPO" && exec setsid "$@" >> "$STATE/logs/$name.log" 2>&1 < /dev/null) &
    echo "$! $name $1" >> "$STATE/pids"
}

# Metadata level for service accounts' requests, except the controllers' (kube-system);
# nothing of anyone else (the admin's set-up, the node agent, the scheduler).
write_audit_policy() {
    cat > "$STATE/audit-policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: None
    userGroups: ["system:serviceaccounts:kube-system"]
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
POLICY
}

start_all() {
    local pki=$STATE/pki
    write_audit_policy
    start etcd /usr/bin/etcd --name fibrl-test --data-dir "$STATE/etcd" \
        --listen-client-urls "https://127.0.0.1:$ETCD_PORT" --advertise-client-urls "https://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "https://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "https://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "fibrl-test=https://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls "" \
        --cert-file "$pki/etcd.crt" --key-file "$pki/etcd.key" --trusted-ca-file "$pki/ca.crt" --client-cert-auth \
        --peer-cert-file "$pki/etcd.crt" --peer-key-file "$pki/etcd.key" --peer-trusted-ca-file "$pki/ca.crt" \
        --peer-client-cert-auth --enable-v2=false
    start kube-apiserver "$BIN/kube-apiserver" --bind-address 127.0.0.1 --advertise-address 127.0.0.1 \
        --secure-port "$API_PORT" --insecure-port 0 --cert-dir "$STATE/apiserver" \
        --etcd-servers "https://127.0.0.1:$ETCD_PORT" --etcd-cafile "$pki/ca.crt" \
        --etcd-certfile "$pki/etcd-client.crt" --etcd-keyfile "$pki/etcd-client.key" \
        --client-ca-file "$pki/ca.crt" --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
        --kubelet-client-certificate "$pki/kubelet-client.crt" --kubelet-client-key "$pki/kubelet-client.key" \
        --kubelet-certificate-authority "$pki/ca.crt" --kubelet-preferred-address-types InternalIP \
        --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-cluster-ip-range 10.0.0.0/24 --authorization-mode Node,RBAC \
        --feature-gates TTLAfterFinished=true --profiling=false --allow-privileged=false \
        --endpoint-reconciler-type none \
        --audit-policy-file "$STATE/audit-policy.yaml" --audit-log-path "$STATE/audit.log" \
        --audit-log-format json --audit-log-maxsize 1024 --audit-log-maxbackup 10
    # endpoint reconciler off: the "kubernetes" Service's Endpoints may not hold a loopback
    # address (validation refuses 127.0.0.1); pods here reach the API server on loopback directly
}

# After the API server is ready: the controller-manager gives up (exits) when the API
# server's /healthz does not answer it within its own short wait, and it is forbidden
# until the API server has written its bootstrap RBAC policy.
start_controllers() {
    local pki=$STATE/pki
    # no --authentication/authorization-kubeconfig: their secure ports then answer /healthz
    # (always allowed) and refuse everything else
    start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$STATE/controller-manager.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$CM_PORT" --port 0 --cert-dir "$STATE/controller-manager" \
        --leader-elect=false --use-service-account-credentials \
        --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
        --feature-gates TTLAfterFinished=true --profiling=false
    start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$STATE/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" --port 0 --cert-dir "$STATE/scheduler" \
        --leader-elect=false --profiling=false
}

# The node: tests/kube/node_agent.py runs the pods the scheduler binds to it (no kubelet here).
start_node_agent() {
    local python pki=$STATE/pki
    # the interpreter itself, not a shim (pyenv): `down` recognizes its processes by executable
    python=$("${FIBRL_KUBE_PYTHON:-$(command -v python || command -v python3)}" -c 'import sys; print(sys.executable)')
    start node-agent "$python" -m tests.kube.node_agent --kubeconfig "$STATE/admin.kubeconfig" \
        --node-name "$NODE_NAME" --runtime "${FIBRL_KUBE_NODE_RUNTIME:-process}" \
        --tls "$pki/node-agent.crt" "$pki/node-agent.key" "$pki/ca.crt"
}

node_ready() {
    local pki=$STATE/pki
    curl -s --max-time 5 --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
        "https://127.0.0.1:$API_PORT/api/v1/nodes/$NODE_NAME" | python3 -c '
import json, sys
node = json.load(sys.stdin)
conditions = (node.get("status") or {}).get("conditions") or []
taints = (node.get("spec") or {}).get("taints") or []
sys.exit(0 if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not taints else 1)'
}

# ready URL CURL-ARGS...: 0 once URL answers "ok" (bounded by the overall deadline)
ready() {
    local url=$1; shift
    while [ "$(curl -s --max-time 5 "$@" "$url" 2>/dev/null)" != ok ]; do
        [ "$SECONDS" -lt "$DEADLINE" ] || return 1
        alive || return 1
        sleep 0.5
    done
}

alive() {  # every process `up` started still runs
    local pid name
    while read -r pid name _; do
        kill -0 "$pid" 2>/dev/null || { log "$name exited; its log: $STATE/logs/$name.log"; tail -n 20 "$STATE/logs/$name.log" >&2; return 1; }
    done < "$STATE/pids"
}

wait_ready() {
    local pki=$STATE/pki
    local admin="--cacert $pki/ca.crt --cert $pki/admin.crt --key $pki/admin.key"   # needs pki set first
    ready "https://127.0.0.1:$API_PORT/readyz" $admin || die "kube-apiserver not ready in ${READY_TIMEOUT}s"
    took "kube-apiserver ready"
    start_controllers
    start_node_agent   # (registers its node meanwhile: the scheduler needs nothing of it yet)
    ready "https://127.0.0.1:$CM_PORT/healthz" -k || die "kube-controller-manager not healthy in ${READY_TIMEOUT}s"
    ready "https://127.0.0.1:$SCHED_PORT/healthz" -k || die "kube-scheduler not healthy in ${READY_TIMEOUT}s"
    took "controller-manager and scheduler healthy"
    # the service-account and token controllers work: the default account has its token
    local sa="https://127.0.0.1:$API_PORT/api/v1/namespaces/default/serviceaccounts/default"
    until curl -s --max-time 5 $admin "$sa" | grep -q '"secrets"'; do
        [ "$SECONDS" -lt "$DEADLINE" ] && alive || die "no token for the default service account in ${READY_TIMEOUT}s"
        sleep 0.5
    done
    took "token controller serving"
    until node_ready 2>/dev/null; do
        [ "$SECONDS" -lt "$DEADLINE" ] && alive || die "node $NODE_NAME not Ready in ${READY_TIMEOUT}s"
        sleep 0.5
    done
}

up() {
    if [ -f "$STATE/pids" ] && alive 2>/dev/null; then
        log "already up (state $STATE)"; echo "$STATE/admin.kubeconfig"; return 0
    fi
    [ -f "$STATE/pids" ] && down
    UP_START=$SECONDS
    build
    need_packages $RUN_PACKAGES
    cd "$REPO"
    rm -rf "$STATE" && mkdir -p "$STATE/logs"
    DEADLINE=$((SECONDS + READY_TIMEOUT))
    ETCD_PORT=$(free_port) ETCD_PEER_PORT=$(free_port) API_PORT=$(free_port)
    CM_PORT=$(free_port) SCHED_PORT=$(free_port)
    took "binaries"
    make_pki
    took "certificates"
    for k in admin controller-manager scheduler node-agent; do kubeconfig "$k"; done
    : > "$STATE/pids"
    trap down EXIT
    start_all
    wait_ready
    trap - EXIT
    echo "$API_PORT" > "$STATE/api-port"
    log "ready in $((SECONDS - DEADLINE + READY_TIMEOUT)) s: https://127.0.0.1:$API_PORT (state $STATE)"
    echo "$STATE/admin.kubeconfig"
}

terminate() {  # terminate PID NAME EXE: TERM, 10 s, KILL; a pid whose command changed is not ours
    local pid=$1 name=$2 exe=$3
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$exe")" ] || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    log "stopped $name ($pid)"
}

down() {  # stop what `up` recorded, newest first
    [ -f "$STATE/pids" ] || { log "nothing to stop (no $STATE/pids)"; return 0; }
    local pid name exe
    tac "$STATE/pids" | while read -r pid name exe; do terminate "$pid" "$name" "$exe"; done
    rm -f "$STATE/pids"
}

kill_tree() {  # kill_tree PID: freeze it (it starts nothing more), SIGKILL what runs under it, then it
    local pid=$1 child
    kill -STOP "$pid" 2>/dev/null || return 0
    for child in $(pgrep -P "$pid" || true); do kill_tree "$child"; done
    kill -KILL "$pid" 2>/dev/null || true
}

crash() {  # crash PID NAME EXE: as terminate, but at once and with everything under it
    local pid=$1 name=$2 exe=$3
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$exe")" ] || return 0
    kill_tree "$pid"
    log "crashed $name ($pid) and the processes under it"
}

stop_one() {  # stop_one NAME [crash]: stop (or crash) one component and forget its pid
    [ -f "$STATE/pids" ] || die "the control plane is not up (no $STATE/pids)"
    local pid name exe kept="" found="" how=${2:-terminate}
    while read -r pid name exe; do
        if [ "$name" = "$1" ]; then "$how" "$pid" "$name" "$exe"; found=1
        else kept+="$pid $name $exe"$'\n'; fi
    done < "$STATE/pids"
    [ -n "$found" ] || die "$1 is not running (names: $(cut -d' ' -f2 "$STATE/pids" | tr '\n' ' '))"
    printf '%s' "$kept" > "$STATE/pids"
}

start_one() {  # start_one NAME: start a stopped component again, as `up` started it; the
    # API server: wait until it is ready, as `up` does (tests that follow an outage test would
    # otherwise find it refusing connections while it starts)
    [ -f "$STATE/commands/$1" ] || die "no command recorded for $1"
    if cut -d' ' -f2 "$STATE/pids" | grep -qx "$1"; then die "$1 runs already"; fi
    local -a argv
    mapfile -d '' argv < "$STATE/commands/$1"
    start "$1" "${argv[@]}"
    if [ "$1" = kube-apiserver ]; then
        local pki=$STATE/pki
        DEADLINE=$((SECONDS + RESTART_TIMEOUT))
        ready "https://127.0.0.1:$(cat "$STATE/api-port")/readyz" --cacert "$pki/ca.crt" \
            --cert "$pki/admin.crt" --key "$pki/admin.key" \
            || die "kube-apiserver not ready ${RESTART_TIMEOUT}s after its start"
    fi
    log "started $1 again"
}

case "${1:-}" in
    build) build ;;
    up) up ;;
    down) down ;;
    stop-one) stop_one "${2:?stop-one NAME}" ;;
    crash-one) stop_one "${2:?crash-one NAME}" crash ;;
    start-one) start_one "${2:?start-one NAME}" ;;
    audit-log) echo "$STATE/audit.log" ;;
    *) echo "usage: $0 build|up|down|stop-one NAME|crash-one NAME|start-one NAME|audit-log" >&2; exit 2 ;;
esac
