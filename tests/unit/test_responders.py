"""Who responds for which process, on a fake host: a responder is the exact process
that opened its connection, for as long as it lives, and only that process
replaces it."""

from __future__ import annotations

import pytest

from watchdogd.core.identity import Peer
from watchdogd.core.service import Caller, Service
from watchdogd.errors import Refusal
from watchdogd_protocol import (
    Acquire,
    ErrorCode,
    Evidence,
    Respond,
    Responding,
    Unblocked,
)

from helpers.fakes import ALICE, BOB, FakeProcess, make_world


def respond(service: Service[FakeProcess], caller: Caller[FakeProcess], job: str = "") -> None:
    reply = service.handle(Respond(id=1, job=job), caller, 1.0)
    assert isinstance(reply, Responding)


def refused(
    service: Service[FakeProcess],
    caller: Caller[FakeProcess],
    request: Respond | Evidence | Unblocked,
) -> Refusal:
    with pytest.raises(Refusal) as caught:
        service.handle(request, caller, 1.0)
    return caught.value


def test_a_process_responds_for_itself_with_the_start_time_of_its_own_process() -> None:
    w = make_world()
    respond(w.service, w.alice, "run-7")
    [responder] = w.service.responders.of_job(ALICE.uid, "run-7")
    assert w.alice.process is not None
    assert (responder.pid, responder.uid) == (ALICE.pid, ALICE.uid)
    assert responder.start_time == w.alice.process.start_time
    assert w.service.responders.registered(w.alice.process)


@pytest.mark.parametrize("gone", ["reaped", "zombie"])
def test_a_connection_whose_process_has_exited_may_not_respond(gone: str) -> None:
    w = make_world()
    w.service.handle(Acquire(id=1, scope="s", timeout=60), w.alice, 1.0)
    assert w.alice.process is not None
    if gone == "reaped":
        w.host.dead.add(ALICE.pid)
    else:
        w.alice.process.exited = True  # its pid still its own, as a zombie's
    refusal = refused(w.service, w.alice, Respond(id=2, job="forged"))
    assert refusal.code == ErrorCode.NO_SUCH_PROCESS
    assert "has exited" in refusal.message
    assert len(w.service.responders) == 0


def test_a_connection_that_outlived_its_process_never_responds_for_the_pids_next_holder() -> None:
    w = make_world()
    respond(w.service, w.bob, "train")
    bobs = w.bob.process
    assert bobs is not None
    # Bob's process exits, a child of his keeps the connection, and his pid goes
    # to a process of alice's, which responds on a connection of its own.
    bobs.exited = True
    w.host.processes[BOB.pid] = (ALICE.uid, ALICE.uid)
    holder = w.service.arming.open_connection(
        Peer(pid=BOB.pid, uid=ALICE.uid, gid=ALICE.gid, pidfd=-1)
    )
    respond(w.service, holder, "alices")
    assert holder.process is not None
    assert holder.process.start_time != bobs.start_time
    # The old connection may neither take the pid back nor answer on it.
    assert refused(w.service, w.bob, Respond(id=2, job="train")).code == ErrorCode.NO_SUCH_PROCESS
    assert refused(w.service, w.bob, Evidence(id=3, ask=1)).code == ErrorCode.INVALID_REQUEST
    assert not w.service.responders.unregister(bobs)
    [responder] = w.service.responders.of_job(ALICE.uid, "alices")
    assert responder.process is holder.process
    assert w.service.responders.of_job(BOB.uid, "train") == []


def test_a_process_has_one_responder_and_replaces_it_only_itself() -> None:
    w = make_world()
    first, second = w.alice, w.service.arming.open_connection(ALICE)
    respond(w.service, first, "a")
    respond(w.service, second, "b")  # the same process, on a connection of its own
    assert [r.job for r in w.service.responders.of_job(ALICE.uid, "b")] == ["b"]
    assert w.service.responders.of_job(ALICE.uid, "a") == []
    assert len(w.service.responders) == 1
    # The connection replaced answers no more, and its end leaves the other be.
    assert refused(w.service, first, Evidence(id=2, ask=1)).code == ErrorCode.INVALID_REQUEST
    assert isinstance(w.service.handle(Evidence(id=3, ask=1), second, 1.0), Responding)
    assert first.process is not None
    assert not w.service.responders.unregister(first.process)
    assert len(w.service.responders) == 1


def test_without_peer_pidfds_a_caller_gone_when_it_connected_never_responds() -> None:
    w = make_world()
    w.host.dead.add(ALICE.pid)
    caller = w.service.arming.open_connection(Peer(pid=ALICE.pid, uid=ALICE.uid, gid=ALICE.gid))
    assert caller.process is None
    w.host.dead.discard(ALICE.pid)  # its pid taken by another process since
    opened = len(w.host.opened)
    assert refused(w.service, caller, Respond(id=1)).code == ErrorCode.NO_SUCH_PROCESS
    assert len(w.host.opened) == opened  # never looked for by its pid again


def test_a_caller_the_kernel_gave_no_pidfd_for_is_never_opened_by_its_pid() -> None:
    """A kernel with SO_PEERPIDFD gives none for a peer reaped already (before
    6.9): whoever holds its pid now is not the process that connected."""
    w = make_world()
    opened = len(w.host.opened)
    gone = Peer(pid=ALICE.pid, uid=ALICE.uid, gid=ALICE.gid, gone=True)
    caller = w.service.arming.open_connection(gone)
    assert refused(w.service, caller, Respond(id=1)).code == ErrorCode.NO_SUCH_PROCESS
    assert len(w.host.opened) == opened


def test_evidence_is_taken_only_from_a_connection_that_responds() -> None:
    w = make_world()
    assert refused(w.service, w.alice, Evidence(id=1, ask=1)).code == ErrorCode.INVALID_REQUEST
    respond(w.service, w.alice)
    assert isinstance(w.service.handle(Evidence(id=2, ask=1), w.alice, 1.0), Responding)
    assert w.alice.process is not None
    assert w.service.responders.unregister(w.alice.process)  # its process exited
    assert refused(w.service, w.alice, Evidence(id=3, ask=1)).code == ErrorCode.INVALID_REQUEST


def test_an_unblock_is_answered_only_on_a_connection_that_responds_and_said_it_unblocks() -> None:
    w = make_world()
    answer = Unblocked(id=1, ask=1, outcome="unblocked")
    assert refused(w.service, w.alice, answer).code == ErrorCode.INVALID_REQUEST
    w.service.handle(Respond(id=2, job="run-7"), w.alice, 1.0)
    [responder] = w.service.responders.of_job(ALICE.uid, "run-7")
    assert not responder.unblock  # a responder of before says nothing: it is never asked
    w.service.handle(Respond(id=3, job="run-7", unblock=True), w.alice, 1.0)
    [responder] = w.service.responders.of_job(ALICE.uid, "run-7")
    assert responder.unblock
    assert isinstance(w.service.handle(answer, w.alice, 1.0), Responding)
