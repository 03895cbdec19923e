"""The messages processes exchange: small frozen dataclasses, never tuples.

Owns the vocabulary of the runtime protocol and its envelope on the wire
(:func:`pack`, :func:`unpack`). Encoding a payload is ``serialization``; moving
bytes is ``transport``; acting on messages is ``hub``.

The envelope: a :class:`Call` or :class:`Reply` (or a list of them) whose fields
are plain values (``None``, ``bool``, ``int``, ``float``, ``str``, small ``bytes``,
tuples of those) and small payloads already pickled (an
:class:`~fibrl.wire.serialization.Encoded` without out-of-band buffers) travels as a
*compact* frame: ``b"FB\x02"`` and one plain pickle of tuples, with each payload's
bytes in it as they are. A message alone in its frame that carries one small
payload and nothing else (a ``put``, a message pushed to a pipe's reader, a
call's result) is a *lone* frame: a fixed binary header, then the payload's
bytes, with no pickle of the envelope at all::

    b"FB\x03" | rid:i64 | flags:u8 | payload                 a Reply (flags: 1 ok,
                                                             2 encoded, 4 payload)
    b"FB\x04" | rid:i64 | len:u16 | len:u16 | oid | method | payload    a Call

Any other message travels as a ``serialization`` frame of the message object
itself. The hot paths (a Pipe message, a queue item, a manager call and its
reply) are all lone or compact: no message class is looked up by name, and no
payload is pickled a second time.
"""
from __future__ import annotations

import pickle
import struct
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from ..config import Config
from ..errors import FrameError, RemoteObjectError, chain_remote
from .serialization import OOB_THRESHOLD, Encoded, FramePart, dumps, dumps_parts, loads

__all__ = ["Call", "Reply", "pack", "unpack", "one_way_head", "payload_reply_head",
           "inline_payload", "COMPACT",
           "LONE_REPLY", "LONE_CALL",
           "RemoteError", "WorkerStart", "MAIN_SOURCE", "blob", "wrap_raw", "wrap_args",
           "RAW_TYPES"]


@dataclass(frozen=True, slots=True, init=False)
class Call:
    """Invoke ``method`` of the hosted object ``oid``. ``rid`` 0 means no reply is wanted."""

    rid: int
    oid: str
    method: str
    args: tuple[Any, ...] = ()

    def __init__(self, rid: int, oid: str, method: str, args: tuple[Any, ...] = ()) -> None:
        # sets the slots directly: a frozen dataclass's own __init__ goes through
        # object.__setattr__ once per field (2-3x slower), and every message of a hot
        # path is built twice, once on each side
        _CALL_SET[0](self, rid)
        _CALL_SET[1](self, oid)
        _CALL_SET[2](self, method)
        _CALL_SET[3](self, args)

    # 7x faster than the default for slotted dataclasses
    def __reduce__(self) -> tuple[type[Call], tuple[int, str, str, tuple[Any, ...]]]:
        return (Call, (self.rid, self.oid, self.method, self.args))


@dataclass(frozen=True, slots=True, init=False)
class Reply:
    """The answer to the :class:`Call` with the same ``rid``.

    ``encoded`` values are a frame of their own (see ``serialization``), decoded
    by the receiver for this reply alone: a value that cannot be unpickled
    there fails its own call instead of the connection.
    """

    rid: int
    ok: bool
    value: Any = None
    encoded: bool = False

    def __init__(self, rid: int, ok: bool, value: Any = None, encoded: bool = False) -> None:
        _REPLY_SET[0](self, rid)    # (see Call.__init__)
        _REPLY_SET[1](self, ok)
        _REPLY_SET[2](self, value)
        _REPLY_SET[3](self, encoded)

    def __reduce__(self) -> tuple[type[Reply], tuple[int, bool, Any, bool]]:
        return (Reply, (self.rid, self.ok, self.value, self.encoded))


# each field's slot setter, which a frozen class's __setattr__ does not stand in front of
_CALL_SET = tuple(Call.__dict__[name].__set__ for name in ("rid", "oid", "method", "args"))
_REPLY_SET = tuple(Reply.__dict__[name].__set__ for name in ("rid", "ok", "value", "encoded"))


@dataclass(frozen=True, slots=True)
class RemoteError:
    """An exception raised in this process, captured to travel to another one.

    The one place for remote errors: the raising side captures an exception
    once (:meth:`capture`); the receiving side never sees a ``RemoteError``,
    because unpickling one gives back the exception itself, with its own type
    and the remote traceback chained as ``__cause__`` (as loky does). Anything
    that reaches a receiver as an exception is raised as it is.
    """

    exc: BaseException
    tb: str

    @classmethod
    def capture(cls, exc: BaseException) -> "RemoteError":
        """Format ``exc``'s traceback now; an exception that cannot be pickled travels as
        a :class:`~fibrl.errors.RemoteObjectError` with its type and message."""
        tb = ""
        if exc.__traceback__ is not None:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            tb = f'\n"""\n{text}"""'
        try:
            dumps(exc)
        except Exception:
            exc = RemoteObjectError(f"{type(exc).__name__}: {exc}")
        exc.__traceback__ = None
        exc.__context__ = exc.__cause__ = None
        return cls(exc, tb)

    def rebuilt(self) -> BaseException:
        """The exception with the remote traceback as ``__cause__`` (what unpickling gives)."""
        return chain_remote(self.exc, self.tb)

    def __reduce__(self) -> tuple[Callable[[BaseException, str], BaseException],
                                  tuple[BaseException, str]]:
        return (_rebuilt, (self.exc, self.tb))


def _rebuilt(exc: BaseException, tb: str) -> BaseException:
    return chain_remote(exc, tb)


@dataclass(frozen=True)
class WorkerStart:
    """What a worker needs to become the process object: sent after authentication.

    Defined here, not by the parent's ``popen``, so that a worker unpickles it
    without importing popen and the backends.
    """

    process: bytes
    config: Config
    preparation: dict[str, Any]
    parent_address: str


# The key, in ``WorkerStart.preparation``, of the main script's source for a worker that
# cannot see the script (see ``popen._preparation`` and ``bootstrap._visible_main``).
MAIN_SOURCE = "fibrl_main_source"

RAW_TYPES = (bytes, bytearray, memoryview)


def blob(data: "bytes | bytearray | memoryview | Encoded") -> Any:
    """Wrap an already serialized payload so a large one travels out of band (an
    :class:`~fibrl.wire.serialization.Encoded` does so by itself)."""
    if type(data) is Encoded:
        return data
    if memoryview(data).nbytes >= OOB_THRESHOLD:
        return pickle.PickleBuffer(data)
    # a small memoryview (a slice of a received frame) cannot be pickled as it is
    return data if type(data) is bytes else bytes(data)


def wrap_raw(value: Any) -> Any:
    """``blob(value)`` for raw payloads, ``value`` itself for anything else.

    A payload that arrived out of band is stored as a ``memoryview`` of its
    frame: when it is forwarded (a queue item handed to a getter in a third
    process) it must travel as a buffer again, since a memoryview is not
    picklable.
    """
    return blob(value) if type(value) in RAW_TYPES else value


def wrap_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call's arguments with raw payloads wrapped (:func:`wrap_raw`); ``args`` itself
    when none is raw, the commonest case (no new tuple)."""
    for arg in args:
        if type(arg) in RAW_TYPES:
            return tuple(wrap_raw(a) for a in args)
    return args if type(args) is tuple else tuple(args)


# The ``kind`` a worker gives when it reports that it could not load its process
# because the main script starts processes at import (no ``if __name__ ==
# "__main__":`` guard); the parent says so once (see ``bootstrap`` and ``popen``).
MISSING_MAIN_GUARD = "missing-main-guard"


# -- the envelope on the wire --------------------------------------------------------------
COMPACT = b"FB\x02"
LONE_REPLY = b"FB\x03"
LONE_CALL = b"FB\x04"
_LONE_REPLY = struct.Struct("<3sqB")    # tag, rid, flags; the payload follows
_LONE_CALL = struct.Struct("<3sqHH")    # tag, rid, len(oid), len(method); they follow
_OK, _ENCODED, _PAYLOAD = 1, 2, 4        # a lone reply's flags
_CALL, _REPLY = 0, 1
_SCALARS = frozenset((type(None), bool, int, float, str))


def _plain(value: Any) -> bool:
    """Whether plain pickle carries ``value`` as fast as it can: no class looked up by
    name, no buffer that should travel out of band."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is bytes:
        return len(value) < OOB_THRESHOLD
    if kind is tuple:
        return all(type(v) in _SCALARS or type(v) is bytes and len(v) < OOB_THRESHOLD
                   for v in value)
    return False


def inline_payload(payload: Encoded) -> Any:
    """The bytes of ``payload`` to embed in a compact or lone frame, or None when it must
    travel out of band (it has buffers, or it is large)."""
    data = payload.data
    if payload.buffers or len(data) >= OOB_THRESHOLD:
        return None
    return data if type(data) is bytes else bytes(data)


def _compact(message: Any) -> Any:
    """The tuple of a compact ``message``, or None when a field cannot travel in one:
    payloads as their bytes, a bit of the mask set for each."""
    kind = type(message)
    if kind is Reply:
        values: tuple[Any, ...] = (message.value,)
    elif kind is Call:
        values = message.args
    else:
        return None
    if len(values) == 1 and type(values[0]) is Encoded:
        # the commonest: one payload alone (a put, a pushed message, a call's result)
        data = inline_payload(values[0])
        if data is None:
            return None
        if kind is Reply:
            return (_REPLY, message.rid, message.ok, message.encoded, 1, data)
        return (_CALL, message.rid, message.oid, message.method, 1, data)
    mask, fields = 0, []
    for i, value in enumerate(values):
        kind_of = type(value)
        if kind_of is Encoded:
            value = inline_payload(value)
            if value is None:
                return None
            mask |= 1 << i
        elif kind_of not in _SCALARS and not _plain(value):
            return None
        fields.append(value)
    if kind is Reply:
        return (_REPLY, message.rid, message.ok, message.encoded, mask, fields[0])
    return (_CALL, message.rid, message.oid, message.method, mask, *fields)


def _lone(message: Any, kind: type) -> Any:
    """The lone frame of ``message`` (of type ``kind``), or None when it is not one (see
    the module doc)."""
    try:
        if kind is Reply:
            value = message.value
            if type(value) is Encoded:
                data, flags = inline_payload(value), _PAYLOAD
                if data is None:
                    return None
            elif type(value) is bytes and len(value) < OOB_THRESHOLD:
                data, flags = value, 0
            else:
                return None
            flags |= (_OK if message.ok else 0) | (_ENCODED if message.encoded else 0)
            return _LONE_REPLY.pack(LONE_REPLY, message.rid, flags) + data
        args = message.args
        if len(args) != 1 or type(args[0]) is not Encoded:
            return None
        data = inline_payload(args[0])
        if data is None:
            return None
        oid, method = message.oid.encode(), message.method.encode()
        return b"".join((_LONE_CALL.pack(LONE_CALL, message.rid, len(oid), len(method)),
                         oid, method, data))
    except struct.error:   # a call id or a name that the header cannot hold
        return None


def one_way_head(oid: str, method: str) -> bytes:
    """The bytes that begin the lone frame of every one-way call of ``method`` to ``oid``
    with one payload (the payload's bytes follow them): a receiver that waits for such
    calls can recognize them without :func:`unpack`."""
    name, op = oid.encode(), method.encode()
    return _LONE_CALL.pack(LONE_CALL, 0, len(name), len(op)) + name + op


def payload_reply_head(rid: int) -> bytes:
    """The bytes that begin the lone frame of every successful reply to call ``rid`` that
    carries one payload (its bytes follow them), such as a message a pipe's owner pushes
    to its reader: a receiver that waits for those can recognize them without
    :func:`unpack`."""
    return _LONE_REPLY.pack(LONE_REPLY, rid, _OK | _PAYLOAD)


def pack(message: "Call | Reply | list[Call] | list[Reply]") -> list[FramePart]:
    """The frame (a list of byte-like parts) that carries ``message``, a :class:`Call`,
    a :class:`Reply` or a list of them; :func:`unpack` gives it back."""
    kind = type(message)
    if kind is Reply or kind is Call:
        lone = _lone(message, kind)
        if lone is not None:
            return [lone]
        one = _compact(message)
        if one is not None:
            return [COMPACT + pickle.dumps(one, protocol=5)]
    elif kind is list:
        # (mypy does not narrow on ``type(x) is list``; a cast would cost a call per frame)
        tuples = [_compact(m) for m in message]  # type: ignore[union-attr]
        if all(t is not None for t in tuples):
            return [COMPACT + pickle.dumps(tuples, protocol=5)]
    return dumps_parts(message)


def unpack(frame: "bytes | memoryview") -> "Call | Reply | list[Call | Reply]":
    """The message (or list of messages) of a frame made by :func:`pack`.

    Raises:
        FrameError: the frame is not one (it came from a broken or foreign peer).
    """
    tag = frame[:3]
    if tag == LONE_REPLY:
        return _lone_reply(frame)
    if tag == LONE_CALL:
        return _lone_call(frame)
    if tag != COMPACT:
        message: Call | Reply | list[Call | Reply] = loads(frame)   # (checked below)
        if type(message) is list:
            if all(type(m) in (Call, Reply) for m in message):
                return message
        elif type(message) in (Call, Reply):
            return message
        raise FrameError(f"a frame carried a {type(message).__name__}, not a message")
    try:
        body = pickle.loads(memoryview(frame)[3:])
        if type(body) is list:
            return [_message(t) for t in body]
        return _message(body)
    except FrameError:
        raise
    except Exception as exc:
        raise FrameError(f"malformed compact frame ({type(exc).__name__}: {exc})") from None


def _lone_reply(frame: "bytes | memoryview") -> Reply:
    try:
        _, rid, flags = _LONE_REPLY.unpack_from(frame)
    except struct.error as exc:
        raise FrameError(f"malformed lone reply ({exc})") from None
    if flags > _OK | _ENCODED | _PAYLOAD:
        raise FrameError(f"malformed lone reply: flags {flags}")
    data = frame[_LONE_REPLY.size:]
    if type(data) is not bytes:
        data = bytes(data)   # (a view of a received frame)
    return Reply(rid, flags & _OK != 0, Encoded(data) if flags & _PAYLOAD else data,
                 flags & _ENCODED != 0)


def _lone_call(frame: "bytes | memoryview") -> Call:
    try:
        _, rid, oid_len, method_len = _LONE_CALL.unpack_from(frame)
        start = _LONE_CALL.size
        mid, end = start + oid_len, start + oid_len + method_len
        if end > len(frame):
            raise FrameError("malformed lone call: its names run past the frame")
        oid, method = str(frame[start:mid], "utf-8"), str(frame[mid:end], "utf-8")
    except (struct.error, UnicodeDecodeError) as exc:
        raise FrameError(f"malformed lone call ({type(exc).__name__}: {exc})") from None
    data = frame[end:]
    return Call(rid, oid, method, (Encoded(data if type(data) is bytes else bytes(data)),))


def _message(t: tuple[Any, ...]) -> "Call | Reply":
    if type(t) is not tuple or len(t) < 5 or type(t[1]) is not int or type(t[4]) is not int:
        raise FrameError("malformed compact message")
    mask = t[4]
    if t[0] == _REPLY and len(t) == 6 and type(t[2]) is bool and type(t[3]) is bool:
        return Reply(t[1], t[2], _payload(t[5]) if mask else t[5], t[3])
    if t[0] == _CALL and type(t[2]) is str and type(t[3]) is str:
        if mask == 1 and len(t) > 5:   # the commonest: a put, its payload first
            return Call(t[1], t[2], t[3], (_payload(t[5]),) + t[6:])
        args = t[5:]
        if mask:
            fields = list(args)
            for i in range(len(fields)):
                if mask >> i & 1:
                    fields[i] = _payload(fields[i])
            args = tuple(fields)
        return Call(t[1], t[2], t[3], args)
    raise FrameError("malformed compact message")


def _payload(data: Any) -> Encoded:
    if type(data) is not bytes:
        raise FrameError("malformed compact message: a payload that is not bytes")
    return Encoded(data)
