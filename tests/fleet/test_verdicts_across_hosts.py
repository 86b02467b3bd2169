"""One job, one incident, one verdict across hosts, against a real etcd: two daemons
on this machine stand in for two hosts. A plain-Python job of three ranks, ranks 0
and 2 on host-a, rank 1 on host-b; ranks 0 and 1 wait under timers that expire
together, so each host opens an incident of its own a moment apart; rank 2 is stuck
elsewhere, outside any block. Both hosts keep the same one incident, with every
rank once, and the same verdict naming rank 2. And a culprit hung inside its block
on one host while the other host's ranks wait outside any block, holding no timer:
the other host gathers their evidence all the same."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import Popen

import pytest

from watchdogd_protocol import IncidentInfo

from helpers.daemon import RunningDaemon
from helpers.etcd import EtcdServer, incident_heads, registered
from helpers.fleet import daemons_of
from helpers.jobs import JOB_RANK, incidents, start_job_rank, whole
from helpers.processes import python_worker, reap, wait_ready
from helpers.waiting import wait_until

HOSTS = ("host-a", "host-b")

CONFIG = """
[daemon]
incident_window = 30

# A second before the dump: long enough to see what an incident shows of a rank
# between its expiry and its dump.
[policies.rank]
steps = [ {{ wait = 1 }}, {{ dump = true }}, {{ signal = "SIGKILL" }} ]

[fleet]
etcd = ["{etcd}"]
host = "{host}"
prefix = "/watchdogd-test"
lease = 2
"""


def two_hosts(
    etcd: EtcdServer, root: Path, lease: int = 2
) -> contextlib.AbstractContextManager[list[RunningDaemon]]:
    return daemons_of(etcd, root, CONFIG.replace("lease = 2", f"lease = {lease}"), HOSTS)


#: A rank to start: its host's daemon, its number, its ``after``, how it hangs
#: (`helpers.jobs.JOB_RANK`) and the wall-clock deadline it waits under, if any.
Rank = tuple[RunningDaemon, int, float, str, float | None]


@contextlib.contextmanager
def job_ranks(etcd: EtcdServer, job: str, wanted: list[Rank]) -> Iterator[list[Popen[str]]]:
    """The ``wanted`` ranks of ``job``, started together, once each is ready and
    both hosts' jobs are in etcd; reaped at the end."""
    ranks = [
        python_worker(
            JOB_RANK,
            *(job, str(rank), str(after), how),
            *(() if until is None else (str(until),)),
            socket=daemon.socket_path,
        )
        for daemon, rank, after, how, until in wanted
    ]
    try:
        for rank in ranks:
            wait_ready(rank)
        wait_until(
            lambda: all(["root", job] in registered(etcd, host) for host in HOSTS),
            what="both hosts' jobs in etcd",
        )
        yield ranks
    finally:
        for rank in ranks:
            reap(rank)


def verdict_on(daemon: RunningDaemon, ranks: int = 3) -> IncidentInfo | None:
    """The one incident ``daemon`` keeps, once it has all its ``ranks`` and a
    settled verdict; None before."""
    listed = incidents(daemon.socket_path)
    if len(listed) != 1:
        return None
    incident = whole(daemon.socket_path, listed[0].id)
    settled = incident.verdict is not None and incident.verdict.settled
    return incident if len(incident.ranks) == ranks and settled else None


def settled_on_both(
    a: RunningDaemon,
    b: RunningDaemon,
    ranks: int,
    wanted: Callable[[IncidentInfo], bool],
    what: str,
) -> dict[str, IncidentInfo]:
    """Each host's one incident once it has all its ``ranks``, a settled verdict
    and what ``wanted`` asks of it (``wanted`` sees every settled one on the way),
    by host."""
    seen: dict[str, IncidentInfo] = {}

    def both() -> bool:
        for daemon, host in ((a, "host-a"), (b, "host-b")):
            incident = verdict_on(daemon, ranks)
            if incident is not None and wanted(incident):
                seen[host] = incident
        return len(seen) == 2

    wait_until(both, what=what, timeout=30)
    return seen


@pytest.mark.parametrize("later", [0.0, 1.0], ids=["together", "rank-1-later"])
def test_two_hosts_converge_on_one_incident_and_one_verdict(
    own_etcd: EtcdServer, tmp_path: Path, later: float
) -> None:
    """Ranks 0 and 1 share one deadline, or rank 1's comes ``later``: then it is
    dumped as a peer of host-a's incident first and its own expiry lists it as
    expired after (as on a loaded machine, where each daemon holds the deadline
    from when it took the arm). The verdict names rank 2 all along."""
    with two_hosts(own_etcd, tmp_path) as (a, b):
        job = "run-3"
        until = time.time() + 6
        wanted: list[Rank] = [(a, 2, 60, "elsewhere", None), (a, 0, 0, "waits", until)]
        with job_ranks(own_etcd, job, [*wanted, (b, 1, 0, "waits", until + later)]) as ranks:
            kinds: set[str] = set()
            expected = {0: "expired", 1: "expired", 2: "peer"}

            def final(incident: IncidentInfo) -> bool:
                assert incident.verdict is not None
                kinds.add(incident.verdict.kind)
                return {rank.rank: rank.role for rank in incident.ranks} == expected

            what = "one incident of ranks 0 and 1 expired, settled, on each host"
            seen = settled_on_both(a, b, 3, final, what)
            assert kinds == {"odd_frame"}
            on_a, on_b = seen["host-a"], seen["host-b"]
            assert on_a.id == on_b.id
            for incident in (on_a, on_b):
                pids = [(rank.host, rank.pid) for rank in incident.ranks]
                assert len(pids) == len(set(pids)) == 3, pids
                verdict = incident.verdict
                assert verdict is not None
                assert verdict.kind == "odd_frame", verdict
                assert [(c.host, c.rank, c.pid) for c in verdict.culprits] == [
                    ("host-a", 2, ranks[0].pid)
                ]
            assert on_a.verdict is not None
            assert on_b.verdict is not None
            assert on_a.verdict.text == on_b.verdict.text
            assert "read_shard" in on_a.verdict.text
            # The id the other host opened answers on both, as the one incident.
            for daemon in (a, b):
                other = whole(daemon.socket_path, on_a.id)
                assert other.id == on_a.id


def test_ranks_that_only_respond_give_their_evidence_to_another_hosts_incident(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """Ranks 0 and 1 on host-a wait in the collective outside any block (they hold
    no timer: only their responders say they are ranks of the job); rank 2 hangs in
    its block on host-b, beside rank 3, which waits as 0 and 1 do. host-a acts on
    host-b's incident with no timer of the job to run a policy on: it asks its
    ranks' responders, and the verdict on both hosts names rank 2."""
    with two_hosts(own_etcd, tmp_path) as (a, b):
        job = "run-outside"
        ranks = [
            start_job_rank(a.socket_path, job, 0, 0, "outside"),
            start_job_rank(a.socket_path, job, 1, 0, "outside"),
            start_job_rank(b.socket_path, job, 3, 0, "outside"),
        ]
        try:
            wait_until(
                lambda: all(["root", job] in registered(own_etcd, host) for host in HOSTS),
                what="both hosts' jobs in etcd",
            )
            ranks.append(start_job_rank(b.socket_path, job, 2, 2.0, "hangs"))

            def odd_frame(incident: IncidentInfo) -> bool:
                return incident.verdict is not None and incident.verdict.kind == "odd_frame"

            seen = settled_on_both(a, b, 4, odd_frame, "the culprit named on both hosts")
            for incident in seen.values():
                assert all(rank.state == "done" for rank in incident.ranks), incident.ranks
                given = {rank.rank: rank.evidence for rank in incident.ranks}
                assert given == {0: "worker", 1: "worker", 2: "worker", 3: "worker"}
                verdict = incident.verdict
                assert verdict is not None
                assert [(c.host, c.rank) for c in verdict.culprits] == [("host-b", 2)]
                assert "read_shard" in verdict.text
        finally:
            for rank in ranks:
                reap(rank)


def test_a_rank_due_while_its_daemon_was_stopped_is_expired_there_not_a_peer(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    """host-b's daemon is stopped across the deadline its rank shares with host-a's
    and goes on once host-a's incident is in etcd: the other host's incident and
    its own rank's expiry wait for it together. The rank fires as itself, is listed
    as expired on both hosts, and no peer policy runs on it: the daemon fires what
    is due before it takes another host's incident in (beside a CPU hog, the news
    was taken first once in seven runs without that). The lease outlasts the stop:
    host-b is late, not lost."""
    with two_hosts(own_etcd, tmp_path, lease=10) as (a, b):
        until = time.time() + 6
        wanted: list[Rank] = [(a, 0, 0, "waits", until), (b, 1, 0, "waits", until)]
        assert b.process is not None
        with job_ranks(own_etcd, "run-stopped", wanted):
            time.sleep(max(0.0, until - 0.5 - time.time()))
            b.process.send_signal(signal.SIGSTOP)
            try:
                wait_until(lambda: incident_heads(own_etcd) == 1, what="host-a's incident in etcd")
                # Past rank 1's deadline as host-b holds it, however late it took
                # the arm: its expiry is due when host-b goes on.
                time.sleep(max(0.0, until + 0.5 - time.time()))
            finally:
                b.process.send_signal(signal.SIGCONT)
            what = "one incident with a settled verdict on each host"
            seen = settled_on_both(a, b, 2, lambda incident: True, what)
            for incident in seen.values():
                roles = {rank.rank: rank.role for rank in incident.ranks}
                assert roles == {0: "expired", 1: "expired"}, incident.ranks
            with b.client() as client:
                peers = [e.pid for e in client.events(limit=1000).events if e.kind == "peer"]
            assert peers == []
