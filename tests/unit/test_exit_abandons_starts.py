"""Interpreter exit while a pool worker is still starting: the backend is told to give
up its starts before the interpreter joins the threads that run them (a
``ThreadPoolExecutor``'s, joined before any ``atexit`` handler), so the program does
not wait a slow start out."""
import subprocess
import sys
import textwrap

from conftest import checkout_env


PROGRAM = """
    import threading, time
    from concurrent.futures import ThreadPoolExecutor
    from fibrl.hosting import runtime

    backend = runtime.backend(runtime.current_config())   # the local backend
    told = threading.Event()
    backend.abandon_starts = told.set      # what a slow start would watch

    def slow_start():
        told.wait(60)                      # a start that waits until told to give up
        print("told" if told.is_set() else "waited it out", flush=True)

    ThreadPoolExecutor(1).submit(slow_start)
    time.sleep(0.5)
    print("exiting", flush=True)
"""


def test_exit_tells_the_backend_before_joining_its_starter_threads(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = checkout_env()
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # "waited it out" after 60 s: the exit joined the starter before telling the backend
    assert done.stdout.split() == ["exiting", "told"], done.stdout + done.stderr[-3000:]
