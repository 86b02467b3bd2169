"""The restart grace: a timer restored at a start that falls due within
`RESTART_GRACE` of it waits until the grace ends for a release that may be on its
way; every other timer keeps its deadline. The grace is given once an arming,
recorded with the timer, however often the daemon starts again."""

from __future__ import annotations

import pytest

from watchdogd.core.timers import Course, Timer, Watch
from watchdogd_protocol import RESTART_GRACE, Acquire, Release, Released

from helpers.fakes import RecordingJournal, make_world

#: The daemon of `make_world` started at 0.0 on the table's clock.
STARTED = 0.0
#: What the event of a timer says whose grace an earlier start gave it.
EARLIER = (
    f"held {RESTART_GRACE:g}s after an earlier restart for a release on its way, and no "
    "longer: the grace is given once an arming"
)


def stored(
    scope: str, deadline: float, *, armed_at: float = -10.0, held_until: float | None = None
) -> Timer:
    """A timer of alice's pid 200, as the state held it when the daemon started
    (``held_until``: when the grace an earlier start gave it ends)."""
    return Timer(
        pid=200, scope=scope, policy="kill", uid=1000, owner=1000, timeout=1.0,
        armed_at=armed_at, deadline=deadline, start_time=1000,
        watch=None if held_until is None else Watch(held_until=held_until),
    )  # fmt: skip


def test_an_overdue_timer_waits_for_the_grace_then_fires_on_its_own_deadline() -> None:
    w = make_world()
    w.service.lifecycle.restore([stored("overdue", deadline=-2.0)])
    assert w.service.firing.expire_due(STARTED + 0.5, 10) == []
    # Held in the table, where a status page shows it and a release finds it.
    assert w.service.table.get(200, "overdue") is not None
    assert w.notified[-1] == STARTED + RESTART_GRACE
    [fired] = w.service.firing.expire_due(STARTED + RESTART_GRACE, 10)
    assert fired.timer.deadline == -2.0  # its lateness counts from the deadline armed
    assert fired.note == f"held {RESTART_GRACE:g}s after the restart for a release on its way"
    fired.process.close()
    assert w.service.table.get(200, "overdue") is None


def test_a_release_that_comes_within_the_grace_disarms_it() -> None:
    w = make_world()
    w.service.lifecycle.restore([stored("released-late", deadline=-0.1)])
    assert w.service.firing.expire_due(STARTED + 0.2, 10) == []
    reply = w.service.handle(Release(id=1, scope="released-late", pid=200), w.alice, 0.3)
    assert isinstance(reply, Released)
    assert reply.found
    assert w.service.firing.expire_due(STARTED + RESTART_GRACE + 1, 10) == []


def test_a_restored_timer_due_within_the_grace_waits_too() -> None:
    w = make_world()
    w.service.lifecycle.restore([stored("soon", deadline=STARTED + RESTART_GRACE / 2)])
    assert w.service.firing.expire_due(STARTED + RESTART_GRACE / 2, 10) == []
    [fired] = w.service.firing.expire_due(STARTED + RESTART_GRACE, 10)
    assert fired.timer.deadline == STARTED + RESTART_GRACE / 2
    fired.process.close()


@pytest.mark.parametrize("deadline", [STARTED + RESTART_GRACE, STARTED + RESTART_GRACE + 5])
def test_a_restored_timer_due_after_the_grace_fires_on_time(deadline: float) -> None:
    w = make_world()
    w.service.lifecycle.restore([stored("later", deadline=deadline)])
    assert w.service.firing.expire_due(deadline - 0.01, 10) == []
    [fired] = w.service.firing.expire_due(deadline, 10)
    assert (fired.timer.deadline, fired.note) == (deadline, "")
    fired.process.close()


def test_a_timer_armed_after_the_start_is_not_held() -> None:
    w = make_world()
    w.service.lifecycle.restore([stored("overdue", deadline=-1.0)])
    w.service.handle(Acquire(id=1, scope="fresh", timeout=0.1, pid=200), w.alice, STARTED)
    [fired] = w.service.firing.expire_due(STARTED + 0.1, 10)
    assert fired.timer.scope == "fresh"
    fired.process.close()
    # Re-armed after the start, a restored timer is the worker's own again.
    w.service.handle(Acquire(id=2, scope="overdue", timeout=0.2, pid=200), w.alice, 0.1)
    [fired] = w.service.firing.expire_due(STARTED + 0.35, 10)
    assert (fired.timer.scope, fired.note) == ("overdue", "")
    fired.process.close()


def test_a_policy_in_progress_resumes_at_once() -> None:
    w = make_world()
    running = Timer(
        pid=200, scope="firing", policy="kill", uid=1000, owner=1000, timeout=1.0,
        armed_at=-10.0, deadline=-9.0, start_time=1000, firing=1, run=Course(fired_at=-9.0),
    )  # fmt: skip
    restored = w.service.lifecycle.restore([running])
    assert [item.timer.scope for item in restored.resumed] == ["firing"]
    for item in restored.resumed:
        item.process.close()


def test_the_hold_is_forgotten_once_every_held_timer_is_gone() -> None:
    w = make_world()
    w.service.lifecycle.restore([stored(f"s{i}", deadline=-1.0) for i in range(3)])
    assert w.service.firing.expire_due(STARTED + 0.1, 10) == []
    w.service.handle(Release(id=1, scope="s0", pid=200), w.alice, 0.2)
    fired = w.service.firing.expire_due(STARTED + RESTART_GRACE, 10)
    assert [item.timer.scope for item in fired] == ["s1", "s2"]
    for item in fired:
        item.process.close()
    assert w.service.firing._grace._held == {}


def test_the_grace_given_is_recorded_with_the_timer_beside_its_deadline() -> None:
    journal = RecordingJournal()
    w = make_world(journal)
    w.service.lifecycle.restore([stored("overdue", deadline=-2.0)])
    assert w.service.firing.expire_due(STARTED + 0.1, 10) == []
    recorded = journal.changes[(200, "overdue", 0)]
    assert recorded is not None
    assert recorded.deadline == -2.0  # the state keeps the deadline it was armed with
    assert recorded.watch == Watch(held_until=STARTED + RESTART_GRACE)


def test_a_later_start_holds_it_only_until_the_grace_it_was_given_ends() -> None:
    journal = RecordingJournal()
    w = make_world(journal, now=0.5)  # the start that gave it its grace was at 0.0
    w.service.lifecycle.restore([stored("overdue", deadline=-2.0, held_until=1.0)])
    assert w.service.firing.expire_due(0.5, 10) == []
    assert w.notified[-1] == 1.0
    assert journal.changes == {}  # nothing more to record
    [fired] = w.service.firing.expire_due(1.0, 10)
    assert fired.timer.deadline == -2.0
    assert fired.note == EARLIER
    fired.process.close()


def test_a_start_after_the_grace_it_was_given_ended_fires_it_at_once() -> None:
    w = make_world(now=3.0)
    w.service.lifecycle.restore([stored("overdue", deadline=-2.0, held_until=1.0)])
    [fired] = w.service.firing.expire_due(3.0, 10)
    assert (fired.timer.deadline, fired.note) == (-2.0, EARLIER)
    fired.process.close()


def test_a_daemon_restarting_in_a_loop_fires_a_due_timer_when_its_one_grace_ends() -> None:
    """Started every 0.7 s and killed 0.7 s after each start, for 21 s: a timer
    armed before the first start and due 0.3 s after it fires at the end of the
    grace that start gave it, on the daemon after. (Given a grace anew at every
    start, it outlived every daemon of the loop.)"""
    journal = RecordingJournal()
    journal.put(stored("hung", deadline=0.3))
    fired_at = None
    for start in (0.7 * n for n in range(30)):
        w = make_world(journal, now=start)
        w.service.lifecycle.restore(journal.state())
        now: float | None = start
        while now is not None and now < start + 0.7:  # killed then: no pass after
            if fired := w.service.firing.expire_due(now, 10):
                fired_at = now
                fired[0].process.close()
                break
            now = min((due for due in w.notified if due > now), default=None)
        if fired_at is not None:
            break
    assert fired_at == STARTED + RESTART_GRACE
