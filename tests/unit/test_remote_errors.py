"""Remote errors: captured once by the raiser, chained as ``__cause__`` when unpickled."""
from __future__ import annotations

import multiprocessing.pool
import pickle
import threading

import pytest

from fibrl.wire import serialization
from fibrl.errors import RemoteObjectError, RemoteTraceback, object_gone, owner_gone
from fibrl.hosting.hub import Hub, Service
from fibrl.wire.messages import RemoteError


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_unpickling_a_captured_error_gives_the_exception_with_its_traceback_as_cause():
    captured = RemoteError.capture(_raise(KeyError("k")))
    received = serialization.loads(serialization.dumps(captured))
    assert type(received) is KeyError and received.args == ("k",)
    assert type(received.__cause__) is multiprocessing.pool.RemoteTraceback
    assert "_raise" in str(received.__cause__) and received.__suppress_context__
    again = pickle.loads(pickle.dumps(received.__cause__))  # the cause travels on too
    assert type(again) is multiprocessing.pool.RemoteTraceback and again.tb == received.__cause__.tb


def test_an_error_without_traceback_travels_without_cause():
    received = pickle.loads(pickle.dumps(RemoteError.capture(ValueError("v"))))
    assert type(received) is ValueError and received.__cause__ is None


def test_an_unpicklable_error_travels_as_remote_object_error_with_its_type_and_message():
    exc = _raise(ValueError("boom"))
    exc.lock = threading.Lock()  # an attribute that cannot be pickled
    received = pickle.loads(pickle.dumps(RemoteError.capture(exc)))
    assert type(received) is RemoteObjectError
    assert "ValueError: boom" in str(received)
    assert isinstance(received.__cause__, RemoteTraceback)


class _Failing(Service):
    def op_fail(self, reply) -> None:
        raise LookupError("from the service")


def test_a_local_call_raises_like_a_remote_one():
    hub = Hub(b"k" * 32)
    try:
        oid = hub.register(_Failing())
        with pytest.raises(LookupError) as info:
            hub.call(None, oid, "fail", timeout=5)
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "op_fail" in str(info.value.__cause__)
    finally:
        hub.close()


def test_a_remote_call_raises_the_service_error_with_its_traceback():
    server, client = Hub(b"s" * 32), Hub(b"s" * 32)
    try:
        oid = server.register(_Failing())
        with pytest.raises(LookupError) as info:
            client.call(server.address, oid, "fail", timeout=30)
        assert "op_fail" in str(info.value.__cause__)
    finally:
        client.close()
        server.close()


def test_one_wording_for_a_gone_owner_and_a_gone_object():
    gone = owner_gone("tcp://127.0.0.1:1", "connection refused", owner="manager server")
    assert isinstance(gone, RemoteObjectError)
    assert str(gone).startswith("lost the manager server at tcp://127.0.0.1:1 that hosts")
    assert "(connection refused)" in str(gone)
    assert "queue-3" in str(object_gone("queue-3", "process 7"))
