"""``watchdogctl run``: a command run as a child under a timer of the daemon.

What the timer's policy acts on is chosen as GNU timeout chooses: by default the
command's process group, the child being started in a group of its own (so a shell
script's own children go with it); with ``--foreground`` the child alone, left in
watchdogctl's group (where it may read from the terminal); with ``--tree`` the child
and every descendant, those that left its group too. The daemon is asked for that
by the policy's name (``group:kill``: `watchdogd.core.policies.on_target`), never
by a policy of the client's making.

The child is not reaped until its timer has been released, so the pid the release
names is still the child's, never a process that reused the number; nor is its group
signalled after it was reaped, when the pgid could have been taken by another. A child
whose timer could not be armed is killed (with its group) rather than left running
unwatched. SIGINT, SIGTERM, SIGHUP and SIGQUIT that reach watchdogctl while the child
runs are passed on as timeout passes them: to the child, then to its group followed
by SIGCONT (so that a stopped member gets them), or with ``--foreground`` to the child
alone. A command that cannot be run ends watchdogctl with 127 (not found) or 126 (found
but not runnable), as the shell and timeout do (`CannotRun`); whatever else stops
watchdogctl from running the command under a timer is a `RunFailed` (125).
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
from watchdogd_protocol import EventInfo

from ..core import TargetKind, on_target

#: Exit status of ``watchdogctl run`` when watchdogctl itself fails (as GNU timeout does).
RUN_FAILED: Final = 125
#: Exit statuses for a command that was found but cannot be run, and one not found
#: (POSIX's for the shell, and GNU timeout's).
CANNOT_INVOKE: Final = 126
NOT_FOUND: Final = 127
#: The signals timeout passes on to its command.
_FORWARDED: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: How long `run_under_timer` waits for the event of an expiry whose policy is still finishing.
_EXPIRY_PATIENCE: Final = 5.0


class RunFailed(click.ClickException):
    """watchdogctl run could not run its command under a timer."""

    exit_code = RUN_FAILED


class CannotRun(RunFailed):
    """The command was found but cannot be run: not executable, a directory, not a
    format the kernel runs (126)."""

    exit_code = CANNOT_INVOKE

    @staticmethod
    def of(program: str, error: OSError) -> CannotRun:
        """The error for ``program``, which ``error`` kept from starting."""
        kind = CommandNotFound if isinstance(error, FileNotFoundError) else CannotRun
        return kind(f"failed to run command {program!r}: {error.strerror or error}")


class CommandNotFound(CannotRun):
    """No command of that name (127)."""

    exit_code = NOT_FOUND


class Ran(NamedTuple):
    """How the command ended: its ``returncode`` as `subprocess` gives it (-N for
    signal N), and the daemon's ``expired`` event when its timer fired on it."""

    pid: int
    returncode: int
    expiry: EventInfo | None


def run_under_timer(
    client: Client,
    command: Sequence[str],
    *,
    scope: str,
    timeout: float,
    policy: str | None,
    target: TargetKind = "group",
) -> Ran:
    """Run ``command`` with the timer ``(its pid, scope)`` armed until it exits, its
    policy (the daemon's default if None) carried out on ``target``: ``group`` (the
    child in a process group of its own), ``process`` (the child alone, in
    watchdogctl's group) or ``tree``."""
    try:
        # Also the proof that a daemon answers, before anything is started.
        seen = client.events(limit=1).last
        named = on_target(target, client.policies().default if policy is None else policy)
    except WatchdogdError as exc:
        raise RunFailed(str(exc)) from None
    own_group = target != "process"
    with _Forwarder(own_group=own_group) as forwarder:
        try:
            child = subprocess.Popen(command, process_group=0 if own_group else None)
        except OSError as exc:
            raise CannotRun.of(command[0], exc) from None
        forwarder.attach(child.pid)
        armed = time.monotonic()
        _arm_child(client, child, scope, timeout, named, own_group=own_group)
        # Wait without reaping, so the pid still names the child when its timer
        # is released; then reap.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        # The daemon's deadline is later than armed + timeout: a child that ended
        # before that was not touched by the daemon, and no event is waited for.
        due = time.monotonic() >= armed + timeout
        found = _release_child(client, child, scope)
        forwarder.detach()
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
    """Passes SIGINT, SIGTERM, SIGHUP and SIGQUIT on to the child, through its pidfd,
    and (``own_group``) to its process group, each followed by SIGCONT there.

    The handlers are in place before the child starts; a signal that arrives before
    the child exists is passed on as soon as it does. A pidfd (rather than
    Popen.send_signal, which may reap) keeps the child unreaped until
    `run_under_timer` reaps it, and the group is signalled only until `detach`, which
    comes before the reaping: while its leader is unreaped, the pgid is the child's.
    """

    def __init__(self, *, own_group: bool) -> None:
        self._own_group = own_group
        self._pidfd: int | None = None
        self._pgid: int | None = None
        self._detached = False
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Forwarder:
        self._previous = {signum: signal.signal(signum, self._forward) for signum in _FORWARDED}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self.detach()

    def attach(self, pid: int) -> None:
        # The group first: a signal handled in between is then pending, and sent to both.
        self._pgid = pid if self._own_group else None
        self._pidfd = os.pidfd_open(pid)
        for signum in self._pending:
            self._send(signum)

    def detach(self) -> None:
        """Pass nothing on from now: the child is about to be reaped."""
        self._detached = True
        self._pgid = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _forward(self, signum: int, frame: object) -> None:
        if self._detached:
            return
        if self._pidfd is None:
            self._pending.append(signum)
        else:
            self._send(signum)

    def _send(self, signum: int) -> None:
        # Then SIGCONT, so that a member of the group that is stopped (at a read from
        # the terminal, SIGTTIN) takes the signal now: what timeout does.
        self._deliver(signum)
        if self._pgid is not None:
            self._deliver(signal.SIGCONT)

    def _deliver(self, signum: int) -> None:
        # The child first, in case it left its group (timeout's order).
        assert self._pidfd is not None
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signum)
        if self._pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pgid, signum)


def _arm_child(
    client: Client,
    child: subprocess.Popen[bytes],
    scope: str,
    timeout: float,
    policy: str,
    *,
    own_group: bool,
) -> None:
    try:
        client.acquire(scope, timeout, policy=policy, pid=child.pid, exit_releases=True)
    except RequestRefused as exc:
        if exc.code == ErrorCode.NO_SUCH_PROCESS:
            return  # it has exited already; nothing to watch
        _abandon(child, own_group=own_group)
        raise RunFailed(str(exc)) from None
    except WatchdogdError as exc:
        _abandon(child, own_group=own_group)
        raise RunFailed(str(exc)) from None


def _release_child(client: Client, child: subprocess.Popen[bytes], scope: str) -> bool | None:
    """Whether the release found the timer armed; None if it failed."""
    try:
        return client.release(scope, pid=child.pid)
    except WatchdogdError as exc:
        # The child has exited, so the daemon drops its timer on its own.
        click.echo(f"watchdogctl: could not release the timer: {exc}", err=True)
        return None


def _abandon(child: subprocess.Popen[bytes], *, own_group: bool) -> None:
    """The child must not run unprotected when its timer could not be armed, nor
    what it started in its group (which, unreaped, it still leads)."""
    if own_group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    child.kill()
    child.wait()
