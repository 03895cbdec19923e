"""Network partitions on the docker backend: iptables rules on the TCP connections of
one worker container, healed after a time.

tests/faults/test_partitions.py makes its partitions with the transport's test seam,
which a docker container does not take from the parent. Here the network itself
loses the packets: worker containers use the host's network, so a worker and its
parent talk over the loopback, and every packet between them crosses the INPUT chain
once. A partition is a chain of the test's own, jumped to from INPUT, with one rule
per direction of each TCP connection of the container (the full address pair: tests
running beside it are not touched) and one per port it listens on; the heal removes
the jump (at once) and then the chain. Two kinds of loss:

* ``drop``: packets vanish, as when a machine or a link goes away. TCP retries with a
  doubling delay, so what was held reaches the other side when TCP next retries
  after the heal (for a partition of a second, well under a second later);
* ``unreachable``: packets are refused with ICMP host-unreachable, as a router says
  when it has no route. TCP keeps retrying at its first pace meanwhile (RFC 6069),
  so what was held arrives within a fraction of a second of the heal.

What must hold (the properties of test_partitions.py, with a real network):

* shorter than ``parent_timeout``: nothing happens: the map's results are exact, no
  worker is lost, requeued or replaced; the cut-off worker's result, produced inside
  the partition, arrives after the heal;
* longer: the parent declares the worker lost and its task runs elsewhere, the map is
  exact; once the partition heals, the stale worker's late result reaches the parent
  and is dropped (each result delivered once), and the container exits by itself
  (nobody kills it);
* a Queue consumer in a container, cut off while it takes items, takes nothing more
  once it sees the partition, gives up its parent and exits: no item is lost (once
  healed, the owner takes back what it pushed and was not acknowledged), and the only
  items returned again (to the next consumer) are the last ones the cut-off consumer's
  ``get()`` returned, just before the cut or during it: their acknowledgement was held
  by the partition (some may still arrive: the closed socket sends what it held once
  healed).

Each fault starts once the worker is known to be where it matters (it reported from
inside its task), each test checks that the rules lost packets (their counters), and
the worker's own view of it (its connection retransmitting) comes through its output,
which the docker engine relays whatever the network does.
"""
import contextlib
import functools
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from conftest import REQUIRE_DOCKER, deliveries_of, kills_of, skip_or_fail, wait_until

import fibrl
from fibrl.hosting.hub import get_hub
from fibrl.wire import faults

pytestmark = pytest.mark.docker
TIMEOUT = 60      # only reached on a hang
HEARTBEAT = 0.25  # heartbeat_interval of every test here


# -- the partition -------------------------------------------------------------------------

def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    # -w: wait for the xtables lock (tests beside this one change their own chains)
    return subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True,
                          timeout=30, check=check)


def _iptables_missing() -> str:
    """'' when this process can add iptables rules, else why not."""
    if os.geteuid() != 0:
        return "network partitions need root (iptables rules)"
    if shutil.which("iptables") is None:
        return "network partitions need iptables (apt-get install iptables)"
    try:
        done = _iptables("-L", "INPUT", "-n", check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"iptables does not run here: {exc}"
    if done.returncode:
        return f"iptables does not run here: {done.stderr.strip()}"
    return ""


_ANY = ("0.0.0.0", "::")   # a port listened on at every address


class NetPartition:
    """The TCP connections and listening ports of one container's processes, cut off
    in both directions by an iptables chain of this partition's own."""

    KINDS = {"drop": ["-j", "DROP"],
             "unreachable": ["-j", "REJECT", "--reject-with", "icmp-host-unreachable"]}

    def __init__(self, pids: list, kind: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind {kind!r} is not one of {sorted(self.KINDS)}")
        self.pids, self.kind = pids, kind
        self.chain = f"fibrl-cut-{uuid.uuid4().hex[:12]}"
        self.connections, self.listening = _tcp_of(pids)
        assert self.connections, f"processes {pids} have no TCP connection to cut"
        self.escaped: list = []   # connections made meanwhile that no rule covered
        self.packets = 0          # what the rules lost, read at the heal
        self._jumped = self._made = False

    def rules(self) -> list:
        rules = []
        for (lhost, lport), (rhost, rport) in sorted(self.connections):
            rules.append(["-s", rhost, "--sport", str(rport), "-d", lhost, "--dport", str(lport)])
            rules.append(["-s", lhost, "--sport", str(lport), "-d", rhost, "--dport", str(rport)])
        for host, port in sorted(self.listening):
            rules.append((["-d", host] if host not in _ANY else []) + ["--dport", str(port)])
        return [["-p", "tcp", *rule, *self.KINDS[self.kind]] for rule in rules]

    def start(self) -> "NetPartition":
        _iptables("-N", self.chain)
        self._made = True
        for rule in self.rules():
            _iptables("-A", self.chain, *rule)
        _iptables("-I", "INPUT", "1", "-j", self.chain)   # the partition begins
        self._jumped = True
        return self

    def counted(self) -> int:
        """Packets the chain's rules lost so far."""
        listing = _iptables("-L", self.chain, "-v", "-n", "-x").stdout.splitlines()[2:]
        return sum(int(line.split()[0]) for line in listing if line.strip())

    def heal(self) -> int:
        """End the partition; how many packets its rules lost. Connections of the
        container that no rule covered (made during the partition) go to ``escaped``."""
        now, listening = _tcp_of(self.pids)
        self.escaped = sorted((now - self.connections) | (listening - self.listening))
        _iptables("-D", "INPUT", "-j", self.chain)        # the partition ends
        self._jumped = False
        self.packets = self.counted()
        self.remove()
        return self.packets

    def remove(self) -> None:
        """Remove the jump and the chain, whatever is left of them (quietly)."""
        if self._jumped:
            _iptables("-D", "INPUT", "-j", self.chain, check=False)
            self._jumped = False
        if self._made:
            _iptables("-F", self.chain, check=False)
            _iptables("-X", self.chain, check=False)
            self._made = False


def _tcp_of(pids: list) -> tuple:
    """(connections ``((local host, port), (remote host, port))``, listening
    ``(host, port)``) of the TCP sockets that ``pids`` and their descendants hold."""
    connections, listening = set(), set()
    for proc in _with_descendants(pids):
        try:
            found = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for conn in found:
            local = (conn.laddr.ip, conn.laddr.port)
            if conn.status == psutil.CONN_LISTEN:
                listening.add(local)
            elif conn.raddr:
                connections.add((local, (conn.raddr.ip, conn.raddr.port)))
    hosts = {host for ends in connections for host, _ in ends}
    hosts |= {host for host, _ in listening if host not in _ANY}
    assert all(host.startswith("127.") for host in hosts), (
        f"container connections not on the IPv4 loopback ({sorted(hosts)}): these tests "
        f"need worker containers on the host's network (docker_network='host') and the "
        f"parent on 127.0.0.1, where every packet between them crosses INPUT")
    return connections, listening


def _with_descendants(pids: list) -> list:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
    return procs


@pytest.fixture
def netcut(docker_engine):
    """``netcut(process, kind)``: cut the docker worker ``process`` (a fibrl process of
    the docker backend) off the network; every partition is removed after the test,
    healed or not (also when it failed)."""
    reason = _iptables_missing()
    if reason:
        skip_or_fail(reason, REQUIRE_DOCKER)
    made = []

    def cut(process, kind: str = "drop") -> NetPartition:
        pid = docker_engine.api.inspect_container(process._popen.job.id)["State"]["Pid"]
        assert pid, f"container of {process} is not running"
        made.append(NetPartition([pid], kind))
        return made[-1].start()

    cut.engine = docker_engine
    yield cut
    for partition in made:
        partition.remove()


@pytest.fixture
def docker_heartbeats(docker_engine, configure):
    """``docker_heartbeats(parent_timeout)``: the docker backend, with heartbeats every
    ``HEARTBEAT`` s that find a silent peer after ``parent_timeout`` s."""
    return lambda limit: configure(backend="docker", heartbeat_interval=HEARTBEAT,
                                   parent_timeout=limit)


# -- in the worker ---------------------------------------------------------------------------

def _parent_connection() -> tuple:
    """This pool worker's ``(local, remote)`` ``host:port`` of its connection to the parent."""
    clients = list(get_hub()._clients.values())
    assert len(clients) == 1, f"a pool worker here talks to its parent only: {clients}"
    _, local, _, remote = faults.endpoints(clients[0]._channel).split()
    return local, remote


def _proc_net(address: str) -> str:
    host, port = address.rsplit(":", 1)
    return "%08X:%04X" % (int.from_bytes(socket.inet_aton(host), sys.byteorder), int(port))


def _retransmitting(local: str, remote: str) -> bool:
    """Whether TCP retransmits on the connection ``local`` -> ``remote`` (its packets are
    being lost): /proc/net/tcp of the host's network, which the container shares."""
    ends = (_proc_net(local), _proc_net(remote))
    with open("/proc/net/tcp") as table:
        for row in table.read().splitlines()[1:]:
            fields = row.split()
            if (fields[1], fields[2]) == ends:
                return int(fields[6], 16) > 0
    return False


def net_probe(x, token, started, runs):
    """``(x * x, the end of its worker's connection to the parent)``. The run that takes
    the token reports that end, waits until that connection loses packets (the
    partition is in place), then says so on its output (the engine relays it) and on
    ``runs`` (through the network), and returns: its result is produced inside the
    partition."""
    local, remote = _parent_connection()
    try:
        token.get_nowait()
    except queue.Empty:
        return x * x, local
    started.put((x, local))
    started.qsize()   # a round trip: the report reached the parent before the partition
    deadline = time.monotonic() + TIMEOUT
    while not _retransmitting(local, remote) and time.monotonic() < deadline:
        time.sleep(0.01)
    at = time.monotonic()   # (the same clock as the parent's: one kernel)
    print(f"net_probe: finished {x} at {at:.3f}", flush=True)
    runs.put(("finished", x, local, at))
    return x * x, local


_FINISHED = re.compile(r"net_probe: finished (\d+) at ([\d.]+)")


class _CutRun:
    """A map on a pool of two whose first task's worker is cut off by the network."""

    def __init__(self, pool, netcut, kind, items=12):
        self.pool, self.items = pool, items
        self.token, self.started, self.runs = fibrl.Queue(), fibrl.Queue(), fibrl.Queue()
        self.token.put("cut off")
        # (closures over lists and dicts only: a cycle through self keeps the queues alive)
        self.kills = kills_of(pool)
        supervisor = pool._engine.supervisor
        self.service = service = pool._engine.service
        self.stale = stale = []   # reports of tasks done already: late results
        tasks, real_record = service._tasks, service._record
        service._record = lambda reports, effects: (
            stale.extend(r for r in reports if r.tid not in tasks),
            real_record(reports, effects))
        probe = functools.partial(net_probe, token=self.token, started=self.started,
                                  runs=self.runs)
        self.result = pool.map_async(probe, range(items), chunksize=1)
        self.deliveries = deliveries_of(self.result)
        # the worker is inside its task: the partition starts
        self.x, self.end = self.started.get(timeout=TIMEOUT)
        self.workers = wait_until(lambda: _both(supervisor.processes()), "both workers")
        self.ids = [p._popen.job.id for p in self.workers]
        self.worker = _worker_at(self.workers, self.end, netcut.engine)
        self.worker_id = self.worker._popen.job.id   # (a process forgets it once it ended)
        self.cut_at = time.monotonic()
        self.partition = netcut(self.worker, kind)
        self.cut_done = time.monotonic()

    def wait_finished(self, timeout: float = 20) -> float:
        """When the cut-off run finished its task (it saw its connection lose packets),
        read from its output: not through the network."""
        job = self.worker._popen.job
        match = wait_until(lambda: _FINISHED.search(job.logs()),
                           "the cut-off run to see the partition and finish its task", timeout,
                           interval=0.05)
        assert int(match.group(1)) == self.x
        return float(match.group(2))

    def check_exact(self, out):
        assert [value for value, _ in out] == [x * x for x in range(self.items)]
        assert sorted(self.deliveries) == sorted(set(self.deliveries)), "a result came twice"

    def restore(self):
        """Undo the hooks on the pool's service (a cycle through it otherwise)."""
        with contextlib.suppress(AttributeError):
            del self.service._record


def _both(processes):
    return processes if len(processes) == 2 and all(p.pid for p in processes) else None


def _worker_at(workers, end: str, engine):
    """The worker of ``workers`` whose container holds the connection end ``end``."""
    host, port = end.rsplit(":", 1)
    for process in workers:
        state = engine.api.inspect_container(process._popen.job.id)["State"]
        connections, _ = _tcp_of([state["Pid"]]) if state["Running"] else (set(), set())
        if any(local == (host, int(port)) for local, _ in connections):
            return process
    pytest.fail(f"no worker container holds the connection end {end}")


def _container_ended(docker_engine, container_id: str) -> bool:
    import docker

    try:
        return docker_engine.api.inspect_container(container_id)["State"]["Status"] in (
            "exited", "dead", "removing")
    except docker.errors.NotFound:
        return True   # ended and removed by its pool


# -- a pool worker cut off -----------------------------------------------------------------

@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["drop", "unreachable"])
def test_network_partition_shorter_than_parent_timeout_changes_nothing(
        docker_heartbeats, netcut, kind):
    # the partition lasts about a second, and TCP delivers what it held at its next try
    # after the heal: at most about as long again with "drop". 6 s: far from both
    limit, seconds = 6.0, 1.0
    docker_heartbeats(limit)
    with fibrl.Pool(2) as pool:
        cut = _CutRun(pool, netcut, kind)
        try:
            finished = cut.wait_finished(timeout=limit / 2)
            time.sleep(max(0.0, cut.cut_done + seconds - time.monotonic()))
            lost = cut.partition.heal()
            healed = time.monotonic()
            assert cut.cut_at < finished < healed, "the task did not finish inside the partition"
            assert lost > 0, "the rules lost no packet: there was no partition"
            assert cut.partition.escaped == [], "a connection went round the partition"
            assert healed - cut.cut_at < limit / 2, "the partition lasted too long for this test"
            out = cut.result.get(TIMEOUT)
            cut.check_exact(out)
            value, end = out[cut.x]
            assert end == cut.end, "the cut-off task ran again elsewhere"
            assert cut.service.stats == {"lost": 0, "requeued": 0, "failed": 0}
            assert sorted(p._popen.job.id for p in pool._engine.supervisor.processes()) == \
                sorted(cut.ids), "a worker was replaced"
            report = cut.runs.get(timeout=TIMEOUT)   # (sent inside the partition)
            assert report == ("finished", cut.x, cut.end, pytest.approx(finished, abs=1e-3))
            assert cut.stale == [] and cut.kills == []
        finally:
            cut.restore()


@pytest.mark.timeout(150)
def test_network_partition_past_parent_timeout_loses_the_worker_once(
        docker_heartbeats, netcut, docker_engine):
    # "unreachable": TCP keeps its first pace, so once healed, what the stale worker
    # sent meanwhile arrives within a fraction of a second: before it exits, which it
    # does PARENT_LOST_GRACE (3 s) after it gave up its parent, at parent_timeout too.
    # With "drop", TCP's next try after a heal this long may come after that exit.
    limit = 3.0
    docker_heartbeats(limit)
    with fibrl.Pool(2, max_task_retries=1) as pool:
        cut = _CutRun(pool, netcut, "unreachable")
        try:
            finished = cut.wait_finished(timeout=limit)
            out = cut.result.get(TIMEOUT)   # the partition holds: the task ran elsewhere
            cut.check_exact(out)
            value, end = out[cut.x]
            assert end != cut.end, "the cut-off worker's result was taken"
            stats = cut.service.stats
            assert stats["lost"] == 1 and stats["requeued"] >= 1, stats
            assert cut.stale == [], "a late result went through the partition"
            # healed: the stale run's late result arrives and is dropped
            lost = cut.partition.heal()
            assert lost > 0, "the rules lost no packet: there was no partition"
            assert cut.partition.escaped == [], "a connection went round the partition"
            assert cut.cut_at < finished, "the task finished before the partition"
            wait_until(lambda: cut.stale, "the stale worker's late result", timeout=limit)
            report = cut.runs.get(timeout=TIMEOUT)
            assert report[:3] == ("finished", cut.x, cut.end), report
            assert sorted(cut.deliveries) == list(range(cut.items)), "a result came twice"
            assert cut.result.get(0) == out
            # it ends by itself (told to stop, or its parent lost), well before the pool
            # would kill it (30 s after the loss)
            stale_id = cut.worker_id
            wait_until(lambda: _container_ended(docker_engine, stale_id),
                       "the stale worker's container to exit", timeout=20)
            others = [i for i in cut.ids if i != stale_id]
            assert not any(_container_ended(docker_engine, i) for i in others), \
                "another worker than the stale one ended"
            assert cut.kills == [], "the stale worker was killed rather than left to exit"
            assert pool.map(abs, range(-5, 5)) == [abs(x) for x in range(-5, 5)]
        finally:
            cut.restore()


# -- a Queue consumer cut off ----------------------------------------------------------------

ITEMS = 300   # (one line of output each: the engine keeps 500 of a container)
_GOT = re.compile(r"consume: got (\d+) at ([\d.]+)")


def consume(q, fast, pause):
    """Take items, the first ``fast`` at once (its window grows: the owner pushes items
    ahead), then one every ``pause`` s, until its connection to the queue's owner loses
    packets (the partition is in place): from then on take nothing more (what its
    window holds stays there) and wait to give up its parent. Print each item (with
    when) on the output, which the engine relays whatever the network does."""
    local, remote = _parent_connection()   # (the owner is the parent)
    taken = 0
    deadline = time.monotonic() + TIMEOUT
    while not _retransmitting(local, remote):
        assert time.monotonic() < deadline, "no partition came"
        try:
            item = q.get(timeout=0.05)   # (a window that ran dry: look again)
        except queue.Empty:
            continue
        print(f"consume: got {item} at {time.monotonic():.4f}", flush=True)
        taken += 1
        if taken > fast:
            time.sleep(pause)
    print(f"consume: cut off at {time.monotonic():.4f}", flush=True)
    time.sleep(TIMEOUT)   # (it exits once it gives up its parent)


@pytest.mark.timeout(180)
def test_a_consumer_cut_off_loses_nothing_and_repeats_only_its_last_items(
        docker_heartbeats, netcut, docker_engine):
    limit = 3.0
    docker_heartbeats(limit)
    q = fibrl.Queue()
    for i in range(ITEMS):
        q.put(i)
    consumer = fibrl.Process(target=consume, args=(q, 40, 0.05))
    consumer.start()
    partition = None
    try:
        job = consumer._popen.job
        wait_until(lambda: len(_GOT.findall(job.logs())) >= 45,
                   "the consumer to take items", TIMEOUT, interval=0.05)   # inside its loop
        cut_at = time.monotonic()
        partition = netcut(consumer, "drop")
        # cut off, it gives up its parent at parent_timeout and exits 3 s later
        consumer.join(limit + 15)
        assert consumer.exitcode is not None, "the cut-off consumer did not end by itself"
        lost = partition.heal()
        assert lost > 0, "the rules lost no packet: there was no partition"
        taken = [(int(item), float(at)) for item, at in _GOT.findall(job.logs())]
        first = [item for item, _ in taken]
        assert len(first) < ITEMS, "the consumer took every item before the partition"
        assert len(set(first)) == len(first), "the consumer got an item twice"
        assert "consume: cut off" in job.logs(), "the consumer did not see the partition"
        # the owner takes back what the consumer's window held (pushed ahead, never
        # returned) once its connection closes (after the heal): the parent drains the rest
        then, deadline = [], time.monotonic() + TIMEOUT
        while set(first) | set(then) != set(range(ITEMS)):
            assert time.monotonic() < deadline, (
                f"items lost: {sorted(set(range(ITEMS)) - set(first) - set(then))[:20]}")
            with contextlib.suppress(queue.Empty):
                then.append(q.get(timeout=1))
        with contextlib.suppress(queue.Empty):
            while True:   # (anything more would come twice)
                then.append(q.get(timeout=1))
        assert len(set(then)) == len(then), "the queue returned an item twice after the cut"
        again = set(first) & set(then)
        # returned again: the last ones the cut-off consumer took, from just before the
        # cut or during it, before it saw it: their acknowledgement (sent within ACK_DELAY)
        # was held by the partition, and the consumer exited before the heal (its socket
        # still sends what it held once healed, so some may arrive)
        assert again == set(first[len(first) - len(again):]), (
            f"returned again, not the consumer's last items: {sorted(again)}; "
            f"its last: {first[-len(again) - 2:]}")
        assert all(at > cut_at - 1.0 for item, at in taken if item in again), (
            "an item taken well before the cut was returned again",
            [(item, round(cut_at - at, 3)) for item, at in taken if item in again])
    finally:
        if partition is not None:
            partition.remove()
        consumer.join(TIMEOUT)
        if consumer.exitcode is None:
            consumer.kill()
            consumer.join(TIMEOUT)
        consumer.close()   # (its sentinel: a failure's traceback keeps the object)
