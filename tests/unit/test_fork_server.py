"""The local fork server's deferred modules: pynng imports asyncio (and through it ssl
and OpenSSL) for an async API fibrl never calls. A worker forked from the fork server
does not carry asyncio until its own code imports it; then it is the real module, and
pynng's async API, which holds the stand-in, works through it."""
import sys

import pytest

import fibrl
from fibrl.backends import _zygote

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

    async def trip():
        with pynng.Pair0(listen="inproc://fork-server-async") as a, \
                pynng.Pair0(dial="inproc://fork-server-async") as b:
            await a.asend(b"ping")
            return await b.arecv()

    return asyncio.run(trip())


@pytest.fixture
def forked_pool(configure):
    configure(backend="local", local_fork_server=True)
    with fibrl.Pool(1) as pool:
        yield pool


def test_a_forked_worker_does_not_carry_asyncio(forked_pool):
    got = forked_pool.apply(_loaded, (("pynng", "asyncio", "ssl"),))
    assert got == {"pynng": True, "asyncio": False, "ssl": False}


def test_a_worker_that_imports_asyncio_gets_the_real_module(forked_pool):
    assert forked_pool.apply(_asyncio_in_a_worker) == ("module", 42)


def test_pynngs_async_api_works_through_the_stand_in(forked_pool):
    assert forked_pool.apply(_pynng_async_round_trip) == b"ping"


def test_a_stand_in_read_during_the_preload_becomes_the_real_module(monkeypatch, tmp_path):
    """A preloaded module that reads an attribute of a deferred one while it imports
    gets the real module, which stays in sys.modules; one that does not leaves no
    stand-in behind."""
    (tmp_path / "eager_reader.py").write_text(
        "import json_stand_in_target as target\nDUMPS = target.dumps\n")
    (tmp_path / "lazy_holder.py").write_text("import colorsys as held\n")
    (tmp_path / "json_stand_in_target.py").write_text("from json import dumps\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("eager_reader", "lazy_holder", "json_stand_in_target", "colorsys"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    _zygote._preload(["eager_reader", "lazy_holder"], ["json_stand_in_target", "colorsys"])
    import eager_reader
    import lazy_holder

    import json
    assert eager_reader.DUMPS is json.dumps
    assert type(sys.modules["json_stand_in_target"]) is type(json)
    assert "colorsys" not in sys.modules
    assert isinstance(lazy_holder.held, _zygote._OnFirstUse)
    assert lazy_holder.held.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert type(sys.modules["colorsys"]) is type(json)
