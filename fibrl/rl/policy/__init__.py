"""Versioned policy parameters, published by a learner and read by rollout workers.

:class:`PolicyStore` is hosted by the learner's own process (a ``fibrl.channel``
listener: no server process to start or lose, and ``publish`` is a copy of the params
and a reference swap); it pickles into a reader, which keeps one connection to it.
:class:`PolicyFollower` is what a rollout worker holds to keep up with it and tag
its rollouts with a version.

Why hosted by the learner: the learner is the only writer, and a reader needs the
learner anyway (a store that outlived it would serve a policy nobody updates); a
separate server would add a second copy of each version and a hop. A version is
frozen once into one buffer whose arrays travel out of band (pickle protocol 5)
and every reader is sent that same buffer by its own connection's thread, so the
publisher's memory grows with ``keep`` and not with the number of readers, and a
reader that stalls or dies mid-transfer stalls nobody else.

Modules: ``store`` (the public classes), ``params`` (the frozen form of a version),
``host`` (the versions kept, the listener, the snapshot file), ``reader`` (the
connection), ``protocol`` (their messages), ``errors``.
"""
from __future__ import annotations

from .errors import PolicyStoreLost, VersionNotKept
from .store import PolicyFollower, PolicyStore

__all__ = ["PolicyStore", "PolicyFollower", "PolicyStoreLost", "VersionNotKept"]
