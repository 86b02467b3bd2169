"""What a policy run (`watchdogd.core.expiry.Run`) asks for and what it is told.

The effects it returns, the observations that answer them (`ANSWERS` pairs each
with the effect it answers), and the step results inside them, made by the host
and the runtime as values: a signal's `SignalResult` (its `Delivery`), a hook's or
a dumper's `HookResult`. An event's words are rendered from these values
(`SignalResult.__str__`, `Outcome`), never parsed back.

Invariants:

- Every effect but `Finish` has exactly one observation that answers it; the run
  raises `WrongObservation` on any other.
- A `SignalResult` of `Delivery.NOT_SENT` comes only from a signal sent before its
  target was opened (`watchdogd.core.expiry.Phase.FIRST_SIGNAL`).
"""

from __future__ import annotations

import enum
import signal
from typing import Final

from msgspec import Struct

from watchdogd_protocol import EventInfo

from ..errors import DaemonError
from .policies import Dump, Exec, Unblock


class WrongObservation(DaemonError):
    """Raised by `Run.observe` for an observation that does not answer the run's
    pending effect: a bug of the executor, which logs it and fails that run."""


class Delivery(enum.Enum):
    """What came of a signal, as the host found."""

    SENT = "sent"
    #: No member was left to signal.
    GONE = "gone"
    #: The kernel refused it (EPERM).
    REFUSED = "not permitted"
    #: Not sent through the process's own pidfd before its target was opened (the
    #: uid that armed it may no longer signal it, or the kernel said something
    #: else): it goes, or is skipped and says why, once the target is opened.
    NOT_SENT = "not sent"


class SignalResult(Struct, frozen=True, gc=False):
    """A signal step's result: its ``delivery``, of ``signum``, and ``to`` whom, in
    the host's words ("" for the timer's process alone). `str` renders it as the
    event says it."""

    delivery: Delivery
    signum: int
    to: str = ""

    def __str__(self) -> str:
        if self.delivery is Delivery.GONE:
            return "gone"
        name = _NAMES.get(self.signum) or signal.Signals(self.signum).name
        said = f"sent {name}" if self.delivery is Delivery.SENT else f"not permitted to send {name}"
        return f"{said} {self.to}" if self.to else said


class HookResult(Struct, frozen=True):
    """How an ``exec`` hook or a dumper ended: ``status`` is its exit status (128+N
    for signal N), None if it could not start or was killed at its limit;
    ``result`` says it in words, ``output`` is what it wrote."""

    status: int | None
    result: str
    output: str


# The effects.


class OpenTarget(Struct, frozen=True, gc=False):
    """Pin the target's members; ``check``: see whether it is gone already (not
    when a signal to the process is next: the signal tells)."""

    check: bool = True


class CheckAlive(Struct, frozen=True, gc=False):
    """Poll whether any member of the target is still running."""


class RecordStep(Struct, frozen=True, gc=False):
    """Have the state record the run at ``step`` (a wait ending at ``step_end``)."""

    step: int
    step_end: float = 0.0


class SendSignal(Struct, frozen=True, gc=False):
    """Send ``signum`` to the target; ``alive``: it was seen alive (or not checked,
    and the signal tells), so a process target need not be polled first. Before
    the target is opened (`Phase.FIRST_SIGNAL`), to the timer's process."""

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
    OpenTarget
    | CheckAlive
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


# The observations, one for each effect but `Finish`.


class Opened(Struct, frozen=True, gc=False):
    """`OpenTarget`: its process's ``command``, why the uid that armed the timer
    may not act on it (``denied``), what its event should say of it (``note``),
    and whether it was alive (None: not checked, the first signal tells)."""

    command: str
    denied: str = ""
    note: str = ""
    alive: bool | None = None


class Seen(Struct, frozen=True, gc=False):
    """`CheckAlive`: whether the target is still running."""

    alive: bool


class Recorded(Struct, frozen=True, gc=False):
    """`RecordStep`: the state holds the run at the step beginning."""


class Signalled(Struct, frozen=True, gc=False):
    """`SendSignal`: its ``result``, and when it was sent (``at``, the daemon's clock)."""

    result: SignalResult
    at: float

    @property
    def went(self) -> bool:
        """The signal went (sent, or its target found gone, or refused): a run
        in its pass may take this later (`watchdogd.runtime.executor`). One not
        sent is left to the target, opened at once (`watchdogd.core.expiry`)."""
        return self.result.delivery is not Delivery.NOT_SENT


class Counted(Struct, frozen=True, gc=False):
    """`ObserveLateness`: counted."""


class Waited(Struct, frozen=True, gc=False):
    """`WaitUntil`: whether the target ``exited`` before the end."""

    exited: bool


class EvidenceIn(Struct, frozen=True, gc=False):
    """`AwaitEvidence`: the ranks' evidence came, or the wait ran out."""


class Hooked(Struct, frozen=True, gc=False):
    """`RunHook`: what the hook's run came to."""

    result: HookResult


class Dumped(Struct, frozen=True, gc=False):
    """`TakeDump`: what the dumper's run came to; ``responder``: the worker's
    responder gave the dump, and no dumper ran."""

    result: HookResult
    responder: bool = False


class PeersUnblocked(Struct, frozen=True, gc=False):
    """`UnblockPeers`: what the step came to, in the runtime's words (``said``)."""

    said: str


class Watched(Struct, frozen=True, gc=False):
    """`WatchExit`: the target exited (``alive`` False), or outlived the watch."""

    alive: bool


Observation = (
    Opened
    | Seen
    | Recorded
    | Signalled
    | Counted
    | Waited
    | EvidenceIn
    | Hooked
    | Dumped
    | PeersUnblocked
    | Watched
)

#: The effect each observation answers.
ANSWERS: Final[dict[type, type]] = {
    Opened: OpenTarget,
    Seen: CheckAlive,
    Recorded: RecordStep,
    Signalled: SendSignal,
    Counted: ObserveLateness,
    Waited: WaitUntil,
    EvidenceIn: AwaitEvidence,
    Hooked: RunHook,
    Dumped: TakeDump,
    PeersUnblocked: UnblockPeers,
    Watched: WatchExit,
}
#: The effects that go in the pass of an expiry, on the way to its first signal.
IN_PASS: Final = frozenset((OpenTarget, RecordStep, SendSignal))

_NAMES: Final = {int(member): member.name for member in signal.Signals}


class Outcome(enum.Enum):
    """What became of a run's target, as its event says (``outcome``)."""

    #: It had exited before the run began.
    GONE = "gone"
    #: It exited during the run.
    EXITED = "exited"
    #: It is still running, and was not sent SIGKILL.
    ALIVE = "alive"
    #: It outlived SIGKILL.
    UNKILLABLE = "unkillable"


#: A skipped step's result when the uid that armed the timer may not act on it.
SKIPPED_DENIED: Final = "skipped: not allowed"
