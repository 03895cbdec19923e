# Worker image for fibrl: workers started in containers/pods run
#   python -m fibrl.bootstrap
# Build it with docker/build-image.sh (or plainly: docker build -t fibrl:latest .).
FROM python:3.11-slim

# fibrl extras installed in the image (comma-separated; e.g. "rl,torch,docker").
# docker and kubernetes by default: the image also runs `fibrl run` parents,
# which start their workers through those clients.
ARG EXTRAS=rl,docker,kubernetes
# Empty by default, so pip installs from PyPI as usual.  For an offline build,
# point pip at wheels shipped in the build context, e.g.
#   --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/tmp/fibrl-src/docker/wheels
# (docker/build-image.sh --offline does this).
ARG PIP_NO_INDEX=
ARG PIP_FIND_LINKS=

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

# Dependencies first, in a layer of their own, when docker/build-wheels.sh has listed them
# (docker/wheels/requirements.txt): a rebuild after a change to fibrl's code alone reuses
# this layer and reinstalls only fibrl. (The Dockerfile is named so that the COPY has a
# source when docker/wheels does not exist.)
COPY Dockerfile docker/wheel[s] /tmp/fibrl-wheels/
RUN if [ -f /tmp/fibrl-wheels/requirements.txt ]; then \
        pip install --find-links /tmp/fibrl-wheels -r /tmp/fibrl-wheels/requirements.txt; \
    fi \
 && rm -rf /tmp/fibrl-wheels

COPY . /tmp/fibrl-src
RUN pip install "/tmp/fibrl-src[${EXTRAS}]" \
 && rm -rf /tmp/fibrl-src \
 && python -c "import fibrl"

# A numeric non-root user: a namespace enforcing the "restricted" Pod Security standard
# admits only pods that run as non-root, which the kubelet can check only for a numeric
# uid. fibrl's pods also set runAsUser to it (kubernetes_run_as_user). The docker
# backend runs its containers as the caller's uid:gid instead, so files workers write
# into a mounted working directory belong to the caller.
RUN groupadd --gid 10001 fibrl \
 && useradd --uid 10001 --gid 10001 --home-dir /app --no-create-home --shell /usr/sbin/nologin fibrl \
 && mkdir -p /app && chown 10001:10001 /app
WORKDIR /app
USER 10001:10001
CMD ["python", "-m", "fibrl.bootstrap"]
