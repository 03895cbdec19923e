#!/usr/bin/env bash
# Prepare, on the host, every wheel the worker image needs so that
# `docker build` can install offline (pip --no-index --find-links).
# The wheels are for the host's Python/platform, so run it with a CPython 3.11
# on linux x86_64 (the image is Debian bookworm, CPython 3.11, glibc 2.36).
#
# Usage: docker/build-wheels.sh [WHEEL_DIR]        (default: docker/wheels)
# Environment: IMAGE_EXTRAS  extras for the image (default: rl,docker,kubernetes,tls)
#              PYTHON        interpreter to use   (default: python3)
set -euo pipefail

cd "$(dirname "$0")/.."
WHEEL_DIR="${1:-${WHEEL_DIR:-docker/wheels}}"
IMAGE_EXTRAS="${IMAGE_EXTRAS:-rl,docker,kubernetes,tls}"
PYTHON="${PYTHON:-python3}"
log() { echo "[build-wheels] $*" >&2; }

pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [[ "$pyver" != 3.11 ]]; then
    log "WARNING: host Python is $pyver but the image has 3.11; binary wheels may not match"
fi
mkdir -p "$WHEEL_DIR"
# Start from an empty folder: wheels of versions no longer wanted must not end up in the
# image's requirements below.
rm -f "$WHEEL_DIR"/*.whl "$WHEEL_DIR"/requirements.txt

# Resolving and building the 55 wheels takes 3-4 minutes on 2 cores. They depend only on
# the declared dependencies, the extras and the interpreter, so a machine keeps them under
# $WHEEL_CACHE/<hash of those> and copies them from there while none of it changed
# (WHEEL_CACHE= turns the cache off; delete the folder to resolve again).
WHEEL_CACHE="${WHEEL_CACHE-/var/cache/fibrl-wheels}"
key=$("$PYTHON" - "$IMAGE_EXTRAS" <<'PY'
import configparser, hashlib, pathlib, platform, sys
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
parts = [sys.argv[1], platform.python_version(), platform.machine()]
parts += [cfg.get("options", "install_requires", fallback=""),
          cfg.get("options", "python_requires", fallback="")]
if cfg.has_section("options.extras_require"):
    parts += [f"{k}={v}" for k, v in sorted(cfg.items("options.extras_require"))]
project = pathlib.Path("pyproject.toml")
parts.append(project.read_text() if project.exists() else "")
print(hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16])
PY
)
cached="$WHEEL_CACHE/$key"
if [[ -n "$WHEEL_CACHE" && -s "$cached/requirements.txt" ]]; then
    cp "$cached"/*.whl "$cached/requirements.txt" "$WHEEL_DIR"/
    log "$(ls "$WHEEL_DIR" | wc -l) wheels from the cache $cached (same dependencies)"
    exit 0
fi

# 1. The project's own wheel plus all its runtime deps (and the extras).
#    Built from a scratch copy so no build/ or *.egg-info lands in the tree.
src=$(mktemp -d "${TMPDIR:-/tmp}/fibrl-src.XXXXXX")
trap 'rm -rf "$src"' EXIT
tar -c --exclude=./.git --exclude=./build --exclude=./dist --exclude='*.egg-info' \
    --exclude=./docker/wheels --exclude=__pycache__ . | tar -x -C "$src"
log "pip wheel .[$IMAGE_EXTRAS] -> $WHEEL_DIR"
WHEEL_DIR=$(cd "$WHEEL_DIR" && pwd)
(cd "$src" && "$PYTHON" -m pip wheel --quiet --wheel-dir "$WHEEL_DIR" ".[$IMAGE_EXTRAS]")

# 2. The build backend, so the image can build fibrl from source offline.
mapfile -t build_reqs < <("$PYTHON" - <<'PY'
import tomllib, pathlib
p = pathlib.Path("pyproject.toml")
reqs = []
if p.exists():
    reqs = tomllib.loads(p.read_text()).get("build-system", {}).get("requires", [])
for r in reqs or ["setuptools>=40.8.0", "wheel"]:
    print(r)
PY
)
log "build requirements: ${build_reqs[*]}"
"$PYTHON" -m pip wheel --quiet --wheel-dir "$WHEEL_DIR" "${build_reqs[@]}"

# 3. What the image installs before fibrl's own code (its cached dependency layer; see the
#    Dockerfile): every wheel but fibrl's, pinned, sorted, so that the list (and the layer)
#    only changes when a dependency does. fibrl itself is built from the source in the image.
rm -f "$WHEEL_DIR"/fibrl-*.whl
"$PYTHON" - "$WHEEL_DIR" <<'PY'
import pathlib, sys
folder = pathlib.Path(sys.argv[1])
pins = set()
for wheel in folder.glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    pins.add(f"{name}=={version}")
(folder / "requirements.txt").write_text("".join(f"{pin}\n" for pin in sorted(pins)))
PY

log "$(ls "$WHEEL_DIR" | wc -l) wheels, $(du -sh "$WHEEL_DIR" | cut -f1) in $WHEEL_DIR"
if [[ -n "$WHEEL_CACHE" ]] && mkdir -p "$WHEEL_CACHE" 2>/dev/null; then
    staged=$(mktemp -d "$WHEEL_CACHE/.new.XXXXXX")
    cp "$WHEEL_DIR"/*.whl "$WHEEL_DIR/requirements.txt" "$staged"/
    rm -rf "$cached" && mv "$staged" "$cached" && log "kept in $cached for the next build"
fi
