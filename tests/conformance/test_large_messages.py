"""Large messages: intact, copied at most once per side, never aliasing the sender's objects.

Peak memory is measured by ``benchmarks/bench_core.py --only rss``; these tests check what a
user relies on: the bytes that arrive are the bytes that were sent when ``send``/``put``
returned, on every backend.
"""
import hashlib

import numpy as np
import pytest

TIMEOUT = 120
MB = 1 << 20


def digest(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def send_then_scribble(chan, size):
    """Send a large array and a large bytes, then overwrite the array at once: the receiver
    must get what was sent."""
    arr = np.arange(size // 8, dtype=np.int64)
    expected = digest(arr)
    (chan.send if hasattr(chan, "send") else chan.put)((expected, arr))
    arr[:] = -1
    blob = bytes(range(256)) * (size // 256)
    (chan.send if hasattr(chan, "send") else chan.put)((digest(blob), blob))


def receive_and_check(chan, out):
    results = []
    for _ in range(2):
        expected, data = chan.recv() if hasattr(chan, "recv") else chan.get(timeout=TIMEOUT)
        results.append((expected == digest(data), type(data).__name__,
                        getattr(data, "flags", None) is None or data.flags.writeable))
    out.put(results)


@pytest.mark.parametrize("kind", ["pipe", "queue"])
def test_large_array_and_bytes_between_children_arrive_as_sent(ctx, kind):
    """Sender and receiver both in children, so the data crosses the owner too."""
    if kind == "pipe":
        recv_end, send_end = ctx.Pipe(duplex=False)
    else:
        recv_end = send_end = ctx.Queue()
    out = ctx.Queue()
    procs = [ctx.Process(target=receive_and_check, args=(recv_end, out)),
             ctx.Process(target=send_then_scribble, args=(send_end, 12 * MB))]
    for p in procs:
        p.start()
    assert out.get(timeout=TIMEOUT) == [(True, "ndarray", True), (True, "bytes", True)]
    for p in procs:
        p.join(TIMEOUT)
        assert p.exitcode == 0


def test_array_changed_after_a_local_put_arrives_as_it_was_put(ctx):
    q = ctx.Queue()
    arr = np.arange(MB, dtype=np.int64)
    q.put(arr)
    arr[:] = 7
    got = q.get(timeout=TIMEOUT)
    assert int(got[0]) == 0 and int(got[-1]) == MB - 1 and got.flags.writeable


def torch_round_trip(chan):
    import torch  # noqa: F401 - the child has torch loaded before it receives, as a torch program

    t = chan.recv()
    chan.send((t.dtype, tuple(t.shape), float(t.sum()), t.is_contiguous()))


def test_large_torch_tensor_through_a_pipe():
    """On the local backend: the worker image does not ship torch."""
    import fibrl

    torch = pytest.importorskip("torch")
    a, b = fibrl.Pipe()
    p = fibrl.Process(target=torch_round_trip, args=(b,))
    p.start()
    t = torch.arange(8 * MB, dtype=torch.float32).reshape(2048, -1)
    a.send(t)
    assert a.poll(TIMEOUT)
    assert a.recv() == (torch.float32, (2048, 4096), float(t.sum()), True)
    p.join(TIMEOUT)
    assert p.exitcode == 0
