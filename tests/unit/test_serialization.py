"""Frames: round trips, out-of-band buffers, bad input."""
import pickle
import threading

import numpy as np
import pytest

from conftest import require_module
from fibrl.wire import serialization
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
    assert len(parts) == 1                       # one frame, joined: nothing out of band
    assert np.array_equal(serialization.loads(parts[0]), np.arange(10))


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


class _FailsToPickle:
    def __getstate__(self):
        raise RuntimeError("refuses to be pickled")


def test_an_error_raised_while_pickling_is_reported_with_the_object():
    with pytest.raises(SerializationError, match="_FailsToPickle.*RuntimeError: refuses"):
        serialization.dumps([1, _FailsToPickle()])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool", "complex64"])
def test_large_torch_tensors_travel_out_of_band(dtype):
    torch = require_module("torch")
    tensor = (torch.rand(300, 257) * 100).to(getattr(torch, dtype))
    parts = serialization.dumps_parts(tensor)
    assert len(parts) == 3 and len(parts[1]) < 1000   # one buffer, a tiny pickle
    back = serialization.loads(b"".join(parts))
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    back += 1 if dtype != "bool" else True             # writable, like a received array


def test_torch_tensor_views_and_leaf_parameters_round_trip():
    torch = require_module("torch")
    strided = torch.rand(400, 300).t()[5:]               # not contiguous
    leaf = torch.rand(200, 200, requires_grad=True)
    param = torch.nn.Parameter(torch.rand(200, 200))
    back = serialization.loads(serialization.dumps([strided, leaf, param, torch.arange(3)]))
    assert torch.equal(back[0], strided)
    assert back[1].requires_grad and back[1].is_leaf and torch.equal(back[1].detach(), leaf)
    assert type(back[2]) is torch.nn.Parameter and torch.equal(back[2].detach(), param)
    assert back[3].tolist() == [0, 1, 2]


class Refuses:
    def __reduce__(self):
        raise RuntimeError("not today")


def test_unpicklable_keeps_the_type_pickle_raised():
    import threading

    with pytest.raises(TypeError, match="fibrl.Lock"):      # pickle's own type
        serialization.dumps({"lock": threading.Lock()})
    with pytest.raises(RuntimeError, match="not today") as info:   # the object's own type
        serialization.dumps([Refuses()])
    assert isinstance(info.value, SerializationError)


def test_stdlib_multiprocessing_objects_name_the_fibrl_replacement():
    import multiprocessing

    queue = multiprocessing.Queue()
    lock = multiprocessing.Lock()
    with pytest.raises(SerializationError, match="create a fibrl.Queue instead"):
        serialization.dumps(queue)                    # outside a start: the stdlib's check
    for obj, replacement in ((queue, "fibrl.Queue"), (lock, "fibrl.Lock"),
                             (multiprocessing.Pipe()[0], "fibrl.Pipe"),
                             (multiprocessing.Value("i", 1), "fibrl.Value")):
        with pytest.raises(SerializationError, match=f"create a {replacement} instead"):
            serialization.dumps({"nested": [obj]}, spawning=True)   # a start: refused here


def test_encoded_borrows_large_buffers_and_owns_them_before_they_are_kept():
    """An Encoded views the sender's array (no copy); loading it, or own(), copies first,
    so changing the original afterwards never changes what a receiver gets."""
    import numpy as np

    arr = np.arange(100_000)
    enc = serialization.encode({"a": arr})
    assert enc.borrowed and len(enc.buffers) == 1
    arr[0] = -1                      # still borrowed: the view sees it
    got = serialization.loads(enc)   # load owns first
    arr[1] = -2
    assert got["a"][0] == -1 and got["a"][1] == 1 and got["a"].flags.writeable


def test_encoded_travels_out_of_band_inside_a_message():
    import pickle

    import numpy as np

    arr = np.arange(100_000)
    enc = serialization.encode(arr)
    frame = serialization.dumps(("reply", enc))
    _, back = serialization.loads(bytearray(frame))
    assert not back.borrowed
    assert np.array_equal(serialization.loads(back), arr)
    big = b"x" * 200_000            # a large bytes is sent out of band, comes back as bytes
    enc = serialization.encode(big)
    assert len(enc.data) < 100 and serialization.loads(enc) == big
    assert type(pickle.loads(pickle.dumps(serialization.loads(enc)))) is bytes


def test_read_only_arrays_stay_read_only_writable_ones_writable():
    import numpy as np

    ro = np.arange(100_000)
    ro.setflags(write=False)
    for arr, writable in ((ro, False), (np.arange(100_000), True)):
        frame = serialization.dumps(arr)
        assert serialization.loads(bytearray(frame)).flags.writeable is writable
