"""The replies: what the daemon answers, as tagged, frozen Structs, and the error
codes its refusals carry.

A reply's ``id`` echoes its request's; an `Error` whose ``id`` is None answers
something whose id could not be read. Fields are added only with defaults and unknown
ones are ignored, so an older client reads a newer daemon's replies.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec
from msgspec import Meta, Struct

from .requests import RequestId
from .responding import GroupState
from .slot_page import SLOTS

#: The most of a command line a status page shows, in UTF-8 bytes (marker included).
MAX_COMMAND_BYTES: Final = 1024


class ErrorCode(enum.StrEnum):
    """Machine-readable codes carried by `Error` replies."""

    #: Raised when the first frame on a connection is not `Hello`.
    HANDSHAKE_REQUIRED = "handshake_required"
    #: The client speaks a major protocol version the daemon does not.
    UNSUPPORTED_VERSION = "unsupported_version"
    #: A frame declared a length over the receiver's bound; the connection is closed.
    FRAME_TOO_LARGE = "frame_too_large"
    #: The frame is not a msgpack message.
    MALFORMED = "malformed"
    #: The ``type`` names no request this daemon knows.
    UNKNOWN_OP = "unknown_op"
    #: The message decodes but a field is missing, of the wrong type or out of range.
    INVALID_REQUEST = "invalid_request"
    #: The named policy is not configured.
    UNKNOWN_POLICY = "unknown_policy"
    #: The caller could not kill(2) the target process, or the target is protected.
    PERMISSION_DENIED = "permission_denied"
    #: The target pid does not exist.
    NO_SUCH_PROCESS = "no_such_process"
    #: No incident of that id is kept that the caller may see.
    NO_SUCH_INCIDENT = "no_such_incident"
    #: The daemon knows nothing of that job of that user: no timer, no incident, no
    #: hang of it.
    NO_SUCH_JOB = "no_such_job"
    #: The target pid is a thread, not a process (not its thread-group leader); the
    #: message names the process it belongs to, which is what to name instead.
    NOT_A_PROCESS = "not_a_process"
    #: A per-uid or global bound on timers or connections was reached.
    LIMIT_EXCEEDED = "limit_exceeded"
    #: The daemon lacks a resource for now (file descriptors, memory); the request
    #: may succeed if sent again later. Nothing was changed.
    UNAVAILABLE = "unavailable"
    #: The daemon failed while handling a valid request (a bug; it is logged).
    INTERNAL = "internal"


class Reply(Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type"):
    """Base of every daemon-to-client message; ``id`` echoes the request's."""

    id: RequestId


class Welcome(Reply, tag="welcome", frozen=True, kw_only=True):
    """Answer to `Hello`: the daemon's protocol version, release and pid.

    ``restart`` is how long a restart of this daemon may take, in seconds, by its
    own measure of loading its state, at its timer cap: a client whose
    connection breaks waits at least this long for the daemon to come back.
    """

    version: int
    server: str
    pid: int
    restart: float = 0.0
    #: The longest timeout it arms (its ``max_timeout``): a client that knows it
    #: refuses a longer one itself, in the same words (0: not said).
    max_timeout: float = 0.0


class Acquired(Reply, tag="acquired", frozen=True, kw_only=True):
    """Answer to `Acquire`: seconds left on the timer, and whether it replaced one.

    ``durable`` is False when the daemon could not write its state (a failing
    disk): the timer is armed and protects, but would not survive a daemon crash.
    """

    remaining: float
    rearmed: bool
    durable: bool = True
    #: Where the timeout in force came from, when the daemon chose it (``auto``).
    timeout_from: str = ""
    #: The number the daemon gave this arming, which a `Release` names to disarm
    #: it and no other (0: a daemon that keeps no numbers, whose release would
    #: disarm whatever arming holds the scope). An older daemon echoed here the
    #: number the client had sent: a client releases with what it reads.
    arm: int = 0
    #: The slot this scope's later blocks may arm and release by stores, when the
    #: request asked for one (`Acquire.slot`) and the daemon offers it.
    slot: SlotGrant | None = None


class SlotGrant(Struct, frozen=True, kw_only=True):
    """A slot of a slot page (`watchdogd_protocol.slot_page`): the page
    (get it with `MapPage` unless it is mapped already), the slot's index in it,
    and its period as the daemon wrote it there, in microseconds: a store is
    taken while the page still shows this period, for a deadline at least that
    far away."""

    page: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    index: Annotated[int, Meta(ge=0, le=SLOTS - 1)]
    period: Annotated[int, Meta(ge=1, le=2**62)]


class Released(Reply, tag="released", frozen=True, kw_only=True):
    """Answer to `Release`: whether a timer was armed under that key; ``durable``
    as for `Acquired`."""

    found: bool
    durable: bool = True


class DaemonInfo(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A summary of the daemon, sent with every status page."""

    version: str
    pid: int
    uptime: float
    timers: int
    processes: int
    connections: int
    requests: int
    expired: int
    exited: int
    #: The daemon cannot write its state: timers live in memory only until it can.
    state_degraded: bool = False
    #: With a fleet: ``connected``, or ``disconnected: why``.
    fleet: str = ""


class TimerInfo(Struct, frozen=True, kw_only=True):
    """One armed timer as a status page shows it.

    ``command`` is the process's command line. A daemon sends it once per process
    in `StatusReply.commands` and leaves it empty here (it is still sent, so older
    clients that require it can read the reply); the clients' ``status()`` fill it
    in (`StatusReply.timers_with_commands`).
    """

    pid: int
    scope: str
    remaining: float
    policy: str
    uid: int
    command: str = ""
    job: str = ""
    rank: int | None = None


class StatusReply(Reply, tag="status", frozen=True, kw_only=True):
    """Answer to `Status`. ``cursor`` is None on the last page.

    ``commands`` maps each pid on the page to its command line, cut to
    `MAX_COMMAND_BYTES` with a ``…`` marker. A page ends at ``limit`` timers or
    before its frame would pass `MAX_REPLY_BYTES`, whichever comes first.
    """

    daemon: DaemonInfo
    timers: list[TimerInfo]
    cursor: str | None = None
    commands: dict[int, str] = {}

    def timers_with_commands(self) -> list[TimerInfo]:
        """``timers`` with each ``command`` taken from ``commands`` where it has one."""
        commands = self.commands
        if not commands:
            return self.timers
        return [
            msgspec.structs.replace(timer, command=commands[timer.pid])
            if timer.pid in commands
            else timer
            for timer in self.timers
        ]


class Pong(Reply, tag="pong", frozen=True, kw_only=True):
    """Answer to `Ping`."""


class StepResult(Struct, frozen=True, kw_only=True):
    """What one step of a policy did, with any output it captured."""

    step: str
    result: str
    output: str = ""


class EventInfo(Struct, frozen=True, kw_only=True):
    """One recorded event. ``kind`` is ``expired``, ``peer`` (a job's peer policy
    run on a process of an incident's job), ``extended`` (a timer given
    more time because its process was starved; ``deadline`` is its new one),
    ``exited``, ``unkillable``, ``reloaded``, ``reload_failed``, ``verdict`` (an
    incident's verdict settled: ``outcome`` is its kind, ``note`` its sentence
    without frames, ``incident`` its id, ``pid`` its first culprit's, 0 for none
    here), ``repeating`` (a job's hang repeated: ``outcome`` is its fingerprint,
    ``incident`` the last of them), ``repeat_reset`` (that mark cleared) or
    ``unblocked`` (a rank's responder cut it out of a collective: ``pid``, ``job``,
    ``rank`` and ``incident`` are whose and why, ``outcome`` is ``host_lost`` or
    ``peers``, ``note`` says what and why); times are Unix
    seconds, ``late`` is seconds from the deadline to the first step. An expiry's
    ``reason`` is ``timeout`` or ``stalled`` (its progress stopped growing for its
    policy's ``stall`` time); ``timeout`` is the timeout it was armed with and
    ``timeout_from`` where that came from when the daemon chose it."""

    seq: int
    kind: str
    time: float
    pid: int
    uid: int
    scope: str
    policy: str
    command: str = ""
    armed_at: float | None = None
    deadline: float | None = None
    fired_at: float | None = None
    late: float | None = None
    outcome: str = ""
    steps: list[StepResult] = []
    timers: int | None = None
    note: str = ""
    state: str = ""
    wchan: str = ""
    reason: str = ""
    timeout: float | None = None
    timeout_from: str = ""
    job: str = ""
    rank: int | None = None
    #: The incident this event belongs to: an expiry of a job's timer, or a peer
    #: policy run on another process of the job (``kind`` ``peer``).
    incident: str = ""
    #: An ``exited`` event's scopes, sorted, the first few of them (``timers``
    #: counts them all).
    scopes: list[str] = []


class EventsReply(Reply, tag="events", frozen=True, kw_only=True):
    """Answer to `Events`. Pass ``last`` as the next request's ``after``."""

    events: list[EventInfo]
    last: int


class PolicyInfo(Struct, frozen=True, kw_only=True):
    """A policy as `Policies` lists it."""

    name: str
    target: str
    steps: list[str]
    root_only: bool
    builtin: bool
    #: Seconds a timer may go without its progress growing (0: no such rule).
    stall: float = 0.0
    #: The policy run on a job's other processes when a timer of a job expires
    #: under this one (``none``: none).
    peers: str = ""


class PoliciesReply(Reply, tag="policies", frozen=True, kw_only=True):
    """Answer to `Policies`."""

    policies: list[PolicyInfo]
    default: str


class MetricsReply(Reply, tag="metrics", frozen=True, kw_only=True):
    """Answer to `Metrics`: Prometheus text exposition format."""

    text: str


class SuggestionInfo(Struct, frozen=True, kw_only=True):
    """How long one scope of one executable of one uid was held before its
    release: ``count`` releases, their median, 99th percentile and longest, in
    seconds (the percentiles to a bucket some 9 % wide), and the timeout the
    daemon suggests (None until it has seen enough releases)."""

    uid: int
    executable: str
    scope: str
    count: int
    p50: float
    p99: float
    max: float
    suggested: float | None = None


class SuggestReply(Reply, tag="suggest", frozen=True, kw_only=True):
    """Answer to `Suggest`; ``cursor`` is None on the last page. ``min_samples``
    is how many releases a suggestion needs, ``margin`` how far above the 99th
    percentile it is."""

    suggestions: list[SuggestionInfo]
    min_samples: int
    margin: float
    cursor: int | None = None


class WhyTimer(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One timer of the process `Why` asks about, as the daemon sees it now.

    ``remaining`` is to its deadline; ``due`` says what its deadline is:
    ``timeout`` (``timeout`` seconds after it was armed, ``armed`` seconds ago)
    or ``stalled`` (``stall`` seconds after its progress last grew,
    ``progressed`` seconds ago). A timer that fell due has ``firing`` set to the
    step its policy is at."""

    scope: str
    policy: str
    remaining: float
    timeout: float
    armed: float
    due: str
    owner: int
    timeout_from: str = ""
    progress: int | None = None
    progressed: float | None = None
    stall: float = 0.0
    firing: str = ""
    notes: list[str] = []


class WhyReply(Reply, tag="why", frozen=True, kw_only=True):
    """Answer to `Why`. ``timers`` are those the caller may see (soonest first,
    at most the request's ``limit``; ``more`` counts the rest), ``events`` the
    latest about the pid, oldest first, ``suggestions`` what history says for the
    scopes of its timers, and ``incidents`` those it is a rank of."""

    pid: int
    command: str = ""
    executable: str = ""
    uid: int | None = None
    timers: list[WhyTimer] = []
    more: int = 0
    events: list[EventInfo] = []
    suggestions: list[SuggestionInfo] = []
    #: The incidents it is a rank of (summaries: `Incident` gives the whole).
    incidents: list[IncidentInfo] = []


class RankInfo(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One process of an incident's job, on ``host``: ``expired`` (its own timer
    expired) or a ``peer`` (it held a timer of the job, or its responder said it is
    a rank of the job). Which rank the job waits for is the incident's `Verdict`'s
    to say, not the role.

    ``state`` is ``pending`` until its policy (the expired rank's own, or the peer
    policy) has run, then ``done``, ``gone`` (it had exited) or ``denied``.
    ``stack`` is what its dump step captured; ``frame`` the innermost frame of
    its main thread, where it was waiting. Both are empty for a caller who may not
    see them: root may; another user only where ptrace's read rule let them read
    the process themselves when it was dumped (``reader_uid``: the one uid besides
    root, with ``reader_gid`` its gid; None: root alone), and ``note`` says why."""

    host: str
    pid: int
    uid: int
    role: str
    scope: str
    state: str = "pending"
    rank: int | None = None
    local_rank: int | None = None
    group_rank: int | None = None
    policy: str = ""
    reason: str = ""
    frame: str = ""
    stack: str = ""
    note: str = ""
    reader_uid: int | None = None
    reader_gid: int | None = None
    #: How its stack was taken: ``worker`` (its responder answered), ``py-spy``
    #: (read from outside, with ptrace) or ``none``; empty until its policy ran.
    evidence: str = ""
    #: Its Flight Recorder's groups, where it has one (`GroupState`).
    flight: list[GroupState] = []
    #: ``peers``: its policy asked that every other rank of the job waiting in the
    #: collective the verdict names be unblocked (a step ``unblock = "peers"``).
    unblock: str = ""
    #: Its responder cut it out of a collective, on its host's request: what it
    #: was cut out of, and why; and when (Unix seconds).
    unblocked: str = ""
    unblocked_at: float | None = None


class Culprit(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A rank a verdict names: on ``host``, process ``pid``, rank ``rank``."""

    host: str
    pid: int
    rank: int | None = None


class CollectiveRef(Struct, frozen=True, kw_only=True):
    """The collective a verdict is about: sequence ``seq`` of ``group``, ``op``."""

    group: str
    seq: int
    op: str


class Verdict(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Who an incident's job waits for. ``kind``: ``missing`` (``culprits`` never
    entered the ``collective`` the others wait in), ``mismatch`` (they entered it
    with another op, sizes or dtypes), ``odd_frame`` (by stacks: their main thread
    waits where the others' do not) or ``undecided``. ``basis`` says on what it rests
    (``flight_recorder``, ``stacks``), ``text`` says it in one sentence, and
    ``settled`` that every host has reported or the incident's window has closed.
    ``groups`` (``undecided``) lists each frame the ranks wait in with the ranks
    there. ``fingerprint`` names the hang of a verdict that names culprits: the
    same on every host and in every run of the job that hangs the same way
    (`HangsReply`)."""

    kind: str
    basis: str = ""
    culprits: list[Culprit] = []
    collective: CollectiveRef | None = None
    text: str = ""
    settled: bool = False
    groups: list[str] = []
    fingerprint: str = ""


class IncidentInfo(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What happened to a job: the first expiry of one of its timers (``host``,
    ``rank``, ``scope``, ``reason``, at ``time``, Unix seconds) and every rank
    the daemons of its hosts found (`RankInfo`). A job is its owner's: ``user``
    armed it (``uid``)."""

    id: str
    job: str
    user: str
    uid: int
    host: str
    scope: str
    reason: str
    time: float
    rank: int | None = None
    kind: str = "expired"
    ranks: list[RankInfo] = []
    #: How many ranks the incident has, when ``ranks`` is left out (a listing).
    count: int = 0
    verdict: Verdict | None = None
    #: Bytes of evidence the daemon no longer keeps of it: trimmed to its
    #: owner's budget (the daemon's ``incident_bytes_per_uid``), stacks first.
    trimmed: int = 0
    #: Whether its hang counts toward its job's repeats (`HangsReply`): ``counted``,
    #: else why not; "" until its verdict settles.
    repeat: str = ""
    #: Its job is marked repeating, on this incident's fingerprint.
    repeating: bool = False


class IncidentsReply(Reply, tag="incidents", frozen=True, kw_only=True):
    """Answer to `Incidents`: summaries (no ``ranks``; ``count`` says how many)."""

    incidents: list[IncidentInfo]


class IncidentReply(Reply, tag="incident", frozen=True, kw_only=True):
    """Answer to `Incident`."""

    incident: IncidentInfo


class PageMapped(Reply, tag="page_mapped", frozen=True, kw_only=True):
    """Answer to `MapPage`: its frame carries the page's descriptor (SCM_RIGHTS).
    ``now`` is the daemon's CLOCK_MONOTONIC in microseconds as it answered: a
    process whose own clock reads otherwise (another time namespace) must not
    use the page."""

    page: int
    now: int


class HangInfo(Struct, frozen=True, kw_only=True):
    """One hang counted toward a job's repeats: its incident, when it opened (Unix
    seconds) and its verdict's fingerprint."""

    incident: str
    time: float
    fingerprint: str


class FingerprintInfo(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a fingerprint stands for: the verdict's ``kind``, the collective's
    ``op`` and ``group``, and the culprits' ``frames`` (``file function``), left
    out (``hidden``) for a caller who may not see those ranks' stacks; ``hangs``
    of the job with it within the repeat window since the last reset, the
    ``last`` at that time (Unix seconds)."""

    id: str
    kind: str
    op: str = ""
    group: str = ""
    frames: list[str] = []
    hidden: bool = False
    hangs: int = 0
    last: float = 0.0


class HangsReply(Reply, tag="hangs", frozen=True, kw_only=True):
    """Answer to `Hangs`: the job's hangs and whether it may be restarted.
    ``repeating`` is the fingerprint its hangs repeated ``limit`` times within
    ``window`` seconds ("" while none did), since ``marked``; ``reset`` is when a
    reset last cleared it (Unix seconds; 0: never). ``hangs`` are the latest it
    counted, oldest first, ``fingerprints`` what they stand for, ``incidents``
    the incidents of the job kept here (summaries), oldest first. ``event`` is
    the number of the latest event about its repeats (0: none)."""

    job: str
    uid: int
    user: str = ""
    repeating: str = ""
    marked: float = 0.0
    reset: float = 0.0
    limit: int = 0
    window: float = 0.0
    hangs: list[HangInfo] = []
    fingerprints: list[FingerprintInfo] = []
    incidents: list[IncidentInfo] = []
    event: int = 0


class Responding(Reply, tag="responding", frozen=True, kw_only=True):
    """Answer to `Respond` and to `Evidence`: taken."""


class Error(Reply, tag="error", frozen=True, kw_only=True):
    """A refused request. ``id`` is None when the request's id could not be read."""

    id: RequestId | None = None  # type: ignore[assignment]  # widened on purpose
    code: str
    message: str


ReplyMessage = (
    Welcome
    | Acquired
    | Released
    | StatusReply
    | Pong
    | EventsReply
    | PoliciesReply
    | MetricsReply
    | SuggestReply
    | WhyReply
    | IncidentsReply
    | IncidentReply
    | HangsReply
    | Responding
    | PageMapped
    | Error
)
