"""Running a policy's ``exec`` and ``dump`` programs: bounded in time and output.

The program comes from the root-owned config, never from a request. It runs without
a shell, in a session of its own (so that a timeout kills everything it started),
with a small fixed environment. ``{pid}`` and ``{scope}`` are substituted only where
they are a whole argument, so a scope can never inject arguments or a command; and
every step's argv has ``{scope}`` only after a ``--`` argument
(`watchdogd.core.policies.check_argv`), so a scope is never read as an option either.
The output is kept in the event for root: `watchdogd.core.pages` hides it from
everyone else.
Its stdout and stderr are captured together, keeping at most `OUTPUT_LIMIT` bytes;
past its time limit its whole session is killed and the step says so.

Dump programs run through a `DumpPool`: at most ``max_dumps`` at once, the rest
waiting their turn first come, first served, so a burst of expiries (a job's
peers, incidents forged in the fleet) starts a few dumpers at a time, never one a
process. A dump step's timeout bounds its wait for a turn and its run together:
the step after it, a policy's SIGKILL, is never put off longer than the dump's
own step says, however many other dumps are queued.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Final

import trio

from ..core import (
    Counters,
    HookResult,
)

OUTPUT_LIMIT: Final = 64 * 1024
_READ: Final = 16 * 1024
#: Time to read what a hook wrote just before it ended.
_DRAIN: Final = 0.5
_DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def search_path() -> str:
    """Where hooks and dumpers are looked up: the daemon's PATH, then the directory
    of its own interpreter (where ``pip install py-spy`` puts py-spy)."""
    return os.pathsep.join(
        [os.environ.get("PATH") or _DEFAULT_PATH, os.path.dirname(sys.executable)]
    )


async def run_hook(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> HookResult:
    """Run ``argv`` with ``env`` for at most ``timeout`` seconds."""
    path = search_path()
    program = shutil.which(argv[0], path=path)
    if program is None:
        return HookResult(None, f"not found: {argv[0]}", "")
    try:
        process = await trio.lowlevel.open_process(
            [program, *argv[1:]],
            env={"PATH": path, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/",
        )
    except (OSError, ValueError) as exc:
        return HookResult(None, f"could not start: {getattr(exc, 'strerror', None) or exc}", "")
    output = bytearray()
    dropped = 0
    drained = trio.Event()

    async def read_output() -> None:
        nonlocal dropped
        assert process.stdout is not None
        while chunk := await process.stdout.receive_some(_READ):
            keep = min(len(chunk), max(0, OUTPUT_LIMIT - len(output)))
            output.extend(chunk[:keep])
            dropped += len(chunk) - keep
        drained.set()

    timed_out = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_output)
        with trio.move_on_after(timeout):
            await process.wait()
            timed_out = False
        if timed_out:
            # The hook is not reaped yet, so its pid, and the session it leads,
            # cannot have been reused: kill everything it started.
            _kill_session(process.pid)
        with trio.CancelScope(shield=True):
            await process.wait()
            with trio.move_on_after(_DRAIN):
                await drained.wait()
        nursery.cancel_scope.cancel()
    assert process.stdout is not None
    await process.stdout.aclose()
    text = output.decode(errors="replace")
    if dropped:
        text += f"\n[{dropped} more bytes dropped]"
    if timed_out:
        return HookResult(None, f"killed after {timeout:g}s", text)
    status = process.returncode
    assert status is not None
    if status < 0:
        return HookResult(128 - status, f"killed by {signal.Signals(-status).name}", text)
    return HookResult(status, f"exit {status}", text)


def _kill_session(leader: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)


class DumpPool:
    """Runs dump programs at most ``size`` at once, the others queued in order of
    arrival (`run`); ``counters`` counts how many run and wait, and how many got
    no turn within their timeout."""

    def __init__(self, size: int, counters: Counters) -> None:
        self._turns = trio.CapacityLimiter(size)
        self._counters = counters

    @property
    def size(self) -> int:
        return int(self._turns.total_tokens)

    def resize(self, size: int) -> None:
        """At most ``size`` at once from now on; dumps running past it run on."""
        if size != self._turns.total_tokens:
            self._turns.total_tokens = size

    async def run(self, argv: Sequence[str], env: Mapping[str, str], timeout: float) -> HookResult:
        """Run ``argv`` as `run_hook` does once it has a turn, the wait for it and
        the run together within ``timeout`` seconds; one that gets no turn within
        them is not run."""
        deadline = trio.current_time() + timeout
        turn = object()
        waited = 0.0
        try:
            self._turns.acquire_on_behalf_of_nowait(turn)
        except trio.WouldBlock:
            waited = await self._wait_for_turn(turn, deadline)
            if waited < 0:
                return self._not_run(timeout)
        try:
            left = deadline - trio.current_time()
            if left <= 0:
                return self._not_run(timeout)
            self._counters.dumps_running += 1
            try:
                result = await run_hook(argv, env, left)
            finally:
                self._counters.dumps_running -= 1
        finally:
            self._turns.release_on_behalf_of(turn)
        if waited:
            note = f"{result.result}; waited {waited:.2f}s for a turn (max_dumps = {self.size})"
            result = HookResult(result.status, note, result.output)
        return result

    def _not_run(self, timeout: float) -> HookResult:
        self._counters.dumps_not_run += 1
        return HookResult(
            None, f"not run: no turn within {timeout:g}s (max_dumps = {self.size}, all running)", ""
        )

    async def _wait_for_turn(self, turn: object, deadline: float) -> float:
        """Queue for a turn until ``deadline``: how long it took, or -1 if none came."""
        started = trio.current_time()
        self._counters.dumps_waiting += 1
        try:
            with trio.move_on_at(deadline):
                await self._turns.acquire_on_behalf_of(turn)
                return trio.current_time() - started
        finally:
            self._counters.dumps_waiting -= 1
        return -1.0
