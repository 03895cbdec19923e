"""Pod creation in waves, so a 500-worker Pool does not flood the API server.

Owns the queue of pods waiting to be created. ``create_job`` returns as soon
as its pod is queued; one thread takes up to ``size`` pods at a time and
creates them concurrently, waits for the whole wave, then takes the next.
The wave size starts at ``kubernetes_create_batch``, halves after a wave
that met 429 (Too Many Requests) and doubles back after a clean one::

    create_job --submit--> deque --creator thread--> wave of <= size jobs
                                                       |  ThreadPoolExecutor(size)
                                                       v
                                               create(job) each (retried by Api.call)
                                               wave done: size = size/2 if throttled else size*2

Each request is still bounded and retried by :class:`~.api.Api`; a job
stopped while queued is skipped.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

__all__ = ["Creator"]

log = logging.getLogger(__name__)


class Creator:
    """Calls ``create(job)`` for submitted jobs, in waves of at most ``batch``."""

    def __init__(self, create: Callable[[Any], None], batch: int,
                 throttled: Callable[[], int]) -> None:
        self._create = create
        self._throttled = throttled
        self._max = self.size = max(1, batch)
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.waves = 0
        self._pool = ThreadPoolExecutor(max_workers=self._max,
                                        thread_name_prefix="fibrl-kube-create")
        self._thread = threading.Thread(target=self._run, daemon=True, name="fibrl-kube-creator")
        self._thread.start()

    def submit(self, job: Any) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def close(self) -> list:
        """Stop creating; return the jobs that were still queued."""
        with self._cond:
            self._closed = True
            left, self._queue = list(self._queue), deque()
            self._cond.notify()
        self._thread.join(10.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return left

    def _create_one(self, job: Any) -> None:
        try:
            self._create(job)
        except Exception as exc:  # never leave a job waiting on a pod nobody will create
            log.exception("creating worker pod %s failed unexpectedly", job.name)
            job.fail(1, f"creating its pod failed unexpectedly: {exc!r} (a bug in fibrl; "
                        f"please report it with the log above)")

    def _next_wave(self) -> list:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            wave: list[Any] = []
            while self._queue and len(wave) < self.size:
                job = self._queue.popleft()
                if not job.ended:
                    wave.append(job)
            return wave

    def _run(self) -> None:
        while not self._closed:
            wave = self._next_wave()
            if not wave:
                continue
            before = self._throttled()
            wait([self._pool.submit(self._create_one, job) for job in wave])
            self.waves += 1
            throttled = self._throttled() > before
            self.size = max(1, self.size // 2) if throttled else min(self._max, self.size * 2)
