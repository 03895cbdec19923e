"""The pool service at scale, without processes: what one dispatch costs with hundreds
of workers waiting, how many workers boot at once, and how a large pool's workers
are paced (more work held, results kept longer) so that the parent's CPU per task
stays flat as the pool grows.
"""
from __future__ import annotations

import threading

import fibrl.pool
from fibrl.hosting.hub import ReplySink
from fibrl.pool.protocol import Kind, Report, ResultSink, pack
from fibrl.pool.service import HORIZON_S, MESSAGES_PER_S, PoolService
from fibrl.pool.worker import FLUSH_S


class Reply(ReplySink):
    """A worker's pending ``next``: records the batch it was answered with."""

    def __init__(self) -> None:
        self.peer = None
        self.rid = 1
        self.values: list = []
        self.event = threading.Event()

    def __call__(self, value=None) -> bool:
        self.values.append(value)
        self.event.set()
        return True

    def fail(self, exc: BaseException) -> bool:
        raise AssertionError(f"unexpected failure: {exc!r}")

    @property
    def batch(self):
        assert self.event.is_set(), "not answered"
        return self.values[-1]


class Sink(ResultSink):
    def __init__(self) -> None:
        self.outcomes: dict = {}

    def sink_deliver(self, index, outcomes, clean=False) -> None:
        self.outcomes.update(enumerate(outcomes, index))

    def sink_abort(self, exc) -> None:
        raise AssertionError(f"aborted: {exc!r}")

    def sink_set_length(self, length: int) -> None:
        pass


def _parked_pool(processes: int) -> tuple[PoolService, dict]:
    """A service whose ``processes`` workers all connected and wait for work."""
    service = PoolService(processes=processes, max_retries=1, maxtasks=None)
    replies = {}
    for wid in service.reserve_workers():
        replies[wid] = Reply()
        service.op_next(replies[wid], wid, [])
    assert not any(r.event.is_set() for r in replies.values())
    return service, replies


def _count_answers(service: PoolService) -> list:
    """Count the workers the service considers answering, from now on."""
    counted: list = []
    answer = service._answer

    def counting(worker, effects):
        counted.append(worker.wid)
        return answer(worker, effects)

    service._answer = counting   # type: ignore[method-assign]
    return counted


def test_work_added_to_a_pool_of_waiting_workers_costs_the_answers_it_gives():
    """One chunk fed to a pool whose 500 workers all wait (an imap feeding slowly):
    one worker is answered, and no other is even looked at."""
    service, replies = _parked_pool(500)
    sink = Sink()
    job = service.open_job(sink, pack(abs), "abs", Kind.MAP, lazy=True)
    counted = _count_answers(service)
    for start in range(20):
        service.add_chunks(job, start, fibrl.pool.chunked([-start], 1))
    assert len(counted) == 20, len(counted)   # a scan of all waiting workers: 10,000
    answered = [wid for wid, reply in replies.items() if reply.event.is_set()]
    assert len(answered) == 20
    # each chunk went to a worker that held nothing: the ones that waited longest
    assert answered == sorted(replies)[:20]


def test_a_worker_reporting_does_not_make_the_service_look_at_the_others():
    """300 workers each hold a chunk of a callable whose cost is not known yet, and wait
    for more (none gets a second before its first is measured). One reports its result
    while it waits: only it is answered; the others were looked at when they asked, and
    nothing changed for them since."""
    service, replies = _parked_pool(300)
    sink = Sink()
    service.submit(sink, pack(abs), "abs", Kind.MAP, fibrl.pool.chunked(range(1000), 1))
    held = {wid: reply.batch.tasks[0] for wid, reply in replies.items()}
    for wid in replies:   # each asks again while its chunk runs: parked
        replies[wid] = Reply()
        service.op_next(replies[wid], wid, [])
    assert not any(reply.event.is_set() for reply in replies.values())
    counted = _count_answers(service)
    wid, spec = next(iter(held.items()))
    service.op_report(Reply(), wid, [Report(spec.tid, 0, 1, pack([0]), 0.01, True)])
    assert counted == [wid]   # a pass over every waiting worker: 300
    assert replies[wid].batch.tasks   # its parked request, answered with work
    assert len(sink.outcomes) == 1


def test_a_local_pool_boots_a_bounded_number_of_workers_at_once():
    service = PoolService(processes=100, max_retries=1, maxtasks=None, max_starting=8)
    first = service.reserve_workers()
    assert len(first) == 8
    assert service.reserve_workers() == []    # eight boot: no more until one has booted
    service.op_booted(Reply(), first[0])
    service.op_booted(Reply(), first[0])      # (once counts once)
    assert len(service.reserve_workers()) == 1
    service.op_next(Reply(), first[1], [])    # connected without saying it booted
    assert len(service.reserve_workers()) == 1
    service.lose(first[2], 1)                 # ended while it booted: replaced
    assert len(service.reserve_workers()) == 1
    unlimited = PoolService(processes=100, max_retries=1, maxtasks=None)
    assert len(unlimited.reserve_workers()) == 100


def _paced_batch(processes: int, chunks: int):
    """The second batch of a worker of a pool of ``processes``, once the callable's cost
    (10 ms an item) is known, with ``chunks`` one-item chunks submitted."""
    service, replies = _parked_pool(processes)
    sink = Sink()
    service.submit(sink, pack(abs), "abs", Kind.MAP,
                   fibrl.pool.chunked(range(chunks), 1))
    wid = min(replies)
    (spec,) = replies[wid].batch.tasks   # cost unknown: one chunk
    again = Reply()
    service.op_next(again, wid, [Report(spec.tid, 0, 1, pack([0]), 0.01, True)])
    return again.batch


def test_a_large_pool_paces_its_workers_so_the_parent_handles_as_many_messages():
    small = _paced_batch(2, 1000)
    assert small.hold <= FLUSH_S                      # as before: results within 20 ms
    assert HORIZON_S / 0.01 - 1 <= len(small.tasks) <= HORIZON_S / 0.01
    large = _paced_batch(512, 512 * 100)
    pace = 512 / MESSAGES_PER_S
    assert large.hold == pace                         # results wait longer
    assert len(large.tasks) >= 2 * pace / 0.01 - 1    # and more work is held
    assert large.refill == int(pace / 0.01)           # asked for with half of it left


def test_when_work_is_scarce_a_worker_asks_again_only_once_done():
    """Fewer chunks pending than a batch for every worker: an early request would wait,
    and the last results would then travel on their own."""
    batch = _paced_batch(16, 40)
    assert batch.refill == -1
    plenty = _paced_batch(16, 4000)
    assert plenty.refill > 0


def test_a_new_job_is_sized_by_its_own_first_result_not_by_an_earlier_job():
    """The same callable on other arguments: a job of 0.2 s items, then a job of
    10 ms ones. The second job's first chunks are sized by the first job's cost (one
    each); from its first result on, by its own: a worker then holds HORIZON_S of
    them, not one at a time while an average of both jobs slowly comes down."""
    service, replies = _parked_pool(2)
    slow = Sink()
    service.submit(slow, pack(abs), "abs", Kind.MAP, fibrl.pool.chunked(range(2), 1))
    for wid, reply in list(replies.items()):
        (spec,) = reply.batch.tasks
        replies[wid] = Reply()
        service.op_next(replies[wid], wid, [Report(spec.tid, 0, 1, pack([0]), 0.2, True)])
    assert len(slow.outcomes) == 2
    fast = Sink()
    service.submit(fast, pack(abs), "abs", Kind.MAP, fibrl.pool.chunked(range(1000), 1))
    wid = min(replies)
    (spec,) = replies[wid].batch.tasks        # 0.2 s an item, as far as it knows: one
    again = Reply()
    service.op_next(again, wid, [Report(spec.tid, 0, 1, pack([0]), 0.01, True)])
    assert HORIZON_S / 0.01 - 1 <= len(again.batch.tasks) <= HORIZON_S / 0.01
