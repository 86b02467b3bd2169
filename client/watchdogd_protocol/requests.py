"""The requests: what a client asks of the daemon, as tagged, frozen Structs with a
bound on every field.

Each request carries an ``id`` that its reply echoes (`RequestId`). `Hello` comes
first on a connection. Bounds that depend on the daemon's config (a scope's length, the
longest timeout) are the daemon's to check; the ones here hold for every daemon.
"""

from __future__ import annotations

from typing import Annotated, Final

from msgspec import Meta, Struct

from .responding import MAX_THREADS, AskId, Collective, FlightRecord, Seconds, ThreadStack

#: Protocol version. A daemon answers a client of any version from
#: `MIN_PROTOCOL_VERSION` up to its own, and refuses one outside that range.
PROTOCOL_VERSION: Final = 2
#: The oldest version this side still speaks: 1 has no responder (`Respond`).
MIN_PROTOCOL_VERSION: Final = 1
#: The longest job name, in UTF-8 bytes.
MAX_JOB_BYTES: Final = 128

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
#: Which arming of a timer a request means: the number the daemon gave it
#: (`Acquired.arm`), positive, at most 63 bits.
Arm = Annotated[int, Meta(ge=1, le=2**63 - 1)]
#: Where a page of events or suggestions resumes (an event's number, a row's
#: offset): a non-negative signed 64-bit value, the most either can reach.
Position = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: Where a status page resumes: the ``cursor`` of the page before, as the daemon
#: wrote it (a deadline and a sequence number, far shorter than this bound).
StatusCursor = Annotated[str, Meta(max_length=64)]


def in_words(seconds: float) -> str:
    """``seconds`` as a person reads a duration: ``30 days``, ``2 hours``, ``90 s``."""
    for unit, size in (("days", 86_400.0), ("hours", 3_600.0), ("minutes", 60.0)):
        if seconds >= size and (seconds / size).is_integer():
            count = int(seconds / size)
            return f"{count:,} {unit[:-1] if count == 1 else unit}"
    return f"{seconds:g} s"


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

    The daemon numbers the arming (`Acquired.arm`), for a `Release` to name. (Older
    clients sent a number of their own, ``arm``, which older daemons kept and
    echoed: a daemon now ignores it, as any unknown field. Numbers that processes
    chose apart could be the same, so another process's re-arm of the scope could
    have the number a late release named.)
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
    #: The process would arm this scope's later blocks by stores into a slot page
    #: (`watchdogd_protocol.slot_page`): a daemon that offers one answers
    #: with a `SlotGrant` (`Acquired.slot`). Heard only for the caller itself.
    slot: bool = False


class Release(Request, tag="release", frozen=True, kw_only=True):
    """Disarm the timer ``(pid, scope)``; releasing an absent timer succeeds.

    With ``arm``, only the arming of that number (`Acquired.arm`) is disarmed: a
    timer armed again since, by this process or any other, stays armed, and the
    reply says ``found`` False. A release sent late, or sent again after its
    connection broke, so never disarms a newer arming of its scope.
    """

    scope: Scope
    pid: Pid | None = None
    arm: Arm | None = None
    #: It releases a block armed by a store into the scope's slot, which the daemon
    #: closed meanwhile: it disarms the scope only while it is still registered,
    #: never an arming made over the socket since (root's, say).
    stored: bool = False


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


class Hangs(Request, tag="hangs", frozen=True, kw_only=True):
    """A job's hangs and whether it may be restarted (`HangsReply`); with ``reset``,
    after its repeating mark is cleared (a fix went in). A job is its owner's:
    ``uid`` (root only) names another user's; by default the caller's own."""

    job: Job
    uid: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    reset: bool = False


class Respond(Request, tag="respond", frozen=True, kw_only=True):
    """On a responder's connection, after `Hello`: this process (the kernel says
    which) answers `EvidenceWanted`, and is a rank of ``job`` (None: of none).
    With ``unblock``, it also answers `UnblockWanted` (a responder of before
    knows no such message, and is never sent one)."""

    job: Job | None = None
    rank: Rank | None = None
    local_rank: Rank | None = None
    group_rank: Rank | None = None
    unblock: bool = False


class Evidence(Request, tag="evidence", frozen=True, kw_only=True):
    """A responder's answer to `EvidenceWanted` ``ask``. ``note`` says what could not
    be taken (no Flight Recorder, what was cut)."""

    ask: AskId
    threads: Annotated[list[ThreadStack], Meta(max_length=MAX_THREADS)] = []
    flight: FlightRecord | None = None
    note: Annotated[str, Meta(max_length=1024)] = ""


class MapPage(Request, tag="map_page", frozen=True, kw_only=True):
    """Hand me slot page ``page`` of my own (`SlotGrant.page`): answered with
    `PageMapped`, whose frame carries the page's descriptor (SCM_RIGHTS)."""

    page: Annotated[int, Meta(ge=1, le=2**63 - 1)]


class Unblocked(Request, tag="unblocked", frozen=True, kw_only=True):
    """A responder's answer to `UnblockWanted` ``ask``: its ``outcome`` (one of
    `UnblockOutcome`'s values; a daemon takes one it does not know as
    ``failed``), the ``collective`` its Flight Recorder says it waits in (the one
    cut, or the one too recent to be), how long it had ``waited`` in it, after
    how many seconds it will have waited long enough (``retry``, for
    ``too_soon``), how many connections it shut or groups it aborted (``cut``),
    and a ``note`` of what went wrong."""

    ask: AskId
    outcome: Annotated[str, Meta(min_length=1, max_length=32)]
    collective: Collective | None = None
    waited: Seconds = 0.0
    retry: Seconds = 0.0
    cut: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    note: Annotated[str, Meta(max_length=1024)] = ""


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
    | Hangs
    | Respond
    | Evidence
    | MapPage
    | Unblocked
)
