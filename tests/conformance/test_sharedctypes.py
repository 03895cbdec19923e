"""Value, Array, RawValue and RawArray across processes. Runs on every backend.

The stdlib's behaviour is the spec, except where no memory is shared across
machines (see ``fibrl.sharedctypes``): those cases raise a clear error.
Worker functions are made by ``_workers()`` so they travel by value.
"""
import ctypes
import time
import types

import pytest

from conftest import join_all, run_process

TIMEOUT = 60
from ctypes.wintypes import POINT  # a Structure any worker can import (x, y: c_long)


def _workers():
    def increment(value, times):
        for _ in range(times):
            with value.get_lock():
                value.value += 1

    def fill(array, start):
        for i in range(len(array)):
            array[i] = start + i

    def write_strings(text, point):
        text.value = b"hello"
        point.x = 35

    def write_pair_slowly(array, started):
        with array.get_lock():
            array[0] = 1
            started.set()
            time.sleep(0.3)
            array[1] = 1

    return types.SimpleNamespace(**locals())


W = _workers()


def test_value_increments_under_its_lock(ctx):
    value = ctx.Value("i", 0)
    procs = [run_process(ctx, W.increment, value, 30) for _ in range(3)]
    W.increment(value, 30)
    join_all(*procs)
    assert value.value == 120
    assert repr(value) == "<Synchronized wrapper for c_int(120)>"


def test_value_types_and_lock_options(ctx):
    assert ctx.Value("d", 1.5).value == 1.5
    assert ctx.Value(ctypes.c_bool, True).value is True
    assert ctx.Value("c", b"a").value == b"a"
    given = ctx.Lock()
    value = ctx.Value("i", 3, lock=given)
    assert value.get_lock() is given
    with value:
        assert value.value == 3  # the holder's own reads do not wait for itself
    raw = ctx.Value("i", 5, lock=False)
    assert not hasattr(raw, "get_lock") and raw.value == 5
    with pytest.raises(AttributeError, match="acquire"):
        ctx.Value("i", 0, lock="not a lock")
    with pytest.raises(TypeError, match="typecode"):
        ctx.Value("Q!", 0)


def test_array_indexing_slicing_from_children(ctx):
    array = ctx.Array("i", 6)
    assert len(array) == 6 and array[:] == [0] * 6
    join_all(run_process(ctx, W.fill, array, 10))
    assert array[:] == [10, 11, 12, 13, 14, 15]
    assert array[1:3] == [11, 12] and array[-1] == 15 and list(array) == array[:]
    array[0:2] = [7, 8]
    assert array[:2] == [7, 8]
    with pytest.raises(IndexError):
        array[6]
    assert ctx.Array("d", [1.0, 2.0])[:] == [1.0, 2.0]


def test_char_array_and_structure_value(ctx):
    text, point = ctx.Array("c", 10), ctx.Value(POINT, 1, 2)
    join_all(run_process(ctx, W.write_strings, text, point))
    assert text.value == b"hello"
    assert text.raw == b"hello" + b"\x00" * 5
    assert (point.x, point.y) == (35, 2)


def test_access_waits_while_another_process_holds_the_lock(ctx):
    array, started = ctx.Array("i", 2), ctx.Event()
    p = run_process(ctx, W.write_pair_slowly, array, started)
    assert started.wait(TIMEOUT)
    assert array[:] == [1, 1]  # never the half-written [1, 0]
    join_all(p)


def test_raw_value_and_array_are_shared_not_copied(ctx):
    value, array = ctx.RawValue("i", 0), ctx.RawArray("d", 3)
    join_all(run_process(ctx, W.fill, array, 1))
    value.value = 9
    assert array[:] == [1.0, 2.0, 3.0] and value.value == 9
    assert not hasattr(array, "get_lock")


def test_raw_objects_refuse_memory_access(ctx):
    array = ctx.RawArray("i", 3)
    with pytest.raises(TypeError):
        memoryview(array)
    with pytest.raises(TypeError):
        ctypes.addressof(array)


def test_synchronized_and_copy_helpers(ctx):
    from fibrl.sharedctypes import copy, synchronized

    raw = ctx.RawArray("i", [1, 2, 3])
    wrapped = synchronized(raw)
    with wrapped:
        wrapped[0] = 5
    duplicate = copy(raw)
    duplicate[1] = 0
    assert raw[:] == [5, 2, 3] and duplicate[:] == [5, 0, 3]
    assert wrapped.get_obj() is raw
