"""The timerfd the scheduler sleeps on."""

from __future__ import annotations

import select
import time

from watchdogd.host.timerfd import TimerFd


def readable(timer: TimerFd, wait: float) -> bool:
    poller = select.poll()
    poller.register(timer.fd, select.POLLIN)
    return bool(poller.poll(wait * 1000))


def test_becomes_readable_at_the_deadline_not_before() -> None:
    timer = TimerFd()
    try:
        deadline = time.monotonic() + 0.05
        timer.set(deadline)
        assert not readable(timer, 0)
        assert readable(timer, 5)
        assert time.monotonic() >= deadline
        timer.clear()
        assert not readable(timer, 0)
    finally:
        timer.close()


def test_a_past_deadline_fires_at_once_and_infinity_disarms() -> None:
    timer = TimerFd()
    try:
        timer.set(time.monotonic() - 1)
        assert readable(timer, 1)
        timer.clear()
        timer.set(time.monotonic() + 0.01)
        timer.set(float("inf"))
        assert not readable(timer, 0.05)
    finally:
        timer.close()
