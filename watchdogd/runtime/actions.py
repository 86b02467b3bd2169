"""Carrying out a policy when a timer expires, in batches.

The scheduler hands over what fell due in one pass (at most `BATCH` timers), and
each expiry goes through three stages:

1. **First signal, in the pass** (`Actions.carry_out`). A policy whose next step is
   a signal to the timer's own process (``target = "process"``: ``kill``, ``term``,
   ``abort``, ``signal:NAME``) has that signal sent at once, in a tight loop over the
   batch: no task and no event yet; in a large batch, no command line read first
   (the event shows the one the process had when its first timer was armed).
   A timer whose policy starts afresh takes the short way
   (`Actions._send_first`): the signal goes through the pidfd the daemon holds
   already, before any object of the expiry is made. For a timer armed by a uid
   other than root, the uids of its process are read from the pidfd first
   (`watchdogd.host.process.uids_of`), and a uid that may no longer signal it is left
   to the usual way, which records why. Everything else waits for settling, so
   10,000 expiries due in the same 10 ms cost about what a bare Python loop
   popping a heap and sending each SIGKILL costs (`make bench`).
2. **Settling, right after** (`Actions.settle`, called by the scheduler in batches
   whenever nothing more is due, so that firing always comes first): the target is
   opened in full (a group's or a tree's members are read from /proc, a cgroup's
   from its ``cgroup.procs``) and further signal steps are sent. A policy with a
   step that waits (``wait``, ``exec``, ``dump``) then gets a task of its own for
   the rest; one that only signals does not.
3. **The outcome.** A target sent SIGKILL is watched, with every other one, by one
   task (`Actions.run`) on one epoll set of pidfds, up to ``unkillable_after``
   seconds: it ends as ``exited``, or is reported ``unkillable`` with its /proc state
   and wait channel. Every expiry ends in one ``expired`` event; the events of a
   batch are recorded together.

Invariants:

- Nothing here raises into the scheduler. A process that is already gone, a signal
  the kernel refuses, a hook that fails or hangs: each becomes the recorded result
  of its step. A bug is logged and costs only that expiry's record.
- Steps after the target has exited are skipped. So is every step when the uid
  that armed the timer may no longer signal its process (its uids changed since;
  see `watchdogd.host.targets`): the event says why, and its outcome is ``alive``. That
  check is made before the first signal, in the pass.
- A timer whose policy was removed by a reload runs the default policy, and its
  event says so. So does the event of a timer that had been given more time as
  starved, and of one judged not starved, why
  (`watchdogd.core.service.Service.expire_due`).
- The state records each step as it starts (a step other than the one the firing
  record already names), so a restart resumes at the step in progress.
- An event's ``late`` is from the deadline to its first step (the first signal).
- Dump steps share one `watchdogd.runtime.hooks.DumpPool` (``max_dumps`` at once); every
  other step runs at once, so a queue of dumps delays no signal but the one after
  a dump of its own policy, and that one no longer than the dump step's timeout.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import trio

from watchdogd_client.protocol import EventInfo, StepResult

from ..core.policies import Dump, Exec, Policy, Signal, Step, Wait
from ..core.service import Service
from ..core.timers import Expired, Timer
from ..host.process import Process, ptrace_reader
from ..host.targets import Target, open_target
from ..logs import log
from .hooks import DumpPool, run_hook, substitute

#: The most expiries one pass fires, and the most one call of `Actions.settle`
#: settles: a pass stays around a millisecond, so a request waits no longer.
BATCH: Final = 256
#: Exited targets taken from the epoll set at a time.
_REAPED_AT_ONCE: Final = 64
#: A pass that fires more than this does not read command lines before the first
#: signal: its events show the command line each process had when it entered the
#: timer table. Signals come first in a burst.
_COMMANDS_FIRST: Final = 8
#: A first signal's result, by number.
_SENT: Final = {int(member): f"sent {member.name}" for member in signal.Signals}


def _resume_point(timer: Timer, policy: Policy, note: str) -> tuple[Timer, str]:
    """Where a resumed expiry goes on: at the step it had reached, unless its
    policy was changed or removed while the daemon was down (the step means
    nothing in another policy): then from the first step, and its event says so."""
    if not (timer.step or timer.step_end) or (timer.plan == policy.plan and not note):
        return timer, note
    again = "its policy changed across a restart; started again from its first step"
    timer = timer.at_step(0)
    return timer, "; ".join(text for text in (note, again) if text)


def _is_peer(timer: Timer) -> bool:
    """Whether ``timer``'s run is a job's peer policy, not its own expiry."""
    return timer.run is not None and timer.run.peer


def _stall_note(timer: Timer) -> str:
    """What an expiry's event says of a timer that stalled."""
    watch = timer.watch
    if watch is None or not timer.stalled:
        return ""
    at = "no progress counter" if watch.progress is None else f"its progress at {watch.progress}"
    return (
        f"stalled: re-armed with {at} for {watch.stall:g} s (its policy's stall), "
        f"before its {timer.timeout:g} s timeout"
    )


@dataclass(slots=True, eq=False)
class _Expiry:
    """One expiry being carried out."""

    timer: Timer
    #: The timer's process, retained until the target is opened.
    process: Process | None
    policy: Policy
    note: str
    #: Where this run started (a resumed expiry: the step it had reached).
    resumed_at: int
    #: The next step to carry out.
    step: int
    command: str = ""
    target: Target | None = None
    gone_at_start: bool = False
    results: list[StepResult] = field(default_factory=list)
    #: A signal was sent (in this run or before a restart); a SIGKILL was sent.
    signalled: bool = False
    killed: bool = False
    #: When this run carried out the policy's first step (the daemon's clock).
    first_step_at: float | None = None


class _Sent(NamedTuple):
    """An expiry whose first signal `Actions.carry_out` sent the short way."""

    item: Expired[Process]
    policy: Policy
    command: str
    #: When the signal was sent (the daemon's clock), and its step's result.
    at: float
    result: str


@dataclass(slots=True, eq=False)
class _Dying:
    """A target sent SIGKILL, watched until every member exits."""

    expiry: _Expiry
    fds: set[int]
    until: float


class Actions:
    """Carries out the policies of expired timers (see the module's docstring)."""

    def __init__(
        self,
        service: Service[Process],
        nursery: trio.Nursery,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
        on_settle: Callable[[], object] = lambda: None,
    ) -> None:
        """``on_settle`` is called when expiries are waiting for `settle`."""
        self._service = service
        self._nursery = nursery
        self._clock = clock
        self._wall = wall
        self._on_settle = on_settle
        self._daemon_pgid = os.getpgrp()
        self._settling: deque[_Expiry | _Sent] = deque()
        self._epoll = select.epoll()
        self._dying: dict[int, _Dying] = {}
        self._deadlines: list[tuple[float, int, _Dying]] = []
        self._order = itertools.count()
        self._watching = trio.Event()
        #: The run task's wait, and until when it waits (the daemon's clock).
        self._sleeping: trio.CancelScope | None = None
        self._waiting_until = math.inf
        self._events: list[EventInfo] = []
        #: Targets sent SIGKILL have exited (or outlived ``unkillable_after``):
        #: `settle` finishes them and sets ``_reaped``.
        self._reap_due = False
        self._reaped = trio.Event()
        self._dumps = DumpPool(service.config.max_dumps, service.metrics)

    @property
    def settling(self) -> int:
        """Expiries waiting for `settle`."""
        return len(self._settling)

    def carry_out(self, expired: list[Expired[Process]]) -> None:
        """Start carrying out each expiry (or resuming it, from the step its timer
        records): send first signals now, leave the rest to `settle`."""
        commands_first = len(expired) <= _COMMANDS_FIRST
        for item in expired:
            try:
                if self._send_first(item, commands_first):
                    continue
            except Exception:
                # Before its signal (nothing after it can raise): the usual way
                # carries the expiry out, or records why it could not.
                log.exception("the short way failed for %r", item.timer)
            expiry = self._begin(item.timer, item.process, item.note)
            if expiry is None:
                continue
            try:
                if expiry.policy.target == "process" and self._next_is_signal(expiry):
                    self._open(expiry, read_command=commands_first, check=False)
                    self._signal_steps(expiry, first_only=True)
            except Exception:
                self._failed(expiry, "could not start the policy")
                continue
            self._settling.append(expiry)
        if self._settling:
            self._on_settle()

    def _send_first(self, item: Expired[Process], read_command: bool) -> bool:
        """The short way for a timer whose policy starts afresh with a signal to
        its process: send it through the process's own pidfd, before anything else
        is made of the expiry (`settle` makes the rest, `_Sent`). A timer armed by
        a uid other than root goes this way only if that uid may still signal the
        process (the check `open_target` makes, on uids read from the pidfd).
        Returns False, having done nothing, for any other expiry: the usual way
        then says why."""
        timer, process = item.timer, item.process
        if timer.step or timer.step_end or _is_peer(timer):
            return False
        policy, note = self._service.policy_for(timer.policy)
        steps = policy.steps
        if note or policy.target != "process" or not steps or type(steps[0]) is not Signal:
            return False
        owner = timer.owner
        if owner and not process.signallable_by(owner):
            return False
        step = steps[0]
        command = process.command() if read_command else process.armed_command
        at = self._clock()
        try:
            signal.pidfd_send_signal(process.fd, step.signum)
            result = _SENT.get(step.signum) or f"sent {step.describe()}"
        except ProcessLookupError:
            result = "gone"
        except PermissionError:
            result = f"not permitted to send {step.describe()}"
        except OSError:
            return False  # not sent: the usual way says why
        self._settling.append(_Sent(item, policy, command, at, result))
        return True

    def settle(self, until: float) -> bool:
        """Carry expiries on past their first signal, and finish those whose
        targets exited, until the daemon's clock reads ``until`` (the next
        deadline, or the end of a slice) or a batch is done, whichever is first;
        at least one thing is done. Returns whether more work is waiting."""
        for count in range(min(BATCH, len(self._settling))):
            if count and self._clock() >= until:
                break
            self._settle_one(self._settling.popleft())
        reap = self._reap_due and (not self._settling or self._clock() < until)
        if reap and self._reap(until):
            self._reap_due = False
            self._reaped.set()
        self._flush_events()
        return bool(self._settling) or self._reap_due

    def _settle_one(self, entry: _Expiry | _Sent) -> None:
        if isinstance(entry, _Sent):
            sent = self._sent_expiry(entry)
            if sent is None:
                return
            entry = sent
        expiry = entry
        try:
            if expiry.target is None:
                self._open(expiry, read_command=True)
            elif not expiry.command:
                expiry.command = expiry.target.command()
            self._signal_steps(expiry, first_only=False)
            target = expiry.target
            assert target is not None
            alive = target.alive()
            if alive and not target.denied and expiry.step < len(expiry.policy.steps):
                self._nursery.start_soon(self._carry_on, expiry)
            elif alive and expiry.killed:
                self._watch(expiry)
            else:
                self._finish(expiry, alive=alive)
        except Exception:
            self._failed(expiry, "the policy failed")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the targets sent SIGKILL for their exit, all in one task: when one
        exits or outlives ``unkillable_after``, have `settle` finish it (so that
        firing still comes first), and wait until it has."""
        task_status.started()
        try:
            while True:
                if not self._deadlines:
                    await self._watching.wait()
                    self._watching = trio.Event()
                    continue
                self._waiting_until = self._deadlines[0][0]
                with trio.move_on_at(self._trio_time(self._waiting_until)) as self._sleeping:
                    await trio.lowlevel.wait_readable(self._epoll.fileno())
                self._sleeping, self._waiting_until = None, math.inf
                self._reaped = trio.Event()
                self._reap_due = True
                self._on_settle()
                await self._reaped.wait()
        finally:
            self.close()

    def close(self) -> None:
        """Let go of every expiry not finished (the daemon is stopping: they stay
        firing in the state, for the next start to resume)."""
        for dying in list(self._dying.values()):
            self._forget(dying)
        for _, _, dying in self._deadlines:
            self._let_go(dying.expiry)
        self._deadlines.clear()
        while self._settling:
            entry = self._settling.popleft()
            if isinstance(entry, _Sent):
                entry.item.process.close()
            else:
                self._let_go(entry)
        self._epoll.close()

    @staticmethod
    def _let_go(expiry: _Expiry) -> None:
        if expiry.process is not None:
            expiry.process.close()
            expiry.process = None
        if expiry.target is not None:
            expiry.target.close()

    # The stages of one expiry.

    def _begin(
        self, timer: Timer, process: Process, judged: str = "", policy: Policy | None = None
    ) -> _Expiry | None:
        """``judged``: what the service found of its starvation, if anything;
        ``policy``: the one a first signal was sent by already."""
        try:
            note = ""
            if policy is None:
                policy, note = self._service.policy_for(timer.policy)
            timer, note = _resume_point(timer, policy, note)
            note = "; ".join(text for text in (note, judged) if text)
        except Exception:
            log.exception("could not start the policy of %r", timer)
            process.close()
            self._service.expiry_finished(timer)
            return None
        expiry = _Expiry(
            timer=timer,
            process=process,
            policy=policy,
            note=note,
            resumed_at=timer.step,
            step=timer.step,
            signalled=timer.step > 0,
        )
        for step in policy.steps[: timer.step]:
            expiry.results.append(StepResult(step=step.describe(), result="done before a restart"))
            expiry.killed = expiry.killed or (
                isinstance(step, Signal) and step.signum == signal.SIGKILL
            )
        return expiry

    def _sent_expiry(self, sent: _Sent) -> _Expiry | None:
        """The expiry whose first signal `_send_first` sent, as if
        `_signal_steps` had sent it."""
        item = sent.item
        expiry = self._begin(item.timer, item.process, item.note, sent.policy)
        if expiry is None:
            return None
        try:
            self._open(expiry, read_command=False, check=False)
            expiry.command = sent.command
            expiry.first_step_at = sent.at
            step = expiry.policy.steps[0]
            assert isinstance(step, Signal)
            self._started(expiry)
            expiry.gone_at_start = sent.result == "gone"
            self._signalled(expiry, step, sent.result, sent.at)
            expiry.step += 1
        except Exception:
            self._failed(expiry, "could not start the policy")
            return None
        return expiry

    def _next_is_signal(self, expiry: _Expiry) -> bool:
        steps = expiry.policy.steps
        return expiry.step < len(steps) and isinstance(steps[expiry.step], Signal)

    def _open(self, expiry: _Expiry, *, read_command: bool, check: bool = True) -> None:
        """Pin the target (it holds pidfds of its own) and let the process go.
        ``check``: see whether it is gone already; without, the first signal
        tells (polling a pidfd takes a lock that a storm of exits holds, and a
        burst of expiries is such a storm)."""
        process = expiry.process
        assert process is not None
        try:
            expiry.command = process.command() if read_command else process.armed_command
            expiry.target = open_target(
                expiry.policy.target, process, self._daemon_pgid, expiry.timer.owner
            )
        finally:
            process.close()
            expiry.process = None
        if check:
            expiry.gone_at_start = not expiry.target.alive()

    def _signal_steps(self, expiry: _Expiry, *, first_only: bool) -> None:
        """Carry out the signal steps from the next one on (only the next one when
        ``first_only``), up to a step that waits."""
        target = expiry.target
        assert target is not None
        steps = expiry.policy.steps
        while expiry.step < len(steps):
            step = steps[expiry.step]
            if not isinstance(step, Signal):
                return
            # Seen alive when it was opened, for the first step of this run.
            first = expiry.step == expiry.resumed_at and expiry.first_step_at is None
            if target.denied or (expiry.gone_at_start if first else not target.alive()):
                return  # `_finish` says why each step left was skipped
            self._started(expiry)
            result = target.signal(step.signum, alive=first)
            if first and result == "gone":
                expiry.gone_at_start = True
            self._signalled(expiry, step, result)
            expiry.step += 1
            if first_only:
                return

    def _started(self, expiry: _Expiry, step_end: float = 0.0) -> None:
        """The next step starts: note when, and have the state record it unless its
        firing record names it already."""
        if expiry.step == expiry.resumed_at and expiry.first_step_at is None:
            expiry.first_step_at = self._clock()
        timer = expiry.timer
        if expiry.step != timer.step or step_end != timer.step_end:
            expiry.timer = self._service.step_started(timer, expiry.step, step_end)

    def _signalled(
        self, expiry: _Expiry, step: Signal, result: str, at: float | None = None
    ) -> None:
        """``step`` was carried out (at ``at``, if not just now)."""
        expiry.results.append(StepResult(step=step.describe(), result=result))
        if not expiry.signalled:
            expiry.signalled = True
            if not _is_peer(expiry.timer):
                now = self._clock() if at is None else at
                self._service.observe_lateness(now - expiry.timer.deadline)
        # A SIGKILL the kernel refused (EPERM) makes no target "unkillable".
        if step.signum == signal.SIGKILL and result.startswith("sent"):
            expiry.killed = True

    async def _carry_on(self, expiry: _Expiry) -> None:
        """The rest of a policy that has a step that waits, in a task of its own.
        Cancelled (the daemon stops), the timer stays firing at the step it had
        reached."""
        target = expiry.target
        assert target is not None
        try:
            values = {"pid": str(expiry.timer.pid), "scope": expiry.timer.scope}
            env = {
                "WATCHDOG_PID": str(expiry.timer.pid),
                "WATCHDOG_SCOPE": expiry.timer.scope,
                "WATCHDOG_POLICY": expiry.policy.name,
                "WATCHDOG_UID": str(expiry.timer.uid),
            }
            steps = expiry.policy.steps
            while expiry.step < len(steps):
                step = steps[expiry.step]
                if target.denied or not target.alive():
                    break
                if isinstance(step, Wait):
                    timer = expiry.timer
                    end = timer.step_end if expiry.step == timer.step and timer.step_end else 0.0
                    end = end or self._clock() + step.seconds
                    self._started(expiry, end)
                    expiry.results.append(await self._wait(step, target, end))
                elif isinstance(step, Signal):
                    self._started(expiry)
                    self._signalled(expiry, step, target.signal(step.signum))
                elif isinstance(step, Dump):
                    self._started(expiry)
                    expiry.results.append(await self._dump(expiry, step, values, env))
                else:
                    self._started(expiry)
                    expiry.results.append(await self._hook(step, values, env))
                expiry.step += 1
            alive = target.alive()
            if alive and expiry.killed:
                alive = not await target.wait_exit(self._service.config.unkillable_after)
            self._finish(expiry, alive=alive)
        except Exception:
            self._failed(expiry, "the policy failed")
        finally:
            target.close()  # cancelled: the timer stays firing at its step
        self._flush_events()

    async def _wait(self, step: Wait, target: Target, end: float) -> StepResult:
        """A wait that ends at ``end`` on the daemon's clock (its original end, when
        it resumes after a restart), or once the target has exited."""
        exited = await target.wait_exit(max(0.0, end - self._clock()))
        result = "exited" if exited else f"still running after {step.seconds:g}s"
        return StepResult(step=step.describe(), result=result)

    async def _dump(
        self, expiry: _Expiry, step: Dump, values: dict[str, str], env: dict[str, str]
    ) -> StepResult:
        """A dump of the timer's process, and who besides root may read it: the one
        user ptrace's read rule let read the process both just before and just
        after it was dumped (`watchdogd.host.process.ptrace_reader`), stored with the
        stack, since the process may be gone when someone looks."""
        before = ptrace_reader(expiry.timer.pid)
        result = await self._hook(step, values, env)
        after = ptrace_reader(expiry.timer.pid)
        self._service.dump_taken(expiry.timer, before if before == after else None)
        return result

    async def _hook(self, step: Step, values: dict[str, str], env: dict[str, str]) -> StepResult:
        assert isinstance(step, Exec | Dump)
        argv = substitute(step.argv, values)
        if isinstance(step, Dump):
            self._dumps.resize(self._service.config.max_dumps)  # a reload may have changed it
            hook = await self._dumps.run(argv, env, step.timeout)
        else:
            hook = await run_hook(argv, env, step.timeout)
        return StepResult(step=step.describe(), result=hook.result, output=hook.output)

    def _finish(self, expiry: _Expiry, *, alive: bool) -> None:
        """Record the expiry's event; it leaves the state."""
        target = expiry.target
        assert target is not None
        timer = expiry.timer
        for step in expiry.policy.steps[len(expiry.results) :]:
            why = "not allowed" if target.denied else "target exited"
            expiry.results.append(StepResult(step=step.describe(), result=f"skipped: {why}"))
        if expiry.gone_at_start:
            outcome = "gone"
        elif alive:
            outcome = "unkillable" if expiry.killed else "alive"
        else:
            outcome = "exited"
        downtime = (
            "fell due while the daemon was not running"
            if timer.deadline < self._service.started <= timer.fired_at
            else ""
        )
        resumed = (
            f"resumed at step {expiry.resumed_at + 1} after a restart" if expiry.resumed_at else ""
        )
        peer = _is_peer(timer)
        extended = (
            f"it had been given {timer.watch.extended:g}s more as starved (its extended event "
            "says why) and was still due"
            if timer.watch is not None and timer.watch.extended and not peer
            else ""
        )
        notes = [
            text
            for text in (
                f"the peer policy of incident {timer.run.incident}"
                if peer and timer.run is not None
                else _stall_note(timer),
                expiry.note,
                extended,
                target.denied,
                target.note,
                downtime,
                resumed,
            )
            if text
        ]
        started = timer.fired_at if expiry.first_step_at is None else expiry.first_step_at
        self._events.append(
            EventInfo(
                seq=0,
                kind="peer" if peer else "expired",
                time=self._wall(),
                pid=timer.pid,
                uid=timer.uid,
                scope=timer.scope,
                policy=expiry.policy.name,
                command=expiry.command,
                armed_at=self._as_wall(timer.armed_at),
                deadline=self._as_wall(timer.deadline),
                fired_at=self._as_wall(timer.fired_at),
                late=None if peer else started - timer.deadline,
                outcome=outcome,
                steps=expiry.results,
                note="; ".join(notes),
                reason="" if peer else "stalled" if timer.stalled else "timeout",
                timeout=timer.timeout,
                timeout_from="" if timer.watch is None else timer.watch.timeout_from,
                job="" if timer.watch is None else timer.watch.job,
                rank=None if timer.watch is None else timer.watch.rank,
                incident="" if timer.run is None else timer.run.incident,
            )
        )
        self._service.expiry_finished(timer)
        if outcome == "unkillable":
            self._report_unkillable(expiry)
        target.close()

    def _failed(self, expiry: _Expiry, what: str) -> None:
        log.exception("%s of %r", what, expiry.timer)
        self._let_go(expiry)
        self._service.expiry_finished(expiry.timer)

    def _flush_events(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self._service.record_expiries(events)

    def _report_unkillable(self, expiry: _Expiry) -> None:
        target = expiry.target
        assert target is not None
        after = self._service.config.unkillable_after
        pid, state, wchan = target.survivor()
        self._service.record_unkillable(
            EventInfo(
                seq=0,
                kind="unkillable",
                time=self._wall(),
                pid=pid,
                uid=expiry.timer.uid,
                scope=expiry.timer.scope,
                policy=expiry.policy.name,
                state=state,
                wchan=wchan,
                note=f"still alive {after:g}s after SIGKILL",
            )
        )

    # Watching targets sent SIGKILL for their exit.

    def _watch(self, expiry: _Expiry) -> None:
        target = expiry.target
        assert target is not None
        until = self._clock() + self._service.config.unkillable_after
        dying = _Dying(expiry, {member.fd for member in target.members}, until)
        for fd in dying.fds:
            self._epoll.register(fd, select.EPOLLIN)
            self._dying[fd] = dying
        heapq.heappush(self._deadlines, (until, next(self._order), dying))
        self._watching.set()
        if until < self._waiting_until and self._sleeping is not None:
            self._sleeping.cancel()  # a reload shortened unkillable_after

    def _reap(self, until: float) -> bool:
        """Finish the watched expiries whose targets exited and those past
        ``unkillable_after``, until ``until``; returns whether none is left."""
        while True:
            ready = self._epoll.poll(0, _REAPED_AT_ONCE)
            for fd, _ in ready:
                dying = self._dying.pop(fd, None)
                if dying is None:
                    continue
                self._epoll.unregister(fd)
                dying.fds.discard(fd)
                if not dying.fds:
                    self._finish(dying.expiry, alive=False)
            if len(ready) < _REAPED_AT_ONCE:
                break
            if self._clock() >= until:
                return False
        now = self._clock()
        while self._deadlines and (not self._deadlines[0][2].fds or self._deadlines[0][0] <= now):
            _, _, dying = heapq.heappop(self._deadlines)
            if dying.fds:
                self._forget(dying)
                target = dying.expiry.target
                assert target is not None
                self._finish(dying.expiry, alive=target.alive())
        return True

    def _forget(self, dying: _Dying) -> None:
        for fd in dying.fds:
            self._epoll.unregister(fd)
            del self._dying[fd]
        dying.fds.clear()

    def _trio_time(self, monotonic: float) -> float:
        return trio.current_time() + (monotonic - self._clock())

    def _as_wall(self, monotonic: float) -> float:
        return self._wall() - (self._clock() - monotonic)
