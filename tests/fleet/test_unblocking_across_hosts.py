"""Unblocking, end to end: two daemons stand in for two hosts of one real etcd, and
a job of real gloo ranks (torch, the Flight Recorder on, a collective timeout of
minutes: tests/helpers/gloo_job.py) spans them. Only a host really gone (frozen,
its daemon and ranks stopped) has the ranks waiting behind it cut out of their
collective, within the lease, ``unblock_after`` and a few seconds; a stopped daemon,
a stopped etcd and a host record forged through etcd's own API and left to lapse
unblock nobody, and the job runs on. A culprit its policy keeps alive (a dump, then
``unblock = "peers"``) has its peers on the other host, waiting outside any block,
raise within seconds of the verdict, which names it ``missing`` on both hosts."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from watchdogd.fleet.etcd import EtcdClient
from watchdogd_protocol import EventInfo, IncidentInfo

from helpers.daemon import RunningDaemon
from helpers.etcd import EtcdServer, registered
from helpers.fleet import daemons_of
from helpers.gloo_job import COLLECTIVE_TIMEOUT, Rank, gloo_job
from helpers.jobs import incidents, whole
from helpers.metrics import samples
from helpers.waiting import PATIENCE, wait_until

pytest.importorskip("torch")


HOSTS = ("host-a", "host-b")
PREFIX = "/watchdogd-test"
LEASE = 2
UNBLOCK_AFTER = 3.0
#: What a loaded test machine adds to a host's loss and a rank's unblocking: seconds
#: of a lease's expiry in etcd, a watch's delivery, an ask and its answer.
SLACK = 6.0

#: Each host's config, for `daemons_of` to name its etcd and host in.
CONFIG = (
    "[daemon]\nincident_window = 30\n\n"
    "[policies.kept]\n"
    'steps = [ {{ dump = true, timeout = 20 }}, {{ unblock = "peers" }} ]\n\n'
    '[fleet]\netcd = ["{etcd}"]\nhost = "{host}"\n'
    f'prefix = "{PREFIX}"\nlease = {LEASE}\nunblock_after = {UNBLOCK_AFTER}\n'
)


@contextlib.contextmanager
def two_hosts(etcd: EtcdServer, root: Path, job: str) -> Iterator[tuple[RunningDaemon, ...]]:
    with daemons_of(etcd, root, CONFIG, HOSTS) as daemons:
        try:
            yield tuple(daemons)
        finally:
            for daemon in daemons:  # a test that stopped one lets it go on, to stop it
                assert daemon.process is not None
                daemon.process.send_signal(signal.SIGCONT)


def jobs_registered(etcd: EtcdServer, job: str) -> None:
    wait_until(
        lambda: all(["root", job] in registered(etcd, host) for host in HOSTS),
        what="both hosts' jobs in etcd",
        timeout=PATIENCE * 2,
    )


def events(daemon: RunningDaemon, kind: str) -> list[EventInfo]:
    with daemon.client() as client:
        return [event for event in client.events(limit=1000).events if event.kind == kind]


def asked(daemon: RunningDaemon, cause: str) -> dict[str, float]:
    """What every ask of ``cause`` came to so far, by outcome."""
    with daemon.client() as client:
        text = client.metrics()
    return {
        labels["outcome"]: value
        for labels, value in samples(text, "watchdogd_unblocks_total")
        if labels.get("cause") == cause
    }


def lost_from(daemon: RunningDaemon, host: str) -> list[IncidentInfo]:
    return [i for i in incidents(daemon.socket_path) if i.kind == "host_lost" and host in i.reason]


def runs_on(ranks: dict[int, Rank], what: str) -> None:
    """Every rank completes collectives still, none raised: the job runs on."""
    before = {number: rank.steps() for number, rank in ranks.items()}
    wait_until(
        lambda: all(rank.steps() >= before[number] + 20 for number, rank in ranks.items()),
        what=f"the job to run on after {what}",
        timeout=PATIENCE * 2,
    )
    assert [rank.raised() for rank in ranks.values()] == [None] * len(ranks), what


def lost_and_asked(daemon: RunningDaemon, host: str, before: tuple[int, float]) -> None:
    """``daemon`` saw ``host`` lost once more than ``before`` said (how many
    incidents, how many asks), and asked its two ranks, each answering."""
    incidents_before, asks_before = before
    wait_until(
        lambda: len(lost_from(daemon, host)) > incidents_before,
        what=f"{host} lost",
        timeout=LEASE + SLACK,
    )
    wait_until(
        lambda: sum(asked(daemon, "host_lost").values()) >= asks_before + 2,
        what="its ranks asked, and answering",
    )


def so_far(daemon: RunningDaemon, host: str) -> tuple[int, float]:
    """How many times ``daemon`` saw ``host`` lost, and asked its ranks, so far."""
    return len(lost_from(daemon, host)), sum(asked(daemon, "host_lost").values())


def forge_a_host_that_lapses(etcd: EtcdServer, job: str) -> None:
    """Through etcd's own API, a host ``host-x`` of root's ``job``, under a lease of
    its own that nobody keeps alive."""

    async def put(client: EtcdClient) -> None:
        lease = await client.grant(LEASE)
        record = {"host": "host-x", "state": "up", "jobs": [["root", job]]}
        await client.put(f"{PREFIX}/hosts/host-x", json.dumps(record).encode(), lease=lease)

    async def run() -> None:
        async with EtcdClient([etcd.url], timeout=30) as client:
            await put(client)

    trio.run(run)


def forge_an_incident_asking_for_peers(etcd: EtcdServer, job: str) -> str:
    """Through etcd's own API, an incident of root's ``job`` from a host ``host-x``
    whose one rank, its culprit, asks for its peers to be unblocked, with a Flight
    Recorder that says the job waits in all_reduce #1000000 of the default group."""
    incident = f"host-x-{time.monotonic_ns()}"
    head = {
        "id": incident, "job": job, "user": "root", "uid": 0, "host": "host-x",
        "scope": "step", "reason": "timeout", "time": time.time(),
    }  # fmt: skip
    waiting = {"group": "0", "seq": 1_000_000, "op": "gloo:all_reduce", "state": "scheduled"}
    rank = {
        "host": "host-x", "pid": 4242, "uid": 0, "role": "expired", "scope": "step",
        "state": "done", "rank": 2, "evidence": "worker", "unblock": "peers",
        "flight": [{"group": "0", "desc": "default_pg", "size": 3, "entered": waiting,
                    "completed": 999_999}],
    }  # fmt: skip

    async def put(client: EtcdClient) -> None:
        lease = await client.grant(60)
        await client.put(f"{PREFIX}/incidents/{incident}", json.dumps(head).encode(), lease=lease)
        key = f"{PREFIX}/ranks/root/{job}/{incident}/host-x"
        await client.put(key, json.dumps([rank]).encode(), lease=lease)

    async def run() -> None:
        async with EtcdClient([etcd.url], timeout=30) as client:
            await put(client)

    trio.run(run)
    return incident


def forged_records_unblock_nobody(
    etcd: EtcdServer, a: RunningDaemon, ranks: dict[int, Rank], job: str
) -> None:
    """A host forged through etcd's API that lapses, and an incident forged there
    that asks for its culprit's peers to be unblocked: the job runs on."""
    forge_a_host_that_lapses(etcd, job)
    lost_and_asked(a, "host-x", (0, 0))
    runs_on(ranks, "a forged host lapsed")
    forged = forge_an_incident_asking_for_peers(etcd, job)
    wait_until(
        lambda: (
            any(r.unblock for r in whole(a.socket_path, forged).ranks)
            if forged in {i.id for i in incidents(a.socket_path)}
            else False
        ),
        what="the forged incident taken, its rank asking for its peers",
    )
    runs_on(ranks, "a forged incident asked for its culprit's peers to be unblocked")
    # Its verdict rests on host-a's own ranks' evidence too: they wait in no
    # collective of its, so none is even asked.
    assert asked(a, "peers").get("unblocked", 0) == 0


def stops_unblock_nobody(
    etcd: EtcdServer, a: RunningDaemon, b: RunningDaemon, ranks: dict[int, Rank]
) -> None:
    """etcd stopped past the lease, then host-b's daemon (its rank running): the
    job runs on."""
    etcd.pause()
    time.sleep(LEASE + 1)
    etcd.resume()
    for daemon in (a, b):
        wait_until(lambda d=daemon: fleet(d) == "connected", what="the fleet back")
    runs_on(ranks, "etcd stopped past the lease")
    time.sleep(1)  # what etcd's return set off is over
    before = so_far(a, "host-b")
    assert b.process is not None
    b.process.send_signal(signal.SIGSTOP)
    lost_and_asked(a, "host-b", before)
    b.process.send_signal(signal.SIGCONT)
    runs_on(ranks, "host-b's daemon stopped past the lease")


def test_only_a_host_really_gone_unblocks_the_ranks_waiting_behind_it(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """Ranks 0 and 1 on host-a, rank 2 on host-b, all-reducing step after step. A
    forged host lapses, a forged incident asks for its culprit's peers to be
    unblocked, etcd stops past the lease, host-b's daemon stops past the lease (its
    rank running): host-a asks its ranks where their evidence says to, they still
    complete their collectives, and none is cut. Then host-b is frozen whole:
    host-a's ranks raise out of their all_reduce within the lease and
    ``unblock_after``."""
    job = f"run-frozen-{time.monotonic_ns()}"
    with two_hosts(own_etcd, tmp_path, job) as (a, b):
        placement = {0: (a, "steps"), 1: (a, "steps"), 2: (b, "steps")}
        with gloo_job(job, tmp_path, placement) as ranks:
            jobs_registered(own_etcd, job)
            forged_records_unblock_nobody(own_etcd, a, ranks, job)
            stops_unblock_nobody(own_etcd, a, b, ranks)
            for daemon in (a, b):
                assert events(daemon, "unblocked") == []
            assert asked(a, "host_lost").get("unblocked", 0) == 0

            jobs_registered(own_etcd, job)
            wait_until(lambda: fleet(b) == "connected", what="host-b back in the fleet")
            lost = len(lost_from(a, "host-b"))
            frozen = time.time()
            assert b.process is not None
            b.process.send_signal(signal.SIGSTOP)
            ranks[2].stop()
            wait_until(
                lambda: ranks[0].raised() and ranks[1].raised(),
                what="host-a's ranks to raise",
                timeout=LEASE + UNBLOCK_AFTER + SLACK + PATIENCE,
            )
            raised = {n: ranks[n].raised() for n in (0, 1)}
            took = max(when - frozen for when, _ in filter(None, raised.values()))
            print(f"host-a's ranks raised {took:.2f} s after host-b froze "
                  f"(lease {LEASE} s, unblock_after {UNBLOCK_AFTER:g} s, "
                  f"collective timeout {COLLECTIVE_TIMEOUT} s)")  # fmt: skip
            assert took < LEASE + UNBLOCK_AFTER + SLACK, raised
            for _, what in filter(None, raised.values()):
                assert "Connection closed by peer" in what or "Connection reset" in what, what
            # Each rank is cut out by its own responder, or raises a moment before
            # its ask as the connections of the rank cut out first close (its
            # responder then finds it waiting in nothing): at least one is cut.
            cut: list[EventInfo] = []

            def both_cut() -> bool:
                cut[:] = events(a, "unblocked")
                return len(cut) == 2

            with contextlib.suppress(AssertionError):
                wait_until(both_cut, what="both ranks' answers recorded", timeout=3)
            assert cut, "no rank of host-a was cut out"
            assert {e.rank for e in cut} <= {0, 1}, cut
            assert all(e.outcome == "host_lost" for e in cut), cut
            assert all("host host-b left the fleet" in e.note for e in cut), cut
            [incident] = lost_from(a, "host-b")[lost:]
            shown = whole(a.socket_path, incident.id)
            assert sorted(r.rank or 0 for r in shown.ranks if r.unblocked) == sorted(
                e.rank or 0 for e in cut
            )


def fleet(daemon: RunningDaemon) -> str:
    with daemon.client() as client:
        return client.status_page(limit=1).daemon.fleet


def test_a_culprit_kept_alive_has_its_peers_on_another_host_raise_within_seconds(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """Ranks 0 and 1 on host-a and rank 3 on host-b wait in an all_reduce outside
    any block; rank 2, on host-b, hangs in read_shard inside its block, under a policy
    that dumps it, then unblocks its peers, and leaves it alive. The verdict on
    both hosts is ``missing`` naming rank 2; its peers raise within seconds of it;
    rank 2 lives."""
    job = f"run-kept-{time.monotonic_ns()}"
    with two_hosts(own_etcd, tmp_path, job) as (a, b):
        placement = {0: (a, "waits"), 1: (a, "waits"), 2: (b, "hangs"), 3: (b, "waits")}
        with gloo_job(job, tmp_path, placement, hang_after=UNBLOCK_AFTER) as ranks:
            wait_until(
                lambda: all(ranks[n].raised() for n in (0, 1, 3)),
                what="rank 2's peers to raise",
                timeout=UNBLOCK_AFTER + SLACK + PATIENCE * 2,
            )
            assert ranks[2].process.poll() is None  # the culprit lives
            assert ranks[2].raised() is None
            for daemon in (a, b):
                [incident] = incidents(daemon.socket_path)
                shown = whole(daemon.socket_path, incident.id)
                # Every host gathered its ranks, those outside any block too.
                assert {r.rank: r.evidence for r in shown.ranks} == dict.fromkeys(
                    range(4), "worker"
                ), shown.ranks
                verdict = shown.verdict
                assert verdict is not None
                assert (verdict.kind, verdict.basis) == ("missing", "flight_recorder"), verdict
                assert [(c.host, c.rank) for c in verdict.culprits] == [("host-b", 2)], verdict
                assert verdict.collective is not None
                assert verdict.collective.op == "gloo:all_reduce"
            # Each peer is cut out by its responder, unless another's cut ended its
            # all_reduce first (a peer's connections closed): at least one is.
            cut = events(a, "unblocked") + events(b, "unblocked")
            assert cut, "no peer cut out"
            assert {e.rank for e in cut} <= {0, 1, 3}, cut
            assert all(e.outcome == "peers" for e in cut), cut
            assert all("the job waits for rank 2 on host host-b" in e.note for e in cut), cut
            [expired] = [e for e in events(b, "expired") if e.rank == 2]
            assert expired.outcome == "alive"
            assert expired.steps[-1].step == "unblock peers"
            assert expired.steps[-1].result.startswith(
                "asked for the ranks waiting in gloo:all_reduce"
            ), expired.steps
            # The verdict names rank 2 as soon as its own Flight Recorder shows it
            # behind; it settles once every host has reported (its policy done).
            settled_at = min(e.time for d in (a, b) for e in events(d, "verdict"))
            raised = [r[0] for n in (0, 1, 3) if (r := ranks[n].raised()) is not None]
            assert expired.deadline is not None
            print(
                f"rank 2's timer fell due; {max(raised) - expired.deadline:.2f} s later all its "
                f"peers had raised, {max(raised) - settled_at:+.2f} s from the first settled "
                "verdict "
                f"(unblock_after {UNBLOCK_AFTER:g} s, collective timeout {COLLECTIVE_TIMEOUT} s)"
            )
            assert abs(max(raised) - settled_at) < SLACK
