"""Value, Array, RawValue and RawArray across processes. Runs on every backend.

The stdlib's behaviour is the spec, except where no memory is shared across
machines (see ``fibrl.sharedctypes``): those cases raise a clear error.
Worker functions are made by ``_workers()`` so they travel by value.
"""
import ctypes
import time
import types
from ctypes.wintypes import POINT  # a Structure any worker can import (x, y: c_long)

import pytest

from conftest import join_all, run_process

TIMEOUT = 60


class Point(ctypes.Structure):  # the CPython docs' example type
    _fields_ = [("x", ctypes.c_double), ("y", ctypes.c_double)]


class Segment(ctypes.Structure):  # nested parts: a Structure, an array and a string field
    _fields_ = [("start", Point), ("counts", ctypes.c_int * 3), ("name", ctypes.c_char * 8)]


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

    def docs_modify(n, x, s, A):  # the CPython docs' sharedctypes example, as written there
        n.value **= 2
        x.value **= 2
        s.value = s.value.upper()
        for a in A:
            a.x **= 2
            a.y **= 2

    def write_every_way(numbers, points, grid, segment, text):
        numbers[0] = 5
        numbers[1] += 10
        numbers[2] **= 2
        numbers[3:5] = [30, 40]
        numbers[5::2] = [50, 70]
        points[0].x = 100.0
        points[1].y += 1.5
        points[2:3][0].x -= 1
        grid[1][0] = 4
        grid[0][1] += 2
        segment.start.x = 7.5
        segment.counts[1] += 5
        segment.name = b"seg"
        text.raw = b"abcdef"
        text[0:2] = b"AB"

    def write_through_get_obj(numbers, points, point):
        numbers.get_obj()[0] = 9
        points.get_obj()[0].x += 1.5
        points.get_obj()[1].y = 2.5
        point.get_obj().x = 4

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


def test_cpython_docs_example_writes_reach_the_parent(ctx):
    initial = [(1.875, -6.25), (-5.75, 2.0), (2.375, 9.5)]
    lock = ctx.Lock()
    n = ctx.Value("i", 7)
    x = ctx.Value(ctypes.c_double, 1.0 / 3.0, lock=False)
    s = ctx.Array("c", b"hello world", lock=lock)
    A = ctx.Array(Point, initial, lock=lock)
    join_all(run_process(ctx, W.docs_modify, n, x, s, A))
    assert n.value == 49 and x.value == (1.0 / 3.0) ** 2 and s.value == b"HELLO WORLD"
    assert [(a.x, a.y) for a in A] == [(px * px, py * py) for px, py in initial]


@pytest.mark.parametrize("lock", [True, False])
def test_every_way_of_writing_reaches_the_parent(ctx, lock):
    numbers = ctx.Array("i", [1, 2, 3, 0, 0, 0, 6, 0], lock=lock)
    points = ctx.Array(Point, [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)], lock=lock)
    grid = ctx.Array(ctypes.c_int * 2, 2, lock=lock)
    segment, text = ctx.Value(Segment, lock=lock), ctx.Array("c", 8, lock=lock)
    join_all(run_process(ctx, W.write_every_way, numbers, points, grid, segment, text))
    assert numbers[:] == [5, 12, 9, 30, 40, 50, 6, 70]
    assert [(p.x, p.y) for p in points] == [(100.0, 2.0), (3.0, 5.5), (4.0, 6.0)]
    assert [row[:] for row in grid] == [[0, 2], [4, 0]]
    assert (segment.start.x, segment.counts[:], segment.name) == (7.5, [0, 5, 0], b"seg")
    assert text.value == b"ABcdef" and text.raw == b"ABcdef\x00\x00"


def test_get_obj_writes_reach_the_parent(ctx):
    numbers, points = ctx.Array("i", 2), ctx.Array(Point, 2)
    point = ctx.Value(Point, 1.0, 2.0)
    join_all(run_process(ctx, W.write_through_get_obj, numbers, points, point))
    assert numbers[:] == [9, 0] and (point.x, point.y) == (4.0, 2.0)
    assert [(p.x, p.y) for p in points] == [(1.5, 0.0), (0.0, 2.5)]


def test_parts_of_structures_refuse_what_they_cannot_store(ctx):
    points = ctx.Array(Point, 2)
    with pytest.raises(AttributeError, match="no field 'z'"):
        points[0].z = 1.0  # a ctypes copy would keep it; a shared element cannot
    with pytest.raises(IndexError):
        points[2]
    assert points[-1]._path == (1,) and len(points[0:5]) == 2
    points[0] = points[1] = Point(3.0, 4.0)
    points[1].x = 0.0
    assert (points[0].x, points[1].x) == (3.0, 0.0)  # a copy, as with ctypes
