"""Fleet members in this process against a real etcd, each on a service of its own on
a fake host: what each member watches, and what it puts. An incident's ranks reach
the hosts of its job and no other, its head is put once, and a member that starts
after a day of incidents with their stacks reads the heads, not the stacks.
(tests/fleet/test_fleet.py runs whole daemons.)"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
import trio

from watchdogd.core.config import Config, DaemonConfig, FleetConfig
from watchdogd.core.identity import Peer
from watchdogd.core.service import Service
from watchdogd.core.timers import Expired
from watchdogd.fleet import member
from watchdogd.fleet.etcd import Data, EtcdClient
from watchdogd.fleet.member import FleetMember
from watchdogd.fleet.publish import MAX_PENDING, PENDING_PER_UID, _Queue
from watchdogd.fleet.records import HostRecord
from watchdogd.fleet.watch import EtcdWatch
from watchdogd.runtime.metrics import exposition
from watchdogd_protocol import (
    Acquire,
    Acquired,
    EventInfo,
    IncidentInfo,
    RankInfo,
    StepResult,
)

from helpers.etcd import EtcdServer
from helpers.fakes import ROOT, FakeHost, FakeProcess, fake_names
from helpers.waiting import PATIENCE

#: The pids of each host's ranks, root's processes.
PIDS = (500, 501)
#: Seconds an expiry on an incident's host joins it: its ranks are followed that
#: long at least.
WINDOW = 1.0
STACK = 'Thread 1 (idle): "MainThread"\n    all_reduce (c10d.py:1)\n'


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """This test's own keys on the shared etcd."""
    return f"/test-member/{request.node.name}"


class RecordingClient(EtcdClient):
    """An etcd client that remembers the keys it put and the watches it opened."""

    def __init__(self, endpoint: str) -> None:
        super().__init__([endpoint])
        self.puts: list[str] = []
        self.watched: list[tuple[str, str | None]] = []
        self.watching = 0
        #: The most watches open at once.
        self.most = 0

    async def put(self, key: Data, value: Data, *, lease: int | None = None) -> int:
        self.puts.append(key if isinstance(key, str) else key.decode())
        return await super().put(key, value, lease=lease)

    @contextlib.asynccontextmanager
    async def open_watch(
        self,
        prefix: Data,
        *,
        through: Data | None = None,
        start_revision: int = 0,
        max_value: int | None = None,
    ) -> AsyncIterator[EtcdWatch]:
        self.watched.append((_text(prefix), None if through is None else _text(through)))
        async with super().open_watch(
            prefix, through=through, start_revision=start_revision, max_value=max_value
        ) as watch:
            self.watching += 1
            self.most = max(self.most, self.watching)
            try:
                yield watch
            finally:
                self.watching -= 1


def _text(data: Data) -> str:
    return data if isinstance(data, str) else data.decode()


@dataclass
class Host:
    """A member, its service on a fake host holding ranks of ``job``, and the peer
    policies it was handed (each ends at once with a stack)."""

    name: str
    service: Service[FakeProcess]
    client: RecordingClient
    peers: list[str] = field(default_factory=list)
    member: FleetMember[FakeProcess] = field(init=False)

    def carry_out(self, expired: list[Expired[FakeProcess]]) -> None:
        events = []
        for item in expired:
            timer, run = item.timer, item.timer.run
            assert run is not None
            if run.peer:
                self.peers.append(run.incident)
            events.append(
                EventInfo(seq=0, kind="peer" if run.peer else "expired", time=time.time(),
                          pid=timer.pid, uid=0, scope=timer.scope, policy=timer.policy,
                          outcome="alive", incident=run.incident,
                          steps=[StepResult(step="dump", result="exit 0", output=STACK)])
            )  # fmt: skip
        self.service.firing.record_expiries(events)
        for item in expired:
            self.service.firing.finished(item.timer)
            item.process.close()

    def hang(self) -> str:
        """Its first rank misses a deadline: the incident's id."""
        now = time.monotonic()
        caller = self.service.arming.open_connection(ROOT)
        self.service.handle(
            Acquire(id=1, scope="hang", timeout=1.0, pid=PIDS[0], job="train", rank=0),
            caller, now,
        )  # fmt: skip
        fired = self.service.firing.expire_due(now + 1.0)
        self.carry_out(fired)
        run = fired[0].timer.run
        assert run is not None
        return run.incident

    def incident(self, incident: str) -> IncidentInfo | None:
        return self.service.incidents.get(incident, 0, 0)


def make_host(name: str, job: str | None, etcd: EtcdServer, prefix: str) -> Host:
    config = Config(
        daemon=DaemonConfig(incident_window=WINDOW),
        fleet=FleetConfig(etcd=[etcd.url], host=name, prefix=prefix),
    )
    fake = FakeHost(dict.fromkeys(PIDS, (0, 0)))
    service = Service(config, fake, daemon_pid=50, now=time.monotonic(), wall=time.time,
                      clock=time.monotonic, render_metrics=exposition, host=name)  # fmt: skip
    if job is not None:
        caller = service.arming.open_connection(ROOT)
        for index, pid in enumerate(PIDS):
            reply = service.handle(
                Acquire(id=pid, scope="step", timeout=3600.0, pid=pid, job=job, rank=index),
                caller, time.monotonic(),
            )  # fmt: skip
            assert isinstance(reply, Acquired), reply
    host = Host(name, service, RecordingClient(etcd.url))
    host.member = FleetMember(
        config.fleet, service.fleet, host.carry_out, fake_names(), client=host.client
    )
    return host


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    with trio.move_on_after(PATIENCE):
        while not condition():
            await trio.sleep(0.01)
        return
    raise AssertionError(f"no {what} within {PATIENCE} s")


@contextlib.asynccontextmanager
async def running(*hosts: Host) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        for host in hosts:
            await nursery.start(host.member.run)
        await wait_for(lambda: all(h.service.fleet.state == "connected" for h in hosts), "up")
        yield
        nursery.cancel_scope.cancel()


def twice(items: list[str], item: str) -> Callable[[], bool]:
    return lambda: items.count(item) == 2


def ranks_of(host: Host, incident: str) -> list[tuple[str, int, str]]:
    shown = host.incident(incident)
    return [] if shown is None else sorted((r.host, r.pid, r.state) for r in shown.ranks)


async def test_an_incidents_ranks_reach_the_hosts_of_its_job_only(
    etcd: EtcdServer, prefix: str
) -> None:
    a, b, c = (make_host(n, j, etcd, prefix) for n, j in (("a", "train"), ("b", "train"),
                                                          ("c", "other")))  # fmt: skip
    async with running(a, b, c):
        # a knows that b holds the job (and expects its ranks) before a's rank hangs.
        await wait_for(lambda: a.member.holders("root", "train") == {"b"}, "b's jobs")
        hung_at = time.time()
        incident = a.hang()
        whole = [("a", 500, "done"), ("a", 501, "done"), ("b", 500, "done"), ("b", 501, "done")]
        await wait_for(lambda: ranks_of(a, incident) == ranks_of(b, incident) == whole, "ranks")
        assert b.peers == [incident, incident]
        # Each of the job's hosts followed the ranks, and stops once all are done and
        # the incident's window has passed.
        await wait_for(lambda: a.client.watching == b.client.watching == 1, "follows ended")
        assert time.time() >= hung_at + WINDOW
    assert c.incident(incident) is None
    assert c.peers == []
    main = (f"{prefix}/hosts/", f"{prefix}/incidents/")
    assert c.client.watched == [main]
    for host in (a, b):
        assert host.client.watched[0] == main
        assert set(host.client.watched[1:]) == {(f"{prefix}/ranks/root/train/", None)}
    # The head once, though a's ranks changed four times; each host's ranks as they
    # changed, under ranks/.
    head = f"{prefix}/incidents/{incident}"
    assert a.client.puts.count(head) == 1
    assert {key for key in a.client.puts + b.client.puts if "/ranks/" in key} == {
        f"{prefix}/ranks/root/train/{incident}/a",
        f"{prefix}/ranks/root/train/{incident}/b",
    }


async def test_two_hosts_incidents_of_one_expiry_are_one_with_one_watch_of_its_ranks(
    etcd: EtcdServer, prefix: str
) -> None:
    """Both hosts' ranks expire at once: each opens an incident, a moment apart. Both
    keep the one opened first, under its id and the other's, with every rank once;
    each host ran the peer policy on its own other rank, once."""
    a, b = make_host("a", "train", etcd, prefix), make_host("b", "train", etcd, prefix)
    async with running(a, b):
        await wait_for(lambda: a.member.holders("root", "train") == {"b"}, "b's jobs")
        await wait_for(lambda: b.member.holders("root", "train") == {"a"}, "a's jobs")
        first, second = a.hang(), b.hang()
        whole = [("a", 500, "done"), ("a", 501, "done"), ("b", 500, "done"), ("b", 501, "done")]
        await wait_for(
            lambda: all(ranks_of(h, i) == whole for h in (a, b) for i in (first, second)),
            "every rank of the job's one incident on both hosts, under either id",
        )
        shown = [h.incident(i) for h in (a, b) for i in (first, second)]
        assert {None if incident is None else incident.id for incident in shown} == {first}
        await wait_for(lambda: a.client.watching == b.client.watching == 1, "follows ended")
    assert a.client.most == b.client.most == 2
    assert (a.peers, b.peers) == ([first], [second])


async def test_an_incident_of_a_job_followed_past_its_windows_is_followed_too(
    etcd: EtcdServer, prefix: str
) -> None:
    a = make_host("a", "train", etcd, prefix)
    long_ago = time.time() - 10 * WINDOW  # every window has passed: a waits for x's ranks
    async with running(a), EtcdClient([etcd.url]) as x:
        for incident in ("x-1", "x-2"):
            head = IncidentInfo(id=incident, job="train", user="root", uid=0, host="x",
                                scope="s", reason="timeout", time=long_ago)  # fmt: skip
            await x.put(f"{prefix}/incidents/{incident}", msgspec.json.encode(head))
            await wait_for(twice(a.peers, incident), f"a's peers of {incident}")
        done = RankInfo(host="x", pid=9, uid=0, role="expired", scope="s", state="done")
        for incident in ("x-1", "x-2"):
            await x.put(f"{prefix}/ranks/root/train/{incident}/x", msgspec.json.encode([done]))
        await wait_for(
            lambda: all(("x", 9, "done") in ranks_of(a, i) for i in ("x-1", "x-2")), "x's ranks"
        )
        await wait_for(lambda: a.client.watching == 1, "the follow ended")
    assert a.client.most == 2


async def test_a_follow_that_nobody_waits_behind_keeps_its_watch(
    etcd: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """x holds the job but never publishes ranks: a's follow of the incident does not
    settle, and runs for turns of a watch; with no other follow waiting, it keeps the
    watch it opened for the time after the window, never opens one a turn."""
    turn = 0.2
    monkeypatch.setattr(member, "_TURN", turn)
    a = make_host("a", "train", etcd, prefix)
    x_holds = HostRecord("x", "up", [("root", "train")])
    async with running(a), EtcdClient([etcd.url]) as x:
        await x.put(f"{prefix}/hosts/x", msgspec.json.encode(x_holds))
        await wait_for(lambda: a.member.holders("root", "train") == {"x"}, "x's jobs")
        a.hang()
        ranks = (f"{prefix}/ranks/root/train/", None)
        # The window's watch, then the one of the time after it, and no more.
        await wait_for(lambda: a.client.watched.count(ranks) == 2, "a's follow past the window")
        await trio.sleep(5 * turn)
        assert a.client.watched.count(ranks) == 2
        assert a.client.watching == 2


async def test_a_member_starting_after_a_day_of_stacks_reads_the_heads_only(
    etcd: EtcdServer, prefix: str
) -> None:
    big = msgspec.json.encode([RankInfo(host="x", pid=1, uid=0, role="peer", scope="s",
                                        stack="y" * 60_000)] * 8)  # fmt: skip
    head = IncidentInfo(id="x-1", job="train", user="root", uid=0, host="x", scope="s",
                        reason="timeout", time=time.time())  # fmt: skip
    async with EtcdClient([etcd.url]) as client:
        # Past the client's 4 MiB bound on a reply: the whole prefix cannot be read.
        for number in range(12):
            await client.put(f"{prefix}/ranks/root/other/old-{number}/x", big)
        await client.put(f"{prefix}/incidents/x-1", msgspec.json.encode(head))
        await client.put(f"{prefix}/ranks/root/train/x-1/x", msgspec.json.encode([]))
    late = make_host("late", "train", etcd, prefix)
    async with running(late):
        await wait_for(lambda: late.peers == ["x-1", "x-1"], "the peers of x-1")


def test_the_publication_queue_takes_uids_in_turn_and_drops_a_flooders_own() -> None:
    queue = _Queue()

    def incident(uid: int, number: int) -> IncidentInfo:
        return IncidentInfo(id=f"h-{uid}-{number}", job="j", user=f"#{uid}", uid=uid,
                            host="h", scope="s", reason="timeout", time=0.0)  # fmt: skip

    dropped = sum(queue.put(incident(1002, number)) for number in range(PENDING_PER_UID + 50))
    assert dropped == 50
    assert queue.put(incident(0, 1)) == 0
    assert queue.put(incident(1001, 1)) == 0
    # Each uid in turn: the flooder's backlog never delays root's or 1001's.
    taken = [queue.take(lambda uid: True) for _ in range(3)]
    assert sorted(item.uid for item in taken if item is not None) == [0, 1001, 1002]
    # A uid over its rate waits; the others go on.
    late = queue.take(lambda uid: uid != 1002)
    assert late is None
    queue.put(incident(0, 2))
    item = queue.take(lambda uid: uid != 1002)
    assert item is not None
    assert item.id == "h-0-2"
    # The whole queue stays bounded, the largest uid's oldest going first.
    for uid in range(2000, 2000 + MAX_PENDING):
        queue.put(incident(uid, 1))
    assert len(queue) <= MAX_PENDING
    # The flooder had the most: its changes went, the others' one each stayed.
    assert queue.take(lambda uid: uid == 2000) is not None
    assert queue.take(lambda uid: uid == 1002) is None


def test_the_jobs_registered_are_roots_first_then_each_uids_share_in_turn() -> None:
    config = Config(daemon=DaemonConfig(max_timers_per_uid=100_000))
    fake = FakeHost(dict.fromkeys(range(1000, 1500), (1003, 1003)) | {999: (0, 0)})
    service = Service(config, fake, daemon_pid=50, now=0.0, wall=lambda: 0.0, clock=lambda: 0.0,
                      render_metrics=exposition, host="a")  # fmt: skip
    flooder = service.arming.open_connection(Peer(pid=1000, uid=1003, gid=1003, pidfd=-1))
    for number in range(300):
        service.handle(Acquire(id=number + 1, scope=f"s{number}", timeout=60.0,
                               job=f"flood-{number:03}"), flooder, 0.0)  # fmt: skip
    other = service.arming.open_connection(Peer(pid=1001, uid=1004, gid=1004, pidfd=-1))
    fake.processes[1001] = (1004, 1004)
    service.handle(Acquire(id=1, scope="mine", timeout=60.0, job="mine"), other, 0.0)
    root = service.arming.open_connection(ROOT)
    service.handle(Acquire(id=1, scope="r", timeout=60.0, pid=999, job="roots"), root, 0.0)
    held = service.fleet.held_jobs(150, 100)
    assert held[0] == (0, "roots")
    assert (1004, "mine") in held
    assert sum(1 for uid, _ in held if uid == 1003) == 100
    assert len(held) == 102
    assert len(service.fleet.held_jobs(10, 100)) == 10
    before = service.fleet.jobs_changed()
    service.handle(Acquire(id=9, scope="no-job", timeout=30.0), flooder, 0.0)
    assert service.fleet.jobs_changed() == before  # no job came or went: nothing to register
    service.handle(Acquire(id=10, scope="new", timeout=30.0, job="new"), flooder, 0.0)
    assert service.fleet.jobs_changed() != before


def test_a_job_whose_processes_are_gone_is_held_while_its_incident_is_open() -> None:
    """Its ranks expired and were killed: no timer, firing or responder of the job
    is left, but its incident is open to more expiries, so the job stays
    registered and another host's incident of it is taken in (the one that may be
    the first of the job's expiry)."""
    wall = [100.0]
    service = Service(Config(), FakeHost({}), daemon_pid=50, now=0.0, wall=lambda: wall[0],
                      clock=lambda: 0.0, render_metrics=exposition, host="a")  # fmt: skip
    before = service.fleet.jobs_changed()
    rank = RankInfo(host="a", pid=4242, uid=1001, role="expired", scope="step", rank=0)
    service.incidents.expired((1001, "train"), "alice", rank, "timeout", wall[0])
    assert service.fleet.jobs_changed() != before
    assert service.fleet.held_jobs(10, 10) == [(1001, "train")]
    remote = IncidentInfo(id="b-1", job="train", user="alice", uid=1001, host="b",
                          scope="step", reason="timeout", time=wall[0] - 0.01, rank=1)  # fmt: skip
    service.fleet.fleet_incident(remote, 1001, 0.0)
    assert service.fleet.knows("b-1")
    wall[0] += 31  # the window closed: the job is no longer held
    assert service.fleet.held_jobs(10, 10) == []
