"""Request handling against a fake process port: targets, authorization, limits,
status paging, exits. The clock is a number passed in."""

from __future__ import annotations

import math

import msgspec
import pytest

from watchdogd.core.identity import Peer
from watchdogd.core.service import Caller, Service
from watchdogd.core.timers import Timer, TimerTable, Watch
from watchdogd.errors import Refusal
from watchdogd_protocol import (
    MAX_COMMAND_BYTES,
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    ErrorCode,
    Hello,
    Ping,
    Pong,
    Release,
    Released,
    Status,
    StatusReply,
    Welcome,
    encode_frame,
)

from helpers.fakes import ALICE, BOB, DAEMON_PID, ROOT, FakeProcess, make_service, make_world


def refusal(
    service: Service[FakeProcess], request: object, caller: Caller[FakeProcess], now: float = 1.0
) -> Refusal:
    with pytest.raises(Refusal) as caught:
        service.handle(request, caller, now)  # type: ignore[arg-type]
    return caught.value


def every_page(
    service: Service[FakeProcess], caller: Caller[FakeProcess], *, limit: int, now: float
) -> tuple[list[str], list[str]]:
    """The scopes of every status page ``caller`` gets, in order, and the cursors
    that led from each page to the next."""
    seen: list[str] = []
    cursors: list[str] = []
    cursor = None
    while True:
        reply = service.handle(Status(id=99, limit=limit, cursor=cursor), caller, now)
        assert isinstance(reply, StatusReply)
        seen += [t.scope for t in reply.timers]
        cursor = reply.cursor
        if cursor is None:
            return seen, cursors
        cursors.append(cursor)


class TestAcquire:
    def test_targets_the_caller_by_default(self) -> None:
        w = make_world()
        service = w.service
        reply = service.handle(Acquire(id=1, scope="s", timeout=5), w.alice, 1.0)
        timer = service.table.get(ALICE.pid, "s")
        assert timer is not None
        assert reply == Acquired(id=1, remaining=5, rearmed=False, arm=timer.arm)
        assert (timer.deadline, timer.policy, timer.uid, timer.owner) == (6.0, "kill", 1000, 1000)
        assert w.host.tracked == {ALICE.pid}
        assert w.notified == [6.0]

    def test_rearm_replaces_timeout_and_policy(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="s", timeout=5), w.alice, 1.0)
        reply = service.handle(Acquire(id=2, scope="s", timeout=9, policy="term"), w.alice, 2.0)
        timer = service.table.get(ALICE.pid, "s")
        assert timer is not None
        assert reply == Acquired(id=2, remaining=9, rearmed=True, arm=timer.arm)
        assert (timer.deadline, timer.policy) == (11.0, "term")
        assert len(service.table) == 1

    def test_one_handle_per_process(self) -> None:
        w = make_world()
        service = w.service
        for scope in "abc":
            service.handle(Acquire(id=1, scope=scope, timeout=5), w.alice, 1.0)
        assert len(w.host.opened) == 1

    def test_unknown_policy_lists_the_known_ones(self) -> None:
        w = make_world()
        service = w.service
        error = refusal(service, Acquire(id=1, scope="s", timeout=5, policy="nuke"), w.alice)
        assert error.code == ErrorCode.UNKNOWN_POLICY
        assert "abort, kill, log, ops, peer_dump, term" in error.message

    def test_root_only_policies(self) -> None:
        w = make_world()
        error = refusal(w.service, Acquire(id=1, scope="s", timeout=5, policy="ops"), w.alice)
        assert error.code == ErrorCode.PERMISSION_DENIED
        assert "'ops' may be chosen by root only" in error.message
        w.service.handle(Acquire(id=2, scope="s", timeout=5, policy="ops"), w.root, 1.0)

    def test_scopes_with_a_nul_character_are_refused(self) -> None:
        w = make_world()
        error = refusal(w.service, Acquire(id=1, scope="a\0b", timeout=5), w.alice)
        assert error.code == ErrorCode.INVALID_REQUEST
        assert "NUL" in error.message

    def test_scope_bytes_are_bounded(self) -> None:
        w = make_world(max_scope_bytes=8)
        service = w.service
        service.handle(Acquire(id=1, scope="é" * 4, timeout=5), w.alice, 1.0)  # 8 bytes
        error = refusal(service, Acquire(id=2, scope="é" * 5, timeout=5), w.alice)
        assert error.code == ErrorCode.INVALID_REQUEST
        assert "10 bytes" in error.message

    @pytest.mark.parametrize("timeout", [math.inf, 31 * 86400.0])
    def test_timeout_is_bounded(self, timeout: float) -> None:
        w = make_world()
        service = w.service
        error = refusal(service, Acquire(id=1, scope="s", timeout=timeout), w.alice)
        assert error.code == ErrorCode.INVALID_REQUEST
        assert "a timeout is at most 30 days here (max_timeout)" in error.message

    def test_a_stale_handle_is_replaced_when_the_pid_was_reused(self) -> None:
        w = make_world()
        w.service.handle(Acquire(id=1, scope="old", timeout=5), w.alice, 1.0)
        first = w.service.table.process(ALICE.pid)
        assert first is not None
        # The process exited and its pid went to a new process, which connects,
        # before the exit was processed: it must not inherit the old timers.
        first.exited = True
        newcomer = w.service.arming.open_connection(ALICE)
        w.service.handle(Acquire(id=2, scope="new", timeout=5), newcomer, 2.0)
        assert w.service.table.get(ALICE.pid, "old") is None
        assert w.service.table.get(ALICE.pid, "new") is not None
        assert w.service.table.process(ALICE.pid) is not first
        w.service.arming.close_connection(w.alice)
        assert first.refs == 0


class TestCallerIdentity:
    def test_a_connection_that_outlived_its_process_never_reaches_the_pids_next_holder(
        self,
    ) -> None:
        w = make_world()
        w.service.handle(Acquire(id=1, scope="bob's", timeout=5), w.bob, 1.0)
        bobs = w.service.table.process(BOB.pid)
        assert bobs is not None
        # Bob's process exits; a child of his keeps the connection. His pid goes
        # to a root process, which root arms a timer on.
        bobs.exited = True
        w.host.processes[BOB.pid] = (0, 0)
        w.service.handle(Acquire(id=2, scope="root's", timeout=60, pid=BOB.pid), w.root, 1.0)
        holder = w.service.table.process(BOB.pid)
        assert holder is not None
        assert holder is not bobs
        for request in (
            Acquire(id=3, scope="root's", timeout=0.001),
            Release(id=4, scope="root's"),
        ):
            error = refusal(w.service, request, w.bob)
            assert error.code == ErrorCode.NO_SUCH_PROCESS
            assert "has exited" in error.message
        timer = w.service.table.get(BOB.pid, "root's")
        assert timer is not None
        assert timer.deadline == 61.0  # untouched

    def test_a_caller_the_kernel_gave_no_pidfd_for_never_arms_on_its_pids_holder(self) -> None:
        """A kernel with SO_PEERPIDFD gives none for a peer reaped already (before
        6.9): whoever holds its pid now is another process."""
        service, host, _ = make_service()
        gone = Peer(pid=ALICE.pid, uid=ALICE.uid, gid=ALICE.gid, gone=True)
        caller = service.arming.open_connection(gone)
        error = refusal(service, Acquire(id=1, scope="s", timeout=5), caller)
        assert error.code == ErrorCode.NO_SUCH_PROCESS
        assert host.opened == []
        assert len(service.table) == 0

    def test_without_peer_pidfds_the_caller_is_opened_when_it_connects(self) -> None:
        service, host, _ = make_service()
        caller = service.arming.open_connection(Peer(pid=ALICE.pid, uid=ALICE.uid, gid=ALICE.gid))
        assert [p.pid for p in host.opened] == [ALICE.pid]
        assert caller.process is host.opened[0]
        service.handle(Acquire(id=1, scope="s", timeout=5), caller, 1.0)
        assert len(host.opened) == 1


class TestAuthorization:
    @pytest.mark.parametrize(
        ("peer", "target", "allowed"),
        [
            (ALICE, 201, True),  # same uid
            (ALICE, 202, True),  # caller uid is the target's saved uid
            (ALICE, 300, False),  # someone else's
            (ALICE, 100, False),  # root's
            (BOB, 200, False),
            (ROOT, 200, True),
            (ROOT, 300, True),
        ],
    )
    def test_kill_rule(self, peer: Peer, target: int, allowed: bool) -> None:
        w = make_world()
        service = w.service
        request = Acquire(id=1, scope="s", timeout=5, pid=target)
        if allowed:
            assert isinstance(
                service.handle(request, service.arming.open_connection(peer), 1.0), Acquired
            )
            assert service.table.get(target, "s") is not None
        else:
            error = refusal(service, request, service.arming.open_connection(peer))
            assert error.code == ErrorCode.PERMISSION_DENIED
            assert f"pid {target}" in error.message
            assert len(service.table) == 0
            assert all(process.refs == 0 for process in w.host.opened)

    @pytest.mark.parametrize("peer", [ROOT, ALICE])
    @pytest.mark.parametrize("target", [1, DAEMON_PID])
    def test_init_and_the_daemon_are_never_targets(self, peer: Peer, target: int) -> None:
        w = make_world()
        service = w.service
        caller = service.arming.open_connection(peer)
        error = refusal(service, Acquire(id=1, scope="s", timeout=5, pid=target), caller)
        assert error.code == ErrorCode.PERMISSION_DENIED

    def test_missing_process(self) -> None:
        w = make_world()
        service = w.service
        error = refusal(service, Acquire(id=1, scope="s", timeout=5, pid=4040), w.root)
        assert error.code == ErrorCode.NO_SUCH_PROCESS
        assert "4040" in error.message

    def test_release_follows_the_same_rule(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="s", timeout=5, pid=300), w.root, 1.0)
        error = refusal(service, Release(id=2, scope="s", pid=300), w.alice)
        assert error.code == ErrorCode.PERMISSION_DENIED
        assert service.table.get(300, "s") is not None
        # Nor may a stranger probe for timers that do not exist.
        error = refusal(service, Release(id=3, scope="nothing", pid=100), w.alice)
        assert error.code == ErrorCode.PERMISSION_DENIED
        assert service.handle(Release(id=4, scope="s", pid=300), w.bob, 1.0) == Released(
            id=4, found=True
        )
        assert all(process.refs == 0 for process in w.host.opened)

    def test_a_held_process_is_judged_by_its_uids_at_the_request(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="s", timeout=5, pid=300), w.root, 1.0)
        w.host.processes[300] = (1000, 1000)  # it called setuid(1000)
        reply = service.handle(Acquire(id=2, scope="alice's", timeout=5, pid=300), w.alice, 1.0)
        timer = service.table.get(300, "alice's")
        assert timer is not None
        assert reply == Acquired(id=2, remaining=5, rearmed=False, arm=timer.arm)
        assert timer.uid == 1000
        error = refusal(service, Release(id=3, scope="s", pid=300), w.bob)
        assert error.code == ErrorCode.PERMISSION_DENIED  # bob's uid is gone from it
        assert "real uid 1000, saved uid 1000" in error.message


class TestRelease:
    def test_release_says_whether_a_timer_was_armed(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="s", timeout=5), w.alice, 1.0)
        assert service.handle(Release(id=2, scope="s"), w.alice, 1.0) == Released(id=2, found=True)
        assert service.handle(Release(id=3, scope="s"), w.alice, 1.0) == Released(id=3, found=False)
        assert w.host.tracked == set()
        [process] = w.host.opened
        assert process.refs == 1  # kept by alice's connection, for her next acquire
        service.arming.close_connection(w.alice)
        assert process.refs == 0

    def test_the_callers_process_is_opened_once_per_connection(self) -> None:
        w = make_world()
        for i in range(5):
            w.service.handle(Acquire(id=i, scope="s", timeout=5), w.alice, 1.0)
            w.service.handle(Release(id=i, scope="s"), w.alice, 1.0)
        assert len(w.host.opened) == 1

    def test_a_release_naming_its_arming_never_disarms_a_later_one(self) -> None:
        """A release sent late (on another connection, or again after its own
        broke) names the arming it meant, by the number the daemon gave it: the
        scope armed again since stays armed."""
        w = make_world()
        service = w.service
        first = service.handle(Acquire(id=1, scope="s", timeout=5), w.alice, 1.0)
        again = service.handle(Acquire(id=2, scope="s", timeout=5), w.alice, 2.0)
        assert isinstance(first, Acquired)
        assert isinstance(again, Acquired)
        assert 0 < first.arm != again.arm > 0
        late = service.handle(Release(id=3, scope="s", arm=first.arm), w.alice, 2.5)
        assert late == Released(id=3, found=False)
        [timer] = service.table.timers_of(ALICE.pid)
        assert timer.arm == again.arm
        assert service.handle(Release(id=4, scope="s", arm=again.arm), w.alice, 3.0) == Released(
            id=4, found=True
        )
        # And a release that names none disarms whatever is armed, as ever.
        service.handle(Acquire(id=5, scope="s", timeout=5), w.alice, 4.0)
        assert service.handle(Release(id=6, scope="s"), w.alice, 4.0) == Released(id=6, found=True)

    def test_a_late_release_never_disarms_roots_rearming_of_the_scope(self) -> None:
        """A worker arms S2; root re-arms the worker's S2 (``watchdogctl arm --pid
        W --scope S2 --timeout 600 --policy term``), in the same reading of the
        clock; the worker's late release of its own arming leaves root's armed.
        (Numbers that each process counted for itself were both 1 here.)"""
        w = make_world()
        service = w.service
        mine = service.handle(Acquire(id=1, scope="S2", timeout=30), w.alice, 1.0)
        roots = service.handle(
            Acquire(id=1, scope="S2", timeout=600, policy="term", pid=ALICE.pid), w.root, 1.0
        )
        assert isinstance(mine, Acquired)
        assert isinstance(roots, Acquired)
        assert roots.rearmed
        assert roots.arm != mine.arm
        late = service.handle(Release(id=2, scope="S2", arm=mine.arm), w.alice, 1.5)
        assert late == Released(id=2, found=False)
        timer = service.table.get(ALICE.pid, "S2")
        assert timer is not None
        assert (timer.policy, timer.owner) == ("term", 0)
        assert timer.deadline == pytest.approx(601.0)

    def test_an_arming_after_a_release_has_a_number_of_its_own(self) -> None:
        """Armed, released and armed again at one reading of the clock: the
        release sent again (its answer was lost) names the first arming, and
        leaves the second armed."""
        w = make_world()
        service = w.service
        first = service.handle(Acquire(id=1, scope="s", timeout=5), w.alice, 7.0)
        assert isinstance(first, Acquired)
        released = Release(id=2, scope="s", arm=first.arm)
        assert service.handle(released, w.alice, 7.0) == Released(id=2, found=True)
        second = service.handle(Acquire(id=3, scope="s", timeout=5), w.alice, 7.0)
        assert isinstance(second, Acquired)
        assert second.arm != first.arm
        assert service.handle(released, w.alice, 7.0) == Released(id=2, found=False)
        assert service.table.get(ALICE.pid, "s") is not None

    def test_a_restored_arming_is_named_by_its_number_or_by_its_clients(self) -> None:
        """A timer restored from the state keeps its number (its arming time),
        and one armed under a daemon that kept its client's number
        (`Watch.client_arm`) is released by that number too; a number that names
        neither disarms nothing."""
        w = make_world()
        service = w.service
        kept = Timer(
            pid=ALICE.pid, scope="kept", policy="kill", uid=1000, owner=1000, timeout=60.0,
            armed_at=-5.0, deadline=55.0, start_time=1000,
        )  # fmt: skip
        older = msgspec.structs.replace(
            kept, scope="older", armed_at=-4.0, watch=Watch(client_arm=3)
        )
        service.lifecycle.restore([kept, older])
        assert older.arm != kept.arm
        for scope, wrong in (("kept", 3), ("older", kept.arm)):
            reply = service.handle(Release(id=1, scope=scope, arm=wrong), w.alice, 1.0)
            assert reply == Released(id=1, found=False)
        for scope, arm in (("kept", kept.arm), ("older", 3)):
            reply = service.handle(Release(id=2, scope=scope, arm=arm), w.alice, 1.0)
            assert reply == Released(id=2, found=True)

    def test_release_of_another_scope_leaves_the_process_tracked(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="a", timeout=5), w.alice, 1.0)
        assert service.handle(Release(id=2, scope="b"), w.alice, 1.0) == Released(id=2, found=False)
        assert w.host.tracked == {ALICE.pid}


class TestLimits:
    def test_timers_per_uid_apply_to_non_root(self) -> None:
        w = make_world(max_timers_per_uid=2)
        service = w.service
        service.handle(Acquire(id=1, scope="a", timeout=5), w.alice, 1.0)
        service.handle(Acquire(id=2, scope="b", timeout=5, pid=201), w.alice, 1.0)
        error = refusal(service, Acquire(id=3, scope="c", timeout=5), w.alice)
        assert error.code == ErrorCode.LIMIT_EXCEEDED
        assert "uid 1000" in error.message
        # Re-arming an existing timer is not a new one.
        service.handle(Acquire(id=4, scope="a", timeout=9), w.alice, 1.0)
        # Others, and w.root, are not affected.
        service.handle(Acquire(id=5, scope="a", timeout=5), w.bob, 1.0)
        for scope in "abc":
            service.handle(Acquire(id=6, scope=scope, timeout=5), w.root, 1.0)

    def test_authorization_comes_before_limits(self) -> None:
        # Alice at her limit must not learn which scopes bob's process has armed:
        # an existing scope would be exempt from the limit, a new one refused.
        w = make_world(max_timers_per_uid=1)
        service = w.service
        service.handle(Acquire(id=1, scope="a", timeout=5), w.alice, 1.0)
        service.handle(Acquire(id=2, scope="bobs", timeout=5), w.bob, 1.0)
        for scope in ("bobs", "absent"):
            error = refusal(service, Acquire(id=3, scope=scope, timeout=5, pid=BOB.pid), w.alice)
            assert error.code == ErrorCode.PERMISSION_DENIED
        # Over the limit on a process she may signal: the limit, and no handle leaks.
        error = refusal(service, Acquire(id=4, scope="b", timeout=5, pid=201), w.alice)
        assert error.code == ErrorCode.LIMIT_EXCEEDED
        assert all(p.refs == 0 for p in w.host.opened if p.pid == 201)

    def test_global_cap_binds_root_too(self) -> None:
        w = make_world(max_timers=2)
        service = w.service
        service.handle(Acquire(id=1, scope="a", timeout=5), w.root, 1.0)
        service.handle(Acquire(id=2, scope="b", timeout=5), w.root, 1.0)
        assert (
            refusal(service, Acquire(id=3, scope="c", timeout=5), w.root).code
            == ErrorCode.LIMIT_EXCEEDED
        )

    def test_connections_per_uid_and_in_total(self) -> None:
        service, _, _ = make_service(max_connections_per_uid=2, max_connections=3)
        first = service.arming.open_connection(ALICE)
        service.arming.open_connection(ALICE)
        with pytest.raises(Refusal, match="uid 1000 has 2 connections open") as caught:
            service.arming.open_connection(ALICE)
        assert caught.value.code == ErrorCode.LIMIT_EXCEEDED
        service.arming.open_connection(ROOT)
        with pytest.raises(Refusal, match="the daemon has 3 connections open"):
            service.arming.open_connection(ROOT)  # the global cap binds root too
        service.arming.close_connection(first)
        service.arming.open_connection(BOB)
        assert service.arming.connections == 3


class TestStatus:
    def test_soonest_first_with_time_left_and_command(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="late", timeout=50), w.alice, 0.0)
        service.handle(Acquire(id=2, scope="soon", timeout=5), w.bob, 0.0)
        reply = service.handle(Status(id=3), w.root, 2.0)
        assert isinstance(reply, StatusReply)
        assert [(t.pid, t.scope, t.remaining, t.command) for t in reply.timers] == [
            (300, "soon", 3.0, ""),
            (200, "late", 48.0, ""),
        ]
        # Command lines travel once per process, beside the timers.
        assert reply.commands == {300: "cmd-300", 200: "cmd-200"}
        assert [t.command for t in reply.timers_with_commands()] == ["cmd-300", "cmd-200"]
        assert reply.cursor is None
        assert (reply.daemon.timers, reply.daemon.processes, reply.daemon.pid) == (2, 2, DAEMON_PID)
        assert reply.daemon.uptime == 2.0

    def test_non_root_sees_only_its_own_uid(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="a", timeout=5), w.alice, 0.0)
        service.handle(Acquire(id=2, scope="b", timeout=5), w.bob, 0.0)
        service.handle(Acquire(id=3, scope="c", timeout=5, pid=201), w.root, 0.0)  # on alice's
        reply = service.handle(Status(id=4), w.alice, 0.0)
        assert isinstance(reply, StatusReply)
        assert sorted(t.scope for t in reply.timers) == ["a", "c"]

    def test_pages_cover_every_timer_once(self) -> None:
        w = make_world()
        service = w.service
        for i in range(25):
            service.handle(Acquire(id=i, scope=f"s{i}", timeout=1 + i % 7), w.alice, 0.0)
        seen: list[str] = []
        cursor = None
        while True:
            reply = service.handle(Status(id=99, limit=10, cursor=cursor), w.alice, 0.0)
            assert isinstance(reply, StatusReply)
            assert len(reply.timers) <= 10
            seen += [t.scope for t in reply.timers]
            cursor = reply.cursor
            if cursor is None:
                break
        assert sorted(seen) == sorted(f"s{i}" for i in range(25))
        remaining = [service.table.get(ALICE.pid, scope).deadline for scope in seen]  # type: ignore[union-attr]
        assert remaining == sorted(remaining)

    def test_a_page_stops_before_the_reply_bound(self) -> None:
        w = make_world(max_scope_bytes=16 * 1024)
        service = w.service
        w.host.command_lines[ALICE.pid] = "python train.py " + "--flag " * 2000
        for i in range(400):
            scope = f"{i:04d}" + "s" * (10 * 1024)
            service.handle(Acquire(id=i, scope=scope, timeout=1 + i), w.alice, 0.0)
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            reply = service.handle(Status(id=99, limit=10_000, cursor=cursor), w.alice, 0.0)
            assert isinstance(reply, StatusReply)
            assert len(encode_frame(reply)) - 4 <= MAX_REPLY_BYTES
            assert reply.commands.keys() == {ALICE.pid}
            command = reply.commands[ALICE.pid]
            assert len(command.encode()) <= MAX_COMMAND_BYTES
            assert command.startswith("python train.py --flag")
            assert command.endswith("…")
            seen += [t.scope[:4] for t in reply.timers]
            pages += 1
            cursor = reply.cursor
            if cursor is None:
                break
        assert seen == [f"{i:04d}" for i in range(400)]  # each once, in order
        assert pages == 4  # about 100 timers of 10 KiB each fit in 1 MiB

    def test_root_pages_resume_within_timers_of_one_deadline(self) -> None:
        """Timers armed in one turn with one timeout share a deadline; the cursor's
        ``seq`` says where among them a page ended."""
        w = make_world()
        service = w.service
        for i in range(25):
            pid = (100, 200, 300)[i % 3]
            service.handle(Acquire(id=i, scope=f"s{i:02d}", timeout=5, pid=pid), w.root, 0.0)
        seen, cursors = every_page(service, w.root, limit=10, now=1.0)
        assert all(cursor.startswith("5.0/") for cursor in cursors)
        assert seen == [f"s{i:02d}" for i in range(25)]  # each once, in arming order

    def test_a_non_root_status_never_walks_the_hosts_timers(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Alice's page comes from her own index: the table's order and its walk
        of every timer are not touched, however many timers root holds."""
        w = make_world()
        service = w.service
        for i in range(200):
            service.handle(Acquire(id=i, scope=f"root-{i}", timeout=1 + i), w.root, 0.0)
        service.handle(Acquire(id=1, scope="b", timeout=5), w.bob, 0.0)
        for i in range(15):
            service.handle(Acquire(id=i, scope=f"a{i:02d}", timeout=20 - i), w.alice, 0.0)

        def everything(*args: object) -> None:
            raise AssertionError("a non-root status walked the host's timers")

        monkeypatch.setattr(TimerTable, "soonest", everything)
        monkeypatch.setattr(TimerTable, "timers", everything)
        seen, _ = every_page(service, w.alice, limit=4, now=0.0)
        assert seen == [f"a{i:02d}" for i in reversed(range(15))]  # soonest first

    def test_command_lines_are_read_again_after_a_second(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="a", timeout=50), w.alice, 0.0)
        w.host.command_lines[ALICE.pid] = "python before.py"

        def command(now: float) -> str:
            reply = service.handle(Status(id=2), w.root, now)
            assert isinstance(reply, StatusReply)
            return reply.commands[ALICE.pid]

        assert command(1.0) == "python before.py"
        w.host.command_lines[ALICE.pid] = "python after.py"  # setproctitle, or exec
        assert command(1.5) == "python before.py"
        assert command(2.0) == "python after.py"

    @pytest.mark.parametrize(
        "cursor", ["x", "", "nan/1", "inf/1", "1e400/2", "1.0/-1", f"1.0/{2**63}", "1.0/1/2"]
    )
    def test_bad_cursor(self, cursor: str) -> None:
        w = make_world()
        service = w.service
        refused = refusal(service, Status(id=1, cursor=cursor), w.root)
        assert refused.code == ErrorCode.INVALID_REQUEST
        assert "the cursor of the page before" in refused.message


class TestExpiryAndExit:
    def test_expire_due_hands_out_retained_handles(self) -> None:
        w = make_world()
        service = w.service
        service.handle(Acquire(id=1, scope="a", timeout=1), w.alice, 0.0)
        service.handle(Acquire(id=2, scope="b", timeout=9), w.alice, 0.0)
        service.handle(Acquire(id=3, scope="a", timeout=1), w.bob, 0.0)
        expired = service.firing.expire_due(1.0)
        assert [(e.timer.pid, e.orphaned) for e in expired] == [(200, False), (300, True)]
        alice, bob = expired[0].process, expired[1].process
        assert alice.refs == 3  # the table's, the action's and her connection's
        assert bob.refs == 2  # the action's and his connection's: he left the table
        assert w.host.tracked == {200}

    def test_exit_drops_every_timer_of_the_process(self) -> None:
        w = make_world()
        service = w.service
        for scope in "abc":
            service.handle(Acquire(id=1, scope=scope, timeout=5), w.alice, 0.0)
        process = service.table.process(ALICE.pid)
        assert process is not None
        dropped = service.lifecycle.process_exited(process, 0.0)
        assert sorted(t.scope for t in dropped) == ["a", "b", "c"]
        assert len(service.table) == 0
        assert w.host.tracked == set()
        assert process.refs == 1  # alice's connection still holds it
        assert service.metrics.exited == 1
        assert service.lifecycle.process_exited(process, 0.0) == []  # reported twice: no effect


def test_ping_and_hello() -> None:
    w = make_world()
    service = w.service
    assert service.handle(Ping(id=5), w.alice, 0.0) == Pong(id=5)
    welcome = service.handle(Hello(id=6, version=PROTOCOL_VERSION), w.alice, 0.0)
    assert isinstance(welcome, Welcome)
    assert welcome.pid == DAEMON_PID
    assert welcome.version == PROTOCOL_VERSION
    # A client of protocol 1, which has no responder, is answered as before.
    older = service.handle(Hello(id=7, version=1), w.alice, 0.0)
    assert isinstance(older, Welcome)
    for unknown in (0, PROTOCOL_VERSION + 1):
        refused = refusal(service, Hello(id=8, version=unknown), w.alice)
        assert refused.code == ErrorCode.UNSUPPORTED_VERSION


def test_restore_judges_each_timer_by_its_own_process() -> None:
    """pid 200 now belongs to a new process (start 1000): an expiry of the old one
    (start 999) is recorded as gone, the new one's expiry resumes, in any order."""
    from watchdogd.core.timers import Course, Timer

    def firing(number: int, start_time: int) -> Timer:
        return Timer(pid=200, scope=f"s{number}", policy="kill", uid=1000, owner=1000,
                     timeout=1.0, armed_at=0.0, deadline=1.0, start_time=start_time,
                     firing=number, run=Course(step=1, fired_at=1.0))  # fmt: skip

    for order in ([firing(1, 999), firing(2, 1000)], [firing(2, 1000), firing(1, 999)]):
        service, _, _ = make_service()
        restored = service.lifecycle.restore(order)
        assert [item.timer.firing for item in restored.resumed] == [2]
        [gone] = [e for e in service.events.page(None, 10, 0) if e.kind == "expired"]
        assert gone.outcome == "gone"
        assert len(service.firing) == 1
        for item in restored.resumed:
            item.process.close()


def test_an_exit_releases_quietly_what_was_armed_so() -> None:
    world = make_world()
    world.service.handle(
        Acquire(id=1, scope="run", timeout=5.0, pid=201, exit_releases=True), world.alice, 0.0
    )
    process = world.service.table.process(201)
    assert process is not None
    assert len(world.service.lifecycle.process_exited(process, 0.0)) == 1
    assert world.service.events.page(None, 10, 0) == []
    assert world.service.metrics.exited == 0


def test_a_restart_loads_its_later_timers_into_the_table_with_their_processes() -> None:
    """The timers due later come in off the event loop (`prepare_later`) and join
    the table whole (`restore_later`): beside a process's first timers, on new
    processes (tracked then), or dropped when their process is gone."""
    from watchdogd.core.timers import Timer

    def stored(pid: int, scope: str, deadline: float, start_time: int) -> Timer:
        return Timer(
            pid=pid, scope=scope, policy="kill", uid=1000, owner=1000, timeout=1.0,
            armed_at=0.0, deadline=deadline, start_time=start_time,
        )  # fmt: skip

    service, host, notified = make_service()
    first = service.lifecycle.restore([stored(200, "soon", 5.0, 1000)])
    assert first.armed == 1
    assert host.tracked == {200}
    later = service.lifecycle.prepare_later(
        [
            stored(200, "later", 100.0, 1000),  # the same process: its handle is reused
            stored(201, "other", 200.0, 1002),  # the fake host's third handle
            stored(300, "reused-pid", 150.0, 5),
        ]
    )
    assert len(service.table) == 1  # nothing changed until merged
    restored = service.lifecycle.restore_later(later)
    assert (restored.armed, restored.dropped) == (2, 1)
    assert host.tracked == {200, 201}
    assert [t.scope for t in service.table.timers_of(200)] == ["soon", "later"]
    assert service.table.get(200, "later") is not None
    assert service.table.owned_by(1000) == 3
    assert sorted(t.scope for t in service.table.visible_to(1000)) == ["later", "other", "soon"]
    assert [p.refs for p in host.opened if p.pid in (200, 300)] == [1, 0, 0]
    assert notified[-1] == 5.0
    due = service.firing.expire_due(1000.0, 10)
    assert [e.timer.scope for e in due] == ["soon", "later", "other"]


def test_later_timers_of_a_pid_now_held_by_another_process_are_dropped() -> None:
    from watchdogd.core.timers import Timer

    def stored(scope: str, deadline: float, start_time: int) -> Timer:
        return Timer(
            pid=201, scope=scope, policy="kill", uid=1000, owner=1000, timeout=1.0,
            armed_at=0.0, deadline=deadline, start_time=start_time,
        )  # fmt: skip

    service, host, _ = make_service()
    service.lifecycle.restore([stored("first", 5.0, 1000)])
    host.opened[0].exited = True  # its process exits; another takes the pid
    later = service.lifecycle.prepare_later([stored("of-the-new-one", 100.0, 1001)])
    restored = service.lifecycle.restore_later(later)
    assert (restored.armed, restored.dropped) == (0, 1)
    assert [t.scope for t in service.table.timers_of(201)] == ["first"]
    assert service.table.owned_by(1000) == 1
    assert host.opened[1].refs == 0


def test_the_stop_drops_every_timer_and_handle_in_one_pass_over_the_processes() -> None:
    w = make_world()
    for scope in ("a", "b"):
        w.service.handle(Acquire(id=1, scope=scope, timeout=5), w.alice, 0.0)
    w.service.handle(Acquire(id=2, scope="c", timeout=5), w.bob, 0.0)
    held = [w.service.table.process(pid) for pid in (ALICE.pid, BOB.pid)]
    w.service.lifecycle.close()
    assert len(w.service.table) == 0
    assert w.service.table.owned_by(ALICE.uid) == 0
    assert list(w.service.table.visible_to(ALICE.uid)) == []
    assert w.host.tracked == set()
    assert [process.refs for process in held if process is not None] == [1, 1]  # the connections'
