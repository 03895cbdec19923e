#!/usr/bin/env bash
# Build the fibrl worker image (default tags fibrl:latest, fibrl:<version>) from the top-level
# Dockerfile.
#
# Usage: docker/build-image.sh [--offline] [--tag TAG] [-- DOCKER_BUILD_ARGS...]
#
#   (default)   plain `docker build`: the base image python:3.11-slim is pulled
#               from your registry and pip installs from PyPI.
#   --offline   for machines that reach PyPI and a Debian mirror but no container
#               registry, and whose containers have no network (CI):
#               builds python:3.11-slim locally with debootstrap if it is
#               missing (docker/build-base.sh), prepares wheels on the host
#               (docker/build-wheels.sh) and installs only from them.
#
# Environment: FIBRL_IMAGE (tag, default fibrl:latest and fibrl:<version>; kubernetes
# pods of the default image run fibrl:<version>), IMAGE_EXTRAS (extras
# installed in the image, default rl,docker,kubernetes,tls: `fibrl run` parents run
# in it too), IMAGE_OFFLINE=1 (same as --offline).
set -euo pipefail

cd "$(dirname "$0")/.."
VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' fibrl/_version.py)"
FIBRL_IMAGE="${FIBRL_IMAGE:-}"
IMAGE_EXTRAS="${IMAGE_EXTRAS:-rl,docker,kubernetes,tls}"
OFFLINE="${IMAGE_OFFLINE:-0}"
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --offline) OFFLINE=1 ;;
        -t|--tag) FIBRL_IMAGE="$2"; shift ;;
        --tag=*) FIBRL_IMAGE="${1#--tag=}" ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        --) shift; extra=("$@"); break ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
log() { echo "[build-image] $*" >&2; }

if [[ -n "$FIBRL_IMAGE" ]]; then
    args=(--tag "$FIBRL_IMAGE")
else
    args=(--tag "fibrl:$VERSION" --tag fibrl:latest)
fi
args+=(--build-arg "EXTRAS=$IMAGE_EXTRAS")
if [[ "$OFFLINE" == 1 ]]; then
    docker/build-base.sh
    IMAGE_EXTRAS="$IMAGE_EXTRAS" docker/build-wheels.sh docker/wheels
    # The Dockerfile copies the context to /tmp/fibrl-src.
    args+=(--build-arg PIP_NO_INDEX=1
           --build-arg PIP_FIND_LINKS=/tmp/fibrl-src/docker/wheels)
fi

# Newer docker CLIs without the buildx plugin need the legacy builder.
if [[ -z "${DOCKER_BUILDKIT:-}" ]] && ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0
fi

log "docker build --force-rm ${args[*]} ${extra[*]} ."
# --force-rm: a failed step leaves no stopped container behind (legacy builder)
docker build --force-rm "${args[@]}" "${extra[@]}" .
docker image ls "${FIBRL_IMAGE:-fibrl}" >&2
