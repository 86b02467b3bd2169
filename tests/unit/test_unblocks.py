"""The unblocks this host's ranks are owed (`watchdogd.core.unblocks`), on a fake
host: who is asked, for what, when again, and what is recorded of a rank cut out."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from watchdogd.core.identity import Peer
from watchdogd.core.service import Caller, Service
from watchdogd.core.unblocks import HOST_LOST, MAX_TRIES, PEERS, OwedUnblock
from watchdogd_protocol import (
    Collective,
    GroupState,
    IncidentInfo,
    RankInfo,
    Respond,
    Unblocked,
    UnblockOutcome,
)

from helpers.fakes import FakeProcess, make_world

ALICE = 1000
JOB = "run-7"


def responder(
    service: Service[FakeProcess], pid: int, rank: int, *, unblock: bool = True, job: str = JOB
) -> Caller[FakeProcess]:
    """Process ``pid`` of alice's, a rank of ``job`` that responds here."""
    caller = service.arming.open_connection(Peer(pid=pid, uid=ALICE, gid=ALICE, pidfd=-1))
    service.handle(Respond(id=1, job=job, rank=rank, unblock=unblock), caller, 0.0)
    return caller


def waiting_in(seq: int, size: int = 3) -> list[GroupState]:
    """A Flight Recorder's default group of ``size`` ranks, waiting in all_reduce ``seq``."""
    entered = Collective(group="0", seq=seq, op="gloo:all_reduce", state="scheduled")
    return [GroupState(group="0", desc="default_pg", size=size, entered=entered, completed=seq - 1)]


def as_it_is(rank: RankInfo) -> Callable[[RankInfo | None], RankInfo]:
    """What `IncidentLog.amend` makes of a rank: ``rank``, whatever was there."""
    return lambda _: rank


def answer(unblock: OwedUnblock, outcome: str, **fields: object) -> Unblocked:
    return Unblocked(id=1, ask=1, outcome=outcome, **fields)  # type: ignore[arg-type]


def test_a_lost_host_owes_each_rank_of_its_job_here_that_unblocks_one_ask() -> None:
    service = make_world().service
    responder(service, 200, 0)
    responder(service, 201, 1, unblock=False)  # a responder of before, or one turned off
    responder(service, 202, 2, job="other-job")
    service.fleet.host_lost("host-b", "alice", [(ALICE, JOB)], 5.0)
    [incident] = service.incidents.listing(ALICE, 10)
    assert incident.kind == "host_lost"
    assert service.unblocks.next_due() == 5.0
    [owed] = service.unblocks.take(5.0)
    assert (owed.responder.pid, owed.cause, owed.incident) == (200, HOST_LOST, incident.id)
    wanted = owed.wanted(10.0, 8.0)
    # Any collective it waits in, entered before the loss, waited in 10 s.
    assert (wanted.group, wanted.seq, wanted.waited, wanted.entered_before) == (None, None, 10, 3)
    assert "host host-b left the fleet" in wanted.reason
    assert service.unblocks.take(9.0) == []


def test_a_rank_too_soon_is_asked_again_when_it_will_have_waited_pinned_to_its_collective() -> None:
    service = make_world().service
    responder(service, 200, 0)
    service.fleet.host_lost("host-b", "alice", [(ALICE, JOB)], 5.0)
    [owed] = service.unblocks.take(5.0)
    collective = Collective(group="0", seq=57, op="gloo:all_reduce")
    for tries in range(1, MAX_TRIES):
        soon = answer(owed, UnblockOutcome.TOO_SOON, collective=collective, retry=7.0)
        service.unblocks.answered(owed, soon, 6.0)
        assert service.unblocks.next_due() == 13.0
        [owed] = service.unblocks.take(13.0)
        assert (owed.group, owed.seq, owed.tries) == ("0", 57, tries)
        assert owed.wanted(10.0, 13.0).entered_before == 8.0  # still before the loss
    service.unblocks.answered(owed, answer(owed, UnblockOutcome.TOO_SOON, retry=1.0), 14.0)
    assert service.unblocks.next_due() is None  # asked often enough
    assert service.metrics.unblocks[(HOST_LOST, "too_soon")] == MAX_TRIES


def test_any_other_answer_ends_the_unblock_and_is_counted() -> None:
    service = make_world().service
    for pid in (200, 201, 202):
        responder(service, pid, pid - 200)
    service.fleet.host_lost("host-b", "alice", [(ALICE, JOB)], 5.0)
    owed = service.unblocks.take(5.0)
    service.unblocks.answered(owed[0], answer(owed[0], UnblockOutcome.NOT_WAITING), 6.0)
    service.unblocks.answered(owed[1], None, 6.0)
    service.unblocks.answered(owed[2], answer(owed[2], "a word of a newer client"), 6.0)
    assert service.unblocks.next_due() is None
    assert dict(service.metrics.unblocks) == {
        (HOST_LOST, "not_waiting"): 1,
        (HOST_LOST, "no_answer"): 1,
        (HOST_LOST, "failed"): 1,
    }
    assert not [e for e in service.events.page(None, 100, 0) if e.kind == "unblocked"]


def test_a_rank_cut_out_is_an_event_of_its_owner_and_a_rank_of_the_incident() -> None:
    service = make_world().service
    responder(service, 200, 3)
    service.fleet.host_lost("host-b", "alice", [(ALICE, JOB)], 5.0)
    [owed] = service.unblocks.take(5.0)
    cut = Collective(group="0", seq=57, op="gloo:all_reduce")
    service.unblocks.answered(
        owed, answer(owed, UnblockOutcome.UNBLOCKED, collective=cut, waited=12.5, cut=3), 6.0
    )
    [event] = [e for e in service.events.page(None, 100, 0) if e.kind == "unblocked"]
    assert (event.pid, event.uid, event.job, event.rank) == (200, ALICE, JOB, 3)
    assert (event.incident, event.outcome) == (owed.incident, HOST_LOST)
    assert event.note.startswith("cut out of gloo:all_reduce #57 of group 0 after waiting 12.5 s")
    assert "host host-b left the fleet" in event.note
    shown = service.incidents.get(owed.incident, ALICE, ALICE)
    assert shown is not None
    [rank] = shown.ranks
    assert (rank.pid, rank.rank, rank.unblocked, rank.unblocked_at) == (
        200, 3, event.note, event.time
    )  # fmt: skip
    assert service.metrics.unblocks[(HOST_LOST, "unblocked")] == 1


def test_peers_are_owed_once_the_verdict_names_the_culprits_and_the_collective() -> None:
    """Another host's incident of alice's job, whose ranks 0 and 1 here wait in
    all_reduce #5 outside any block; rank 2 on host b never entered it, and its
    policy asks for its peers to be unblocked."""
    service = make_world().service
    for pid in (200, 201):
        responder(service, pid, pid - 200)
    head = IncidentInfo(
        id="b-1", job=JOB, user="alice", uid=ALICE, host="b", scope="s", reason="timeout", time=0.0
    )
    assert service.fleet.fleet_incident(head, ALICE, 1.0) == []  # no timer: asked for evidence
    asks = service.firing.take_asks()
    assert sorted(responder.pid for _, responder in asks) == [200, 201]
    for pid in (200, 201):
        service.firing.evidence_given(
            "b-1", pid, "", evidence="worker", flight=waiting_in(5), reader=None
        )
    culprit = RankInfo(
        host="b", pid=900, uid=ALICE, role="expired", scope="s", state="done", rank=2,
        flight=[msgspec.structs.replace(waiting_in(5)[0], entered=None, completed=4)],
    )  # fmt: skip
    service.fleet.fleet_ranks("b-1", "b", [culprit], 2.0)
    assert service.unblocks.check(2.0) == 0  # nobody asked for it
    service.fleet.fleet_ranks("b-1", "b", [msgspec.structs.replace(culprit, unblock=PEERS)], 3.0)
    assert service.unblocks.waiting
    assert service.unblocks.check(3.0) == 2
    owed = service.unblocks.take(3.0)
    assert sorted(unblock.responder.pid for unblock in owed) == [200, 201]
    for unblock in owed:
        assert (unblock.cause, unblock.group, unblock.seq) == (PEERS, "0", 5)
        assert "the job waits for rank 2 on host b in gloo:all_reduce #5" in unblock.why
    assert not service.unblocks.waiting
    assert service.unblocks.check(4.0) == 0  # once


def test_a_culprit_here_is_never_owed_and_its_own_policy_asks_for_its_peers() -> None:
    service = make_world().service
    for pid in (200, 201, 202):
        responder(service, pid, pid - 200)
    head = IncidentInfo(
        id="b-1", job=JOB, user="alice", uid=ALICE, host="b", scope="s", reason="timeout", time=0.0
    )
    service.fleet.fleet_incident(head, ALICE, 1.0)
    service.firing.take_asks()
    behind = [msgspec.structs.replace(waiting_in(5)[0], entered=None, completed=4)]
    for pid, flight in ((200, waiting_in(5)), (201, waiting_in(5)), (202, behind)):
        service.firing.evidence_given("b-1", pid, "", evidence="worker", flight=flight, reader=None)
    assert service.unblocks.want("b-1", 202, ALICE, 2.0)
    assert not service.unblocks.want("no-such-incident", 202, ALICE, 2.0)
    shown = service.incidents.get("b-1", ALICE, ALICE)
    assert shown is not None
    assert {rank.pid: rank.unblock for rank in shown.ranks} == {200: "", 201: "", 202: PEERS}
    assert service.unblocks.check(2.0) == 2
    assert sorted(u.responder.pid for u in service.unblocks.take(2.0)) == [200, 201]


def test_a_verdict_that_never_names_a_collective_is_waited_for_no_longer_than_its_bound() -> None:
    service = make_world().service
    responder(service, 200, 0)
    head = IncidentInfo(
        id="b-1", job=JOB, user="alice", uid=ALICE, host="b", scope="s", reason="timeout", time=0.0
    )
    service.fleet.fleet_incident(head, ALICE, 1.0)
    service.unblocks.want_remote("b-1", 1.0)
    assert service.unblocks.check(100.0) == 0
    assert service.unblocks.waiting
    assert service.unblocks.check(1000.0) == 0
    assert not service.unblocks.waiting


def test_the_fallback_signal_is_for_ranks_here_that_no_responder_unblocks() -> None:
    """Ranks 0 (a responder that unblocks), 1 (one that does not), 2 (none: its
    stack from py-spy) and 3 (none, and the culprit whose policy runs the step) of
    another host's incident, besides rank 4 there, the culprit for cause."""
    service = make_world().service
    responder(service, 200, 0)
    responder(service, 201, 1, unblock=False)
    head = IncidentInfo(
        id="b-1", job=JOB, user="alice", uid=ALICE, host="b", scope="s", reason="timeout", time=0.0
    )
    service.fleet.fleet_incident(head, ALICE, 1.0)
    service.firing.take_asks()
    for pid in (200, 201):
        waiting = waiting_in(5, size=5)
        service.firing.evidence_given(
            "b-1", pid, "", evidence="worker", flight=waiting, reader=None
        )
    here = service.incidents.host
    for pid, number in ((202, 2), (203, 3)):
        rank = RankInfo(
            host=here, pid=pid, uid=ALICE, role="peer", scope="s", state="done", rank=number,
            evidence="py-spy", stack='Thread 1 (idle): "MainThread"\n    wait (x.py:1)\n',
        )  # fmt: skip
        service.incidents.amend("b-1", pid, as_it_is(rank))
    behind = [msgspec.structs.replace(waiting_in(5, size=5)[0], entered=None, completed=4)]
    culprit = RankInfo(
        host="b", pid=900, uid=ALICE, role="expired", scope="s", state="done", rank=4,
        flight=behind,
    )  # fmt: skip
    service.fleet.fleet_ranks("b-1", "b", [culprit], 2.0)
    verdict = service.unblocks.named("b-1")
    assert verdict is not None
    # Ranks 2 and 3 have no record: the verdict names them missing too.
    assert {c.rank for c in verdict.culprits} == {2, 3, 4}
    fallback = service.unblocks.unanswered("b-1", verdict, 203)
    assert sorted(rank.rank or 0 for rank in fallback) == [1, 2]
