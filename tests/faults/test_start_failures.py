"""Pool workers that cannot start: the pool's error names the worker's own error,
its traceback is logged once, and the pool stops after the same error twice.

Scripts run as real programs (a subprocess from the repository root, so docker
containers mount this checkout)."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Only a worker imports the module: the parent runs the script as __main__.
FAILS_IN_WORKERS = """
    import sys
    import fibrl
    if __name__ != "__main__":
        import {module}

    def square(x):
        return x * x

    if __name__ == "__main__":
        fibrl.init(backend=sys.argv[1])
        with fibrl.Pool(3) as pool:
            print(pool.map(square, range(6), chunksize=1))
"""


def _run(script, backend, pythonpath=(), timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *pythonpath]))
    return subprocess.run([sys.executable, str(script), backend], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _assert_named_once(out, module):
    err = out.stderr
    assert out.returncode == 1, err[-5000:]
    final = err.strip().splitlines()[-1]
    assert final.startswith("fibrl.errors.WorkerLostError: the pool stopped starting"), final
    assert f"ModuleNotFoundError: No module named '{module}'" in final
    assert 'main.py", line 5, in <module>' in final   # the line that raised, in the worker
    assert err.count("could not load its process and exits") == 1, err[-5000:]
    assert err.count(f"import {module}\n") == 1, err[-5000:]   # the worker's traceback


def test_a_worker_whose_import_fails_names_it_once_local(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(FAILS_IN_WORKERS.format(module="no_such_module_xq")))
    out = _run(script, "local")
    _assert_named_once(out, "no_such_module_xq")


@pytest.mark.docker
def test_a_docker_worker_that_cannot_import_a_pythonpath_module_says_what_is_mounted(
        tmp_path, docker_engine):
    """The user's PYTHONPATH names a folder docker does not mount: the parent imports
    the module, the containers cannot."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mylib_outside.py").write_text("VALUE = 1\n")
    app = tmp_path / "app"
    app.mkdir()
    script = app / "main.py"
    script.write_text(textwrap.dedent(FAILS_IN_WORKERS.format(module="mylib_outside")))
    out = _run(script, "docker", pythonpath=[str(lib)])
    _assert_named_once(out, "mylib_outside")
    final = out.stderr.strip().splitlines()[-1]
    assert "mounted into it at the same paths" in final
    assert ROOT in final and str(app) in final and str(lib) not in final.split("paths: ")[1]
