"""A root canary: a root process under a short timer, its death timed through a
pidfd, so that a test of an attack checks that root's timers still fire on time
while it goes on."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

from watchdogd_client import Client

from helpers.daemon import expired_event
from helpers.processes import at_timing_priority, at_timing_priority_now, reap, sleeper
from helpers.waiting import PATIENCE


class Canary:
    """A ``sleep`` child of the test armed by root through ``client`` to be killed
    in ``timeout`` seconds; a thread notes when its pidfd says it died."""

    def __init__(self, client: Client, timeout: float, scope: str = "canary") -> None:
        self.client = client
        with at_timing_priority():
            self.victim = sleeper()
        self._pidfd = os.pidfd_open(self.victim.pid)
        remaining = client.acquire(scope, timeout, pid=self.victim.pid)
        # The latest it can be: a slow answer never makes a canary late.
        self.deadline = time.monotonic() + remaining
        self.died: float | None = None
        self._watcher = threading.Thread(target=self._wait, daemon=True)
        self._watcher.start()

    def _wait(self) -> None:
        at_timing_priority_now()
        ready, _, _ = select.select([self._pidfd], [], [], PATIENCE * 4)
        if ready:
            self.died = time.monotonic()

    def lateness(self) -> float:
        """How late after its deadline it was signalled: the later of its death by
        SIGKILL as seen here and its first signal as the daemon recorded it."""
        self._watcher.join(PATIENCE * 4)
        assert self.died is not None, f"canary pid {self.victim.pid} never died"
        assert self.victim.wait(timeout=PATIENCE) == -signal.SIGKILL
        event = expired_event(self.client, self.victim.pid)
        assert event.late is not None
        return max(self.died - self.deadline, event.late)

    def close(self) -> None:
        os.close(self._pidfd)
        reap(self.victim)
