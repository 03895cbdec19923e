"""Hosting: objects that live in one process and are used from any other.

* ``runtime`` -- the config in force, this process's hub, the exit sequence;
* ``hub``     -- the services a process hosts for others, and its calls to theirs;
* ``hosted``  -- the one base of handles to hosted objects;
* ``mailbox`` -- the FIFO behind queues and pipe ends (the owner's side, a pipe's,
  a consumer's window).

Built on :mod:`fibrl.wire`; the public objects (queues, pipes, locks, managers,
pools) are built on this.
"""
