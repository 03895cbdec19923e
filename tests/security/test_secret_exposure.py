"""Defect: a docker worker's secret was a plain container environment variable (shown by
`docker inspect`), and a local worker started without the fork server had it in
/proc/<pid>/environ. Then it was a file in the container's writable layer, on the
host's disk under docker's overlay directory until the container was removed. Now it
shows in none of these, and the worker still authenticates."""
import json
import os

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


def _files_holding(folder, needle):
    found = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as file:
                    if needle in file.read():
                        found.append(os.path.relpath(path, folder))
    return found


@pytest.mark.docker
@pytest.mark.parametrize("ctx", ["docker"], indirect=True)
def test_docker_worker_secret_not_on_the_hosts_disk(ctx):
    """Nothing in the container's writable layer (docker's overlay directory on the
    host) nor in ``docker inspect`` holds the secret, while the worker runs and after it
    authenticated (it reached the Event through the parent)."""
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
            shown = client.api.inspect_container(container.id)
            assert _secret() not in json.dumps(shown)
            upper = shown["GraphDriver"]["Data"]["UpperDir"]
            assert os.path.isdir(upper), f"docker's overlay directory {upper} is not here"
            for form in (_secret(), bytes(fibrl.current_process().authkey)):
                needle = form.encode() if isinstance(form, str) else form
                assert _files_holding(upper, needle) == [], upper
    finally:
        event.set()
        proc.join(60)
        client.close()
    assert proc.exitcode == 0
