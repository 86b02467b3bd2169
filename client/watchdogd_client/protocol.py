"""The watchdogd wire protocol: message types and framing, with no I/O.

A connection is a byte stream of frames. Each frame is a 4-byte big-endian unsigned
length followed by one msgpack message of exactly that length. Messages are tagged,
frozen msgspec Structs; the tag travels in the ``type`` key.

Invariants the daemon and the client both rely on:

- The first request on a connection is `Hello`; the daemon answers `Welcome` or an
  `Error` and closes the connection when the major version is not one it speaks.
- Every request carries an ``id`` that its reply echoes, so a client may pipeline.
  An `Error` whose ``id`` is None answers something whose id could not be read.
- A frame that declares more bytes than the receiver's bound is refused before any
  buffer of that size exists (`FrameReader` raises `FrameTooLarge`).
- Time on the wire is always relative seconds (``timeout``, ``remaining``); absolute
  deadlines never leave the daemon.
- New fields are added only with defaults, and unknown fields are ignored, so an older
  peer can read a newer peer's messages (msgspec's schema-evolution rules).
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Final

import msgspec
from msgspec import Meta, Struct

from .errors import FrameTooLarge, ProtocolError

__all__ = [
    "MAX_COMMAND_BYTES",
    "MAX_JOB_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_REPLY_FRAME",
    "MAX_REQUEST_FRAME",
    "PROTOCOL_VERSION",
    "Acquire",
    "Acquired",
    "Auto",
    "DaemonInfo",
    "Error",
    "ErrorCode",
    "EventInfo",
    "Events",
    "EventsReply",
    "FrameReader",
    "Hello",
    "Incident",
    "IncidentInfo",
    "IncidentReply",
    "Incidents",
    "IncidentsReply",
    "Metrics",
    "MetricsReply",
    "Ping",
    "Policies",
    "PoliciesReply",
    "PolicyInfo",
    "Pong",
    "RankInfo",
    "Release",
    "Released",
    "Reply",
    "Request",
    "Status",
    "StatusReply",
    "StepResult",
    "Suggest",
    "SuggestReply",
    "SuggestionInfo",
    "TimerInfo",
    "Welcome",
    "Why",
    "WhyReply",
    "WhyTimer",
    "decode_reply",
    "decode_request",
    "encode_frame",
    "encode_frame_into",
]

#: Major protocol version. A peer with another major version is refused at handshake.
PROTOCOL_VERSION: Final = 1
#: Default bound on a frame the daemon accepts (requests are small).
MAX_REQUEST_FRAME: Final = 64 * 1024
#: The daemon never sends a reply frame longer than this: status and events pages
#: are cut by encoded size as well as by count.
MAX_REPLY_BYTES: Final = 1024 * 1024
#: Default bound on a frame the client accepts; at least `MAX_REPLY_BYTES`, with room
#: for a future daemon that sends more.
MAX_REPLY_FRAME: Final = 16 * 1024 * 1024
#: The longest job name, in UTF-8 bytes.
MAX_JOB_BYTES: Final = 128
#: The most of a command line a status page shows, in UTF-8 bytes (marker included).
MAX_COMMAND_BYTES: Final = 1024

_HEADER: Final = struct.Struct(">I")
HEADER_SIZE: Final = _HEADER.size

RequestId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: Negative pids and 0 mean process groups to kill(2); they are never a valid target.
Pid = Annotated[int, Meta(ge=1, le=2**31 - 1)]
#: The byte-length bound on a scope is the daemon's (configurable) limit.
Scope = Annotated[str, Meta(min_length=1)]
#: NaN, zero and negative values fail here; infinity and the configured maximum are
#: refused by the daemon with a message that states its limit.
Timeout = Annotated[float, Meta(gt=0)]
PolicyName = Annotated[str, Meta(min_length=1, max_length=128)]
PageSize = Annotated[int, Meta(ge=1, le=10_000)]
#: A job's name: the daemon bounds it to `MAX_JOB_BYTES` UTF-8 bytes.
Job = Annotated[str, Meta(min_length=1)]
Rank = Annotated[int, Meta(ge=0, le=2**31 - 1)]
#: A progress counter: any non-negative 64-bit value.
Progress = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: Where a page of events or suggestions resumes (an event's number, a row's
#: offset): a non-negative signed 64-bit value, the most either can reach.
Position = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: Where a status page resumes: the ``cursor`` of the page before, as the daemon
#: wrote it (a deadline and a sequence number, far shorter than this bound).
StatusCursor = Annotated[str, Meta(max_length=64)]


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


class Request(Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type"):
    """Base of every client-to-daemon message."""

    id: RequestId


class Hello(Request, tag="hello", frozen=True, kw_only=True):
    """First request on a connection: the client's protocol version."""

    version: int
    client: str = ""


class Auto(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Asks the daemon for a timeout learned from how long this scope was held
    before (`Acquire.auto`), at least ``floor`` seconds."""

    floor: Annotated[float, Meta(ge=0)] = 0.0


class Acquire(Request, tag="acquire", frozen=True, kw_only=True):
    """Arm, or re-arm, the timer ``(pid, scope)`` to expire ``timeout`` seconds from now.

    ``pid`` defaults to the caller (as the kernel reports it). ``policy`` defaults to
    the daemon's default policy. Re-arming replaces the timeout and the policy.

    ``progress`` is a counter the worker's own work advances: under a policy with a
    ``stall`` time, a re-arm keeps the timer alive only while its progress grows.
    With ``auto``, ``timeout`` is a ceiling: the daemon arms what it suggests for
    this scope (`Suggest`), between ``auto.floor`` and the ceiling, once it has
    seen enough releases of it, and the ceiling until then (a daemon that predates
    ``auto`` arms the ceiling).
    """

    scope: Scope
    timeout: Timeout
    policy: PolicyName | None = None
    pid: Pid | None = None
    #: The process's exit releases the timer quietly: an exit with only such timers
    #: armed is no event (`watchdogctl run`, whose command is expected to end).
    exit_releases: bool = False
    progress: Progress | None = None
    auto: Auto | None = None
    #: The distributed job the process is a rank of, and its ranks (torchrun's
    #: RANK, LOCAL_RANK, GROUP_RANK): an expiry opens an incident for the job.
    job: Job | None = None
    rank: Rank | None = None
    local_rank: Rank | None = None
    group_rank: Rank | None = None


class Release(Request, tag="release", frozen=True, kw_only=True):
    """Disarm the timer ``(pid, scope)``; releasing an absent timer succeeds."""

    scope: Scope
    pid: Pid | None = None


class Status(Request, tag="status", frozen=True, kw_only=True):
    """One page of the armed timers, soonest first, with a summary of the daemon.

    Pass the reply's ``cursor`` to get the next page.
    """

    limit: PageSize = 1000
    cursor: StatusCursor | None = None


class Ping(Request, tag="ping", frozen=True, kw_only=True):
    """Liveness check."""


class Events(Request, tag="events", frozen=True, kw_only=True):
    """Recorded events, oldest first.

    With ``after`` None: the latest ``limit`` events. Otherwise the events whose
    ``seq`` is greater than ``after``; when there are none yet, the daemon holds the
    reply up to ``wait`` seconds for one to happen (a long poll, for following).
    """

    after: Position | None = None
    limit: PageSize = 100
    wait: Annotated[float, Meta(ge=0, le=300)] = 0.0


class Policies(Request, tag="policies", frozen=True, kw_only=True):
    """The configured policies and the default one."""


class Metrics(Request, tag="metrics", frozen=True, kw_only=True):
    """The daemon's metrics in the Prometheus text exposition format."""


class Suggest(Request, tag="suggest", frozen=True, kw_only=True):
    """What the daemon learned of how long scopes are held before their release,
    and the timeout it suggests for each: the caller's own uid's (root: every
    uid's), sorted by uid, executable and scope. Pass the reply's ``cursor`` to
    get the next page."""

    limit: PageSize = 1000
    cursor: Position = 0


class Why(Request, tag="why", frozen=True, kw_only=True):
    """Everything the daemon knows about why process ``pid`` was, or would be,
    acted on: its timers (those the caller may see), the expiries of its in
    progress, the latest events about it, and what history suggests for its
    scopes."""

    pid: Pid
    #: The most timers, and events, to include.
    limit: Annotated[int, Meta(ge=1, le=1000)] = 100


class Incidents(Request, tag="incidents", frozen=True, kw_only=True):
    """The latest incidents the caller may see (root: all; another uid: those of
    its own jobs), newest last, without their stacks."""

    limit: PageSize = 100


class Incident(Request, tag="incident", frozen=True, kw_only=True):
    """One incident, with every rank's stack the caller may see."""

    incident: Annotated[str, Meta(min_length=1, max_length=128)]


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
    ``exited``, ``unkillable``, ``reloaded`` or ``reload_failed``; times are Unix
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
    """One process of an incident's job: the rank that was ``hung`` (its timer
    expired) or a ``peer`` (it held a timer of the job), on ``host``.

    ``state`` is ``pending`` until its policy (the hung rank's own, or the peer
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


class IncidentsReply(Reply, tag="incidents", frozen=True, kw_only=True):
    """Answer to `Incidents`: summaries (no ``ranks``; ``count`` says how many)."""

    incidents: list[IncidentInfo]


class IncidentReply(Reply, tag="incident", frozen=True, kw_only=True):
    """Answer to `Incident`."""

    incident: IncidentInfo


class Error(Reply, tag="error", frozen=True, kw_only=True):
    """A refused request. ``id`` is None when the request's id could not be read."""

    id: RequestId | None = None  # type: ignore[assignment]  # widened on purpose
    code: str
    message: str


RequestMessage = (
    Hello
    | Acquire
    | Release
    | Status
    | Ping
    | Events
    | Policies
    | Metrics
    | Suggest
    | Why
    | Incidents
    | Incident
)
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
    | Error
)

_REQUEST_TAGS: Final = tuple(sorted(str(t.__struct_config__.tag) for t in RequestMessage.__args__))


class _Envelope(Struct):
    """The two fields an error reply needs from a request that failed validation."""

    id: RequestId | None = None
    type: str | None = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RequestMessage)
_reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode_frame(message: Request | Reply) -> bytes:
    """Return one complete frame carrying ``message``."""
    out = bytearray()
    encode_frame_into(message, out)
    return bytes(out)


def encode_frame_into(message: Request | Reply, out: bytearray) -> None:
    """Append one complete frame carrying ``message`` to ``out``.

    Several replies appended to one buffer go out in one send.
    """
    start = len(out)
    out += b"\0\0\0\0"
    _encoder.encode_into(message, out, start + HEADER_SIZE)
    _HEADER.pack_into(out, start, len(out) - start - HEADER_SIZE)


def decode_request(frame: bytes) -> RequestMessage:
    """Decode and validate one request frame body.

    Raises `ProtocolError` with the code to answer with and, when it could be read,
    the request's id.
    """
    try:
        return _request_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _invalid_request(frame, exc) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"not a msgpack message: {exc}") from None


def _invalid_request(frame: bytes, exc: msgspec.ValidationError) -> ProtocolError:
    try:
        envelope = _envelope_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        envelope = _Envelope()
    if envelope.type is not None and envelope.type not in _REQUEST_TAGS:
        known = ", ".join(_REQUEST_TAGS)
        return ProtocolError(
            ErrorCode.UNKNOWN_OP,
            f"unknown request type {envelope.type!r}; known: {known}",
            envelope.id,
        )
    return ProtocolError(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}", envelope.id)


def decode_reply(frame: bytes) -> ReplyMessage:
    """Decode one reply frame body; raises `ProtocolError` if it is not a valid reply."""
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"unreadable reply from daemon: {exc}") from None


class FrameReader:
    """Splits a byte stream into frame bodies.

    Bytes are buffered only up to the end of the current frame; a header that declares
    more than ``max_frame`` bytes raises `FrameTooLarge` before anything is allocated
    for it. After `FrameTooLarge` the stream is out of sync and must be closed.
    """

    __slots__ = ("_buffer", "_max_frame")

    def __init__(self, max_frame: int) -> None:
        self._max_frame = max_frame
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received of a frame not yet complete (0 between frames)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return every frame body they complete, in order."""
        if not self._buffer:
            # Fast path: most reads hold exactly one whole request.
            if len(data) >= HEADER_SIZE:
                (length,) = _HEADER.unpack_from(data)
                self._check(length)
                if len(data) == HEADER_SIZE + length:
                    return [data[HEADER_SIZE:]]
            buffer = self._buffer = bytearray(data)
        else:
            buffer = self._buffer
            buffer += data
        frames: list[bytes] = []
        start = 0
        end = len(buffer)
        while end - start >= HEADER_SIZE:
            (length,) = _HEADER.unpack_from(buffer, start)
            self._check(length)
            stop = start + HEADER_SIZE + length
            if stop > end:
                break
            frames.append(bytes(buffer[start + HEADER_SIZE : stop]))
            start = stop
        del buffer[:start]
        return frames

    def _check(self, length: int) -> None:
        if length > self._max_frame:
            raise FrameTooLarge(
                ErrorCode.FRAME_TOO_LARGE,
                f"frame declares {length} bytes; the limit is {self._max_frame}",
            )
