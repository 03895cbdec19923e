"""Deferred imports (fibrl.wire.deferred): pynng imports asyncio (and through it ssl
and OpenSSL) for an async API fibrl never calls. A worker, forked from the local fork
server or started on its own, does not carry asyncio until its own code imports it;
then it is the real module, and pynng's async API, which holds the stand-in, works
through it."""
import subprocess
import sys
import textwrap

import pytest

import fibrl

TIMEOUT = 60


def _loaded(names):
    return {name: name in sys.modules for name in names}


def _asyncio_in_a_worker():
    import asyncio

    async def answer():
        await asyncio.sleep(0)
        return 42

    return type(asyncio).__name__, asyncio.run(answer())


def _pynng_async_round_trip():
    import asyncio

    import pynng
    import pynng._aio

    held = type(pynng._aio.asyncio).__name__   # what pynng imported at the worker's start

    async def trip():
        with pynng.Pair0(listen="inproc://fork-server-async") as a, \
                pynng.Pair0(dial="inproc://fork-server-async") as b:
            await a.asend(b"ping")
            return await b.arecv()

    return held, asyncio.run(trip())


@pytest.fixture(params=[True, False], ids=["fork server", "own interpreter"])
def forked_pool(request, configure):
    configure(backend="local", local_fork_server=request.param)
    with fibrl.Pool(1) as pool:
        yield pool


def test_a_worker_does_not_carry_asyncio(forked_pool):
    got = forked_pool.apply(_loaded, (("pynng", "asyncio", "ssl"),))
    assert got == {"pynng": True, "asyncio": False, "ssl": False}


def test_a_worker_that_imports_asyncio_gets_the_real_module(forked_pool):
    assert forked_pool.apply(_asyncio_in_a_worker) == ("module", 42)


def test_pynngs_async_api_works_through_the_stand_in(forked_pool):
    assert forked_pool.apply(_pynng_async_round_trip) == ("OnFirstUse", b"ping")


def _preloaded(tmp_path, modules: dict, preload: list, defer: list, then: str) -> str:
    """Run, in a fresh interpreter, an import of ``preload`` (modules written from
    ``modules``) under ``deferring(defer)``, then the code ``then``; its output."""
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    script = textwrap.dedent(f"""
        import importlib, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from fibrl.wire.deferred import deferring
        assert not set({defer!r}) & set(sys.modules), "imported before"
        with deferring({defer!r}):
            for name in {preload!r}:
                importlib.import_module(name)
    """) + textwrap.dedent(then)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_deferred_module_imports_on_first_use_and_is_then_the_real_one(tmp_path):
    out = _preloaded(tmp_path, {"holder": "import colorsys as held\n"}, ["holder"],
                     ["colorsys"], """
        import holder
        print("colorsys" in sys.modules, type(holder.held).__name__, repr(holder.held))
        hsv = holder.held.rgb_to_hsv(1.0, 0.0, 0.0)
        print("colorsys" in sys.modules, hsv)
        import colorsys
        print(holder.held.rgb_to_hsv is colorsys.rgb_to_hsv, type(colorsys).__name__)
    """)
    first, used, same = out.splitlines()
    assert first.startswith("False OnFirstUse <module 'colorsys' from ")
    assert used == "True (0.0, 1.0, 1.0)"
    assert same == "True module"


def test_a_deferred_module_read_during_the_preload_becomes_the_real_one(tmp_path):
    out = _preloaded(tmp_path, {"eager": "from colorsys import rgb_to_hsv\n"}, ["eager"],
                     ["colorsys"], """
        import colorsys, eager
        print(type(colorsys).__name__, eager.rgb_to_hsv is colorsys.rgb_to_hsv)
    """)
    assert out.split() == ["module", "True"]


def test_a_submodule_imported_during_the_preload_is_loaded_once(tmp_path):
    """``import asyncio.events`` while asyncio stands in: the real asyncio loads it, and
    the import does not run it again (two AbstractEventLoop classes, two policies)."""
    out = _preloaded(tmp_path, {"sub": "import asyncio.events\n"}, ["sub"], ["asyncio"], """
        import asyncio, asyncio.base_events
        print(type(asyncio).__name__,
              asyncio.base_events.events is asyncio.events is sys.modules["asyncio.events"],
              isinstance(asyncio.new_event_loop(), asyncio.events.AbstractEventLoop),
              asyncio.events.__spec__.origin == asyncio.events.__file__)
    """)
    assert out.split() == ["module", "True", "True", "True"]


def test_a_deferred_module_that_is_not_installed_is_an_import_error_as_without(tmp_path):
    out = _preloaded(tmp_path, {"optional": """
        try:
            import fibrl_no_such_module as opt
        except ImportError:
            opt = None
    """}, ["optional"], ["fibrl_no_such_module"], """
        import optional
        print(optional.opt, "fibrl_no_such_module" in sys.modules)
    """)
    assert out.split() == ["None", "False"]
