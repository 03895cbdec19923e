"""The envelope of calls and replies on the wire: compact where it can be, exact always."""
import pickle

import numpy as np
import pytest

from fibrl.wire import serialization
from fibrl.errors import FrameError, RemoteObjectError
from fibrl.wire.messages import (COMPACT, LONE_CALL, LONE_REPLY, Call, RemoteError, Reply, pack,
                            unpack)
from fibrl.wire.serialization import Encoded, encode


def _frame(message):
    return b"".join(bytes(p) for p in pack(message))


def _same(a, b):
    """Messages equal, comparing an Encoded by what it decodes to."""
    assert type(a) is type(b)
    if type(a) is Reply:
        assert (a.rid, a.ok, a.encoded) == (b.rid, b.ok, b.encoded)
        pairs = [(a.value, b.value)]
    else:
        assert (a.rid, a.oid, a.method, len(a.args)) == (b.rid, b.oid, b.method, len(b.args))
        pairs = list(zip(a.args, b.args))
    for x, y in pairs:
        if type(x) is Encoded:
            assert type(y) is Encoded
            assert serialization.loads(x) == serialization.loads(y)
        else:
            assert x == y and type(x) is type(y)


LONE = [
    Reply(7, True, encode(b"x" * 100)),                             # a pushed pipe message
    Call(0, "pipe-1", "put", (encode({"k": [1, 2]}),)),             # a put
    Reply(3, True, b"answer", True),                                # a manager call's reply
    Reply(4, False, encode(("no", 3)), True),
    Reply(2**63 - 1, True, b""),
    Call(5, "pipe-ø", "pút", (encode(None),)),
]
COMPACT_ONLY = [
    Call(3, "mgr", "call", ("ident", "append", b"payload", ())),    # a manager call
    Call(9, "q", "get", (None,)), Call(9, "q", "get", (2.5,)), Reply(1, True, None),
    Call(4, "q", "want", (3, 16, 1)), Reply(5, False, "text", False),
    Call(2, "mgr", "decref", (("a", "b"),)),
    Call(0, "q", "put", (encode(1), 2.5)),                          # a put with a timeout
    Reply(2**64, True, encode(1)), Call(-2**64, "q", "put", (encode(1),)),  # ids too large
]
HOT = LONE + COMPACT_ONLY


@pytest.mark.parametrize("message", LONE, ids=lambda m: type(m).__name__)
def test_a_lone_payload_travels_after_a_fixed_header_and_comes_back_equal(message):
    frame = _frame(message)
    assert frame[:3] == (LONE_REPLY if type(message) is Reply else LONE_CALL)
    payload = message.value if type(message) is Reply else message.args[0]
    payload = payload.data if type(payload) is Encoded else payload
    header = 12 if type(message) is Reply else 15 + len(message.oid.encode()) \
        + len(message.method.encode())
    assert frame[header:] == payload and len(frame) == header + len(payload)  # nothing else
    _same(unpack(frame), message)


@pytest.mark.parametrize("message", COMPACT_ONLY, ids=lambda m: type(m).__name__)
def test_other_hot_messages_travel_compact_and_come_back_equal(message):
    frame = _frame(message)
    assert frame.startswith(COMPACT)
    _same(unpack(frame), message)


def test_a_lone_frame_received_as_a_view_comes_back_as_bytes():
    frame = _frame(Reply(7, True, encode(b"y" * 1000)))
    back = unpack(memoryview(bytearray(frame)))
    assert type(back.value.data) is bytes and serialization.loads(back.value) == b"y" * 1000
    call = unpack(memoryview(_frame(LONE[1])))
    assert call.oid == "pipe-1" and serialization.loads(call.args[0]) == {"k": [1, 2]}


def test_a_batch_travels_as_one_compact_frame():
    frame = _frame(HOT)
    assert frame.startswith(COMPACT)
    back = unpack(frame)
    assert len(back) == len(HOT)
    for a, b in zip(back, HOT):
        _same(a, b)


OTHER = [
    Reply(1, False, RemoteError.capture(ValueError("boom"))),       # an exception
    Call(0, "q", "put", (encode(np.arange(100_000)),)),             # out-of-band buffer
    Call(0, "q", "put", (b"x" * 200_000,)),                         # large raw payload
    Call(1, "q", "call", ({"a": 1},)),                              # not a plain value
    Call(1, "q", "call", ((1, (2, 3)),)),                           # a nested tuple
]


@pytest.mark.parametrize("message", OTHER, ids=lambda m: type(m).__name__)
def test_other_messages_travel_as_pickled_objects(message):
    frame = _frame(message)
    assert frame.startswith(serialization.MAGIC)
    back = unpack(frame)
    assert type(back) is type(message) and back.rid == message.rid
    if type(message) is Reply:
        with pytest.raises(ValueError, match="boom"):
            raise back.value
    elif message.method == "put":
        arg = back.args[0]
        assert len(bytes(serialization.as_bytes(arg)) if type(arg) is Encoded else arg) \
            >= 200_000 or np.array_equal(serialization.loads(arg), np.arange(100_000))


def test_a_mixed_batch_falls_back_whole():
    frame = _frame([HOT[0], OTHER[0]])
    assert frame.startswith(serialization.MAGIC)
    assert [type(m) for m in unpack(frame)] == [Reply, Reply]


@pytest.mark.parametrize("body", [
    b"", b"garbage", pickle.dumps((1, 2)), pickle.dumps((0, "rid", "o", "m", 0)),
    pickle.dumps((1, 5, "yes", False, 0, None)), pickle.dumps((0, 1, 2, "m", 0)),
    pickle.dumps((5, 1, "o", "m", 0)), pickle.dumps([(0, 1, "o", "m", 0), "x"]),
    pickle.dumps((0, 1, "o", "m", 1, 12345)),  # marked a payload, not bytes
])
def test_malformed_compact_frames_are_refused(body):
    with pytest.raises(FrameError):
        unpack(COMPACT + body)


@pytest.mark.parametrize("frame", [
    LONE_REPLY, LONE_REPLY + b"\x01" * 8,                           # truncated header
    LONE_REPLY + (1).to_bytes(8, "little") + b"\x08payload",        # unknown flag
    LONE_CALL + (1).to_bytes(8, "little") + b"\x01\x00",             # truncated header
    LONE_CALL + (1).to_bytes(8, "little") + b"\x05\x00\x03\x00" + b"oid",  # names too long
    LONE_CALL + (1).to_bytes(8, "little") + b"\x01\x00\x01\x00" + b"\xff" + b"m",  # not utf-8
])
def test_malformed_lone_frames_are_refused(frame):
    with pytest.raises(FrameError, match="lone"):
        unpack(frame)
    with pytest.raises(FrameError, match="lone"):
        unpack(memoryview(frame))


def test_a_frame_of_something_else_than_messages_is_refused():
    with pytest.raises(FrameError, match="not a message"):
        unpack(serialization.dumps({"not": "a message"}))
    with pytest.raises(FrameError):
        unpack(b"nonsense")


def test_remote_errors_still_arrive_as_themselves():
    back = unpack(_frame(Reply(1, False, RemoteError.capture(RemoteObjectError("gone")))))
    assert isinstance(back.value, RemoteObjectError)
