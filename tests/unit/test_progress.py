"""Progress that can't be faked, learned timeouts and `Why`, against the fake process
port: the deadlines and what each reply says. The clock is a number passed in."""

from __future__ import annotations

import pytest

from watchdogd.core.config import Config, HistoryConfig, PolicyConfig, StepConfig
from watchdogd.core.service import Caller, Service
from watchdogd_protocol import (
    Acquire,
    Acquired,
    Auto,
    Release,
    Suggest,
    SuggestReply,
    Why,
    WhyReply,
)

from helpers.fakes import FakeProcess, World, make_world

STALLING = PolicyConfig(steps=[StepConfig(signal="SIGKILL")], stall=5.0)


def world() -> World:
    made = make_world()
    made.service.reconfigure(
        Config(
            policies={"stalling": STALLING, "ops": PolicyConfig(steps=[], root_only=True)},
            history=HistoryConfig(min_samples=3),
        )
    )
    return made


def arm(
    service: Service[FakeProcess],
    caller: Caller[FakeProcess],
    now: float,
    *,
    progress: int | None = None,
    timeout: float = 60.0,
    scope: str = "loop",
    policy: str | None = "stalling",
    auto: Auto | None = None,
) -> Acquired:
    request = Acquire(
        id=1, scope=scope, timeout=timeout, policy=policy, progress=progress, auto=auto
    )
    reply = service.handle(request, caller, now)
    assert isinstance(reply, Acquired)
    return reply


def deadline(service: Service[FakeProcess], pid: int = 200, scope: str = "loop") -> float:
    timer = service.table.get(pid, scope)
    assert timer is not None
    return timer.deadline


def test_renewals_keep_a_timer_alive_only_while_its_progress_grows() -> None:
    w = world()
    assert arm(w.service, w.alice, 0.0, progress=1).remaining == 5.0
    assert arm(w.service, w.alice, 1.0, progress=2).remaining == 5.0
    assert deadline(w.service) == 6.0
    # The same value, a lower one, or none: its progress did not grow.
    for now, progress in ((2.0, 2), (3.0, 1), (4.0, None)):
        assert arm(w.service, w.alice, now, progress=progress).remaining == 6.0 - now
        assert deadline(w.service) == 6.0
    timer = w.service.table.get(200, "loop")
    assert timer is not None
    assert timer.stalled
    # Growth past the highest value seen moves it again.
    arm(w.service, w.alice, 5.0, progress=3)
    assert deadline(w.service) == 10.0


def test_the_timeout_still_bounds_a_timer_that_progresses() -> None:
    w = world()
    arm(w.service, w.alice, 0.0, progress=1, timeout=2.0)
    assert deadline(w.service) == 2.0
    timer = w.service.table.get(200, "loop")
    assert timer is not None
    assert not timer.stalled


def test_a_timer_released_and_armed_again_starts_anew() -> None:
    w = world()
    arm(w.service, w.alice, 0.0, progress=7)
    w.service.handle(Release(id=2, scope="loop"), w.alice, 1.0)
    arm(w.service, w.alice, 4.0, progress=7)
    assert deadline(w.service) == 9.0


def test_progress_under_a_policy_without_stall_is_kept_and_changes_nothing() -> None:
    w = world()
    arm(w.service, w.alice, 0.0, progress=1, policy=None, timeout=3.0)
    arm(w.service, w.alice, 1.0, progress=1, policy=None, timeout=3.0)
    assert deadline(w.service) == 4.0
    timer = w.service.table.get(200, "loop")
    assert timer is not None
    assert timer.watched is not None
    assert timer.watched.progress == 1


def test_auto_arms_the_ceiling_until_history_suggests_then_the_suggestion() -> None:
    w = world()
    for start in (0.0, 1.0):
        reply = arm(w.service, w.alice, start, policy=None, timeout=30.0, auto=Auto())
        assert (reply.remaining, reply.timeout_from) == (
            30.0,
            f"ceiling: {int(start)} of the 3 releases a suggestion needs",
        )
        w.service.handle(Release(id=2, scope="loop"), w.alice, start + 0.2)
    w.service.handle(Acquire(id=3, scope="loop", timeout=9.0), w.alice, 2.0)
    w.service.handle(Release(id=4, scope="loop"), w.alice, 2.25)
    reply = arm(w.service, w.alice, 3.0, policy=None, timeout=30.0, auto=Auto(floor=0.1))
    assert reply.remaining == pytest.approx(0.5)  # 2 x p99 (0.25, to its bucket)
    assert reply.timeout_from.startswith("learned: 0.5 s suggested by 3 releases")
    timer = w.service.table.get(200, "loop")
    assert timer is not None
    assert timer.timeout == pytest.approx(0.5)
    # Another user's history of the same scope is their own.
    reply = arm(w.service, w.bob, 3.0, policy=None, timeout=30.0, auto=Auto(), scope="loop")
    assert reply.remaining == 30.0


def test_suggest_shows_a_user_their_own_history_and_root_everyone_s() -> None:
    w = world()
    for caller in (w.alice, w.bob):
        w.service.handle(Acquire(id=1, scope="step", timeout=9.0), caller, 0.0)
        w.service.handle(Release(id=2, scope="step"), caller, 0.5)
    mine = w.service.handle(Suggest(id=3), w.alice, 1.0)
    assert isinstance(mine, SuggestReply)
    assert [(row.uid, row.executable, row.scope, row.count) for row in mine.suggestions] == [
        (1000, "/usr/bin/prog-200", "step", 1)
    ]
    assert (mine.min_samples, mine.margin, mine.cursor) == (3, 2.0, None)
    everyone = w.service.handle(Suggest(id=4), w.root, 1.0)
    assert isinstance(everyone, SuggestReply)
    assert [row.uid for row in everyone.suggestions] == [1000, 2000]
    first = w.service.handle(Suggest(id=5, limit=1), w.root, 1.0)
    assert isinstance(first, SuggestReply)
    assert first.cursor == 1
    rest = w.service.handle(Suggest(id=6, limit=1, cursor=1), w.root, 1.0)
    assert isinstance(rest, SuggestReply)
    assert rest.cursor is None
    assert first.suggestions + rest.suggestions == everyone.suggestions


def test_why_says_what_is_due_and_why() -> None:
    w = world()
    arm(w.service, w.alice, 0.0, progress=4)
    arm(w.service, w.alice, 2.0, progress=4)
    arm(w.service, w.alice, 2.0, scope="plain", policy=None, timeout=10.0)
    reply = w.service.handle(Why(id=1, pid=200), w.alice, 3.0)
    assert isinstance(reply, WhyReply)
    assert (reply.command, reply.executable, reply.uid) == ("cmd-200", "/usr/bin/prog-200", 1000)
    loop, plain = reply.timers
    assert (loop.scope, loop.due, loop.remaining, loop.progress, loop.stall) == (
        "loop",
        "stalled",
        2.0,
        4,
        5.0,
    )
    assert loop.progressed == 3.0
    assert loop.armed == 1.0
    assert (plain.scope, plain.due, plain.remaining, plain.timeout_from) == (
        "plain",
        "timeout",
        9.0,
        "",
    )
    # Bob may not see alice's process: nothing of it.
    hidden = w.service.handle(Why(id=2, pid=200), w.bob, 3.0)
    assert isinstance(hidden, WhyReply)
    assert (hidden.timers, hidden.command, hidden.uid) == ([], "", None)


def test_why_shows_an_expiry_in_progress() -> None:
    w = world()
    arm(w.service, w.alice, 0.0, progress=1)
    [expired] = w.service.firing.expire_due(5.0)
    reply = w.service.handle(Why(id=1, pid=200), w.root, 5.5)
    assert isinstance(reply, WhyReply)
    [timer] = reply.timers
    assert timer.firing == "step 1 of 1: SIGKILL"
    assert timer.due == "stalled"
    expired.process.close()
