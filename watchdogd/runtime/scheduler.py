"""The task that fires timers on time.

It sleeps until the earliest deadline, with no polling interval, and is woken early
only when a deadline earlier than the one it sleeps for is armed (`notify`); re-arms
that move deadlines later, the common case, cost it nothing. Firing is synchronous
and never waits on an action, so one slow action cannot delay another timer. Tasks
that serve requests also call `poll` between requests, so timers fire on time even
while a flood of requests keeps the event loop busy.

Work comes in bounded passes, so that a burst of expiries never holds the event
loop for long: ``fire(now)`` fires one batch of what is due and says whether more
may be; ``settle(until)`` does the follow-up work of expiries (see
`watchdogd.runtime.executor`) until the next deadline, or for a slice of at most
`SLICE`, and says whether more remains. Firing always comes first: follow-up work runs only
when nothing is due, and the task lets every other task run between passes.

On the daemon's own clock (CLOCK_MONOTONIC) it sleeps on a `TimerFd`, which wakes it
within microseconds of the deadline; on any other clock (trio's test clocks) it
sleeps with trio's own deadlines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final

import trio

from ..host.timerfd import TimerFd


def _nothing(until: float) -> bool:
    return False


#: The longest the task settles before it lets other tasks run (seconds).
SLICE: Final = 0.002


class Scheduler:
    """Calls ``fire(now)`` whenever a deadline may have passed, and ``settle``
    while it has work and nothing is due."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        next_deadline: Callable[[], float | None],
        fire: Callable[[float], bool],
        settle: Callable[[float], bool] = _nothing,
        heartbeat: tuple[float, Callable[[], object]] | None = None,
    ) -> None:
        """``fire(now)`` returns True when it stopped at its batch with more
        perhaps due; ``settle(until)`` works until its clock reads ``until`` (the
        next deadline, or the end of a slice of `SLICE`), and returns True when it
        has more to do. ``heartbeat`` is (interval, beat): ``beat()`` is called
        from this task's own loop at least every ``interval`` seconds (systemd's
        WATCHDOG=1), so a stalled loop stops beating."""
        self._clock = clock
        self._next_deadline = next_deadline
        self._fire = fire
        self._settle = settle
        self._heartbeat = heartbeat
        self._target = math.inf
        self._sleep: trio.CancelScope | None = None

    def poll(self, now: float) -> None:
        """Fire a batch of what is due at ``now`` if anything is. Called by busy
        connection tasks, so that a flood of requests cannot keep the scheduler task
        from running on time; O(1) when nothing is due. The scheduler task is woken
        for the follow-up work."""
        if now >= self._target:
            if not self._fire(now):
                deadline = self._next_deadline()
                self._target = math.inf if deadline is None else deadline
            self.wake()

    def notify(self, deadline: float) -> None:
        """A timer with ``deadline`` was armed: wake up if it is the new earliest."""
        if deadline < self._target:
            self._target = deadline
            self.wake()

    def wake(self) -> None:
        """Run a pass now (there is work to settle)."""
        if self._sleep is not None:
            self._sleep.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        timer = TimerFd() if self._clock is time.monotonic else None
        next_beat = -math.inf if self._heartbeat is not None else math.inf
        try:
            task_status.started()
            while True:
                now = self._clock()
                if now >= next_beat:
                    next_beat = self._beat(now)
                if self._fire(now):
                    self._target = now
                    await trio.lowlevel.checkpoint()
                    continue
                deadline = self._next_deadline()
                self._target = math.inf if deadline is None else deadline
                if self._settle(min(self._target, now + SLICE)):
                    await trio.lowlevel.checkpoint()
                    continue
                wake = min(self._target, next_beat)
                with trio.CancelScope() as self._sleep:
                    if timer is not None:
                        timer.set(wake)
                        await trio.lowlevel.wait_readable(timer.fd)
                        timer.clear()
                    else:
                        self._sleep.deadline = trio.current_time() + (wake - self._clock())
                        await trio.sleep_forever()
                self._sleep = None
        finally:
            if timer is not None:
                timer.close()

    def _beat(self, now: float) -> float:
        """Beat; returns when the next beat is due."""
        assert self._heartbeat is not None
        interval, beat = self._heartbeat
        beat()
        return now + interval
