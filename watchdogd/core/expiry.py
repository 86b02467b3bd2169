"""The policy run of a timer that fell due, as a state machine without I/O.

A `Run` is made from the firing `Timer` (its ``step`` and ``step_end`` are the
machine's recorded state), the `Policy` it runs and what the service noted of how
it came to fire. The runtime's executor (`watchdogd.runtime.executor`) asks it for
the next effect with `Run.next` and carries that effect out; what it observed goes
back through the method named for the effect. Every transition is in `Run.next`:

=================  =========================================  ====================
effect             carried out as                             observed with
=================  =========================================  ====================
`CheckAlive`       polling the target's pidfds                `Run.seen`
`RecordStep`       the state recording the step in progress   `Run.recorded`
`SendSignal`       signalling the target                      `Run.signalled`
`ObserveLateness`  a lateness metric                          `Run.observed`
`WaitUntil`        waiting for the target's exit until a time `Run.waited`
`AwaitEvidence`    waiting for an incident's ranks' evidence  `Run.evidence_in`
`RunHook`          running an ``exec`` hook                   `Run.hooked`
`TakeDump`         running a stack dumper                     `Run.hooked`
`UnblockPeers`     having the job's waiting ranks unblocked   `Run.unblocked`
`WatchExit`        watching a target sent SIGKILL             `Run.watched`
`Finish`           recording the event; the timer leaves      (the run is over)
=================  =========================================  ====================

`Run.next` changes nothing until its effect is observed (it only notes when a step
began), so an executor may stop after any effect and ask again later: the burst's
first signal is this machine executed inline (`first_signal` says which runs may
send it before anything else is made of the expiry; `Run.signalled` takes its
result afterwards).

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

import signal
from typing import Final, assert_never

from msgspec import Struct

from watchdogd_protocol import EventInfo, StepResult

from .policies import Dump, Exec, Policy, Signal, Step, Unblock, Wait, placeholders, step_name
from .timers import Timer

#: The name in an event of a dump step that the worker's responder gave.
BY_RESPONDER: Final = "dump by the worker's responder"


class CheckAlive(Struct, frozen=True, gc=False):
    """Poll whether any member of the target is still running."""


class RecordStep(Struct, frozen=True, gc=False):
    """Have the state record the run at ``step`` (a wait ending at ``step_end``)."""

    step: int
    step_end: float = 0.0


class SendSignal(Struct, frozen=True, gc=False):
    """Send ``signum`` to the target; ``alive``: it was seen alive (or not checked,
    and the signal tells), so a process target need not be polled first."""

    signum: int
    alive: bool = False


class ObserveLateness(Struct, frozen=True, gc=False):
    """Count ``seconds`` from the deadline to the run's first signal."""

    seconds: float


class WaitUntil(Struct, frozen=True, gc=False):
    """Wait until ``end`` (the daemon's clock) or the target's exit."""

    end: float


class AwaitEvidence(Struct, frozen=True, gc=False):
    """Wait until the incident's other ranks on this host have given their
    evidence, or until ``until`` (the daemon's clock)."""

    incident: str
    until: float


class RunHook(Struct, frozen=True):
    """Run ``step``'s argv, with ``values`` substituted, in ``env``."""

    step: Exec
    values: dict[str, str]
    env: dict[str, str]


class TakeDump(Struct, frozen=True):
    """Run ``step``'s dumper on the timer's process, as `RunHook` runs a hook."""

    step: Dump
    values: dict[str, str]
    env: dict[str, str]


class UnblockPeers(Struct, frozen=True):
    """Ask for the ranks of ``incident``'s job waiting in the collective its verdict
    names to be unblocked, as ``step`` says (`watchdogd.core.unblocks`)."""

    step: Unblock
    incident: str


class WatchExit(Struct, frozen=True, gc=False):
    """Watch the target, sent SIGKILL, for its exit, up to ``unkillable_after``."""


class Finish(Struct, frozen=True):
    """The run is over: record ``event``; the timer leaves the state. With
    ``unkillable``, the target outlived SIGKILL (`Run.unkillable_event`)."""

    event: EventInfo
    unkillable: bool = False


Effect = (
    CheckAlive
    | RecordStep
    | SendSignal
    | ObserveLateness
    | WaitUntil
    | AwaitEvidence
    | RunHook
    | TakeDump
    | UnblockPeers
    | WatchExit
    | Finish
)

_CHECK: Final = CheckAlive()
_WATCH: Final = WatchExit()
#: A signal step's result, by number, when the kernel took it.
SENT: Final = {int(member): f"sent {member.name}" for member in signal.Signals}


def is_peer(timer: Timer) -> bool:
    """Whether ``timer``'s run is a job's peer policy, not its own expiry."""
    return timer.run is not None and timer.run.peer


def first_signal(timer: Timer, policy: Policy, note: str) -> Signal | None:
    """The signal a run of ``policy`` on ``timer`` sends first to the timer's own
    process, if the run starts afresh with one and nothing need be said of it
    (``note``): the executor may then send it before it makes anything else of
    the expiry, and hand its result to `Run.signalled`. None for any other run.
    (A policy that starts with a signal takes no dump first, so its signal never
    waits for an incident's evidence, `AwaitEvidence`.)"""
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
    watch = timer.watch
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
        "_end",
        "_evidence_until",
        "_lateness",
        "_watched",
        "command",
        "daemon_started",
        "denied",
        "evidence_wait",
        "first_step_at",
        "gone_at_start",
        "killed",
        "note",
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
        self.timer = timer
        self.policy = policy
        self.note = "; ".join(text for text in (note, judged) if text)
        self.daemon_started = daemon_started
        incident = timer.run.incident if timer.run is not None and not is_peer(timer) else ""
        self.evidence_wait = evidence_wait if incident and _dumps_first(policy) else 0.0
        #: When the wait for the evidence ends, once it began (0: over, or none).
        self._evidence_until: float | None = None
        #: Where this run started (a resumed expiry: the step it had reached),
        #: and the next step to carry out.
        self.resumed_at = self.step = timer.step
        self.command = ""
        self.denied = ""
        self.target_note = ""
        self.gone_at_start = False
        self.results: list[StepResult] = []
        #: A signal was sent (in this run or before a restart); a SIGKILL was sent.
        self.signalled_once = timer.step > 0
        self.killed = False
        #: When this run carried out its first step (the daemon's clock).
        self.first_step_at: float | None = None
        for step in policy.steps[: timer.step]:
            self.results.append(StepResult(step=self._named(step), result="done before a restart"))
            self.killed = self.killed or (
                isinstance(step, Signal) and step.signum == signal.SIGKILL
            )
        #: The target as last seen (None: not since the last step), when the next
        #: step began, the end of a wait in progress, a lateness to count, and
        #: whether a dying target was watched.
        self._alive: bool | None = None
        self._begun_at: float | None = None
        self._end = 0.0
        self._lateness: float | None = None
        self._watched = False

    @property
    def signals_next(self) -> bool:
        """Whether the next step is a signal."""
        steps = self.policy.steps
        return self.step < len(steps) and type(steps[self.step]) is Signal

    # Observations.

    def opened(
        self, command: str, *, denied: str = "", note: str = "", alive: bool | None = None
    ) -> None:
        """The target was opened: its process's ``command``, why its uid may not
        act on it (``denied``), what its event should say of it (``note``), and
        whether it was alive (None: not checked, the first signal tells)."""
        self.command, self.denied, self.target_note = command, denied, note
        if alive is not None:
            self.gone_at_start = not alive

    def seen(self, alive: bool) -> None:
        """`CheckAlive`: whether the target is still running."""
        self._alive = alive

    def recorded(self) -> None:
        """`RecordStep`: the state holds the run at the step beginning."""
        end = self._end if isinstance(self.policy.steps[self.step], Wait) else 0.0
        self.timer = self.timer.at_step(self.step, end)

    def signalled(self, result: str, at: float) -> None:
        """`SendSignal`: its result, and when it was sent (the daemon's clock). Also
        the first signal sent inline, before this run asked for it
        (`first_signal`)."""
        step = self.policy.steps[self.step]
        assert isinstance(step, Signal)
        if self.step == self.resumed_at and self.first_step_at is None:
            self.first_step_at = at if self._begun_at is None else self._begun_at
            if result == "gone":
                self.gone_at_start = True
        self.results.append(StepResult(step=self._named(step), result=result))
        if not self.signalled_once:
            self.signalled_once = True
            if not is_peer(self.timer):
                self._lateness = at - self.timer.deadline
        # A SIGKILL the kernel refused (EPERM) makes no target "unkillable".
        if step.signum == signal.SIGKILL and result.startswith("sent"):
            self.killed = True
        self._done()

    def observed(self) -> None:
        """`ObserveLateness`: counted."""
        self._lateness = None

    def waited(self, exited: bool) -> None:
        """`WaitUntil`: whether the target exited before the end."""
        step = self.policy.steps[self.step]
        assert isinstance(step, Wait)
        result = "exited" if exited else f"still running after {step.seconds:g}s"
        self._began()
        self.results.append(StepResult(step=self._named(step), result=result))
        self._done()

    def evidence_in(self) -> None:
        """`AwaitEvidence`: the ranks' evidence came, or the wait ran out."""
        self._evidence_until = 0.0

    def hooked(self, result: str, output: str = "", *, responder: bool = False) -> None:
        """`RunHook` or `TakeDump`: what the hook's run came to; ``responder``: the
        worker's responder gave the dump, and no dumper ran."""
        step = self.policy.steps[self.step]
        self._began()
        name = BY_RESPONDER if responder else self._named(step)
        self.results.append(StepResult(step=name, result=result, output=output))
        self._done()

    def unblocked(self, result: str) -> None:
        """`UnblockPeers`: what the step came to."""
        step = self.policy.steps[self.step]
        self._began()
        self.results.append(StepResult(step=self._named(step), result=result))
        self._done()

    def watched(self, alive: bool) -> None:
        """`WatchExit`: the target exited (``alive`` False), or outlived the watch."""
        self._watched = True
        self._alive = alive

    # Transitions.

    def next(self, now: float, wall: float) -> Effect:
        """The effect to carry out next, ``now`` on the daemon's clock (``wall``
        on the wall clock at the same moment)."""
        if self._lateness is not None:
            return ObserveLateness(self._lateness)
        steps = self.policy.steps
        if self.step < len(steps) and not self.denied and not self._watched:
            step = steps[self.step]
            first = self.step == self.resumed_at and self.first_step_at is None
            if first and type(step) is Signal:
                # Seen alive when the target was opened, or not checked: the
                # signal tells.
                go_on = not self.gone_at_start
            elif self._alive is None:
                return _CHECK
            else:
                go_on = self._alive
            if go_on:
                if type(step) is Signal and self.evidence_wait and self._evidence_until != 0.0:
                    if self._evidence_until is None:
                        self._evidence_until = now + self.evidence_wait
                    assert self.timer.run is not None
                    return AwaitEvidence(self.timer.run.incident, self._evidence_until)
                return self._step(step, first, now)
        if self._alive is None:
            return _CHECK
        if self._alive and self.killed and not self._watched:
            return _WATCH
        return self._finish(self._alive, now, wall)

    def _step(self, step: Step, first: bool, now: float) -> Effect:
        if self._begun_at is None:
            self._begun_at = now
            if isinstance(step, Wait):
                timer = self.timer
                resumed = self.step == timer.step and timer.step_end
                self._end = timer.step_end if resumed else now + step.seconds
        end = self._end if isinstance(step, Wait) else 0.0
        if self.step != self.timer.step or end != self.timer.step_end:
            return RecordStep(self.step, end)
        match step:
            case Signal():
                return SendSignal(step.signum, alive=first)
            case Wait():
                return WaitUntil(self._end)
            case Exec():
                return RunHook(step, self._values(), self._env())
            case Dump():
                return TakeDump(step, self._values(), self._env())
            case Unblock():
                return UnblockPeers(step, self.timer.run.incident if self.timer.run else "")
            case _:
                assert_never(step)

    def _began(self) -> None:
        if self.step == self.resumed_at and self.first_step_at is None:
            self.first_step_at = self._begun_at

    def _done(self) -> None:
        """The step in progress is over: on to the next, the target unseen."""
        self.step += 1
        self._alive = None
        self._begun_at = None

    def _values(self) -> dict[str, str]:
        return placeholders(self.timer.pid, self.timer.scope)

    def _named(self, step: Step) -> str:
        return step_name(step, self._values())

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
        why = "not allowed" if self.denied else "target exited"
        steps = [
            *self.results,
            *(
                StepResult(step=self._named(step), result=f"skipped: {why}")
                for step in self.policy.steps[len(self.results) :]
            ),
        ]
        if self.gone_at_start:
            outcome = "gone"
        elif alive:
            outcome = "unkillable" if self.killed else "alive"
        else:
            outcome = "exited"
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
            outcome=outcome,
            steps=steps,
            note="; ".join(self._notes()),
            reason="" if peer else "stalled" if timer.stalled else "timeout",
            timeout=timer.timeout,
            timeout_from="" if timer.watch is None else timer.watch.timeout_from,
            job="" if timer.watch is None else timer.watch.job,
            rank=None if timer.watch is None else timer.watch.rank,
            incident="" if timer.run is None else timer.run.incident,
        )
        return Finish(event, unkillable=outcome == "unkillable")

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
            f"it had been given {timer.watch.extended:g}s more as starved (its extended event "
            "says why) and was still due"
            if timer.watch is not None and timer.watch.extended and not peer
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
