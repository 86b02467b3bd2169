"""The executor: carries out the effects of policy runs, in batches.

What to do is decided by the policy run, a state machine in the core
(`watchdogd.core.expiry.Run`); this module only carries its effects out, in one
`match` (`Executor._advance`), and hands back what it observed. The scheduler
hands over what fell due in one pass (at most `BATCH` timers), and each expiry
goes through three stages:

1. **First signal, in the pass** (`Executor.carry_out`). Each expiry's run is
   made at once, and the effects it gives on the way to its first signal to the
   timer's own process (``target = "process"``: ``kill``, ``term``, ``abort``,
   ``signal:NAME``) are carried out at once, in a tight loop over the batch:
   the core decides which (`watchdogd.core.expiry.Run.next_in_pass`), the same
   `match` as every other effect carries them out (`Executor._advance`). What a
   signal sent in the pass was observed (`watchdogd.core.effects.Signalled`) is
   kept with its expiry and handed to its run when it settles: the run changes
   nothing until its effect is observed, so the rest of the batch waits for no
   bookkeeping of the first. No task and no event yet; in a large batch, no
   command line read first (the event
   shows the one the process had when its first timer was armed). A run that
   starts afresh with such a signal (`watchdogd.core.expiry.first_signal`) has
   it pending before its target is opened: it goes through the pidfd the daemon
   holds already (`watchdogd.host.targets.signal_process`), and most such come
   from the core as a `watchdogd.core.firing.Due`, whose firing record is made
   only when it settles: a burst's state is made and written once its signals
   are out, and until then the state holds it armed. For a timer armed by a uid
   other than root, the uids of its process are read from the pidfd first
   (`watchdogd.host.process.Process.signallable_by`); a uid that may no longer
   signal it has the signal left to its target, once opened, which records why.
   Everything else waits for settling, so a burst of expiries due at once costs
   about what a bare Python loop popping a heap and sending each SIGKILL costs
   (`make bench`).
2. **Settling, right after** (`Executor.settle`, called by the scheduler in
   batches whenever nothing more is due, so that firing always comes first): the
   target is opened in full (a group's or a tree's members are read from /proc, a
   cgroup's from its ``cgroup.procs``) and the run's effects are carried out up to
   one that waits (``wait``, ``exec``, ``dump``): the rest gets a task of its own.
   A run that only signals gets none.
3. **The outcome.** A target sent SIGKILL is watched, with every other one, by one
   task (`Executor.run`) on one epoll set of pidfds, up to ``unkillable_after``
   seconds: it ends as ``exited``, or is reported ``unkillable`` with its /proc
   state and wait channel. Every expiry ends in one event; the events of a batch
   are recorded together.

Invariants:

- Nothing here raises into the scheduler. A process that is already gone, a signal
  the kernel refuses, a hook that fails or hangs: each becomes the recorded result
  of its step (a value of `watchdogd.core.effects`, handed back as a typed
  observation). A bug, an observation that does not answer the run's pending
  effect among them (`watchdogd.core.effects.WrongObservation`), is logged with
  its traceback and costs only that expiry's record: its timer leaves the state.
- A run whose task is cancelled (the daemon stops), or that is still watched or
  settling then, leaves its timer firing at the step it had reached, for the next
  start to resume.
- Dump steps are taken by `watchdogd.runtime.gathering.Gatherer`, whose dumpers
  share one pool (``max_dumps`` at once); every other step runs at once, so a
  queue of dumps delays no signal but the one after a dump of its own policy, and
  that one no longer than the dump step's timeout.
- An unblock step asks for the job's waiting ranks to be unblocked, at once, and
  then waits, up to its timeout, for the incident's verdict to name their
  collective (the ranks are unblocked by `watchdogd.runtime.unblocker`, not here);
  its fallback signal goes only to ranks of this host that hold a timer of the
  job, through its pidfd, and that the timer's owner may still signal.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import os
import select
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, assert_never

import trio

from watchdogd_protocol import EventInfo

from ..core import (
    AwaitEvidence,
    CheckAlive,
    Counted,
    Due,
    EvidenceIn,
    Expired,
    Finish,
    Hooked,
    Observation,
    ObserveLateness,
    Opened,
    OpenTarget,
    Recorded,
    RecordStep,
    Run,
    RunHook,
    Seen,
    SendSignal,
    Service,
    Signalled,
    SignalResult,
    TakeDump,
    UnblockPeers,
    Waited,
    WaitUntil,
    Watched,
    WatchExit,
    substitute,
)
from ..host.process import Process
from ..host.targets import Target, open_target, signal_process
from ..logs import log
from .asks import Asks
from .gathering import Gatherer
from .hooks import run_hook
from .unblocker import unblock_step

#: The most expiries one pass fires, and the most one call of `Executor.settle`
#: settles: a pass stays short, so a request waits no longer.
BATCH: Final = 256
#: Exited targets taken from the epoll set at a time.
_REAPED_AT_ONCE: Final = 64
#: A pass that fires more than this does not read command lines before the first
#: signal: its events show the command line each process had when it entered the
#: timer table. Signals come first in a burst.
_COMMANDS_FIRST: Final = 8
#: How often a first signal waiting for its incident's evidence looks again.
_EVIDENCE_POLL: Final = 0.05


@dataclass(slots=True, eq=False)
class _Expiry:
    """One expiry being carried out: its run, and what it acts on."""

    run: Run
    #: The timer's process, retained until the target is opened.
    process: Process | None
    target: Target | None = None
    #: Taken out as a `Due`: its firing record is made when it settles.
    due: Due[Process] | None = None
    #: Whether the command line is read when it is first needed (in a large
    #: pass, not: the one the process had when armed stands in).
    read_command: bool = True
    #: The command line read before a signal sent ahead of the target.
    command: str = ""
    #: The signal sent in the pass, as observed: its run takes it when it settles.
    sent: Signalled | None = None


@dataclass(slots=True, eq=False)
class _Dying:
    """A target sent SIGKILL, watched until every member exits."""

    expiry: _Expiry
    fds: set[int]
    until: float


#: An effect that waits, bound to its expiry, for the expiry's task to await.
_Waiting = Callable[[], Awaitable[None]]


class Executor:
    """Carries out the policy runs of expired timers (see the module's docstring)."""

    def __init__(
        self,
        service: Service[Process],
        nursery: trio.Nursery,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
        on_settle: Callable[[], object] = lambda: None,
        asks: Asks | None = None,
        tick: Callable[[float], object] = lambda now: None,
    ) -> None:
        """``on_settle`` is called when expiries are waiting for `settle`; ``asks``
        reach the workers' responders; ``tick`` fires what is due (at a time of
        ``clock``), as a busy connection does between its requests."""
        self._service = service
        self._gatherer = Gatherer(service, Asks() if asks is None else asks, lambda: tick(clock()))
        self._nursery = nursery
        self._clock = clock
        self._wall = wall
        self._on_settle = on_settle
        self._daemon_pgid = os.getpgrp()
        self._settling: deque[_Expiry] = deque()
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

    @property
    def settling(self) -> int:
        """Expiries waiting for `settle`."""
        return len(self._settling)

    def carry_out(self, expired: Sequence[Expired[Process] | Due[Process]]) -> None:
        """Start carrying out each expiry (or resuming it, from the step its timer
        records): send first signals now, leave the rest to `settle`. A `Due`'s
        firing record is made once its signal is out, when it settles. Then ask for
        the evidence of each rank of an incident that no policy dumps (it holds no
        timer of the job but responds: `Service.take_asks`), with ``expired`` empty
        too: another host's incident may bring only such ranks."""
        commands_first = len(expired) <= _COMMANDS_FIRST
        started = self._service.started
        for taken in expired:
            expiry = self._begin(taken, started, commands_first)
            if expiry is None:
                continue
            try:
                self._advance(expiry, in_pass=True)
            except Exception:
                self._failed(expiry, "could not start the policy")
                continue
            expiry.read_command = True
            self._settling.append(expiry)
        if self._settling:
            self._on_settle()
        for incident, responder in self._service.firing.take_asks():
            self._nursery.start_soon(
                self._gatherer.ask_rank, incident, responder.pid, responder.start_time
            )

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

    def _settle_one(self, expiry: _Expiry) -> None:
        try:
            self._record(expiry)  # its signal went: now firing
            if expiry.target is not None and not expiry.run.command:
                expiry.run.command = expiry.target.command()
            sent, expiry.sent = expiry.sent, None
            waiting = self._advance(expiry, sent)
            if waiting is not None:
                self._nursery.start_soon(self._carry_on, expiry, waiting)
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
            expiry = self._settling.popleft()
            self._record(expiry)  # its signal went: firing in the state, as every other
            self._let_go(expiry)
        self._epoll.close()

    @staticmethod
    def _let_go(expiry: _Expiry) -> None:
        if expiry.process is not None:
            expiry.process.close()
            expiry.process = None
        if expiry.target is not None:
            expiry.target.close()
            expiry.target = None

    # Carrying out a run's effects.

    # One branch per effect type, by design: every effect is carried out in one place.
    def _advance(  # noqa: PLR0912
        self, expiry: _Expiry, observed: Observation | None = None, *, in_pass: bool = False
    ) -> _Waiting | None:
        """Carry out the effects of the expiry's run (once it took ``observed``)
        up to one that waits, and return that one, bound, for the expiry's task to
        await. None once the run has finished or its target is watched;
        ``in_pass`` (the pass), once the run gives no more effects for the pass
        (`Run.next_in_pass`), or once its signal went (sent, or found gone or
        refused; one not sent is left to its target, in the pass): that observation
        waits in ``expiry.sent`` for the run to take when it settles. Each
        effect's observation goes back with the question of the next
        (`Run.answer`)."""
        run = expiry.run
        if observed is not None:
            effect = run.answer(observed, self._clock(), self._wall(), in_pass=in_pass)
        elif in_pass:
            effect = run.next_in_pass(self._clock(), self._wall())
        else:
            effect = run.next(self._clock(), self._wall())
        while True:
            match effect:
                # First: a burst's first signals are most of what a pass carries out.
                case SendSignal(signum=signum, alive=alive):
                    observed = self._send(expiry, signum, alive=alive)
                    if in_pass and observed.went:
                        expiry.sent = observed
                        return None
                case None:
                    return None
                case OpenTarget(check=check):
                    observed = self._open(expiry, check=check)
                case CheckAlive():
                    observed = Seen(self._target(expiry).alive())
                case RecordStep(step=step, step_end=step_end):
                    self._service.firing.step_started(run.timer, step, step_end)
                    observed = Recorded()
                case ObserveLateness(seconds=seconds):
                    self._service.metrics.observe_lateness(seconds)
                    observed = Counted()
                case WaitUntil(end=end):
                    return functools.partial(self._wait, run, self._target(expiry), end)
                case AwaitEvidence(incident=incident, until=until):
                    return functools.partial(self._await_evidence, run, incident, until)
                case RunHook() | TakeDump():
                    return functools.partial(self._hook, run, effect)
                case UnblockPeers():
                    return functools.partial(unblock_step, self._service, run, effect, self._clock)
                case WatchExit():
                    self._watch(expiry, self._clock() + self._service.rules.daemon.unkillable_after)
                    return None
                case Finish():
                    self._finish(expiry, effect)
                    return None
                case _:
                    assert_never(effect)
            effect = run.answer(observed, self._clock(), self._wall(), in_pass=in_pass)

    def _send(self, expiry: _Expiry, signum: int, *, alive: bool) -> Signalled:
        """Send a signal of the run: to its target, or, before the target is
        opened, to the timer's process through its own pidfd (its command line
        read first, for the event)."""
        target = expiry.target
        if target is not None:
            at = self._clock()
            return Signalled(target.signal(signum, alive=alive), at)
        process = expiry.process
        assert process is not None
        expiry.command = process.command() if expiry.read_command else process.armed_command
        at = self._clock()
        result: SignalResult = signal_process(process, signum, expiry.run.timer.owner)
        return Signalled(result, at)

    @staticmethod
    def _target(expiry: _Expiry) -> Target:
        target = expiry.target
        assert target is not None
        return target

    async def _carry_on(self, expiry: _Expiry, waiting: _Waiting | None) -> None:
        """The rest of a run that has a step that waits, in a task of its own.
        Cancelled (the daemon stops), the timer stays firing at the step it had
        reached."""
        try:
            while waiting is not None:
                await waiting()
                waiting = self._advance(expiry)
        except Exception:
            self._failed(expiry, "the policy failed")
        finally:
            if waiting is not None:
                self._let_go(expiry)  # cancelled, or failed: never resumed here
        self._flush_events()

    async def _await_evidence(self, run: Run, incident: str, until: float) -> None:
        """Until this host's other ranks of ``incident`` have given their evidence,
        or ``until`` (the daemon's clock): looked at every `_EVIDENCE_POLL` seconds,
        a wait of seconds at most."""
        while not self._service.incidents.evidence_in(incident, run.timer.pid):
            left = until - self._clock()
            if left <= 0:
                break
            await trio.sleep(min(left, _EVIDENCE_POLL))
        run.observe(EvidenceIn())

    async def _wait(self, run: Run, target: Target, end: float) -> None:
        """A wait that ends at ``end`` on the daemon's clock (its original end, when
        it resumes after a restart), or once the target has exited."""
        run.observe(Waited(await target.wait_exit(max(0.0, end - self._clock()))))

    async def _hook(self, run: Run, effect: RunHook | TakeDump) -> None:
        """An ``exec`` hook, or a dump of the timer's process (`_dump`)."""
        if isinstance(effect, TakeDump):
            await self._gatherer.dump(run, effect)
            return
        hook = await run_hook(
            substitute(effect.step.argv, effect.values), effect.env, effect.step.timeout
        )
        run.observe(Hooked(hook))

    # The stages of one expiry.

    def _begin(
        self, taken: Expired[Process] | Due[Process], started: float, read_command: bool
    ) -> _Expiry | None:
        """The run of ``taken``'s policy: a `Due`'s made of its timer as armed (its
        firing record is made when it settles, `_record`), by the policy it was
        taken out by. ``started``: when the daemon started; ``read_command``: see
        `_Expiry`."""
        due = None
        try:
            if isinstance(taken, Due):
                due = taken
                run = Run.signalling(due.timer, due.policy, due.signal, daemon_started=started)
            else:
                policy, note = self._service.rules.policy_for(taken.timer.policy)
                run = Run(
                    taken.timer,
                    policy,
                    note,
                    taken.note,
                    daemon_started=started,
                    evidence_wait=self._service.rules.daemon.incident_evidence_wait,
                )
        except Exception:
            log.exception("could not start the policy of %r", taken.timer)
            timer = taken.timer if due is None else self._service.firing.record(due).timer
            taken.process.close()
            self._service.firing.finished(timer)
            return None
        return _Expiry(run, taken.process, due=due, read_command=read_command)

    def _record(self, expiry: _Expiry) -> None:
        """A `Due`'s firing record is made (its signal went, or its run ends):
        its run goes on with the timer as that record holds it."""
        if expiry.due is not None:
            expiry.run.recorded(self._service.firing.record(expiry.due).timer)
            expiry.due = None

    def _open(self, expiry: _Expiry, *, check: bool) -> Opened:
        """Pin the target (it holds pidfds of its own) and let the process go.
        ``check``: see whether it is gone already; without, the first signal
        tells (polling a pidfd takes a lock that a storm of exits holds, and a
        burst of expiries is such a storm)."""
        process = expiry.process
        assert process is not None
        run = expiry.run
        try:
            command = expiry.command or (
                process.command() if expiry.read_command else process.armed_command
            )
            target = expiry.target = open_target(
                run.policy.target, process, self._daemon_pgid, run.timer.owner
            )
        finally:
            process.close()
            expiry.process = None
        alive = target.alive() if check else None
        return Opened(command, denied=target.denied, note=target.note, alive=alive)

    def _finish(self, expiry: _Expiry, finish: Finish) -> None:
        """Record the expiry's event; it leaves the state."""
        run, target = expiry.run, expiry.target
        assert target is not None
        self._events.append(finish.event)
        self._service.firing.finished(run.timer)
        if finish.unkillable:
            pid, state, wchan = target.survivor()
            after = self._service.rules.daemon.unkillable_after
            event = run.unkillable_event(pid, state, wchan, after=after, wall=self._wall())
            self._service.firing.record_unkillable(event)
        target.close()

    def _failed(self, expiry: _Expiry, what: str) -> None:
        """Log the exception being handled, with its traceback, and end the
        expiry: its timer leaves the state (a `Due` is recorded first)."""
        log.exception("%s of %r", what, expiry.run.timer)
        self._let_go(expiry)
        self._record(expiry)
        self._service.firing.finished(expiry.run.timer)

    def _flush_events(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self._service.firing.record_expiries(events)

    # Watching targets sent SIGKILL for their exit.

    def _watch(self, expiry: _Expiry, until: float) -> None:
        target = expiry.target
        assert target is not None
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
                    self._watched(dying.expiry, alive=False)
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
                self._watched(dying.expiry, alive=target.alive())
        return True

    def _watched(self, expiry: _Expiry, *, alive: bool) -> None:
        """The watch of ``expiry``'s target ended: its run finishes."""
        try:
            self._advance(expiry, Watched(alive))
        except Exception:
            self._failed(expiry, "the policy failed")

    def _forget(self, dying: _Dying) -> None:
        for fd in dying.fds:
            self._epoll.unregister(fd)
            del self._dying[fd]
        dying.fds.clear()

    def _trio_time(self, monotonic: float) -> float:
        return trio.current_time() + (monotonic - self._clock())
