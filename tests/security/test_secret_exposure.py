"""Defect: a docker worker's secret was a plain container environment variable (shown by
`docker inspect`), and a local worker started without the fork server had it in
/proc/<pid>/environ. Now neither shows it, and the worker still authenticates."""
import json

import pytest

import fibrl


def _wait_on(event):
    event.wait(60)


def _secret():
    return bytes(fibrl.current_process().authkey).hex()


@pytest.mark.parametrize("fork_server", [False, True])
@pytest.mark.parametrize("ctx", ["local"], indirect=True)
def test_local_worker_has_no_secret_in_environ(ctx, fork_server):
    fibrl.init(backend="local", local_fork_server=fork_server)   # ctx restores the config
    event = fibrl.Event()
    proc = fibrl.Process(target=_wait_on, args=(event,))
    proc.start()
    try:
        for name in ("environ", "cmdline"):
            with open(f"/proc/{proc.pid}/{name}", "rb") as shown:
                assert _secret().encode() not in shown.read(), name
    finally:
        event.set()
        proc.join(60)
    assert proc.exitcode == 0


@pytest.mark.docker
@pytest.mark.parametrize("ctx", ["docker"], indirect=True)
def test_docker_worker_secret_not_in_docker_inspect(ctx):
    import docker

    from fibrl.popen import run_id

    event = fibrl.Event()
    proc = fibrl.Process(target=_wait_on, args=(event,))
    proc.start()
    client = docker.from_env()
    try:
        containers = client.containers.list(filters={"label": f"fibrl.run={run_id()}"})
        assert containers, "no worker container found"
        for container in containers:
            assert _secret() not in json.dumps(client.api.inspect_container(container.id))
            shown = container.exec_run(["sh", "-c", "cat /proc/*/environ 2>/dev/null"])
            assert _secret().encode() not in shown.output
    finally:
        event.set()
        proc.join(60)
        client.close()
    assert proc.exitcode == 0
