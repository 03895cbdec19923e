"""The ``fibrl`` command: launch a script as the parent of a run, and manage runs.

::

    fibrl run  [--backend kubernetes|docker] [--image IMG | --build [--registry REG] [--platform P]]
               [--namespace NS] [--cpu N] [--memory SIZE] [--gpu N] [--env K=V ...]
               [--service-account SA] [--follow | --detach] -- python train.py ARGS
    fibrl ps   [--backend B] [--namespace NS]
    fibrl logs RUN [--backend B] [--namespace NS] [--follow] [--pod NAME]
    fibrl stop RUN [--backend B] [--namespace NS]

``run`` waits for the script and exits with its exit code (``--follow`` also
streams its output, else it says how to follow it with ``fibrl logs``;
``--detach`` prints the run id and returns at once). A docker run's parent
container stays, with its output, until ``fibrl stop``. Without ``--backend``
it launches on kubernetes unless the config's backend is docker.
Settings not given as options come from the fibrl config (``FIBRL_*``
variables, ``.fibrlconfig``): ``kubernetes_namespace``, ``kubernetes_kubeconfig``,
``image``, ``registry``, ``kubernetes_service_account``...

This module owns the options and what is printed: the script's output on
stdout, fibrl's own messages on stderr. How a run starts on each backend is
:mod:`fibrl.launch`'s.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Optional

from .config import CLUSTER_BACKENDS as BACKENDS
from .config import Config, resolve
from .errors import BackendUnavailableError, ConfigError, FibrlError

__all__ = ["main"]



def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fibrl", description="Launch a script on kubernetes or docker as the parent of "
                                  "a fibrl run, and list, follow and stop runs.")
    parser.add_argument("--version", action="version", version=f"fibrl {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(commands)
    _common(commands.add_parser("ps", help="list runs and their pods / containers")) \
        .set_defaults(handler=_ps)
    logs = _common(commands.add_parser("logs", help="print the output of a run's parent"))
    logs.add_argument("run", help="run id (see fibrl ps)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep streaming")
    logs.add_argument("--pod", help="a pod (or container) of the run instead of its parent")
    logs.set_defaults(handler=_logs)
    stop = _common(commands.add_parser("stop", help="delete everything a run created"))
    stop.add_argument("run", help="run id (see fibrl ps)")
    stop.set_defaults(handler=_stop)
    return parser


def _add_run(commands) -> None:
    run = _common(commands.add_parser(
        "run", help="run a script as the parent of a new run",
        description="Run a script (as a kubernetes Job, or a docker container) whose fibrl "
                    "workers fan out from there."))
    image = run.add_mutually_exclusive_group()
    image.add_argument("--image", help="image holding the script and fibrl (default: config image)")
    image.add_argument("--build", action="store_true",
                       help="docker build the image from ./Dockerfile (and push it to --registry)")
    run.add_argument("--registry", help="registry to push the built image to (config: registry)")
    run.add_argument("--platform", default="",
                     help="platform of the built image, e.g. linux/amd64 (an arm64 laptop "
                          "building for amd64 nodes)")
    run.add_argument("--cpu", type=float, default=0.0, help="CPU cores of the script's pod")
    run.add_argument("--memory", default="", help="memory of the script's pod, e.g. 2g or 2Gi")
    run.add_argument("--gpu", type=int, default=0, help="GPUs (nvidia.com/gpu) of the script's pod")
    run.add_argument("--env", action="append", default=[], metavar="K=V",
                     help="environment variable of the script (repeatable)")
    run.add_argument("--service-account", help="service account of the script's pod (default: "
                                               "config kubernetes_service_account, else fibrl)")
    wait = run.add_mutually_exclusive_group()
    wait.add_argument("--follow", "-f", action="store_true", help="stream the script's output")
    wait.add_argument("--detach", "-d", action="store_true",
                      help="print the run id and return without waiting")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                     help="the script to run, e.g. -- python train.py --steps 100")
    run.set_defaults(handler=_run)


def _version() -> str:
    import fibrl

    return fibrl.__version__


def _common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--backend", choices=BACKENDS,
                        help="where runs live (default: config backend if docker, else kubernetes)")
    parser.add_argument("--namespace", "-n", help="kubernetes namespace (config: "
                                                  "kubernetes_namespace)")
    parser.add_argument("--kubeconfig", help="kubeconfig path (config: kubernetes_kubeconfig)")
    return parser


def _config(args: argparse.Namespace) -> Config:
    overrides = {"kubernetes_namespace": args.namespace, "kubernetes_kubeconfig": args.kubeconfig,
                 "registry": getattr(args, "registry", None)}
    config = resolve()
    changes = {k: v for k, v in overrides.items() if v is not None}
    return config.replace(**changes) if changes else config


def _backend(args: argparse.Namespace, config: Config) -> str:
    return args.backend or (config.backend if config.backend in BACKENDS else "kubernetes")


def _launcher(args: argparse.Namespace, config: Config):
    from .launch import get_launcher

    return get_launcher(_backend(args, config), config)


def _say(text: str) -> None:
    sys.stderr.write(f"fibrl: {text}\n")
    sys.stderr.flush()


# -- fibrl run -------------------------------------------------------------------------

def _env(pairs: list) -> dict:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--env {pair!r} is not K=V. Fix: e.g. --env WANDB_MODE=offline.")
        env[name] = value
    return env


def _command(argv: list) -> tuple:
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        raise ConfigError("fibrl run needs the command to run after --, e.g. "
                          "`fibrl run -- python train.py`.")
    return tuple(command)


def _image(args: argparse.Namespace, config: Config, backend: str, run_id: str) -> str:
    if not args.build:
        return args.image or config.image
    from .launch.build import build_image, image_tag, load_image, push_image

    loader = None
    if backend == "kubernetes" and not config.registry:
        loader = _local_cluster(config)     # refuse before a build nothing could run
    tag = build_image(os.getcwd(), image_tag(config.registry, os.getcwd(), run_id),
                      platform=args.platform)
    if config.registry:
        push_image(tag)
    elif loader:
        load_image(loader, tag)
    return tag


def _local_cluster(config: Config) -> list:
    """How to load a built image into a kind / minikube cluster; an error for others."""
    from .launch.build import local_cluster_loader

    context = _kube_context(config)
    loader = local_cluster_loader(context)
    if loader is None:
        raise ConfigError(
            f"fibrl run --build has no registry to push to (--registry or config registry), "
            f"and the cluster (kubeconfig context {context or '<none>'!r}) is neither kind "
            f"nor minikube, whose nodes an image can be loaded into: its nodes could never "
            f"pull the built image. Fix: --registry REGISTRY (after `docker login`), or "
            f"build and push yourself and pass --image.")
    return loader


def _kube_context(config: Config) -> str:
    from kubernetes import config as kube_config

    path = (config.kubernetes_kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
            or os.path.expanduser("~/.kube/config"))
    try:
        _, active = kube_config.list_kube_config_contexts(config_file=path)
    except Exception:   # no kubeconfig, or not one the loader reads: no local cluster known
        return ""
    return (active or {}).get("name", "")


def _run(args: argparse.Namespace, config: Config) -> int:
    command, env = _command(args.argv), _env(args.env)
    backend = _backend(args, config)
    try:
        return _launch(args, config, backend, command, env)
    except BackendUnavailableError as exc:
        if backend != "kubernetes":
            raise
        raise _no_cluster(args, command, exc) from exc


def _launch(args: argparse.Namespace, config: Config, backend: str, command: tuple,
            env: dict) -> int:
    run_id = secrets.token_hex(6)
    from .launch import RunRequest, get_launcher

    launcher = get_launcher(backend, config)
    request = RunRequest(
        run_id=run_id, command=command, image=_image(args, config, backend, run_id),
        cpu=args.cpu, memory=args.memory, gpu=args.gpu, env=env, workdir=os.getcwd(),
        service_account=args.service_account or config.kubernetes_service_account or "fibrl")
    where = launcher.launch(request)
    _say(f"run {run_id} started: {where} ({backend}"
         f"{', namespace ' + config.kubernetes_namespace if backend == 'kubernetes' else ''})")
    follow = _follow_hint(config, backend, run_id)
    if args.detach:
        _say(f"{follow}; `fibrl stop {run_id}{_flag(config, backend)}` ends it and deletes it.")
        print(run_id)
        return 0
    if not args.follow:
        _say(f"waiting for it to end; {follow} (or run with -f to stream it here).")
    try:
        ended = launcher.wait(run_id, args.follow, sys.stdout.buffer)
    except KeyboardInterrupt:
        _say(f"stopped waiting; run {run_id} goes on. {follow}, "
             f"`fibrl stop {run_id}{_flag(config, backend)}` to end it.")
        return 130
    _say(_ended(config, backend, run_id, ended))
    return ended.status


def _flag(config: Config, backend: str) -> str:
    """The option the other commands need to find this run (their default backend is
    the config's if it is docker, else kubernetes)."""
    return " --backend docker" if backend == "docker" and config.backend != "docker" else ""


def _follow_hint(config: Config, backend: str, run_id: str) -> str:
    return f"`fibrl logs {run_id}{_flag(config, backend)} -f` follows its output"


def _ended(config: Config, backend: str, run_id: str, ended) -> str:
    text = f"run {run_id}: the script ended with exit status {ended.status}"
    if ended.reason:
        text += f": {ended.reason}"
    if backend == "docker":   # the container keeps its output, as a finished Job's pod does
        text += (f". Its container stays, with its output (`fibrl logs {run_id}"
                 f"{_flag(config, backend)}`), until `fibrl stop {run_id}{_flag(config, backend)}`")
    return text + "."


def _no_cluster(args: argparse.Namespace, command: tuple,
                exc: BackendUnavailableError) -> BackendUnavailableError:
    from .backends.kubernetes.api import IN_CLUSTER_ADVICE

    chose = ("kubernetes (given with --backend)" if args.backend else
             "kubernetes (the default: the config's backend is not docker)")
    detail = str(exc).replace(f", or {IN_CLUSTER_ADVICE}", "").replace(IN_CLUSTER_ADVICE, "")
    return BackendUnavailableError(
        f"fibrl run launches on {chose} and found no cluster: {detail} To run the script "
        f"in a docker container on this machine instead: `fibrl run --backend docker -- "
        f"{' '.join(command)}`.")


# -- fibrl ps / logs / stop -------------------------------------------------------------

def _ps(args: argparse.Namespace, config: Config) -> int:
    rows = [("RUN", "PARENT", "STATUS", "WORKERS", "AGE")]
    for info in _launcher(args, config).runs():
        workers = ", ".join(f"{n} {phase}" for phase, n in sorted(info.workers.items())) or "-"
        rows.append((info.run_id, info.parent, info.status, workers, info.age))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _logs(args: argparse.Namespace, config: Config) -> int:
    try:
        _launcher(args, config).logs(args.run, args.follow, sys.stdout.buffer, args.pod)
    except KeyboardInterrupt:
        return 130
    return 0


def _stop(args: argparse.Namespace, config: Config) -> int:
    deleted = _launcher(args, config).stop(args.run)
    for name in deleted:
        print(name)
    if not deleted:
        _say(f"nothing labelled fibrl.run={args.run} was found.")
    return 0


def main(argv: Optional[list] = None) -> int:
    """Entry point of the ``fibrl`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.handler(args, _config(args))
    except FibrlError as exc:
        _say(f"error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
