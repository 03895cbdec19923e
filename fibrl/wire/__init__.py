"""The wire: how bytes and objects travel between fibrl processes.

* ``transport``     -- authenticated nng connections, listeners and channels (the
  only module that imports pynng);
* ``gate``          -- the TCP ports in front of plaintext listeners: counts, times
  and hands on connections before nng sees them;
* ``serialization`` -- frames of pickled objects, large buffers out of band;
* ``messages``      -- what processes send each other (calls, replies, worker
  starts) and their compact envelope;
* ``faults``        -- frames dropped, delayed, held or cut on their way out, for
  fibrl's own tests only (switched on by them, or in a worker by
  ``FIBRL_TEST_FAULTS``, read here).

Nothing here knows about hosted objects or backends; users reach this layer
through :mod:`fibrl.channel`.
"""
import os as _os

if _os.environ.get("FIBRL_TEST_FAULTS"):   # a test's faults for this process
    from . import faults as _faults

    _faults.install_from_env()
