"""The frames of fibrl.rl.envs.protocol: compact per-step frames and their fallbacks."""
from __future__ import annotations

from conftest import require_module

np = require_module("numpy", "CI_REQUIRE_DOCKER")
require_module("gymnasium", "CI_REQUIRE_DOCKER")

from fibrl.rl.envs.protocol import (Call, Failure, Reset, Result, Step, decode,  # noqa: E402
                                     encode)


def frame_bytes(frame):
    """What the transport sends: a frame or its parts joined."""
    if isinstance(frame, list):
        return b"".join(bytes(memoryview(p).cast("B")) for p in frame)
    return frame


def result(obs, infos=None, restarts=()):
    n = len(obs)
    return Result(3, 1, 42, tuple(range(5, 5 + n)), obs, np.arange(n, dtype=np.float64) / 3,
                  np.arange(n) % 2 == 0, np.arange(n) % 3 == 0, infos or [None] * n, restarts)


def check_result(got, want):
    assert (got.worker, got.gen, got.seq, got.slots) == (want.worker, want.gen, want.seq,
                                                          want.slots)
    assert got.obs.dtype == want.obs.dtype and got.obs.shape == want.obs.shape
    np.testing.assert_array_equal(got.obs, want.obs)
    for name in ("rewards", "terminated", "truncated"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == np.asarray(b).dtype, name
        np.testing.assert_array_equal(a, b)
    assert tuple(got.restarts) == tuple(want.restarts)
    assert len(got.infos) == len(want.infos)
    for a, b in zip(got.infos, want.infos):
        assert (a is None) == (b is None)
        if b is not None:
            assert a.keys() == b.keys()
            for key in b:
                np.testing.assert_array_equal(a[key], b[key])


def test_step_frame_is_compact_and_round_trips():
    msg = Step(7, (0, 2, 5), np.array([1, 0, 1], dtype=np.int64))
    frame = encode(msg)
    assert type(frame) is bytes and frame[:2] == b"FS"
    assert len(frame) < 80  # no pickle: header, slots and 24 bytes of actions
    got = decode(frame)
    assert (got.seq, got.slots) == (7, (0, 2, 5))
    np.testing.assert_array_equal(got.actions, msg.actions)
    assert got.actions.dtype == np.int64 and got.actions.flags.writeable


def test_box_actions_keep_shape_and_dtype():
    actions = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 2, 2)
    got = decode(encode(Step(1, (0, 1, 2), actions)))
    assert got.actions.shape == (3, 2, 2) and got.actions.dtype == np.float32
    np.testing.assert_array_equal(got.actions, actions)


def test_result_frame_round_trips_with_and_without_infos():
    obs = np.arange(12, dtype=np.float32).reshape(3, 4)
    plain = result(obs)
    frame = encode(plain)
    assert type(frame) is bytes and frame[:2] == b"FR"
    check_result(decode(frame), plain)
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        failure = Failure.capture(1, exc)
    rich = result(obs, infos=[None, {"final_obs": np.ones(4), "x": 1}, None],
                  restarts=(failure,))
    got = decode(encode(rich))
    check_result(got, rich)
    (back,) = got.restarts
    assert back.summary == "RuntimeError: boom" and back.restarted
    assert back.traceback.rstrip().endswith("RuntimeError: boom")
    assert type(back.error) is RuntimeError and back.error.args == ("boom",)


def test_a_failure_whose_exception_does_not_pickle_keeps_its_type_and_message():
    import threading

    class Odd(Exception):
        def __init__(self, lock):
            super().__init__("odd")
            self.lock = lock

    try:
        raise Odd(threading.Lock())
    except Odd as exc:
        failure = Failure.capture(0, exc, restarted=False)
    back = decode(encode(Result(1, 0, 5, (0,), np.zeros((1, 2)), np.zeros(1),
                                np.zeros(1, bool), np.zeros(1, bool), [None], (failure,))))
    (got,) = back.restarts
    assert got.error is None and got.summary == "Odd: odd" and not got.restarted


def test_large_observations_travel_as_their_own_part():
    obs = np.random.default_rng(0).integers(0, 255, (4, 4, 84, 84), dtype=np.uint8)
    msg = result(obs)
    frame = encode(msg)
    assert isinstance(frame, list) and memoryview(frame[1]).nbytes == obs.nbytes
    check_result(decode(frame_bytes(frame)), msg)


def test_other_messages_are_fibrl_frames():
    dict_obs = {"a": np.zeros((2, 3)), "b": np.ones(2, dtype=np.int64)}
    reset_result = Result(1, 0, 5, (0, 1), np.zeros((2, 4)), None, None, None, [None, None])
    dict_result = Result(1, 0, 4, (0, 1), dict_obs, np.zeros(2), np.zeros(2, bool),
                         np.zeros(2, bool), [None, None])
    for msg in (Reset(1, (0, 1), (3, 4), None), Call(2, "render"),
                Step(3, (0,), {"x": np.zeros((1, 2))}), dict_result, reset_result):
        frame = encode(msg)
        assert frame_bytes(frame)[:3] == b"FB\x01", msg
        got = decode(frame)
        assert type(got) is type(msg) and got.seq == msg.seq
