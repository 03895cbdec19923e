#!/usr/bin/env bash
# Build a local stand-in for the official `python:3.11-slim` image with
# debootstrap, for machines that can reach a Debian mirror but no container
# registry (CI does this).  Users who can pull images do not need it.
#
# The result is a minimal Debian bookworm (Python 3.11) where, as in the
# official image, `python`, `python3`, `pip` and `pip3` are on PATH and pip
# may install as root (the PEP 668 EXTERNALLY-MANAGED marker is removed).
#
# Usage: docker/build-base.sh [--force]
# Environment:
#   BASE_IMAGE        tag to create            (default: python:3.11-slim)
#   DEBIAN_SUITE      Debian suite             (default: bookworm)
#   DEBIAN_MIRROR     mirror for debootstrap   (default: first deb.debian.org
#                     style URI found in the host's apt sources, else
#                     http://deb.debian.org/debian)
#   DEBOOTSTRAP_CACHE optional directory to keep downloaded .debs between runs
#   FORCE=1           rebuild even if BASE_IMAGE already exists locally
set -euo pipefail

BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
FORCE="${FORCE:-0}"
[[ "${1:-}" == "--force" ]] && FORCE=1

log() { echo "[build-base] $*" >&2; }

if [[ "$FORCE" != 1 ]] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "image $BASE_IMAGE already exists; skipping debootstrap (FORCE=1 to rebuild)"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    log "debootstrap needs root"; exit 1
fi

if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
    for _ in 1 2 3; do apt-get update -qq && break; sleep 5; done
    apt-get install -y -qq debootstrap >/dev/null
fi

if [[ -z "${DEBIAN_MIRROR:-}" ]]; then
    # Reuse the host's Debian mirror (deb822 or one-line sources).
    DEBIAN_MIRROR=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' \
                      /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
                    | head -n1 | tr -d ' ' || true)
    DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
fi

ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/fibrl-rootfs.XXXXXX")

cleanup() {
    # debootstrap mounts proc/sys inside the target; never rm -rf through a
    # live mount point.
    local m
    for m in $(awk -v r="$ROOTFS" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r); do
        umount -l "$m" 2>/dev/null || true
    done
    if awk -v r="$ROOTFS" 'index($2, r) == 1 {f=1} END {exit !f}' /proc/mounts; then
        log "WARNING: mounts remain under $ROOTFS; not deleting it"
    else
        rm -rf --one-file-system "$ROOTFS"
    fi
    rm -f "$ROOTFS.log"
}
trap cleanup EXIT

cache_args=()
if [[ -n "${DEBOOTSTRAP_CACHE:-}" ]]; then
    mkdir -p "$DEBOOTSTRAP_CACHE"
    cache_args=(--cache-dir="$(cd "$DEBOOTSTRAP_CACHE" && pwd)")
fi

start=$SECONDS
for attempt in 1 2; do
    log "debootstrap $DEBIAN_SUITE from $DEBIAN_MIRROR into $ROOTFS (attempt $attempt)"
    if debootstrap --variant=minbase \
           --include=python3,python3-pip,ca-certificates \
           "${cache_args[@]}" \
           "$DEBIAN_SUITE" "$ROOTFS" "$DEBIAN_MIRROR" >"$ROOTFS.log" 2>&1; then
        break
    fi
    log "debootstrap failed; last lines of $ROOTFS.log:"
    tail -n 30 "$ROOTFS.log" >&2
    [[ $attempt == 2 ]] && exit 1
    cleanup
    mkdir -p "$ROOTFS"
done
rm -f "$ROOTFS.log"
log "debootstrap took $((SECONDS - start)) s"

# Make it look like python:3.11-slim where it matters.
rm -f "$ROOTFS"/usr/lib/python3*/EXTERNALLY-MANAGED
ln -sf /usr/bin/python3 "$ROOTFS/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$ROOTFS/usr/local/bin/pip"
cat >"$ROOTFS/etc/pip.conf" <<'PIPCONF'
[global]
disable-pip-version-check = true
no-cache-dir = true
root-user-action = ignore
PIPCONF
# Trim: package caches, docs, man pages, non-English locales.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
       "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/var/log/*.log "$ROOTFS"/var/log/apt/* "$ROOTFS"/tmp/*
find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'en*' ! -name locale.alias \
     -exec rm -rf {} + 2>/dev/null || true
# Byte-compile the standard library, as python:3.11-slim ships it: the worker image
# runs with PYTHONDONTWRITEBYTECODE=1, so without these every worker start would
# compile each stdlib module it imports again (about 0.3 s per container here).
chroot "$ROOTFS" sh -c 'python3 -m compileall -q /usr/lib/python3*' >/dev/null

# Unmount whatever debootstrap left before tarring.
for m in $(awk -v r="$ROOTFS" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$m"
done

log "importing as $BASE_IMAGE"
tar --numeric-owner -C "$ROOTFS" \
    --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . \
  | docker import \
      -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      -c 'ENV LANG=C.UTF-8' \
      -c 'CMD ["python3"]' \
      - "$BASE_IMAGE" >/dev/null
docker image ls "$BASE_IMAGE" >&2
docker run --rm "$BASE_IMAGE" sh -c 'python --version && pip --version' >&2
log "done in $((SECONDS - start)) s"
