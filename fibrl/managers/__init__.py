"""Managers: shared objects hosted by a server process, reached through proxies.

``fibrl.Manager()`` / :class:`SyncManager` and custom :class:`BaseManager`
subclasses follow ``multiprocessing.managers``: the server runs as a fibrl
Process on the configured backend (its own container or pod there), objects
live in it and clients call them through proxies that pickle to any process,
on any machine, guarded by the manager's authkey. :class:`AsyncManager`'s
proxies return a :class:`ProxyHandle` from every call, so calls to many
remote objects overlap.

Layout (policy above mechanism)::

    manager.py   BaseManager / SyncManager / AsyncManager: registry, start,
                 connect, shutdown (runs the server process)
    proxies.py   BaseProxy, AutoProxy, the typed proxies, ProxyHandle
    server.py    Server + ManagerService: objects, refcounts, how calls run
    lines.py     per-thread dedicated connections, hubs per authkey, decrefs

    client thread --line--> server peer thread: op_call runs the method there
    client (any)  --hub---> ManagerService.op_spawn -> per-object lane -> worker

A server that is killed or lost makes every pending and later call raise
:class:`fibrl.errors.RemoteObjectError` (promptly when its socket closes,
within ``parent_timeout`` when its machine vanishes); a wrong authkey raises
:class:`fibrl.AuthenticationError` before anything is unpickled.
"""
from __future__ import annotations

from .manager import Array, AsyncManager, BaseManager, Namespace, State, SyncManager, Value
from .proxies import (AcquirerProxy, ArrayProxy, AsyncAutoProxy, AsyncProxy, AutoProxy,
                      BarrierProxy, BaseListProxy, BasePoolProxy, BaseProxy, ConditionProxy,
                      DictProxy, EventProxy, HandleTimeout, IteratorProxy, ListProxy, MakeProxyType,
                      NamespaceProxy, PoolProxy, ProxyHandle, RebuildProxy, ValueProxy)
from .server import Server, Token, public_methods

__all__ = [
    "AcquirerProxy", "Array", "ArrayProxy", "AsyncAutoProxy", "AsyncManager", "AsyncProxy",
    "AutoProxy", "BarrierProxy", "BaseListProxy", "BaseManager", "BasePoolProxy",
    "BaseProxy", "ConditionProxy", "DictProxy", "EventProxy", "HandleTimeout",
    "IteratorProxy", "ListProxy", "MakeProxyType", "Namespace", "NamespaceProxy",
    "PoolProxy", "ProxyHandle", "RebuildProxy", "Server", "State", "SyncManager", "Token",
    "Value", "ValueProxy", "public_methods",
]
