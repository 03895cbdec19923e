"""Frames: round trips, out-of-band buffers, bad input."""
import pickle
import threading

import numpy as np
import pytest

from fibrl import serialization
from fibrl.errors import FrameError, SerializationError


def test_round_trip_plain_objects():
    obj = {"a": [1, 2.5, "x"], "b": (None, True), "c": b"bytes"}
    assert serialization.loads(serialization.dumps(obj)) == obj


def test_lambdas_and_closures_fall_back_to_cloudpickle():
    k = 3
    fn = serialization.loads(serialization.dumps(lambda x: x + k))
    assert fn(1) == 4


def test_large_buffers_travel_out_of_band_and_arrive_writable():
    arr = np.arange(1_000_000, dtype=np.float64)
    parts = serialization.dumps_parts(arr)
    assert len(parts) == 3                       # header, pickle, one out-of-band buffer
    assert len(parts[1]) < 1000                  # the array is not inside the pickle
    back = serialization.loads(b"".join(parts))
    assert np.array_equal(back, arr) and back.flags.writeable


def test_small_buffers_stay_in_band():
    parts = serialization.dumps_parts(np.arange(10))
    assert len(parts) == 2


def test_unpicklable_object_is_named():
    with pytest.raises(SerializationError, match="cannot pickle.*lock") as info:
        serialization.dumps({"lock": threading.Lock()})
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("data", [b"", b"garbage", b"FB\x01", pickle.dumps([1, 2])])
def test_garbage_is_not_a_frame(data):
    with pytest.raises(FrameError):
        serialization.loads(data)


def test_truncated_frame_is_detected():
    frame = serialization.dumps(np.arange(100_000))
    with pytest.raises(FrameError, match="length mismatch|truncated"):
        serialization.loads(frame[:-10])
