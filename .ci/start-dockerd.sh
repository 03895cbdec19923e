#!/usr/bin/env bash
# Make sure a docker engine answers `docker info`: install docker.io from apt
# if dockerd is missing, start dockerd in the background (log under /tmp) and
# wait for it, bounded.  Exits non-zero, with the log tail, if it never comes up.
#
# Environment: DOCKERD_LOG (default /tmp/fibrl-dockerd.log),
#              DOCKERD_WAIT seconds to wait (default 60)
set -euo pipefail

DOCKERD_LOG="${DOCKERD_LOG:-/tmp/fibrl-dockerd.log}"
DOCKERD_WAIT="${DOCKERD_WAIT:-60}"
log() { echo "[start-dockerd] $*" >&2; }

if docker info >/dev/null 2>&1; then
    log "docker engine already running"
    exit 0
fi

if ! command -v dockerd >/dev/null 2>&1; then
    log "installing docker.io from apt"
    export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
    for _ in 1 2 3; do apt-get update -qq && break; sleep 5; done
    apt-get install -y -qq docker.io >/dev/null
fi

# A stale pid file from a dead daemon makes dockerd refuse to start.
pidfile=/var/run/docker.pid
if [[ -f "$pidfile" ]] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    log "removing stale $pidfile"
    rm -f "$pidfile"
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
    log "starting dockerd (log: $DOCKERD_LOG)"
    # Own session, no inherited stdio: the daemon outlives this script
    # without holding the caller's output pipes open.
    setsid nohup dockerd --storage-driver=overlay2 \
        </dev/null >>"$DOCKERD_LOG" 2>&1 &
fi

for ((i = 0; i < DOCKERD_WAIT; i++)); do
    if docker info >/dev/null 2>&1; then
        log "docker engine up after ${i} s: $(docker version --format '{{.Server.Version}}')"
        exit 0
    fi
    sleep 1
done

log "ERROR: docker engine did not come up within ${DOCKERD_WAIT} s"
log "---- last lines of $DOCKERD_LOG ----"
tail -n 40 "$DOCKERD_LOG" >&2 || true
exit 1
