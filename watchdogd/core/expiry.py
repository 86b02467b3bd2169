"""The policy run of a timer that fell due, as a closed state machine without I/O.

A `Run` is made from the firing `Timer` (its ``step`` and ``step_end`` are the
machine's recorded state), the `Policy` it runs and what the service noted of how
it came to fire. It holds the effect it waits on (`Run.next` returns it) and a
named `Phase`; the runtime's executor (`watchdogd.runtime.executor`) carries the
effect out and hands back what it observed through one method, `Run.observe`,
as one of the typed observations of `watchdogd.core.effects`. An observation that
does not answer the pending effect is a bug of its caller: `Run.observe` raises
`WrongObservation`. `Run.answer` is `Run.observe` and then `Run.next`, in one call:
the executor's loop asks once a turn. Every transition is in `Run.next` and
`Run.observe`:

=================  =========================================  ====================
effect             carried out as                             observed as
=================  =========================================  ====================
`OpenTarget`       pinning the target's members               `Opened`
`CheckAlive`       polling the target's pidfds                `Seen`
`RecordStep`       the state recording the step in progress   `Recorded`
`SendSignal`       signalling the target                      `Signalled`
`ObserveLateness`  a lateness metric                          `Counted`
`WaitUntil`        waiting for the target's exit until a time `Waited`
`AwaitEvidence`    waiting for an incident's ranks' evidence  `EvidenceIn`
`RunHook`          running an ``exec`` hook                   `Hooked`
`TakeDump`         running a stack dumper                     `Dumped`
`UnblockPeers`     having the job's waiting ranks unblocked   `PeersUnblocked`
`WatchExit`        watching a target sent SIGKILL             `Watched`
`Finish`           recording the event; the timer leaves      (the run is over)
=================  =========================================  ====================

Step results are values (`watchdogd.core.effects`), made by the host and the
runtime: a signal's `SignalResult` (its `Delivery`), a hook's or a dumper's
`HookResult`; the event's words are rendered from them, never parsed.

`Run.next` changes nothing until its effect is observed (it only notes when a step
began), so an executor may stop after any effect and ask again later. The burst's
first signal is no other path: a run that starts afresh with a signal to its own
process (`first_signal`, the one place that decides it) starts in
`Phase.FIRST_SIGNAL`, its pending effect that signal, before its target is opened
(`Run.signalling` makes it of a `watchdogd.core.firing.Due`, whose signal was
found when its timer was taken out); `Run.next_in_pass` gives the effects that go
in the pass of the expiry, up to a run's first signal to its process alone.

Invariants:

- A restart resumes from the stored timer: a `Run` made from a timer at step N
  counts the steps before N as done and carries on at N (a wait at its recorded
  end), unless its policy's plan changed meanwhile: then it starts again from the
  first step, and its event says so.
- Each step is recorded as it starts, unless the firing record names it already.
- Steps after the target has exited are skipped; so is every step when the uid
  that armed the timer may no longer signal its process (``denied``).
- An event's ``late`` is from the deadline to this run's first step; the lateness
  metric counts the first signal of a run that starts afresh, never a peer run.
- A target sent SIGKILL that is alive after the last step is watched until it
  exits, or for ``unkillable_after`` seconds: then it is ``unkillable``.
- The first signal of a run that is part of an incident (its own expiry, not a
  peer run), of a policy that dumps before it signals, waits, once, until the
  incident's other ranks on this host have given their evidence, or for
  ``evidence_wait`` seconds, whichever comes first: their stacks are taken before
  one of them is signalled. It never waits for another host.
"""

from __future__ import annotations

import enum
import functools
import signal
from typing import Final, assert_never

from watchdogd_protocol import EventInfo, StepResult

from .effects import (
    ANSWERS,
    IN_PASS,
    SKIPPED_DENIED,
    AwaitEvidence,
    CheckAlive,
    Counted,
    Delivery,
    Dumped,
    Effect,
    EvidenceIn,
    Finish,
    Hooked,
    Observation,
    ObserveLateness,
    Opened,
    OpenTarget,
    Outcome,
    PeersUnblocked,
    Recorded,
    RecordStep,
    RunHook,
    Seen,
    SendSignal,
    Signalled,
    SignalResult,
    TakeDump,
    UnblockPeers,
    Waited,
    WaitUntil,
    Watched,
    WatchExit,
    WrongObservation,
)
from .policies import Dump, Exec, Policy, Signal, Step, Unblock, Wait, placeholders, step_name
from .timers import Timer

#: The name in an event of a dump step that the worker's responder gave.
BY_RESPONDER: Final = "dump by the worker's responder"


class Phase(enum.Enum):
    """Where a run is: what its pending effect may be."""

    #: A fresh run's first signal, to its own process, is pending (`first_signal`);
    #: its target may be opened before it goes, or after.
    FIRST_SIGNAL = "first signal"
    #: Its target is to be opened (`OpenTarget`).
    OPENING = "opening"
    #: Its steps are carried out, one effect at a time.
    STEPS = "steps"
    #: Its first signal waits for its incident's evidence (`AwaitEvidence`).
    EVIDENCE = "evidence"
    #: Every step is done or skipped: the target is seen, then the run finishes.
    ENDING = "ending"
    #: Its target, sent SIGKILL and still alive, is watched (`WatchExit`).
    WATCHING = "watching"
    #: `Finish` was returned.
    OVER = "over"


_CHECK: Final = CheckAlive()
_WATCH: Final = WatchExit()


@functools.cache
def _first(signum: int) -> SendSignal:
    """A first signal's effect: frozen, so made once a signal number."""
    return SendSignal(signum, alive=True)


def is_peer(timer: Timer) -> bool:
    """Whether ``timer``'s run is a job's peer policy, not its own expiry."""
    return timer.run is not None and timer.run.peer


def first_signal(timer: Timer, policy: Policy, note: str) -> Signal | None:
    """The signal a run of ``policy`` on ``timer`` sends first to the timer's own
    process, if the run starts afresh with one and nothing need be said of it
    (``note``): its `Run` starts in `Phase.FIRST_SIGNAL`, that signal pending
    before anything else is made of the expiry (and `watchdogd.core.firing` may
    make its firing record after it). None for any other run. (A policy that
    starts with a signal takes no dump first, so its signal never waits for an
    incident's evidence, `AwaitEvidence`.)"""
    if timer.step or timer.step_end or is_peer(timer) or note or policy.target != "process":
        return None
    steps = policy.steps
    if not steps or type(steps[0]) is not Signal:
        return None
    return steps[0]


def _dumps_first(policy: Policy) -> bool:
    """Whether ``policy`` takes a dump before its first signal: a policy that asks
    for the stacks, whose kill may then wait for the other ranks' (`AwaitEvidence`)."""
    for step in policy.steps:
        if isinstance(step, Signal):
            return False
        if isinstance(step, Dump):
            return True
    return False


def resume_point(timer: Timer, policy: Policy, note: str) -> tuple[Timer, str]:
    """Where a resumed expiry goes on: at the step it had reached, unless its
    policy was changed or removed while the daemon was down (the step means
    nothing in another policy): then from the first step, and its event says so."""
    if not (timer.step or timer.step_end) or (timer.plan == policy.plan and not note):
        return timer, note
    again = "its policy changed across a restart; started again from its first step"
    timer = timer.at_step(0)
    return timer, "; ".join(text for text in (note, again) if text)


def stall_note(timer: Timer) -> str:
    """What an expiry's event says of a timer that stalled."""
    watch = timer.watched
    if watch is None or not timer.stalled:
        return ""
    at = "no progress counter" if watch.progress is None else f"its progress at {watch.progress}"
    return (
        f"stalled: re-armed with {at} for {watch.stall:g} s (its policy's stall), "
        f"before its {timer.timeout:g} s timeout"
    )


class Run:
    """One policy run (see the module's docstring)."""

    __slots__ = (
        "_alive",
        "_begun_at",
        "_evidence_owed",
        "_opened",
        "_pending",
        "command",
        "daemon_started",
        "denied",
        "evidence_wait",
        "first_step_at",
        "gone_at_start",
        "killed",
        "note",
        "phase",
        "policy",
        "results",
        "resumed_at",
        "signalled_once",
        "step",
        "target_note",
        "timer",
    )

    def __init__(
        self,
        timer: Timer,
        policy: Policy,
        note: str = "",
        judged: str = "",
        *,
        daemon_started: float,
        evidence_wait: float = 0.0,
    ) -> None:
        """``note``: what the policy's lookup said (`Service.policy_for`);
        ``judged``: what the service found of its starvation, if anything;
        ``daemon_started``: when the daemon started (the daemon's clock);
        ``evidence_wait``: the most its first signal waits for its incident's
        ranks' evidence, if it is part of one."""
        timer, note = resume_point(timer, policy, note)
        first = first_signal(timer, policy, note)
        incident = timer.run is not None and timer.run.incident and not timer.run.peer
        self._start(
            timer,
            policy,
            f"{note}; {judged}" if note and judged else note or judged,
            daemon_started,
            evidence_wait if incident and _dumps_first(policy) else 0.0,
        )
        if timer.step:
            self.signalled_once = True
            self._done_before(policy.steps[: timer.step])
        self.phase: Phase
        self._pending: Effect | None
        if first is not None:
            self.phase, self._pending = Phase.FIRST_SIGNAL, _first(first.signum)
        else:
            self.phase, self._pending = Phase.OPENING, self._open_target()

    @classmethod
    def signalling(
        cls, timer: Timer, policy: Policy, first: Signal, *, daemon_started: float
    ) -> Run:
        """The run of a timer the core took out as a `watchdogd.core.firing.Due`:
        a fresh run, with nothing to note and no incident, whose first step,
        ``first``, goes to its own process, as `first_signal` decided when the
        timer was taken out (the checks that found it are not made again: a
        burst's runs are made in its pass). ``timer`` is as armed until its
        firing record is made (`recorded`): the same deadline, process and owner."""
        run = cls.__new__(cls)
        run._start(timer, policy, "", daemon_started, 0.0)
        run.phase, run._pending = Phase.FIRST_SIGNAL, _first(first.signum)
        return run

    def _start(
        self, timer: Timer, policy: Policy, note: str, daemon_started: float, evidence_wait: float
    ) -> None:
        """What every run starts with: at its timer's step, nothing observed."""
        self.timer = timer
        self.policy = policy
        self.note = note
        self.daemon_started = daemon_started
        self.evidence_wait = evidence_wait
        #: The first signal still waits for the incident's evidence.
        self._evidence_owed = bool(evidence_wait)
        #: Where this run started (a resumed expiry: the step it had reached),
        #: and the next step to carry out.
        self.resumed_at = self.step = timer.step
        self.command = self.denied = self.target_note = ""
        self.gone_at_start = self.killed = self._opened = False
        #: A signal was sent (in this run or before a restart); a SIGKILL was sent.
        self.signalled_once = False
        #: Each step's result; a signal's kept as its value until the run
        #: finishes, so that a burst's signals wait for no words.
        self.results: list[StepResult | tuple[Signal, SignalResult]] = []
        #: When this run carried out its first step (the daemon's clock).
        self.first_step_at: float | None = None
        #: The target as last seen (None: not since the last step), and when the
        #: next step began (None: not yet).
        self._alive: bool | None = None
        self._begun_at: float | None = None

    def _done_before(self, steps: tuple[Step, ...]) -> None:
        for step in steps:
            self.results.append(StepResult(step=self._named(step), result="done before a restart"))
            self.killed = self.killed or (
                isinstance(step, Signal) and step.signum == signal.SIGKILL
            )

    def recorded(self, timer: Timer) -> None:
        """The firing record of its timer was made (a `signalling` run's, once
        its first signal went): the run goes on with it."""
        self.timer = timer

    @property
    def signals_next(self) -> bool:
        """Whether the next step is a signal."""
        steps = self.policy.steps
        return self.step < len(steps) and type(steps[self.step]) is Signal

    @property
    def pending(self) -> Effect | None:
        """The effect the run waits on (None: `next` decides it when asked)."""
        return self._pending

    # Transitions.

    def next(self, now: float, wall: float) -> Effect:
        """The effect to carry out next, ``now`` on the daemon's clock (``wall``
        on the wall clock at the same moment): the pending one, until it is
        observed."""
        if self._pending is None:
            self._pending = self._decide(now, wall)
        return self._pending

    def next_in_pass(self, now: float, wall: float) -> Effect | None:
        """`next`, if it is on the way to this run's first signal to its own
        process (opening the process, recording the step, the signal itself),
        which goes in the pass of the expiry, before anything else is made of the
        others due with it; None once that signal was sent, and for any other
        run or effect."""
        if self.phase is Phase.FIRST_SIGNAL:
            return self._pending  # the signal itself
        if self.first_step_at is not None or self.denied:
            return None
        if self.policy.target != "process" or not self.signals_next:
            return None
        effect = self.next(now, wall)
        return effect if type(effect) in IN_PASS else None

    def answer(
        self, observation: Observation, now: float, wall: float, *, in_pass: bool = False
    ) -> Effect | None:
        """`observe`, then the effect to carry out next (`next`, or `next_in_pass`
        with ``in_pass``): what the executor asks after each effect it carried out."""
        self.observe(observation)
        return self.next_in_pass(now, wall) if in_pass else self.next(now, wall)

    def observe(self, observation: Observation) -> None:
        """Take what the executor observed of the pending effect; raises
        `WrongObservation` for one that does not answer it (an `Opened` may also
        come while a first signal is pending)."""
        pending = self._pending
        opening_early = type(observation) is Opened and self.phase is Phase.FIRST_SIGNAL
        if type(pending) is not ANSWERS[type(observation)] and not opening_early:
            raise WrongObservation(
                f"{observation!r} does not answer {pending!r} (phase: {self.phase.value}) "
                f"in the run of {self.policy.name!r} on pid {self.timer.pid}"
            )
        if not opening_early:
            self._pending = None
        self._take(observation, pending)

    # One branch per observation, by design: each is taken in one place.
    def _take(self, observation: Observation, pending: Effect | None) -> None:
        match observation:
            case Opened():
                self._opened_as(observation)
            case Seen(alive=alive):
                self._alive = alive
            case Recorded():
                assert isinstance(pending, RecordStep)
                self.timer = self.timer.at_step(pending.step, pending.step_end)
            case Signalled(result=result, at=at):
                self._signalled(result, at)
            case Counted():
                pass
            case Waited(exited=exited):
                step = self.policy.steps[self.step]
                assert isinstance(step, Wait)
                self._ended(step, "exited" if exited else f"still running after {step.seconds:g}s")
            case EvidenceIn():
                self._evidence_owed = False
                self.phase = Phase.STEPS
            case Hooked(result=result):
                self._ended(self.policy.steps[self.step], result.result, result.output)
            case Dumped(result=result, responder=responder):
                step = self.policy.steps[self.step]
                self._ended(step, result.result, result.output, BY_RESPONDER if responder else "")
            case PeersUnblocked(said=said):
                self._ended(self.policy.steps[self.step], said)
            case Watched(alive=alive):
                self._alive = alive
            case _:
                assert_never(observation)

    def _opened_as(self, opened: Opened) -> None:
        self.command, self.denied, self.target_note = opened.command, opened.denied, opened.note
        if opened.alive is not None:
            self.gone_at_start = not opened.alive
        self._opened = True
        if self.phase is Phase.FIRST_SIGNAL and not (self.denied or self.gone_at_start):
            return  # the first signal stays pending
        self.phase, self._pending = Phase.STEPS, None

    def _signalled(self, result: SignalResult, at: float) -> None:
        if result.delivery is Delivery.NOT_SENT:
            if self.phase is not Phase.FIRST_SIGNAL or self._opened:
                raise WrongObservation(f"{result!r} from a target opened, on pid {self.timer.pid}")
            # Left for the target, once opened, to send or to say why not.
            self.phase, self._pending = Phase.OPENING, self._open_target()
            return
        step = self.policy.steps[self.step]
        assert isinstance(step, Signal)
        if self.step == self.resumed_at and self.first_step_at is None:
            self.first_step_at = at if self._begun_at is None else self._begun_at
            if result.delivery is Delivery.GONE:
                self.gone_at_start = True
        self.results.append((step, result))
        if not self.signalled_once:
            self.signalled_once = True
            if not is_peer(self.timer):
                self._pending = ObserveLateness(at - self.timer.deadline)
        # A SIGKILL the kernel refused (EPERM) makes no target "unkillable".
        if step.signum == signal.SIGKILL and result.delivery is Delivery.SENT:
            self.killed = True
        self._done()
        if self.phase is Phase.FIRST_SIGNAL:
            self.phase = Phase.STEPS if self._opened else Phase.OPENING

    def _ended(self, step: Step, result: str, output: str = "", name: str = "") -> None:
        """A step that took its time (a wait, a hook, a dump, an unblock) ended."""
        if self.step == self.resumed_at and self.first_step_at is None:
            self.first_step_at = self._begun_at
        self.results.append(
            StepResult(step=name or self._named(step), result=result, output=output)
        )
        self._done()

    def _done(self) -> None:
        """The step in progress is over: on to the next, the target unseen."""
        self.step += 1
        self._alive = None
        self._begun_at = None

    def _open_target(self) -> OpenTarget:
        # Whether it is gone is asked only before the run's first step, and not
        # when that step is a signal to the process alone: the signal tells
        # (polling a pidfd takes a lock that a storm of exits holds, and a burst
        # of expiries is such a storm).
        if self.first_step_at is not None:
            return OpenTarget(check=False)
        return OpenTarget(check=self.policy.target != "process" or not self.signals_next)

    def _decide(self, now: float, wall: float) -> Effect:
        """The next effect, once the one before it was observed."""
        if self.phase is Phase.OPENING:
            return self._open_target()
        if self.phase is Phase.WATCHING:
            self.phase = Phase.OVER
            return self._finish(bool(self._alive), now, wall)
        if self.phase is Phase.STEPS:
            effect = self._next_step(now)
            if effect is not None:
                return effect
            self.phase = Phase.ENDING
        if self._alive is None:
            return _CHECK
        if self._alive and self.killed:
            self.phase = Phase.WATCHING
            return _WATCH
        self.phase = Phase.OVER
        return self._finish(self._alive, now, wall)

    def _next_step(self, now: float) -> Effect | None:
        """The effect of the next step, if one is to be carried out."""
        steps = self.policy.steps
        if self.step >= len(steps) or self.denied:
            return None
        step = steps[self.step]
        first = self.step == self.resumed_at and self.first_step_at is None
        if first and type(step) is Signal:
            # Seen alive when the target was opened, or not checked: the signal
            # tells.
            go_on = not self.gone_at_start
        elif self._alive is None:
            return _CHECK
        else:
            go_on = self._alive
        if not go_on:
            return None
        if type(step) is Signal and self._evidence_owed:
            assert self.timer.run is not None
            self.phase = Phase.EVIDENCE
            return AwaitEvidence(self.timer.run.incident, now + self.evidence_wait)
        return self._step(step, first, now)

    def _step(self, step: Step, first: bool, now: float) -> Effect:
        if self._begun_at is None:
            self._begun_at = now
        end = 0.0
        if isinstance(step, Wait):
            timer = self.timer
            resumed = self.step == timer.step and timer.step_end
            end = timer.step_end if resumed else self._begun_at + step.seconds
        if self.step != self.timer.step or end != self.timer.step_end:
            return RecordStep(self.step, end)
        match step:
            case Signal():
                return SendSignal(step.signum, alive=first)
            case Wait():
                return WaitUntil(end)
            case Exec():
                return RunHook(step, self._values(), self._env())
            case Dump():
                return TakeDump(step, self._values(), self._env())
            case Unblock():
                return UnblockPeers(step, self.timer.run.incident if self.timer.run else "")
            case _:
                assert_never(step)

    def _values(self) -> dict[str, str]:
        return placeholders(self.timer.pid, self.timer.scope)

    def _named(self, step: Step) -> str:
        return step_name(step, self._values())

    def _said(self, step: Signal, result: SignalResult) -> StepResult:
        return StepResult(step=self._named(step), result=str(result))

    def _env(self) -> dict[str, str]:
        return {
            "WATCHDOG_PID": str(self.timer.pid),
            "WATCHDOG_SCOPE": self.timer.scope,
            "WATCHDOG_POLICY": self.policy.name,
            "WATCHDOG_UID": str(self.timer.uid),
        }

    # The outcome.

    def _finish(self, alive: bool, now: float, wall: float) -> Finish:
        timer = self.timer
        why = SKIPPED_DENIED if self.denied else "skipped: target exited"
        steps = [
            *(done if isinstance(done, StepResult) else self._said(*done) for done in self.results),
            *(
                StepResult(step=self._named(step), result=why)
                for step in self.policy.steps[len(self.results) :]
            ),
        ]
        if self.gone_at_start:
            outcome = Outcome.GONE
        elif alive:
            outcome = Outcome.UNKILLABLE if self.killed else Outcome.ALIVE
        else:
            outcome = Outcome.EXITED
        peer = is_peer(timer)
        started = timer.fired_at if self.first_step_at is None else self.first_step_at

        def as_wall(monotonic: float) -> float:
            return wall - (now - monotonic)

        event = EventInfo(
            seq=0,
            kind="peer" if peer else "expired",
            time=wall,
            pid=timer.pid,
            uid=timer.uid,
            scope=timer.scope,
            policy=self.policy.name,
            command=self.command,
            armed_at=as_wall(timer.armed_at),
            deadline=as_wall(timer.deadline),
            fired_at=as_wall(timer.fired_at),
            late=None if peer else started - timer.deadline,
            outcome=outcome.value,
            steps=steps,
            note="; ".join(self._notes()),
            reason="" if peer else "stalled" if timer.stalled else "timeout",
            timeout=timer.timeout,
            timeout_from="" if timer.watched is None else timer.watched.timeout_from,
            job="" if timer.watched is None else timer.watched.job,
            rank=None if timer.watched is None else timer.watched.rank,
            incident="" if timer.run is None else timer.run.incident,
        )
        return Finish(event, unkillable=outcome is Outcome.UNKILLABLE)

    def _notes(self) -> list[str]:
        timer = self.timer
        peer = is_peer(timer)
        downtime = (
            "fell due while the daemon was not running"
            if timer.deadline < self.daemon_started <= timer.fired_at
            else ""
        )
        resumed = (
            f"resumed at step {self.resumed_at + 1} after a restart" if self.resumed_at else ""
        )
        extended = (
            f"it had been given {timer.watched.extended:g}s more as starved (its extended event "
            "says why) and was still due"
            if timer.watched is not None and timer.watched.extended and not peer
            else ""
        )
        first = (
            f"the peer policy of incident {timer.run.incident}"
            if peer and timer.run is not None
            else stall_note(timer)
        )
        notes = (first, self.note, extended, self.denied, self.target_note, downtime, resumed)
        return [text for text in notes if text]

    def unkillable_event(
        self, pid: int, state: str, wchan: str, *, after: float, wall: float
    ) -> EventInfo:
        """The event of a target still alive ``after`` seconds after SIGKILL:
        ``pid`` is a member still alive, in /proc ``state`` and wait channel
        ``wchan``."""
        return EventInfo(
            seq=0,
            kind="unkillable",
            time=wall,
            pid=pid,
            uid=self.timer.uid,
            scope=self.timer.scope,
            policy=self.policy.name,
            state=state,
            wchan=wchan,
            note=f"still alive {after:g}s after SIGKILL",
        )
