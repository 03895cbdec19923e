"""A connected process that sends a frame fibrl cannot read (a malformed lone or compact
envelope: a buggy or hostile peer that knows the secret) loses its connection, in either
direction, and the hub goes on serving everyone else."""
import threading

import pytest

from fibrl.errors import RemoteObjectError
from fibrl.hosting.hub import Hub, Service
from fibrl.wire.messages import COMPACT, LONE_CALL, LONE_REPLY

SECRET = b"f" * 32
RID = (1).to_bytes(8, "little")

UNREADABLE = [
    LONE_CALL + RID + b"\xff\x00\x01\x00" + b"o",     # its names run past the frame
    LONE_CALL + RID + b"\x01\x00\x01\x00" + b"\xffm",  # a name that is not UTF-8
    LONE_REPLY + RID + b"\x80" + b"payload",          # an unknown flag
    LONE_REPLY + b"\x01",                             # a truncated header
    COMPACT + b"garbage",
]


class _Echo(Service):
    def op_echo(self, reply, value) -> None:
        reply(value)

    def op_poison(self, reply, frame) -> None:
        reply.peer.send([frame])   # to the caller, in place of the answer


@pytest.fixture
def hubs():
    made = []

    def make() -> Hub:
        made.append(Hub(SECRET))
        return made[-1]

    yield make
    for hub in reversed(made):
        hub.close()


@pytest.mark.parametrize("frame", UNREADABLE, ids=range(len(UNREADABLE)))
def test_a_caller_that_sends_an_unreadable_frame_is_dropped_and_others_are_served(hubs, frame):
    server, bad, good = hubs(), hubs(), hubs()
    oid = server.register(_Echo())
    assert bad.call(server.address, oid, "echo", 1, timeout=30) == 1
    client, dropped = bad.client(server.address), threading.Event()
    client.on_lost(dropped.set)
    client._channel.send([frame])
    assert dropped.wait(10), "the server kept a peer that sends garbage"
    assert good.call(server.address, oid, "echo", 2, timeout=30) == 2
    # the dropped process may connect again, as any other
    assert bad.call(server.address, oid, "echo", 3, timeout=30) == 3


@pytest.mark.parametrize("frame", UNREADABLE, ids=range(len(UNREADABLE)))
def test_a_server_that_answers_with_an_unreadable_frame_loses_the_connection(hubs, frame):
    server, caller = hubs(), hubs()
    oid = server.register(_Echo())
    with pytest.raises(RemoteObjectError, match="connection dropped"):
        caller.call(server.address, oid, "poison", frame, timeout=30)
    assert caller.call(server.address, oid, "echo", 4, timeout=30) == 4   # a new connection
