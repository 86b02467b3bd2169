"""Incidents on one host, through a real daemon: a hung rank's expiry gathers the
stacks of every rank of its job, and a job belongs to the user who armed it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd_client import Client

from helpers.daemon import RunningDaemon, configured_daemon, ctl
from helpers.jobs import gathered, incidents, start_rank, whole
from helpers.processes import reap, sleeper
from helpers.users import NOBODY, as_nobody
from helpers.waiting import PATIENCE, wait_until

CONFIG = """
[policies.rank]
steps = [ { dump = true, timeout = 20 }, { signal = "SIGKILL" } ]
"""


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as running:
        yield running


def test_a_hung_rank_gathers_the_stack_of_every_rank(daemon: RunningDaemon) -> None:
    socket = daemon.socket_path
    ranks = [start_rank(socket, "train-1", rank, 60) for rank in (0, 2)]
    try:
        hung = start_rank(socket, "train-1", 1, 0.5)
        ranks.append(hung)
        wait_until(lambda: hung.poll() is not None, what="the hung rank's end")
        assert hung.returncode == -signal.SIGKILL

        wait_until(lambda: gathered(socket), what="every rank's stack", timeout=PATIENCE * 3)
        [listed] = incidents(socket)
        incident = whole(socket, listed.id)
        assert (incident.job, incident.rank, incident.scope, incident.reason) == (
            "train-1",
            1,
            "step",
            "timeout",
        )
        assert incident.user == "root"
        assert [(r.rank, r.role, r.state) for r in incident.ranks] == [
            (1, "expired", "done"),
            (0, "peer", "done"),
            (2, "peer", "done"),
        ]
        for rank in incident.ranks:
            assert rank.frame.startswith(f"waiting_in_rank_{rank.rank} ("), rank.stack
        # The peers were only looked at: they still run, their timers armed, and
        # why says which incident they are part of.
        assert all(worker.poll() is None for worker in ranks[:2])
        why = ctl(socket, "why", str(ranks[0].pid))
        assert f"incident {listed.id}: job train-1, expired on " in why.stdout
        text = ctl(socket, "incident", listed.id)
        assert "waiting in waiting_in_rank_1 (" in text.stdout
        assert text.stdout.index("rank 1 pid") < text.stdout.index("rank 0 pid")
        table = ctl(socket, "incidents")
        assert listed.id in table.stdout
        assert "train-1" in table.stdout
        events = ctl(socket, "events", "--json")
        peers = [json.loads(line) for line in events.stdout.splitlines()]
        assert sum(event["kind"] == "peer" for event in peers) == 2
    finally:
        for worker in ranks:
            reap(worker)


def test_a_job_is_its_owners_alone(daemon: RunningDaemon) -> None:
    """uid 65534 names root's job: its expiry opens an incident of its own, which
    root's rank is no part of (it is not even looked at), and root's incident of
    the job is not one it may see."""
    socket = daemon.socket_path
    root_rank = start_rank(socket, "shared-name", 0, 60)
    theirs = os.fork()
    if theirs == 0:  # pragma: no cover - the rank of uid 65534, until killed
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        with Client(socket) as client:
            client.acquire("step", 0.3, policy="rank", job="shared-name", rank=1)
        time.sleep(300)
        os._exit(0)
    try:
        _, status = os.waitpid(theirs, 0)
        assert os.WIFSIGNALED(status)
        assert os.WTERMSIG(status) == signal.SIGKILL

        def settled() -> bool:
            listed = incidents(socket)
            return len(listed) == 1 and whole(socket, listed[0].id).ranks[0].state == "done"

        wait_until(settled, what="uid 65534's incident", timeout=PATIENCE * 3)
        [own] = incidents(socket)
        assert (own.uid, own.user, own.count) == (NOBODY, "nobody", 1)
        assert as_nobody(lambda client: [i.id for i in client.incidents()], socket) == {
            "ok": [own.id]
        }
        with daemon.client() as client:
            assert not [e for e in client.events(limit=100).events if e.pid == root_rank.pid]
            client.acquire("step", 0.1, pid=root_rank.pid, policy="log", job="shared-name")
            wait_until(lambda: len(incidents(socket)) == 2, what="root's incident")
        roots = next(i.id for i in incidents(socket) if i.uid == 0)
        refused = as_nobody(lambda client: client.incident(roots), socket)
        assert refused["refused"] == "no_such_incident"
    finally:
        reap(root_rank)


#: Incidents kept small, so that a flood passes the shares many times over.
SHARED = """
[daemon]
incidents = 20
incidents_per_uid = 5
"""
#: A uid with no passwd entry, as a container's often is.
NAMELESS = 4242


def opened_as(uid: int, socket: Path, prefix: str, count: int, within: float) -> int:
    """In a child running as ``uid`` (fork, then setresuid), open up to ``count``
    incidents, one job each (a ``log`` timer of 1 ms), for at most ``within``
    seconds; wait until each has expired, and return how many were armed."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        armed = -1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            end = time.monotonic() + within
            with Client(socket) as client:
                armed = 0
                while armed < count and time.monotonic() < end:
                    name = f"{prefix}-{armed}"
                    client.acquire(name, 0.001, policy="log", job=name)
                    armed += 1
                # Its timers fire only while it lives: it leaves once none is armed.
                while client.status().timers and time.monotonic() < end + PATIENCE:
                    time.sleep(0.01)
        finally:
            os.write(write_end, str(armed).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        armed = int(pipe.read())
    os.waitpid(child, 0)
    assert armed > 0, f"uid {uid} could not arm its timers"
    return armed


def incidents_opened(client: Client) -> int:
    """The daemon's count of the incidents it opened, from its metrics."""
    for line in client.metrics().splitlines():
        if line.startswith("watchdogd_incidents_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no watchdogd_incidents_total in the metrics")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as other uids")
def test_a_flood_of_incidents_leaves_roots_readable(socket_path: Path, tmp_path: Path) -> None:
    """uid 65534 opens incident after incident: root's and another user's earlier
    incidents stay readable, and the flooder keeps no more than its share."""
    with configured_daemon(socket_path, tmp_path, SHARED, for_everyone=True) as daemon:
        socket = daemon.socket_path
        victim = sleeper()
        try:
            with daemon.client() as client:
                client.acquire("root", 0.01, pid=victim.pid, policy="log", job="root-job")
                wait_until(lambda: incidents_opened(client) == 1, what="root's incident")
                [root_incident] = incidents(socket)
                opened_as(NAMELESS, socket, "theirs", 2, PATIENCE)
                wait_until(lambda: incidents_opened(client) == 3, what="uid 4242's incidents")
                theirs = [i.id for i in incidents(socket) if i.uid == NAMELESS]
                assert len(theirs) == 2

                flood = opened_as(NOBODY, socket, "flood", 2000, 10.0)
                assert flood > 20, "too few to pass the shares: the machine is too slow"
                wait_until(
                    lambda: incidents_opened(client) == 3 + flood,
                    what="every incident of the flood",
                    timeout=PATIENCE * 3,
                )
        finally:
            reap(victim)
        shown = ctl(socket, "incident", root_incident.id)
        assert shown.returncode == 0, shown.stderr
        assert root_incident.id in shown.stdout
        assert whole(socket, root_incident.id).job == "root-job"
        for incident in theirs:
            assert whole(socket, incident).uid == NAMELESS
        kept = incidents(socket)
        floods = [i for i in kept if i.uid == NOBODY]
        assert len(floods) == 5, [i.job for i in floods]
        # Its newest are the ones kept; its first is gone, for root as for itself.
        newest = [f"flood-{n}" for n in range(flood - 5, flood)]
        assert sorted(i.job for i in floods) == sorted(newest)
        seen = as_nobody(lambda client: [i.job for i in client.incidents()], socket)
        assert len(seen["ok"]) == 5
        assert "flood-0" not in seen["ok"]
