"""``fibrl run --build``: build the project's image with docker and push it.

Owns the image tag of a run, the docker CLI calls (``build``, ``push``) and,
for a local cluster without a registry, loading the image into its nodes
(``kind load docker-image``, ``minikube image load``). Their output goes to
stderr, so that stdout stays the script's.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Optional, TextIO

from .. import __version__
from ..errors import BackendError

__all__ = ["image_tag", "build_image", "push_image", "local_cluster_loader", "load_image"]


def image_tag(registry: str, project_dir: str, run_id: str) -> str:
    """``<registry>/<project>:<run>``, or ``fibrl-<project>:<run>`` without a registry.

    Example:
        >>> image_tag("registry.example.com/team", "/home/me/My Project", "3f2a9c01be77")
        'registry.example.com/team/my-project:3f2a9c01be77'
        >>> image_tag("", "/src/walker", "ab12")
        'fibrl-walker:ab12'
    """
    project = re.sub(r"[^a-z0-9._-]+", "-", os.path.basename(os.path.abspath(project_dir)).lower())
    project = project.strip("-._") or "project"
    if registry:
        return f"{registry.rstrip('/')}/{project}:{run_id}"
    return f"fibrl-{project}:{run_id}"


def _docker() -> str:
    found = shutil.which("docker")
    if not found:
        raise BackendError("--build needs the docker command line, which is not on PATH. Fix: "
                           "install docker (or build and push the image yourself and pass "
                           "--image).")
    return found


def _run(argv: list, what: str, out: TextIO) -> None:
    out.write(f"fibrl: {' '.join(argv)}\n")
    out.flush()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, errors="replace") as proc:
        assert proc.stdout is not None   # stdout=PIPE
        for line in proc.stdout:
            out.write(line)
        out.flush()
    if proc.returncode != 0:
        raise BackendError(f"{what} failed (`{' '.join(argv)}` exited with {proc.returncode}); "
                           f"its output is above.")


def build_image(project_dir: str, tag: str, out: Optional[TextIO] = None,
                platform: str = "") -> str:
    """``docker build [--platform P] -t tag project_dir`` (its ``Dockerfile``); returns ``tag``."""
    dockerfile = os.path.join(project_dir, "Dockerfile")
    if not os.path.isfile(dockerfile):
        raise BackendError(
            f"--build needs a Dockerfile in {project_dir}, and there is none. Fix: write one "
            f"that copies the project into an image with python and fibrl (e.g. `FROM "
            f"fibrl:{__version__}` then `COPY . /app` and `WORKDIR /app`), or pass --image.")
    argv = [_docker(), "build"] + (["--platform", platform] if platform else [])
    _run(argv + ["-t", tag, project_dir], "building the image", out or sys.stderr)
    return tag


def local_cluster_loader(context: str) -> Optional[list]:
    """The command that loads an image into the nodes of a local cluster, from the name of
    the kubeconfig context (None for any other cluster: it needs a registry).

    Example:
        >>> local_cluster_loader("kind-rl"), local_cluster_loader("minikube")
        (['kind', 'load', 'docker-image', '--name', 'rl'], ['minikube', 'image', 'load'])
        >>> local_cluster_loader("gke_project_europe-west1_prod") is None
        True
    """
    if context.startswith("kind-"):
        return ["kind", "load", "docker-image", "--name", context[len("kind-"):]]
    if context == "minikube":
        return ["minikube", "image", "load"]
    return None


def load_image(loader: list, tag: str, out: Optional[TextIO] = None) -> None:
    """Run ``loader`` (see :func:`local_cluster_loader`) for ``tag``."""
    if not shutil.which(loader[0]):
        raise BackendError(f"loading {tag} into the cluster needs the {loader[0]} command, "
                           f"which is not on PATH. Fix: install it, or give --registry.")
    _run(loader + [tag], f"loading {tag} into the cluster's nodes", out or sys.stderr)


def push_image(tag: str, out: Optional[TextIO] = None) -> None:
    """``docker push tag``."""
    _run([_docker(), "push", tag], f"pushing {tag} (is `docker login` done for its registry?)",
         out or sys.stderr)
