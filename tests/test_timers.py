"""The timer table: keys, re-arm, orphaned processes, owner counts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from watchdogd.core.timers import TimerTable


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
