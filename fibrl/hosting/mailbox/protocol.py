"""What the owner and the consumers of a mailbox say to each other: the states a
consumer's window reports with its acknowledgements, the run of small items that
travels as one message, and the merging of one-way puts into such runs.

Shared by :mod:`.owner` (the mailbox) and :mod:`.consumer` (a window on it)."""
from __future__ import annotations

import pickle
from array import array
from typing import Any, Optional

from ...wire.messages import Call, blob
from ...wire.serialization import OOB_THRESHOLD, Encoded

__all__ = ["EMPTY", "IDLE", "WAITING", "ASKING", "WINDOW_ITEMS", "Run", "merge_puts"]

#: What a non-blocking take answers when nothing is stored.
EMPTY = object()

# What a consumer's window says with each acknowledgement (its ``waiting`` argument):
IDLE = 0      # no get() of that process waits
WAITING = 1   # a get() waits: the next item stored goes to it
ASKING = 2    # a non-blocking get() asks now: push an item stored, then answer it

#: Most items a consumer's window holds (pushed, not yet acknowledged). It must outlast
#: an acknowledgement's trip and the push it frees at the consumer's rate, or get() runs
#: dry: 256 items (1.7 ms at 150k items/s) did not on a busy 2-core machine.
WINDOW_ITEMS = 4096


class Run:
    """Small items pushed in a row, as one ``bytes`` and their lengths: pickled one by
    one, their wrappers cost more than the items (a 100 B item: 1 us of ~8 per item)."""

    __slots__ = ("data", "sizes")

    def __init__(self, data: bytes, sizes: bytes) -> None:
        self.data = data
        self.sizes = sizes

    @staticmethod
    def of(items: list[Any]) -> Any:
        """The value to push for ``items``: a run when every one is a small pickle
        (no out-of-band buffer, under ``OOB_THRESHOLD``), else the items (a lone one
        by itself: a large one travels out of band, uncopied)."""
        if len(items) > 1 and all(type(i) is Encoded and not i.buffers for i in items):
            data = [i.data for i in items]
            sizes = [len(d) if type(d) is bytes else memoryview(d).nbytes for d in data]
            if max(sizes) < OOB_THRESHOLD:
                return Run(b"".join(data), array("Q", sizes).tobytes())
        items = [blob(i) for i in items]
        return items if len(items) > 1 else items[0]

    def items(self) -> list[Encoded]:
        """The items again, each an :class:`Encoded` viewing this run's ``data``."""
        out: list[Encoded]
        data, out, at = memoryview(self.data), [], 0
        for size in memoryview(self.sizes).cast("Q"):
            out.append(Encoded(data[at:at + size]))
            at += size
        return out

    def __reduce__(self) -> tuple[type[Run], tuple[bytes | pickle.PickleBuffer, bytes]]:
        data = self.data   # a long run goes out of band, as a large item would
        return (Run, (pickle.PickleBuffer(data) if len(data) >= OOB_THRESHOLD else data,
                       self.sizes))


def merge_puts(oid: str, calls: list[Call]) -> Optional[Call]:
    """One ``put_run`` call for one-way puts of small items that follow each other on a
    connection (their Call and wrapper cost more than a 100 B item); None: as they are.
    A process that puts into a queue or pipe owned elsewhere declares it to its hub
    (:meth:`~fibrl.hosting.hub.Hub.merge_calls`)."""
    if any(not c.args or c.args[1:] not in ((), (None,)) for c in calls):
        return None   # (a put with a timeout: it may wait, it goes alone)
    run = Run.of([c.args[0] for c in calls])
    return Call(0, oid, "put_run", (run,)) if type(run) is Run else None

