"""``watchdogctl run``: a command run as a child under a timer of the daemon.

The child is not reaped until its timer has been released, so the pid the release
names is still the child's, never a process that reused the number. A child whose
timer could not be armed is killed rather than left running unwatched. SIGINT,
SIGTERM and SIGHUP that reach watchdogctl while the child runs are passed on to it.
Whatever stops watchdogctl from running the command under a timer is a `RunFailed`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import click

from watchdogd_client import Client, ErrorCode, RequestRefused, WatchdogdError
from watchdogd_client.protocol import EventInfo

#: Exit status of ``watchdogctl run`` when watchdogctl itself fails (as GNU timeout does).
RUN_FAILED: Final = 125
_FORWARDED: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: How long `run_under_timer` waits for the event of an expiry whose policy is still finishing.
_EXPIRY_PATIENCE: Final = 5.0


class RunFailed(click.ClickException):
    """watchdogctl run could not run its command under a timer."""

    exit_code = RUN_FAILED


class Ran(NamedTuple):
    """How the command ended: its ``returncode`` as `subprocess` gives it (-N for
    signal N), and the daemon's ``expired`` event when its timer fired on it."""

    pid: int
    returncode: int
    expiry: EventInfo | None


def run_under_timer(
    client: Client, command: Sequence[str], *, scope: str, timeout: float, policy: str | None
) -> Ran:
    """Run ``command`` with the timer ``(its pid, scope)`` armed until it exits."""
    try:
        # Also the proof that a daemon answers, before anything is started.
        seen = client.events(limit=1).last
    except WatchdogdError as exc:
        raise RunFailed(str(exc)) from None
    with _Forwarder() as forwarder:
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            raise RunFailed(str(exc)) from None
        forwarder.attach(child.pid)
        armed = time.monotonic()
        _arm_child(client, child, scope, timeout, policy)
        # Wait without reaping, so the pid still names the child when its timer
        # is released; then reap.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        # The daemon's deadline is later than armed + timeout: a child that ended
        # before that was not touched by the daemon, and no event is waited for.
        due = time.monotonic() >= armed + timeout
        found = _release_child(client, child, scope)
        returncode = child.wait()
        fired = due and found is not True
        expiry = _expiry_of(client, child.pid, scope, seen) if fired else None
    return Ran(child.pid, returncode, expiry)


def _expiry_of(client: Client, pid: int, scope: str, seen: int) -> EventInfo | None:
    """The daemon's ``expired`` event for the timer ``(pid, scope)``, or None when it
    did not fire. It is recorded once the policy has finished, a moment after the
    process died: wait for it, for at most `_EXPIRY_PATIENCE` seconds. An ``exited``
    event for the pid first means the exit found the timer still armed: no expiry."""
    deadline = time.monotonic() + _EXPIRY_PATIENCE
    while True:
        left = deadline - time.monotonic()
        try:
            page = client.events(after=seen, limit=1000, wait=max(left, 0.0))
        except WatchdogdError:
            return None  # the run's result does not depend on this report
        for event in page.events:
            if event.pid != pid:
                continue
            if event.kind == "expired" and event.scope == scope:
                return event
            if event.kind == "exited":
                return None
        seen = page.last
        if left <= 0:
            return None


class _Forwarder:
    """Passes SIGINT, SIGTERM and SIGHUP on to the child, through its pidfd.

    The handlers are in place before the child starts; a signal that arrives before
    the child exists is passed on as soon as it does. A pidfd (rather than
    Popen.send_signal, which may reap) keeps the child unreaped until `run_under_timer` reaps it.
    """

    def __init__(self) -> None:
        self._pidfd: int | None = None
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Forwarder:
        self._previous = {signum: signal.signal(signum, self._forward) for signum in _FORWARDED}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._pidfd is not None:
            os.close(self._pidfd)

    def attach(self, pid: int) -> None:
        self._pidfd = os.pidfd_open(pid)
        for signum in self._pending:
            self._send(signum)

    def _forward(self, signum: int, frame: object) -> None:
        if self._pidfd is None:
            self._pending.append(signum)
        else:
            self._send(signum)

    def _send(self, signum: int) -> None:
        assert self._pidfd is not None
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signum)


def _arm_child(
    client: Client, child: subprocess.Popen[bytes], scope: str, timeout: float, policy: str | None
) -> None:
    try:
        client.acquire(scope, timeout, policy=policy, pid=child.pid, exit_releases=True)
    except RequestRefused as exc:
        if exc.code == ErrorCode.NO_SUCH_PROCESS:
            return  # it has exited already; nothing to watch
        _abandon(child)
        raise RunFailed(str(exc)) from None
    except WatchdogdError as exc:
        _abandon(child)
        raise RunFailed(str(exc)) from None


def _release_child(client: Client, child: subprocess.Popen[bytes], scope: str) -> bool | None:
    """Whether the release found the timer armed; None if it failed."""
    try:
        return client.release(scope, pid=child.pid)
    except WatchdogdError as exc:
        # The child has exited, so the daemon drops its timer on its own.
        click.echo(f"watchdogctl: could not release the timer: {exc}", err=True)
        return None


def _abandon(child: subprocess.Popen[bytes]) -> None:
    """The child must not run unprotected when its timer could not be armed."""
    child.kill()
    child.wait()
