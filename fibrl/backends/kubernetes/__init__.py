"""The kubernetes backend: each worker is a pod. Its modules, split along the
policy/mechanism line:

* ``backend``   -- :class:`KubernetesBackend`: creates the run's worker pods,
  follows them with one watch, removes what the run created;
* ``settings``  -- config keys parsed into one frozen object; names, labels,
  quantities; where this process runs (a pod or not);
* ``manifests`` -- the Secret, worker Pod and launcher Job fibrl sends (pure dicts);
* ``api``       -- the official client: connecting, retries with backoff on
  429/5xx, and errors that name the fix;
* ``watch``     -- one list+watch of a run's pods, resyncing with backoff;
* ``job``       -- one worker pod as a Job: what its status means (exit code,
  failure reason) and its state machine;
* ``creator``   -- pod creation in bounded waves.

The ``docker`` backend has the same shape. ``import fibrl`` imports none of
these modules, and they import the ``kubernetes`` package themselves, inside
functions, when first used.
"""
from __future__ import annotations

from .backend import KubernetesBackend
from .job import KubernetesJob

__all__ = ["KubernetesBackend", "KubernetesJob"]
