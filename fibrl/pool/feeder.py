"""Lazy inputs: ``imap`` reads its iterable only a bounded backlog ahead of the caller.

A :class:`Feeder` thread (one per pool, started by the first ``imap``) pulls
chunks from each lazy input, pickles them and hands them to the service while
fewer than ``backlog`` chunks are fed but not yet taken by the caller's
iterator; the iterator pokes the feeder as the caller consumes. Memory stays
bounded however long the input is. After ``close()`` the bound is lifted so
that ``close(); join()`` completes every task, as with the stdlib.

Data flow::

    caller: for x in pool.imap(f, huge):      Feeder thread
        IMapIterator.next() --poke every----> wait until fed - taken < limit
        (results from the service)   limit/2   islice(huge, chunksize) -> dumps
                                                 -> service.add_chunks(job, start, chunks)
                                                 end of input -> service.end_inputs(job, n)

An exception raised by the input iterable is delivered at the position it
would have filled and ends the input there (so does a non-iterable input, at
position 0, as in the stdlib); an item that cannot be pickled, whatever its
pickling raises, fails its own position (its whole chunk when ``chunksize``
> 1) with a :class:`~fibrl.errors.SerializationError`.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Iterator, Optional

from .protocol import pack
from .results import Failure
from .service import PoolService

__all__ = ["Feeder"]

_CHUNKS_PER_ROUND = 64
_WAIT_S = 5.0


class _Lazy:
    __slots__ = ("job", "sink", "it", "chunksize", "limit", "fed")

    def __init__(self, job: Any, sink: Any, it: Iterator, chunksize: int, limit: int) -> None:
        self.job, self.sink, self.it, self.chunksize = job, sink, it, chunksize
        self.limit = limit  # items fed but not taken by the caller, at most
        self.fed = 0


class Feeder:
    """Feeds lazy inputs to ``service``, at most ``backlog`` chunks ahead of each caller."""

    def __init__(self, service: PoolService, name: str, backlog: int) -> None:
        self._service = service
        self._name = name
        self._backlog = backlog
        # chunks handed over at once: half the backlog, so a large pool's idle
        # workers get batches, not one chunk each
        self._round = max(_CHUNKS_PER_ROUND, backlog // 2)
        self._cond = threading.Condition()
        self._inputs: list[_Lazy] = []
        self._unbounded = False   # the pool was closed: feed everything
        self._stopped = False     # the pool was terminated: feed nothing more
        self._thread: Optional[threading.Thread] = None

    def add(self, job: Any, sink: Any, iterable: Any, chunksize: int) -> None:
        try:
            it = iter(iterable)
        except Exception as exc:  # as the stdlib: the first next() raises it, the job ends
            sink.sink_deliver(0, [Failure(exc)])
            self._service.end_inputs(job, 1)
            return
        lazy = _Lazy(job, sink, it, chunksize, self._backlog * chunksize)
        sink._watch(max(1, lazy.limit // 2), self._poke)
        with self._cond:
            self._inputs.append(lazy)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"{self._name}-feeder")
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._unbounded = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _poke(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the feeder thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            lazy = self._next_ready()
            if lazy is None:
                return
            try:
                self._feed(lazy)
            except Exception as exc:  # one broken input must not stall every other one
                self._fail(lazy, exc)

    def _next_ready(self) -> Optional[_Lazy]:
        with self._cond:
            while not self._stopped:
                for lazy in self._inputs:
                    if self._unbounded or lazy.fed - lazy.sink._taken() < lazy.limit:
                        self._inputs.remove(lazy)   # round robin: to the back
                        self._inputs.append(lazy)
                        return lazy
                if self._unbounded and not self._inputs:
                    return None
                self._cond.wait(_WAIT_S)
            return None

    def _feed(self, lazy: _Lazy) -> None:
        chunks: list = []
        start = lazy.fed
        room = (lazy.limit - (lazy.fed - lazy.sink._taken())) // lazy.chunksize
        if self._unbounded:
            room = self._round
        for _ in range(max(1, min(room, self._round))):
            try:
                items = list(itertools.islice(lazy.it, lazy.chunksize))
            except Exception as exc:  # the input itself raised: that position fails, input ends
                self._submit(lazy, start, chunks)
                lazy.sink.sink_deliver(lazy.fed, [Failure(exc)])
                lazy.fed += 1
                return self._end(lazy)
            if not items:
                self._submit(lazy, start, chunks)
                return self._end(lazy)
            try:
                chunks.append((pack(items), len(items)))
            except Exception as exc:  # pack names the item: SerializationError, whatever
                self._submit(lazy, start, chunks)  # its __getstate__/__reduce__ raised
                lazy.sink.sink_deliver(lazy.fed, [Failure(exc)] * len(items))
                chunks, start = [], lazy.fed + len(items)
            lazy.fed += len(items)
        self._submit(lazy, start, chunks)

    def _submit(self, lazy: _Lazy, start: int, chunks: list) -> None:
        if chunks:
            self._service.add_chunks(lazy.job, start, chunks)

    def _fail(self, lazy: _Lazy, exc: Exception) -> None:
        """Feeding ``lazy`` failed unexpectedly: its caller gets the error, the job ends."""
        error = RuntimeError(
            f"the pool could not feed this imap input any further ({type(exc).__name__}: "
            f"{exc}); the items read so far complete, the rest of the input is dropped. "
            f"This is most likely a bug in fibrl; please report it with the traceback below.")
        error.__cause__ = exc
        lazy.sink.sink_abort(error)
        self._end(lazy)

    def _end(self, lazy: _Lazy) -> None:
        with self._cond:
            if lazy in self._inputs:
                self._inputs.remove(lazy)
        self._service.end_inputs(lazy.job, lazy.fed)
