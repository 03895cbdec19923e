"""The wire: how bytes and objects travel between fibrl processes.

* ``transport``     -- authenticated nng connections, listeners and channels (the
  only module that imports pynng);
* ``gate``          -- the TCP ports in front of plaintext listeners: counts, times
  and hands on connections before nng sees them;
* ``serialization`` -- frames of pickled objects, large buffers out of band;
* ``messages``      -- what processes send each other (calls, replies, worker
  starts) and their compact envelope.

Nothing here knows about hosted objects or backends; users reach this layer
through :mod:`fibrl.channel`.
"""
