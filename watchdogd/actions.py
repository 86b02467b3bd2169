"""What happens when a timer expires: the process is killed through its pidfd.

An action never raises into the scheduler: a process that is already gone, or a
signal the kernel refuses, becomes the recorded result of the expiry. Each expiry is
logged as one line: pid, scope, policy, how late the signal went out, and the result.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from .logs import log, logfmt
from .process import Process
from .timers import Expired


def send(process: Process, signum: int) -> str:
    """Signal ``process`` through its pidfd; returns what happened, in a word or two."""
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        return "gone"
    except OSError as exc:
        return f"failed: {exc.strerror}"
    return f"sent {signal.Signals(signum).name}"


class Actions:
    """Carries out expiries; ``clock`` is the clock deadlines are on."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def carry_out(self, expired: list[Expired[Process]]) -> None:
        """Act on every expired timer, then release its process handle."""
        for item in expired:
            try:
                result = send(item.process, signal.SIGKILL)
                late = self._clock() - item.timer.deadline
            finally:
                item.process.close()
            timer = item.timer
            log.warning(
                logfmt(
                    "expired",
                    pid=timer.pid,
                    scope=timer.scope,
                    policy=timer.policy,
                    late_ms=late * 1000,
                    result=result,
                )
            )
