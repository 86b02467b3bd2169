"""The incident log: one incident per job and window, who may see what, bounds, and
the frame a rank was waiting in."""

from __future__ import annotations

import msgspec

from watchdogd.core.identity import Peer
from watchdogd.core.incidents import IncidentLog
from watchdogd.core.ranks import MAX_STACK_BYTES, first_frame
from watchdogd_protocol import (
    MAX_REPLY_BYTES,
    Acquire,
    EventInfo,
    GroupState,
    IncidentInfo,
    RankInfo,
    StepResult,
)

from helpers.fakes import make_world

DUMP = """\
Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4243 (idle): "loader"
    wait (threading.py:331)
Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2288)
    train_step (train.py:88)
    <module> (train.py:120)
"""


def rank(
    pid: int, number: int, *, role: str = "expired", host: str = "a", uid: int = 1000
) -> RankInfo:
    return RankInfo(host=host, pid=pid, uid=uid, role=role, scope="step", rank=number)


def finished(incident: str, pid: int, kind: str = "expired", stack: str = DUMP) -> EventInfo:
    return EventInfo(
        seq=0,
        kind=kind,
        time=0.0,
        pid=pid,
        uid=1000,
        scope="step",
        policy="rank",
        outcome="exited",
        steps=[StepResult(step="dump py-spy dump --pid {pid}", result="exit 0", output=stack)],
        incident=incident,
    )


def test_the_frame_a_rank_waited_in_is_the_main_threads_innermost() -> None:
    assert first_frame(DUMP) == "all_reduce (torch/distributed/distributed_c10d.py:2288)"
    assert first_frame('Thread 7 (active): "worker"\n    spin (x.py:3)\n') == "spin (x.py:3)"
    assert first_frame("py-spy: no such process") == ""


def test_expiries_of_a_job_within_the_window_are_one_incident() -> None:
    log = IncidentLog("a", window=30.0)
    first, new = log.expired((1000, "train"), "alice", rank(10, 3), "timeout", 100.0)
    assert new
    again, new = log.expired((1000, "train"), "alice", rank(11, 4), "timeout", 129.0)
    assert (again, new) == (first, False)
    # Another user's job of the same name is theirs; after the window, a new one.
    other, new = log.expired((2000, "train"), "bob", rank(20, 0), "timeout", 129.0)
    assert new
    assert other != first
    later, new = log.expired((1000, "train"), "alice", rank(10, 3), "stalled", 131.0)
    assert new
    assert later != first


def test_a_rank_gets_its_stack_and_each_user_sees_their_own() -> None:
    log = IncidentLog("a")
    incident, _ = log.expired((0, "train"), "root", rank(10, 1), "timeout", 1.0)
    log.add(incident, rank(11, 0, role="peer", uid=1000))
    log.add(incident, rank(12, 2, role="peer", uid=2000))
    log.finished(finished(incident, 11, kind="peer"))
    log.finished(finished(incident, 10))
    root_view = log.get(incident, 0, 0)
    assert root_view is not None
    assert [(r.rank, r.role, r.state, bool(r.stack)) for r in root_view.ranks] == [
        (1, "expired", "done", True),
        (0, "peer", "done", True),
        (2, "peer", "pending", False),
    ]
    assert root_view.ranks[0].frame.startswith("all_reduce")
    # Root's job: no other user may see it at all.
    assert log.get(incident, 1000, 1000) is None
    assert log.listing(1000, 10) == []
    assert [i.id for i in log.listing(0, 10)] == [incident]


def test_a_users_incident_shows_them_only_their_processes_stacks() -> None:
    log = IncidentLog("a")
    incident, _ = log.expired((1000, "train"), "alice", rank(10, 1), "timeout", 1.0)
    log.merge_ranks(
        incident, "b", [msgspec.structs.replace(rank(99, 7, host="b", uid=0), stack=DUMP)]
    )
    view = log.get(incident, 1000, 1000)
    assert view is not None
    assert [(r.host, r.pid, r.stack) for r in view.ranks] == [("a", 10, ""), ("b", 99, "")]
    assert log.get(incident, 0, 0) is not None


def test_a_host_is_settled_once_none_of_its_ranks_is_pending() -> None:
    log = IncidentLog("a")
    incident, _ = log.expired((0, "train"), "root", rank(10, 0), "timeout", 1.0)
    log.add(incident, rank(11, 1, role="peer"))
    assert log.settled_hosts(incident) == set()
    log.merge_ranks(incident, "b", [msgspec.structs.replace(rank(20, 2, host="b"), state="done")])
    log.finished(finished(incident, 10))
    assert log.settled_hosts(incident) == {"b"}
    log.finished(finished(incident, 11, kind="peer"))
    assert log.settled_hosts(incident) == {"a", "b"}
    assert log.settled_hosts("no-such-incident") == set()


def test_bounds_on_incidents_and_stacks() -> None:
    log = IncidentLog("a", keep=3)
    ids = [log.expired((1000, f"job{n}"), "alice", rank(n, 0), "timeout", 1.0)[0] for n in range(5)]
    assert [i.id for i in log.listing(0, 10)] == ids[2:]
    incident = ids[-1]
    log.finished(finished(incident, 4, stack="x" * (2 * MAX_STACK_BYTES)))
    view = log.get(incident, 0, 0)
    assert view is not None
    assert len(view.ranks[0].stack.encode()) <= MAX_STACK_BYTES
    for pid in range(100, 130):
        log.add(incident, rank(pid, pid, role="peer"))
        log.finished(finished(incident, pid, kind="peer", stack="y" * MAX_STACK_BYTES))
    view = log.get(incident, 0, 0)
    assert view is not None
    assert len(msgspec.msgpack.encode(view)) < MAX_REPLY_BYTES


def opened(log: IncidentLog, uid: int, job: str, wall: float = 1.0) -> str:
    """The id of a new incident of ``uid``'s ``job``."""
    incident, new = log.expired((uid, job), f"user{uid}", rank(1, 0, uid=uid), "timeout", wall)
    assert new
    return incident


def test_one_uids_flood_evicts_only_its_own_incidents() -> None:
    log = IncidentLog("a", keep=20, per_uid=20)
    roots = [opened(log, 0, f"root{n}") for n in range(3)]
    alices = [opened(log, 1001, f"alice{n}") for n in range(4)]
    flood = [opened(log, 1002, f"flood{n}") for n in range(2704)]
    for incident in roots:
        assert log.get(incident, 0, 0) is not None
    for incident in alices:
        assert log.get(incident, 1001, 1001) is not None
    # The flooder kept the rest of the shared 20, its newest.
    assert (log.kept(0), log.kept(1001), log.kept(1002)) == (3, 4, 16)
    assert [i.id for i in log.listing(1002, 100)] == flood[-16:]
    assert log.get(flood[0], 0, 0) is None
    # An evicted incident is open to its job's expiries no more: a later one opens anew.
    again, new = log.expired((1002, "flood0"), "user1002", rank(1, 0), "timeout", 2.0)
    assert new
    assert again != flood[0]


def test_roots_share_is_its_own() -> None:
    log = IncidentLog("a", keep=5)
    roots = [opened(log, 0, f"root{n}") for n in range(7)]
    for n in range(50):
        opened(log, 65534, f"nobody{n}")
    # Root's own newest five: root's incidents give way to root's alone.
    assert [i.id for i in log.listing(0, 100) if i.uid == 0] == roots[2:]
    assert (log.kept(0), log.kept(65534), len(log)) == (5, 5, 10)


def test_a_uid_keeps_at_most_its_share() -> None:
    log = IncidentLog("a", keep=100, per_uid=10)
    ids = [opened(log, 1001, f"job{n}") for n in range(25)]
    assert log.kept(1001) == 10
    assert [i.id for i in log.listing(1001, 100)] == ids[-10:]


def test_many_uids_share_the_log_fairly() -> None:
    log = IncidentLog("a", keep=100, per_uid=100)
    # 40 uids with two incidents each, within their fair share, then a flooder.
    few = {uid: [opened(log, uid, f"j{n}") for n in range(2)] for uid in range(2000, 2040)}
    for n in range(1000):
        opened(log, 1002, f"flood{n}")
    assert all(
        log.get(incident, uid, uid) is not None for uid, ids in few.items() for incident in ids
    )
    assert log.kept(1002) == 20
    # A newcomer takes its room from whoever holds the most: the flooder.
    newcomer = opened(log, 3000, "late")
    assert log.get(newcomer, 3000, 3000) is not None
    assert (log.kept(1002), len(log)) == (19, 100)
    # More uids than room: each holds at most one, the newest uids' kept.
    crowd = IncidentLog("a", keep=10)
    for uid in range(1000, 1100):
        opened(crowd, uid, "j")
    assert [i.uid for i in crowd.listing(0, 100)] == list(range(1090, 1100))


def test_incidents_from_the_fleet_count_against_their_owner() -> None:
    log = IncidentLog("a", keep=4, per_uid=4)
    root = opened(log, 0, "root-job")
    mine = opened(log, 1001, "mine")
    for n in range(10):
        remote = IncidentInfo(
            id=f"b-{n}",
            job=f"j{n}",
            user="user1002",
            uid=1002,
            host="b",
            scope="step",
            reason="timeout",
            time=1.0,
        )
        log.merge(remote)
    assert log.get(root, 0, 0) is not None
    assert log.get(mine, 1001, 1001) is not None
    assert (log.kept(1001), log.kept(1002)) == (1, 3)
    assert [i.id for i in log.listing(1002, 100)] == ["b-7", "b-8", "b-9"]


def test_a_shrunk_log_keeps_the_newest_of_each_share() -> None:
    log = IncidentLog("a", keep=10, per_uid=10)
    roots = [opened(log, 0, f"r{n}") for n in range(6)]
    alices = [opened(log, 1001, f"a{n}") for n in range(6)]
    bobs = [opened(log, 1002, f"b{n}") for n in range(4)]
    log.resize(4, per_uid=3)
    assert [i.id for i in log.listing(0, 100) if i.uid == 0] == roots[-4:]
    assert [i.id for i in log.listing(1001, 100)] == alices[-2:]
    assert [i.id for i in log.listing(1002, 100)] == bobs[-2:]


def test_the_service_opens_an_incident_and_sends_the_peer_policy() -> None:
    world = make_world()
    service = world.service
    for pid, scope, timeout in ((200, "hung", 1.0), (201, "waiting", 60.0)):
        caller = service.arming.open_connection(Peer(pid=pid, uid=1000, gid=1000, pidfd=-1))
        request = Acquire(id=1, scope=scope, timeout=timeout, job="j", rank=pid - 200)
        service.handle(request, caller, 0.0)
    fired = service.firing.expire_due(1.0)
    runs = [(item.timer.pid, item.timer.policy, item.timer.run) for item in fired]
    assert [(pid, policy, run is not None and run.peer) for pid, policy, run in runs] == [
        (200, "kill", False),
        (201, "peer_dump", True),
    ]
    [listed] = service.incidents.listing(1000, 10)
    assert (listed.job, listed.user, listed.count) == ("j", "alice", 2)
    assert {run.incident for _, _, run in runs if run is not None} == {listed.id}
    assert service.incidents.listing(2000, 10) == []
    # The peer's own timer is still armed.
    assert service.table.get(201, "waiting") is not None
    for item in fired:
        item.process.close()


def test_an_expiry_joining_an_incident_sends_the_peer_policy_to_the_ranks_it_lacks() -> None:
    """torchrun restarted the job within the window: the restarted ranks' expiry
    joins the incident, and the rank waiting for it is dumped as the first
    attempt's was; a process the incident lists already is not sent it again."""
    world = make_world()
    service = world.service

    def arm(pid: int, timeout: float, now: float) -> None:
        world.host.processes.setdefault(pid, (1000, 1000))
        caller = service.arming.open_connection(Peer(pid=pid, uid=1000, gid=1000, pidfd=-1))
        service.handle(Acquire(id=1, scope="step", timeout=timeout, job="j"), caller, now)

    arm(200, 1.0, 0.0)
    arm(201, 60.0, 0.0)
    first = service.firing.expire_due(1.0)
    arm(210, 1.0, 5.0)
    arm(211, 60.0, 5.0)
    second = service.firing.expire_due(6.0)
    assert [(item.timer.pid, item.timer.policy) for item in second] == [
        (210, "kill"),
        (211, "peer_dump"),
    ]
    [listed] = service.incidents.listing(1000, 10)
    assert {run.incident for item in second if (run := item.timer.run) is not None} == {listed.id}
    whole = service.incidents.get(listed.id, 1000, 1000)
    assert whole is not None
    assert [(rank.pid, rank.role) for rank in whole.ranks] == [
        (200, "expired"),
        (210, "expired"),
        (201, "peer"),
        (211, "peer"),
    ]
    for item in first + second:
        item.process.close()


def test_a_hung_rank_that_joins_elsewhere_sends_the_peer_policy_to_new_local_ranks() -> None:
    """Another host's incident of alice's job, kept here: a rank of the job that
    started here since (a restart) gets the peer policy when a new hung rank
    joins the incident there, and a rank listed already does not get it again."""
    world = make_world()
    service = world.service
    caller = service.arming.open_connection(Peer(pid=200, uid=1000, gid=1000, pidfd=-1))
    service.handle(Acquire(id=1, scope="step", timeout=60.0, job="j", rank=0), caller, 0.0)
    head = IncidentInfo(
        id="b-1", job="j", user="alice", uid=1000, host="b", scope="s", reason="timeout", time=0.0
    )
    [first] = service.fleet.fleet_incident(head, 1000, 1.0)
    assert (first.timer.pid, first.timer.policy) == (200, "peer_dump")
    later = service.arming.open_connection(Peer(pid=201, uid=1000, gid=1000, pidfd=-1))
    service.handle(Acquire(id=2, scope="step", timeout=60.0, job="j", rank=1), later, 2.0)
    one = rank(900, 5, host="b")
    assert service.fleet.fleet_ranks("b-1", "b", [one], 3.0) == []  # the same hung rank
    two = rank(901, 7, host="b")
    [second] = service.fleet.fleet_ranks("b-1", "b", [one, two], 4.0)
    assert second.timer.pid == 201
    shown = service.incidents.get("b-1", 1000, 1000)
    assert shown is not None
    here = service.incidents.host
    assert sorted((r.host, r.pid, r.role) for r in shown.ranks) == [
        ("b", 900, "expired"),
        ("b", 901, "expired"),
        (here, 200, "peer"),
        (here, 201, "peer"),
    ]
    for item in (first, second):
        item.process.close()


def test_a_rank_whose_deadline_passed_before_another_hosts_incident_came_is_expired() -> None:
    """On a loaded host the fleet's news is taken before the expiry of a rank whose
    deadline has passed too: that rank fires as itself, the incident lists it as
    expired, and no peer policy runs on it; a rank not due yet is a peer."""
    world = make_world()
    service = world.service
    for pid, timeout in ((200, 1.0), (201, 60.0)):
        caller = service.arming.open_connection(Peer(pid=pid, uid=1000, gid=1000, pidfd=-1))
        service.handle(Acquire(id=1, scope="step", timeout=timeout, job="j", rank=pid), caller, 0.0)
    wall = service.context.wall() - 0.5  # opened there first, a moment ago
    head = IncidentInfo(
        id="b-1", job="j", user="alice", uid=1000, host="b", scope="s", reason="timeout", time=wall
    )
    runs = service.fleet.fleet_incident(head, 1000, 1.5)
    assert [(item.timer.pid, item.timer.policy) for item in runs] == [
        (200, "kill"),
        (201, "peer_dump"),
    ]
    shown = service.incidents.get("b-1", 1000, 1000)
    assert shown is not None
    assert sorted((rank.pid, rank.role) for rank in shown.ranks) == [
        (200, "expired"),
        (201, "peer"),
    ]
    assert service.firing.expire_due(1.5) == []
    for item in runs:
        item.process.close()


def test_a_stack_is_shown_to_the_user_ptrace_let_read_it_when_it_was_dumped() -> None:
    log = IncidentLog("a")
    incident, _ = log.expired((1000, "train"), "alice", rank(10, 0, uid=1000), "timeout", 1.0)
    log.add(incident, rank(11, 1, role="peer", uid=1000))
    log.dumped(incident, 10, "expired", (1000, 1000))
    log.dumped(incident, 11, "peer", None)  # e.g. its saved uid was root's
    log.finished(finished(incident, 10))
    log.finished(finished(incident, 11, kind="peer"))
    remote = msgspec.structs.replace(rank(99, 2, host="b", uid=4242), stack=DUMP, reader_uid=1000)
    log.merge_ranks(incident, "b", [remote])
    view = log.get(incident, 1000, 1000)
    assert view is not None
    shown = {r.pid: (bool(r.stack), bool(r.frame), r.state) for r in view.ranks}
    assert shown == {
        10: (True, True, "done"),
        11: (False, False, "done"),
        99: (True, False, "pending"),
    }
    [hidden] = [r for r in view.ranks if r.pid == 11]
    assert "shown to root only" in hidden.note
    # The same uid in another group could not have read it.
    other_group = log.get(incident, 1000, 2000)
    assert other_group is not None
    assert {r.pid for r in other_group.ranks if r.stack} == {99}
    root = log.get(incident, 0, 0)
    assert root is not None
    assert all(r.stack for r in root.ranks)


def _two_hosts() -> tuple[IncidentLog, IncidentLog]:
    ids = {"a": iter(["a-1", "a-2"]), "b": iter(["b-1", "b-2"])}
    return (
        IncidentLog("a", window=30.0, new_id=lambda: next(ids["a"])),
        IncidentLog("b", window=30.0, new_id=lambda: next(ids["b"])),
    )


def _head(log: IncidentLog, incident: str) -> IncidentInfo:
    head = log.head(incident)
    assert head is not None
    return head


def test_expiries_of_one_job_on_two_hosts_converge_on_the_one_opened_first() -> None:
    """Both hosts opened an incident of the job 2.2 ms apart; each then sees the
    other's head: both keep the one opened first, under its id, with every rank."""
    a, b = _two_hosts()
    job = (1000, "train")
    on_a, _ = a.expired(job, "alice", rank(10, 0, host="a"), "timeout", 100.0)
    on_b, _ = b.expired(job, "alice", rank(20, 1, host="b"), "timeout", 100.0022)
    assert (on_a, on_b) == ("a-1", "b-1")
    # Each host's head reaches the other.
    assert a.merge(_head(b, on_b)) == "a-1"
    assert b.merge(_head(a, on_a)) == "a-1"
    # The ranks each host publishes under the id it now keeps reach the other.
    on_b_now = b.get("a-1", 0, 0)
    assert on_b_now is not None
    b_ranks = [r for r in on_b_now.ranks if r.host == "b"]
    assert [r.pid for r in b_ranks] == [20]
    a.merge_ranks("b-1", "b", b_ranks)  # under the id b opened: the same incident
    assert a.merge_ranks("a-1", "b", b_ranks) is False  # the same ranks again
    b.merge_ranks("a-1", "a", [rank(10, 0, host="a")])
    for log in (a, b):
        whole = log.get("a-1", 0, 0)
        assert whole is not None
        assert sorted((r.host, r.pid) for r in whole.ranks) == [("a", 10), ("b", 20)]
        assert [info.id for info in log.listing(0, 10)] == ["a-1"]
        # The id the other host opened still answers, as the one it joined.
        assert log.get("b-1", 0, 0) == whole
    # A later expiry of the job on b, within the window, joins the same incident.
    again, new = b.expired(job, "alice", rank(21, 2, host="b"), "timeout", 101.0)
    assert (again, new) == ("a-1", False)


def test_a_remote_incident_opened_later_joins_this_hosts() -> None:
    a, b = _two_hosts()
    job = (1000, "train")
    a.expired(job, "alice", rank(10, 0, host="a"), "timeout", 100.0)
    b.expired(job, "alice", rank(20, 1, host="b"), "timeout", 100.5)
    assert a.merge(_head(b, "b-1")) == "a-1"
    assert "b-1" in a
    assert a.resolve("b-1") == "a-1"
    assert len(a) == 1


def test_incidents_of_a_job_a_window_apart_stay_two() -> None:
    a, b = _two_hosts()
    job = (1000, "train")
    a.expired(job, "alice", rank(10, 0, host="a"), "timeout", 100.0)
    b.expired(job, "alice", rank(20, 1, host="b"), "timeout", 200.0)
    assert a.merge(_head(b, "b-1")) == "b-1"
    assert [info.id for info in a.listing(0, 10)] == ["a-1", "b-1"]


def test_a_peer_whose_own_timer_then_expires_is_listed_once_as_expired() -> None:
    a, b = _two_hosts()
    job = (1000, "train")
    a.expired(job, "alice", rank(10, 0, host="a"), "timeout", 100.0)
    kept = b.merge(_head(a, "a-1"))
    b.add(kept, rank(20, 1, role="peer", host="b"))
    assert b.expired(job, "alice", rank(20, 1, host="b"), "timeout", 100.2) == ("a-1", False)
    whole = b.get("a-1", 0, 0)
    assert whole is not None
    assert [(r.pid, r.role) for r in whole.ranks] == [(20, "expired")]


def test_a_peer_that_then_expires_keeps_its_peer_dumps_evidence_until_its_own_replaces_it() -> None:
    """Its verdict does not lose the rank between its own expiry and its own dump,
    and a policy of its own that dumps nothing leaves it the peer dump's stack."""
    a, b = _two_hosts()
    job = (1000, "train")
    a.expired(job, "alice", rank(10, 0, host="a"), "timeout", 100.0)
    kept = b.merge(_head(a, "a-1"))
    b.add(kept, rank(20, 1, role="peer", host="b"))
    b.dumped(kept, 20, "peer", (1000, 1000), evidence="worker")
    b.finished(finished(kept, 20, kind="peer"))
    b.expired(job, "alice", rank(20, 1, host="b"), "timeout", 100.2)

    def shown() -> RankInfo:
        whole = b.get("a-1", 0, 0)
        assert whole is not None
        [only] = whole.ranks
        return only

    expired = shown()
    assert (expired.role, expired.state, expired.evidence) == ("expired", "pending", "worker")
    assert (expired.stack, expired.reader_uid) == (DUMP, 1000)
    assert expired.frame.startswith("all_reduce")
    killed = msgspec.structs.replace(finished(kept, 20), steps=[])
    b.finished(killed)
    assert (shown().state, shown().stack) == ("done", DUMP)


def test_a_verdicts_frame_is_shown_only_to_who_may_see_that_ranks_stack() -> None:
    log = IncidentLog("a", window=30.0)
    job = (1000, "train")
    incident, _ = log.expired(job, "alice", rank(10, 0), "timeout", 100.0)
    for pid, number in ((11, 1), (12, 2)):
        log.add(incident, rank(pid, number, role="peer"))
    waiting = DUMP
    elsewhere = DUMP.replace("train_step (train.py:88)", "read_shard (loader.py:42)")
    # Alice could read ranks 10 and 11 when they were dumped, not 12.
    for pid in (10, 11):
        log.dumped(incident, pid, "expired" if pid == 10 else "peer", (1000, 1000))
    for pid, stack, kind in (
        (10, waiting, "expired"),
        (11, waiting, "peer"),
        (12, elsewhere, "peer"),
    ):
        log.finished(finished(incident, pid, kind, stack))
    as_root = log.get(incident, 0, 0)
    as_alice = log.get(incident, 1000, 1000)
    assert as_root is not None
    assert as_alice is not None
    assert as_root.verdict is not None
    assert as_alice.verdict is not None
    assert as_root.verdict.kind == as_alice.verdict.kind == "odd_frame"
    assert [c.pid for c in as_alice.verdict.culprits] == [12]
    assert "read_shard" in as_root.verdict.text
    assert "read_shard" not in as_alice.verdict.text
    assert "train_step" in as_alice.verdict.text  # the ranks she may read
    assert "rank 2" in as_alice.verdict.text


#: A thread beside the main one that makes a stack as large as a dump keeps.
BULK = "".join(f"    work_{n} (/srv/{'p' * 900}.py:{n})\n" for n in range(60))
BIG = DUMP + 'Thread 4244 (idle): "bulk"\n' + BULK
KIB = 1024


def with_evidence(log: IncidentLog, uid: int, job: str, ranks: int, stack: str = BIG) -> str:
    """A new incident of ``uid``'s ``job`` whose ``ranks`` peers each gave ``stack``
    (the expired rank gives none)."""
    incident = opened(log, uid, job)
    for pid in range(100, 100 + ranks):
        log.add(incident, rank(pid, pid, role="peer", uid=uid))
        log.given(incident, pid, stack, evidence="worker", flight=[], reader=None)
    return incident


def stacks(log: IncidentLog, incident: str) -> list[int]:
    shown = log.get(incident, 0, 0)
    assert shown is not None
    return [len(r.stack.encode()) for r in shown.ranks if r.role == "peer"]


def test_a_uids_evidence_past_its_budget_loses_its_oldest_stacks_first_and_says_so() -> None:
    told: list[tuple[int, int]] = []
    log = IncidentLog("a", evidence_per_uid=1024 * KIB, on_trimmed=lambda *a: told.append(a))
    ids = [with_evidence(log, 1000, f"job{n}", 8) for n in range(4)]
    assert len(BIG.encode()) > 50 * KIB
    assert log.budget.held(1000) <= 1024 * KIB
    # 32 stacks of 54.5 KiB given, 1 MiB kept: 14 stacks cut (each cut keeps
    # 2 KiB), the oldest incident's, then the next one's.
    cut = [n for n in ids for size in stacks(log, n) if size <= 2 * KIB]
    assert cut == [ids[0]] * 8 + [ids[1]] * 6
    assert stacks(log, ids[3]) == [len(BIG.encode())] * 8
    oldest = log.get(ids[0], 0, 0)
    assert oldest is not None
    peer = oldest.ranks[1]
    assert peer.stack.startswith('Thread 4242 (idle): "MainThread"\n    all_reduce')
    assert "train_step (train.py:88)" in peer.stack
    assert "work_" not in peer.stack
    assert "passed their bytes of evidence" in peer.note
    assert peer.frame == "all_reduce (torch/distributed/distributed_c10d.py:2288)"
    # What went is counted, on the incident and to the daemon.
    assert oldest.trimmed > 8 * 50 * KIB
    assert sum(size for _, size in told) == sum(
        i.trimmed for i in (log.get(n, 0, 0) for n in ids) if i is not None
    )
    assert {uid for uid, _ in told} == {1000}


def test_a_verdict_by_the_stacks_stays_the_same_once_they_are_cut() -> None:
    log = IncidentLog("a", evidence_per_uid=1024 * KIB)
    incident = opened(log, 1000, "train")
    elsewhere = BIG.replace("train_step (train.py:88)", "read_shard (loader.py:42)")
    for pid, stack in ((11, BIG), (12, BIG), (13, BIG), (14, elsewhere)):
        log.add(incident, rank(pid, pid, role="peer"))
        log.given(incident, pid, stack, evidence="worker", flight=[], reader=None)
    before = log.get(incident, 0, 0)
    assert before is not None
    assert before.verdict is not None
    assert before.verdict.kind == "odd_frame"
    for n in range(30):
        with_evidence(log, 1000, f"later{n}", 2)
    after = log.get(incident, 0, 0)
    assert after is not None
    assert all(len(r.stack.encode()) <= 2 * KIB for r in after.ranks)
    assert after.verdict == before.verdict


def test_past_its_stacks_a_uids_oldest_incidents_go_whole_and_its_newest_stays() -> None:
    log = IncidentLog("a", evidence_per_uid=1024 * KIB)
    ids = [with_evidence(log, 1000, f"job{n}", 200, stack=DUMP * 3) for n in range(6)]
    assert log.budget.held(1000) <= 1024 * KIB
    kept = [i.id for i in log.listing(0, 100)]
    assert kept == ids[-len(kept) :]
    assert 1 <= len(kept) < 6
    newest = log.get(ids[-1], 0, 0)
    assert newest is not None
    assert len(newest.ranks) == 201  # every rank listed, whatever was cut


def test_one_incident_alone_over_the_budget_gives_its_summaries_last() -> None:
    log = IncidentLog("a", evidence_per_uid=1024 * KIB)
    incident = opened(log, 1000, "huge")
    # Summaries of groups of 4,000 members listed one by one: 90 KiB a rank.
    groups = [GroupState(group=str(n), ranks=list(range(0, 8000, 2))) for n in range(8)]
    for pid in range(100, 130):
        log.add(incident, rank(pid, pid, role="peer"))
        log.given(incident, pid, BIG, evidence="worker", flight=groups, reader=None)
    assert log.budget.held(1000) <= 1024 * KIB
    shown = log.get(incident, 0, 0)
    assert shown is not None
    peers = [r for r in shown.ranks if r.role == "peer"]
    # Every stack was cut before any summary went; then the oldest ranks' went.
    assert all(len(r.stack.encode()) <= 2 * KIB for r in peers)
    dropped = [r.pid for r in peers if not r.flight]
    assert dropped == list(range(100, 100 + len(dropped)))
    assert 0 < len(dropped) < 30
    assert all(r.flight == groups for r in peers if r.pid not in dropped)


def test_one_uids_evidence_never_trims_another_uids_or_roots() -> None:
    log = IncidentLog("a", evidence=2048 * KIB, evidence_per_uid=1024 * KIB)
    roots = with_evidence(log, 0, "root-job", 4)
    alices = with_evidence(log, 1001, "alice-job", 4)
    for n in range(20):
        with_evidence(log, 65534, f"flood{n}", 8)
    assert stacks(log, roots) == stacks(log, alices) == [len(BIG.encode())] * 4
    assert log.budget.held(65534) <= 1024 * KIB
    # Past the shared total, whoever holds the most gives back: the flood again.
    for n in range(20):
        with_evidence(log, 1002, f"bob{n}", 8)
    assert stacks(log, alices) == [len(BIG.encode())] * 4
    assert log.budget.held(1001) + log.budget.held(1002) + log.budget.held(65534) <= 2048 * KIB
    # Root's own share is root's: its own flood trims its own oldest.
    for n in range(60):
        with_evidence(log, 0, f"root{n}", 8)
    assert stacks(log, alices) == [len(BIG.encode())] * 4
    assert log.budget.held(0) <= 2048 * KIB


def test_a_lowered_budget_trims_at_the_reload() -> None:
    log = IncidentLog("a")
    ids = [with_evidence(log, 1000, f"job{n}", 8) for n in range(4)]
    assert log.budget.held(1000) > 1024 * KIB
    log.budget.resize(64 * 1024 * KIB, 1024 * KIB)
    assert log.budget.held(1000) <= 1024 * KIB
    assert stacks(log, ids[3]) == [len(BIG.encode())] * 8
