"""The timer table: keys, re-arm, orphaned processes, owner counts, the order and
who sees what, by example and against a model (hypothesis)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Never

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from watchdogd.core.interning import Shared
from watchdogd.core.timers import Timer, TimerTable


@dataclass(eq=False)
class Handle:
    pid: int
    start_time: int = 0


def arm(
    table: TimerTable[Handle],
    handle: Handle,
    scope: str,
    timeout: float,
    *,
    now: float = 0.0,
    owner: int = 1000,
) -> bool:
    _, rearmed = table.arm(
        handle, scope, timeout=timeout, policy="kill", uid=owner, owner=owner, now=now
    )
    return rearmed


def test_one_timer_per_pid_and_scope() -> None:
    table: TimerTable[Handle] = TimerTable()
    a, b = Handle(10), Handle(11)
    assert arm(table, a, "x", 5) is False
    assert arm(table, a, "y", 5) is False
    assert arm(table, b, "x", 5) is False
    assert arm(table, a, "x", 9, now=1) is True  # re-arm replaces
    assert len(table) == 3
    assert table.process_count == 2
    timer = table.get(10, "x")
    assert timer is not None
    assert timer.deadline == 10


def test_a_pid_is_held_with_one_handle() -> None:
    table: TimerTable[Handle] = TimerTable()
    arm(table, Handle(10), "x", 5)
    with pytest.raises(ValueError, match="another handle"):
        arm(table, Handle(10), "y", 5)


def test_disarm_returns_the_handle_with_the_last_timer() -> None:
    table: TimerTable[Handle] = TimerTable()
    handle = Handle(10)
    arm(table, handle, "x", 5)
    arm(table, handle, "y", 5)
    timer, gone = table.disarm(10, "x")
    assert timer is not None
    assert gone is None
    timer, gone = table.disarm(10, "y")
    assert gone is handle
    assert table.process(10) is None
    assert table.disarm(10, "y") == (None, None)


def test_a_disarm_that_names_an_arming_takes_that_arming_only() -> None:
    table: TimerTable[Handle] = TimerTable()
    handle = Handle(10)
    arm(table, handle, "x", 5, now=1.0)
    first = table.get(10, "x")
    arm(table, handle, "x", 5, now=2.0)
    second = table.get(10, "x")
    assert first is not None
    assert second is not None
    assert table.disarm(10, "x", first.arm) == (None, None)
    assert table.get(10, "x") is second
    assert table.disarm(10, "x", second.arm) == (second, handle)


def test_an_armings_number_is_one_to_one_with_its_arming_time() -> None:
    """Positive arming times (the daemon's CLOCK_MONOTONIC) give positive numbers
    below 2**63, as a release's `Arm` must be, in the order of the times, each
    time its own: the next float after one gives the next number."""
    times = [5e-324, 1e-300, 0.5, 12345.5, math.nextafter(12345.5, math.inf), 1e9, 1e300]
    numbers = [
        Timer(deadline=0.0, pid=1, scope="s", policy="kill", uid=0, owner=0, timeout=1.0,
              armed_at=at).arm
        for at in times
    ]  # fmt: skip
    assert numbers == sorted(set(numbers))
    assert numbers[0] >= 1
    assert numbers[-1] < 2**63
    assert numbers[4] == numbers[3] + 1


def test_pop_due_marks_orphaned_processes() -> None:
    table: TimerTable[Handle] = TimerTable()
    a, b = Handle(10), Handle(11)
    arm(table, a, "soon", 1)
    arm(table, a, "later", 100)
    arm(table, b, "soon", 2)
    expired = table.pop_due(5)
    assert [(item.timer.pid, item.timer.scope, item.orphaned) for item in expired] == [
        (10, "soon", False),
        (11, "soon", True),
    ]
    assert table.process(10) is a
    assert table.process(11) is None
    assert table.next_deadline() == 100


def test_forget_takes_every_timer_of_a_process() -> None:
    table: TimerTable[Handle] = TimerTable()
    handle = Handle(10)
    for scope in "abc":
        arm(table, handle, scope, 5)
    arm(table, Handle(11), "a", 5)
    forgotten = table.forget(10)
    assert forgotten is not None
    assert forgotten[0] is handle
    assert sorted(timer.scope for timer in forgotten[1]) == ["a", "b", "c"]
    assert len(table) == 1
    assert table.forget(10) is None
    assert [item.timer.pid for item in table.pop_due(100)] == [11]


def test_owner_counts_follow_every_change() -> None:
    table: TimerTable[Handle] = TimerTable()
    a = Handle(10)
    arm(table, a, "x", 5, owner=1000)
    arm(table, a, "y", 5, owner=1000)
    arm(table, a, "x", 5, owner=1000)  # re-arm does not count twice
    arm(table, Handle(11), "x", 1, owner=2000)
    assert table.owned_by(1000) == 2
    assert table.owned_by(2000) == 1
    table.disarm(10, "y")
    table.pop_due(1)
    assert table.owned_by(1000) == 1
    assert table.owned_by(2000) == 0
    table.forget(10)
    assert table.owned_by(1000) == 0


def test_equal_deadlines_expire_in_the_order_they_were_armed() -> None:
    table: TimerTable[Handle] = TimerTable()
    a, b = Handle(10), Handle(11)
    arm(table, b, "first", 5)
    arm(table, a, "second", 5)
    arm(table, b, "third", 4, now=1)
    assert [t.seq for t in table.soonest()] == [0, 1, 2]
    assert [item.timer.scope for item in table.pop_due(5)] == ["first", "second", "third"]


def test_repeated_values_are_one_object() -> None:
    """Timers armed with equal policies and timeouts share the objects: at a
    million timers, a copy each would cost tens of megabytes."""
    table: TimerTable[Handle] = TimerTable()
    handle = Handle(10, start_time=123_456_789)
    for i in range(3):
        table.arm(
            handle, f"s{i}", timeout=float("3600"), policy="".join("kill"),
            uid=1000, owner=1000, now=float(i),
        )  # fmt: skip
    first, *others = table.timers()
    for timer in others:
        assert timer.policy is first.policy
        assert timer.timeout is first.timeout
        assert timer.pid is handle.pid
        assert timer.start_time is handle.start_time


def test_one_scope_armed_by_many_processes_is_one_object() -> None:
    """The ranks of a job, the workers of a service, arm the same scopes: each
    request decodes its own copy, which the table does not keep."""
    table: TimerTable[Handle] = TimerTable()
    for pid in range(10, 13):
        table.arm(
            Handle(pid), "".join(["train/", "step"]), timeout=60.0, policy="kill",
            uid=1000, owner=1000, now=float(pid),
        )  # fmt: skip
    first, *others = table.timers()
    assert others
    assert all(timer.scope is first.scope for timer in others)
    assert table.shared_scope("".join(["train/", "step"])) is first.scope


def test_shared_values_are_bounded() -> None:
    shared: Shared[float] = Shared(bound=3)
    first = shared[float("2.5")]
    assert shared[float("2.5")] is first
    shared[float("3.5")]
    shared[float("7.5")]
    shared[float("8.5")]  # a fourth value: it starts over
    assert len(shared) == 1
    assert shared[float("2.5")] is not first


def test_a_non_root_uid_sees_its_processes_and_what_it_armed() -> None:
    table: TimerTable[Handle] = TimerTable()
    alice, bob, daemon = Handle(10), Handle(20), Handle(30)
    table.arm(alice, "own", timeout=1, policy="kill", uid=1000, owner=1000, now=0)
    table.arm(alice, "by-root", timeout=1, policy="kill", uid=1000, owner=0, now=0)
    table.arm(bob, "by-alice", timeout=1, policy="kill", uid=2000, owner=1000, now=0)
    table.arm(bob, "bobs", timeout=1, policy="kill", uid=2000, owner=2000, now=0)
    table.arm(daemon, "roots", timeout=1, policy="kill", uid=0, owner=0, now=0)
    assert sorted(t.scope for t in table.visible_to(1000)) == ["by-alice", "by-root", "own"]
    assert sorted(t.scope for t in table.visible_to(2000)) == ["bobs", "by-alice"]
    assert list(table.visible_to(3000)) == []
    table.forget(20)
    assert sorted(t.scope for t in table.visible_to(1000)) == ["by-root", "own"]
    assert list(table.visible_to(2000)) == []


class Untouchable(list[Timer]):
    """The timers of a process that a walk must not visit."""

    def __iter__(self) -> Never:
        raise AssertionError("walked the timers of another user's process")


def test_what_a_uid_sees_is_found_without_walking_other_processes() -> None:
    table: TimerTable[Handle] = TimerTable()
    for pid in range(100, 150):  # root's processes, a thousand timers
        handle = Handle(pid)
        for i in range(20):
            table.arm(handle, f"r{i}", timeout=1, policy="kill", uid=0, owner=0, now=0)
    alice = Handle(10)
    table.arm(alice, "mine", timeout=1, policy="kill", uid=1000, owner=1000, now=0)
    for pid in range(100, 150):
        tracked = table._processes[pid]
        tracked.timers = Untouchable(tracked.timers)
    assert [timer.scope for timer in table.visible_to(1000)] == ["mine"]
    assert list(table.visible_to(2000)) == []


def test_restored_ties_without_numbers_still_order() -> None:
    """Schema 1 stored no ``seq``: restored timers may tie on (deadline, seq)."""
    table: TimerTable[Handle] = TimerTable()
    handle = Handle(10)
    timers = [
        Timer(deadline=5.0, pid=10, scope=scope, policy="kill", uid=0, owner=0,
              timeout=5.0, armed_at=0.0)
        for scope in ("b", "a", "c")
    ]  # fmt: skip
    table.restore([(handle, timers)])
    assert [t.scope for t in table.soonest()] == ["a", "b", "c"]
    timer, _ = table.disarm(10, "b")
    assert timer is not None
    assert [t.scope for t in table.soonest()] == ["a", "c"]


PIDS = st.sampled_from([10, 11, 12, 13])
SCOPES = st.sampled_from(["a", "b", "c"])
UIDS = st.sampled_from([0, 1000, 2000])
#: Few distinct times, so deadlines tie often.
TIMES = st.integers(min_value=0, max_value=8).map(float)


class TableAgainstModel(RuleBasedStateMachine):
    """The table agrees with a dict of what is armed, under every operation:
    contents, order, owner counts, what each uid sees, and a restart."""

    def __init__(self) -> None:
        super().__init__()
        self.table: TimerTable[Handle] = TimerTable()
        self.handles: dict[int, Handle] = {}
        #: (pid, scope) -> (deadline, uid, owner), in the order armed.
        self.model: dict[tuple[int, str], tuple[float, int, int]] = {}

    def handle(self, pid: int) -> Handle:
        if self.table.process(pid) is None:
            self.handles[pid] = Handle(pid)
        return self.handles[pid]

    @rule(pid=PIDS, scope=SCOPES, now=TIMES, timeout=TIMES, uid=UIDS, owner=UIDS)
    def arm(
        self, *, pid: int, scope: str, now: float, timeout: float, uid: int, owner: int
    ) -> None:
        timer, rearmed = self.table.arm(
            self.handle(pid), scope, timeout=timeout + 1, policy="kill",
            uid=uid, owner=owner, now=now,
        )  # fmt: skip
        assert rearmed == ((pid, scope) in self.model)
        self.model.pop((pid, scope), None)
        self.model[(pid, scope)] = (timer.deadline, uid, owner)
        assert timer.deadline == now + timeout + 1

    @rule(pid=PIDS, scope=SCOPES)
    def disarm(self, pid: int, scope: str) -> None:
        timer, gone = self.table.disarm(pid, scope)
        assert (timer is not None) == ((pid, scope) in self.model)
        self.model.pop((pid, scope), None)
        assert (gone is not None) == (timer is not None and all(p != pid for p, _ in self.model))

    @rule(now=TIMES, limit=st.none() | st.integers(min_value=0, max_value=5))
    def pop_due(self, now: float, limit: int | None) -> None:
        expired = self.table.pop_due(now, limit)
        # Earliest first; ties in the order they were armed (the model's order).
        due = sorted(
            (key for key, (deadline, _, _) in self.model.items() if deadline <= now),
            key=lambda key: self.model[key][0],
        )[:limit]
        assert [item.timer.key for item in expired] == due
        for item in expired:  # the process leaves with its last timer
            del self.model[item.timer.key]
            assert item.orphaned == all(p != item.timer.pid for p, _ in self.model)

    @rule(pid=PIDS)
    def forget(self, pid: int) -> None:
        forgotten = self.table.forget(pid)
        keys = [key for key in self.model if key[0] == pid]
        assert (forgotten is None) == (not keys)
        if forgotten is not None:
            assert sorted(timer.key for timer in forgotten[1]) == sorted(keys)
        for key in keys:
            del self.model[key]

    @rule()
    def restart(self) -> None:
        """What a restart does: every timer into a new table, by process."""
        by_pid: dict[int, list[Timer]] = {}
        for timer in self.table.timers():
            by_pid.setdefault(timer.pid, []).append(timer)
        before = list(self.table.soonest())
        self.table = TimerTable()
        self.table.restore((self.handles[pid], timers) for pid, timers in by_pid.items())
        assert list(self.table.soonest()) == before

    @rule(deadline=TIMES, seq=st.integers(min_value=0, max_value=3))
    def page(self, deadline: float, seq: int) -> None:
        assert list(self.table.soonest((deadline, seq))) == [
            timer for timer in self.table.soonest() if (timer.deadline, timer.seq) > (deadline, seq)
        ]

    @invariant()
    def agrees(self) -> None:
        table = self.table
        assert len(table) == len(self.model)
        assert table.process_count == len({pid for pid, _ in self.model})
        ordered = list(table.soonest())
        assert [timer.key for timer in ordered] == sorted(
            self.model, key=lambda key: self.model[key][0]
        )
        positions = [(timer.deadline, timer.seq) for timer in ordered]
        assert positions == sorted(set(positions))  # unique, in order
        assert table.next_deadline() == (ordered[0].deadline if ordered else None)
        for uid in (0, 1000, 2000):
            assert table.owned_by(uid) == sum(o == uid for _, _, o in self.model.values())
        for uid in (1000, 2000):
            assert sorted(timer.key for timer in table.visible_to(uid)) == sorted(
                key for key, (_, u, o) in self.model.items() if uid in (u, o)
            )


TableAgainstModel.TestCase.settings = settings(
    max_examples=200 if os.environ.get("WATCHDOGD_SOAK", "") == "1" else 80,
    stateful_step_count=40,
    deadline=None,
)
TestTableAgainstModel = TableAgainstModel.TestCase
