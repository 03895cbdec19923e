"""What a newcomer's first programs run into: targets that cannot be loaded in the
worker, functions defined under the main guard, a missing main guard, a script
that imports modules from its own folder. Scripts run as real programs (a
subprocess from the repository root, so containers mount this checkout)."""
import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import fibrl

TIMEOUT = 60
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _explode_in_worker(parent_pid):
    if os.getpid() != parent_pid:
        raise RuntimeError("this argument cannot be rebuilt in a worker (test)")
    return "rebuilt"


class BreaksInWorker:
    """Pickles fine; its unpickling raises in any process but the one that made it."""

    def __reduce__(self):
        return (_explode_in_worker, (os.getpid(),))


def noop(arg):
    return arg


def test_target_that_cannot_be_loaded_fails_at_once_with_its_error_logged(ctx, caplog):
    p = ctx.Process(target=noop, args=(BreaksInWorker(),))
    begin = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="fibrl"):
        p.start()
        p.join(TIMEOUT)
    elapsed = time.monotonic() - begin
    assert p.exitcode == 1
    assert elapsed < fibrl.get_context().config.start_timeout
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("fibrl"))
    assert "could not load its process" in logged
    assert "this argument cannot be rebuilt in a worker (test)" in logged


def _run_script(tmp_path, source, *args, cwd=ROOT, name="main.py", timeout=240):
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _backend_param(request):
    if request.param == "docker":
        from conftest import docker_available, skip_or_fail

        reason = docker_available()
        if reason:
            skip_or_fail(reason, "CI_REQUIRE_DOCKER")
    return request.param


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def script_backend(request):
    return _backend_param(request)


GUARDED_TARGET = """
    import sys
    import fibrl

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1])

        def cube(q, x):
            q.put(x ** 3)

        class Holder:
            def __init__(self, v):
                self.v = v

        def unwrap(q, holder):
            q.put(holder.v)

        q = fibrl.Queue()
        for target, args in ((cube, (q, 3)), (unwrap, (q, Holder("held")))):
            p = fibrl.Process(target=target, args=args)
            p.start()
            print(q.get(timeout=120))
            p.join(120)
            print("exitcode", p.exitcode)
"""


def test_function_defined_under_the_main_guard_runs_as_target(tmp_path, script_backend):
    out = _run_script(tmp_path, GUARDED_TARGET, script_backend)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["27", "exitcode", "0", "held", "exitcode", "0"]


GUARDED_IN_POOL = """
    import sys
    import fibrl
    from fibrl.futures import ProcessPoolExecutor

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1])

        def square(x):
            return x * x

        class Box:
            pass

        with fibrl.Pool(2) as pool:
            print(pool.map(square, range(4)), pool.apply(square, (5,)))
            print(list(pool.imap(square, range(3))), pool.starmap(square, [(6,)]))
            try:
                pool.apply(type, (Box(),))  # an argument, not the task's function
            except Exception as exc:
                print("error:", exc)
        with ProcessPoolExecutor(2) as executor:
            print(list(executor.map(square, range(3))), executor.submit(square, 7).result(120))
"""


def test_function_defined_under_the_main_guard_runs_in_pool(tmp_path, script_backend):
    out = _run_script(tmp_path, GUARDED_IN_POOL, script_backend)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:2] == ["[0, 1, 4, 9] 25", "[0, 1, 4] [36]"]
    assert lines[2].startswith("error: define Box at module top level (functions defined "
                               "under `if __name__ == '__main__':` ")
    assert lines[3:] == ["[0, 1, 4] 49"]


UNGUARDED = """
    import os
    import fibrl

    if __name__ == "__mp_main__":   # a worker importing the script: count it
        with open(os.environ["WORKER_IMPORTS"], "a") as counts:
            counts.write("w")

    def square(x):
        return x * x

    with fibrl.Pool(2) as pool:
        print(pool.map(square, range(4), chunksize=1))
"""


def test_missing_main_guard_is_said_once_with_the_fix(tmp_path, monkeypatch):
    imports = tmp_path / "worker-imports"
    monkeypatch.setenv("WORKER_IMPORTS", str(imports))
    out = _run_script(tmp_path, UNGUARDED, timeout=180)
    assert out.returncode != 0
    # the workers started at once (two) fail; the pool starts no replacement
    assert 1 <= len(imports.read_text()) <= 2, out.stderr[-5000:]
    assert "WorkerLostError: the pool stopped starting workers" in out.stderr
    said = out.stderr.count('no `if __name__ == "__main__":` guard')
    assert said == 1, out.stderr[-5000:]
    assert 'if __name__ == "__main__":\n        main()' in out.stderr
    assert out.stderr.count("bootstrapping phase") == 0, out.stderr[-5000:]
    assert len(out.stderr.splitlines()) < 60, out.stderr[-5000:]


SCRIPT_WITH_NEIGHBOUR = """
    import sys
    import fibrl
    import helpers

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1])
        q = fibrl.Queue()
        p = fibrl.Process(target=helpers.work, args=(q, 6))
        p.start()
        print(q.get(timeout=120))
        p.join(120)
        print("exitcode", p.exitcode)
"""


def test_script_run_from_elsewhere_imports_its_own_folder(tmp_path, script_backend):
    """`cd project && python ~/tools/run.py`, where run.py imports a module of its own
    folder: the worker finds it, as spawn's would (the folder is on sys.path)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "helpers.py").write_text("def work(q, x):\n    q.put(x * 7)\n")
    out = _run_script(tools, SCRIPT_WITH_NEIGHBOUR, script_backend, name="run.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["42", "exitcode", "0"]


@pytest.mark.kubernetes
@pytest.mark.parametrize("ctx", ["kubernetes"], indirect=True)
def test_kubernetes_says_at_start_when_the_image_lacks_the_programs_code(ctx, caplog,
                                                                          monkeypatch):
    """This test module is imported from the working directory; the stock image cannot
    hold it: said in the parent, before the pod starts, with both fixes."""
    from fibrl import popen

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(popen, "_images_checked", set())
    with caplog.at_level(logging.WARNING, logger="fibrl"):
        p = ctx.Process(target=noop, args=(1,))
        p.start()
        said = [r for r in caplog.records if "holds fibrl but not this program's code"
                in r.getMessage()]
        p.join(TIMEOUT)
    assert p.exitcode == 0
    assert len(said) == 1
    text = said[0].getMessage()
    # names modules of the working directory (the first few, in the suite: any of them)
    found = re.search(r"the modules it imports from (\S+) \(([^)]*)\)", text)
    assert found and found.group(1) == os.getcwd(), text
    assert found.group(2).split(", ")[0].isidentifier(), text
    assert "fibrl run" in text and "image=" in text
    assert popen.code_not_in_image(fibrl.get_context().config.replace(image="me/app:1")) is None


def close_std_streams():
    sys.stdout.close()
    sys.stderr.close()


def drop_std_streams():
    sys.stdout = None
    sys.stderr = None


@pytest.mark.parametrize("target", [close_std_streams, drop_std_streams])
def test_child_that_closes_or_removes_stdout_and_stderr_exits_0(ctx, target):
    p = ctx.Process(target=target)
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 0


def test_child_without_std_streams_exits_0_when_spawned(target=close_std_streams):
    previous = fibrl.get_context().config
    fibrl.init(backend="local", local_fork_server=False)
    try:
        p = fibrl.Process(target=target)
        p.start()
        p.join(TIMEOUT)
        assert p.exitcode == 0
    finally:
        fibrl.init(**{f: getattr(previous, f) for f in ("backend", "local_fork_server")})


def report_executable_and_logger(q):
    from multiprocessing import util

    logger = util.get_logger()
    q.put((sys.executable, logger.level, util._log_to_stderr))


def test_set_executable_chooses_the_local_workers_interpreter(tmp_path):
    from multiprocessing import spawn

    chosen = tmp_path / "python-chosen"
    chosen.symlink_to(sys.executable)
    ctx = fibrl.get_context("local")
    q = ctx.Queue()
    ctx.set_executable(str(chosen))
    try:
        p = ctx.Process(target=report_executable_and_logger, args=(q,))
        p.start()
        executable, _, _ = q.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
    finally:
        spawn.set_executable(sys.executable)
    assert executable == str(chosen)
    assert p.exitcode == 0


def test_set_executable_on_a_container_backend_says_the_image_decides():
    with pytest.raises(NotImplementedError, match=r"image=\.\.\."):
        fibrl.get_context("docker").set_executable(sys.executable)


def test_log_to_stderr_level_reaches_children(ctx):
    from multiprocessing import util

    q = ctx.Queue()
    logger = util.get_logger()
    handlers = list(logger.handlers)
    try:
        ctx.log_to_stderr(logging.INFO)
        p = ctx.Process(target=report_executable_and_logger, args=(q,))
        p.start()
        _, level, to_stderr = q.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
    finally:
        for handler in logger.handlers[len(handlers):]:
            logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        util._log_to_stderr = False
    assert (level, to_stderr) == (logging.INFO, True)


def grandchild_watches_its_parent(q, reported):
    parent = fibrl.parent_process()
    q.put(("alive", parent.is_alive(), parent.pid == os.getppid() or parent.pid))
    reported.set()
    begin = time.monotonic()
    parent.join(TIMEOUT)
    q.put(("after", parent.is_alive(), time.monotonic() - begin))


def child_dies_after_grandchild_reports(q, reported):
    grandchild = fibrl.Process(target=grandchild_watches_its_parent, args=(q, reported))
    grandchild.start()
    q.put(("child", os.getpid()))
    reported.wait(TIMEOUT)
    os._exit(0)   # abruptly: the grandchild's parent dies under it


# On docker the grandchild is a process inside its parent's container (the container
# cannot reach the engine), which must outlive the parent long enough to see it die;
# on kubernetes it is a pod of its own.
def test_parent_process_in_a_grandchild_sees_its_parent_die(ctx):
    q, reported = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child_dies_after_grandchild_reports, args=(q, reported))
    p.start()
    got = dict((item[0], item[1:]) for item in (q.get(timeout=TIMEOUT) for _ in range(2)))
    child_pid = got["child"][0]
    alive, parent_pid = got["alive"]
    assert alive is True
    assert parent_pid in (True, child_pid)
    kind, alive_after, waited = q.get(timeout=TIMEOUT)
    assert (kind, alive_after) == ("after", False)
    assert waited < TIMEOUT / 2
    p.join(TIMEOUT)


PIPED = """
    import sys
    import fibrl

    class Greeting:
        def __init__(self, text):
            self.text = text

    def greet(q, greeting):
        q.put(greeting.text + " from a piped-in script")

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1] if len(sys.argv) > 1 else "local")
        q = fibrl.Queue()
        p = fibrl.Process(target=greet, args=(q, Greeting("hello")))
        p.start()
        print(q.get(timeout=120))
        p.join(120)
        print("exitcode", p.exitcode)
"""


def test_piped_in_script_runs(script_backend):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-", script_backend], input=textwrap.dedent(PIPED),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["hello from a piped-in script", "exitcode 0"]
