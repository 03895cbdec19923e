"""The hosted FIFO behind queues and pipe ends.

A :class:`Mailbox` lives in the hub of the process that created it and holds
serialized items (never unpickled here). ``get`` requests that cannot be
answered are parked in arrival order, so an item goes to whichever consumer
asked first and no consumer prefetches more than it asked for. Deadlines are
the mailbox's: when a parked ``get`` times out the mailbox answers ``Empty``
itself, so an item is never handed to a getter that stopped waiting.

A consumer in another process reads through a *window* (:class:`Window`, one
per process and queue): the owner pushes items ahead into it, on one stream
call, while that process calls ``get()``. The window's size adapts on the
consumer's side: it starts at one item, doubles each time a ``get()`` finds it
empty, up to ``WINDOW_ITEMS``, and halves when recalled. The owner bounds it in
bytes (``WINDOW_BYTES``) and, while several consumers share the queue, to twice
the smallest window (at least ``FAIR_MIN``, at most ``SHARED_ITEMS``). Items
pushed go to consumers waiting in ``get()`` first, one each in turn, then to
the windows holding fewest (each an even share of what is stored, as far as it
has room). The consumer counts the items its ``get()`` returned and sends that
count (its *acknowledgement*) on its next request to the owner, or within
``ACK_DELAY`` seconds. A window that holds items while other consumers wait,
and whose consumer has been silent for ``RECALL_GAPS`` times its usual gap
between messages (``RECALL_MIN`` to ``RECALL_IDLE`` seconds), is *recalled*:
the consumer drops what it has not returned, answers with its count, and the
owner puts those items back in the queue at their place (merged by the order
they were first pushed, whichever window gives back first). Every window stays
in queue order too: an item given back is pushed only to a window that holds
nothing newer, so no consumer reaches a stop sentinel while an item put before
it is still on its way.

    consumer (Window)                          owner (Mailbox)
    get(): open(size) ---------------------->  op_window: stream; push items
           <-------- item, item, ... -------   (up to size items / WINDOW_BYTES held)
    get(): returned++; want(returned, size) ->  op_want: forget returned ones, push more
           <----------- "recall" ----------   (others wait, this one is idle)
    returned(count) ----------------------->  op_returned: the rest -> back in the queue
           <----------- "resume" ----------   (pushes before it were given back too)
                                               drop_peer: everything held -> back in the queue

An item handed to another process stays *unacknowledged* until that process
confirms it was returned by ``get()``. When the process's connection drops
first (it died, or the answer could not be delivered), its unacknowledged
items go back to the front of the queue, in order. So no item is ever lost,
and an item is returned by more than one ``get()`` only when the process
whose ``get()`` returned it died before its acknowledgement reached the
owner. A request/reply ``get`` (the owner's own, a pipe's) is acknowledged
the same way by :func:`take`.

Besides the queue operations it counts the open *writer* handles of a pipe
end (per peer, so a dead process's handles close with it) to raise
``EOFError`` like a closed pipe.

The package's modules, in the order an item travels:

* ``protocol`` -- what owner and consumers say: window states, runs of small
  items, the merging of one-way puts into runs;
* ``owner``    -- :class:`Mailbox`, the hosted FIFO (the owner's side);
* ``pipe``     -- :class:`PipeBox`, one direction of a pipe;
* ``consumer`` -- :class:`Window` and :func:`take` (the side of a process that
  reads from a mailbox another process owns);
* ``producer`` -- :class:`Ledger` (the side of a process that puts into a mailbox
  another process owns: items lost with a connection are counted and reported).
"""
from __future__ import annotations

from .consumer import Window, take
from .owner import Mailbox
from .pipe import PipeBox
from .producer import Ledger
from .protocol import EMPTY, merge_puts

__all__ = ["Mailbox", "PipeBox", "Window", "Ledger", "EMPTY", "take", "merge_puts"]
