"""Request handling: the one place where every request type is dispatched.

Synchronous and free of sockets, clocks, logs and randomness: the caller passes
``now`` (on the monotonic clock the table uses) to each call, and the runtime passes
in at start the wall clock that stamps events, the monotonic clock of the log
throttle, the log sink, the incident id maker, and the processes port that does the
few system calls that opening and watching a process need. That keeps
every rule here testable with a fake port and numbers for the time.

Rules kept here:

- The target of a request is the caller (its kernel-reported pid) unless it names a
  pid; a named pid is allowed where the caller could kill(2) it
  (`watchdogd.core.identity.may_signal`: root, or the caller's uid equal to the
  target's real or saved uid). pid 1 and the daemon are never targets.
  The uids are those of the moment of the request: read when the process is opened,
  or read again (`ProcessPort.refresh`) when the table already holds it, since it
  may have called setuid(2) since its first timer.
- Release is authorized like arming: you may release what you could have armed.
- Per-uid limits apply to non-root callers; everyone is bounded by the global caps.
- Authorization comes before limits, so a refusal never tells one user what another
  has armed.
- A non-root caller sees only the timers on its own uid's processes or that it armed.
- The output of a hook (``exec`` and ``dump`` steps) is shown to root only: it ran
  with the daemon's privileges and may say anything the daemon can read. Everyone
  else who may see the event sees each step and its result (the exit status). The
  record keeps the output; only the reply to a non-root caller leaves it out.
- A timer whose policy has ``starvation_grace`` is measured when it is armed and
  judged at its deadline, before its policy starts (`watchdogd.core.starvation`):
  one whose process was starved is armed again for the grace, once per arming,
  with an ``extended`` event that says why. Only such timers pay for it: the
  others read nothing from the system when armed or when they fire.

Process handles are reference-counted: the table holds one per process in it, each
connection holds one on its caller's own process (so a worker that arms and releases
in a loop does not reopen a pidfd each time), and a request holds one while it runs.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar, assert_never

import msgspec

from watchdogd_client.protocol import (
    MAX_COMMAND_BYTES,
    MAX_JOB_BYTES,
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    DaemonInfo,
    ErrorCode,
    EventInfo,
    Events,
    EventsReply,
    Hello,
    Incident,
    IncidentInfo,
    IncidentReply,
    Incidents,
    IncidentsReply,
    Metrics,
    MetricsReply,
    Ping,
    Policies,
    PoliciesReply,
    PolicyInfo,
    Pong,
    RankInfo,
    Release,
    Released,
    ReplyMessage,
    RequestMessage,
    Status,
    StatusReply,
    StepResult,
    Suggest,
    SuggestionInfo,
    SuggestReply,
    TimerInfo,
    Welcome,
    Why,
    WhyReply,
    WhyTimer,
)

from .._version import __version__
from ..errors import Refusal
from .config import Config
from .counters import Counters
from .events import EventLog
from .history import History
from .history import Key as HistoryKey
from .identity import ROOT, Peer, may_signal
from .incidents import IncidentLog
from .logline import LogSink, NullSink, RateLimitedLog, Throttle
from .policies import BUILTIN, NO_PEERS, PEER_DUMP, Policy, signal_policy
from .starvation import UNMEASURED, Sample, Verdict, judge
from .timers import Expired, Run, StoreKey, Timer, TimerTable, Watch

#: What a status page may spend on timers and command lines: the reply bound less
#: generous room for the rest (the daemon summary, the cursor, the framing).
_STATUS_PAGE_BYTES: Final = MAX_REPLY_BYTES - 4096
#: The most a `TimerInfo` takes encoded, besides its scope, policy and job: eight
#: keys (50 bytes), three ints and a float (24), three string headers (15), an
#: empty command.
_TIMER_BYTES: Final = 100
#: The most an entry of `StatusReply.commands` takes besides its text.
_COMMAND_BYTES: Final = 16
#: The most a `SuggestionInfo` takes encoded, besides its executable and scope.
_SUGGESTION_BYTES: Final = 160
#: Ends a command line cut to fit.
_CLIPPED: Final = "…"
#: Scopes named in an ``exited`` event; the count covers the rest.
_LISTED_SCOPES: Final = 10
#: How long a command line read for a status page is shown again without being
#: read again (`_CommandLines`).
_COMMAND_SECONDS: Final = 1.0
#: A status cursor: a deadline as ``repr`` writes a float, then its timer's sequence
#: number.
_CURSOR: Final = re.compile(r"(?P<deadline>-?[0-9][0-9.e+-]{0,31})/(?P<seq>[0-9]{1,19})")
_MAX_SEQ: Final = 2**63 - 1


class TargetProcess(Protocol):
    """What the service needs of a process handle."""

    @property
    def pid(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def saved_uid(self) -> int: ...
    @property
    def start_time(self) -> int: ...
    def retain(self) -> TargetProcess: ...
    def close(self) -> None: ...


P = TypeVar("P", bound=TargetProcess)


class Journal(Protocol):
    """Where the service reports each change of the timers it must keep (the
    state store, `watchdogd.storage.store.Store`)."""

    @property
    def generation(self) -> int:
        """Bumped by every change."""

    @property
    def degraded(self) -> bool:
        """Whether changes are currently not made durable (a failing disk)."""

    @property
    def errors(self) -> int:
        """Writes that failed."""

    def put(self, timer: Timer) -> None:
        """``timer`` is armed (new or re-armed), or its policy moved on a step."""

    def drop(self, timer: Timer) -> None:
        """``timer`` is gone: released, its process exited, or its policy ended."""

    def commit(self, generation: int) -> bool:
        """Write what is pending; whether every change up to ``generation`` is in."""

    def commit_soon(self) -> None:
        """Have what is pending written soon, though no reply waits for it."""


class NullJournal:
    """The journal of a daemon without state (``--no-state``): remembers nothing,
    and so is never degraded."""

    generation = 0
    errors = 0
    degraded = False

    def put(self, timer: Timer) -> None:
        pass

    def drop(self, timer: Timer) -> None:
        pass

    def commit(self, generation: int) -> bool:
        return True

    def commit_soon(self) -> None:
        pass


class ProcessPort(Protocol[P]):
    """The system calls request handling needs, behind one interface."""

    def open(self, pid: int, peer: Peer) -> P:
        """Open a handle on ``pid``; raise `Refusal` (no_such_process) if it is gone."""

    def alive(self, process: P) -> bool:
        """Whether the process still holds its pid."""

    def refresh(self, process: P) -> bool:
        """Read its real and saved uid again, into the handle; False when it has
        exited (the handle then keeps the old ones)."""

    def command(self, process: P) -> str:
        """Its command line, for status."""

    def executable(self, process: P) -> str:
        """The path of the executable it runs, for its history."""

    def track(self, process: P) -> None:
        """Watch it for its exit (it entered the table); idempotent."""

    def untrack(self, process: P) -> None:
        """Drop the table's reference (it left the table)."""

    def user_name(self, uid: int) -> str:
        """The fleet name of user ``uid`` (`watchdogd.host.users`) if known at once, else
        ``#UID``; never a lookup that waits (it is asked for, for next time)."""

    def sample(self, process: P) -> Sample | None:
        """What the kernel says of it now: its CPU time and the pressure on its
        cgroup and on the host; None once it has exited."""


@dataclass(slots=True)
class Restored(Generic[P]):
    """What `Service.restore` put back: armed timers, dropped ones (their process
    is gone), and expiries whose policy resumes."""

    armed: int = 0
    dropped: int = 0
    resumed: list[Expired[P]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Caller(Generic[P]):
    """One connection's caller: its kernel-reported credentials and, once it has
    armed a timer on itself, a handle on its process kept for the connection's life."""

    peer: Peer
    process: P | None = None


class Service(Generic[P]):
    """The daemon's state and its answer to every request."""

    def __init__(
        self,
        config: Config,
        processes: ProcessPort[P],
        *,
        daemon_pid: int,
        now: float,
        wall: Callable[[], float],
        clock: Callable[[], float],
        render_metrics: Callable[[Counters, Mapping[str, tuple[str, float]]], str],
        on_deadline: Callable[[float], None] = lambda deadline: None,
        on_event: Callable[[], object] = lambda: None,
        journal: Journal | None = None,
        log: LogSink | None = None,
        new_id: Callable[[], str] | None = None,
        host: str = "localhost",
    ) -> None:
        self.config = config.daemon
        self.policies: Mapping[str, Policy] = config.policy_set()
        self.table: TimerTable[P] = TimerTable()
        self.metrics = Counters()
        #: The log of lines requests can cause, rate-limited per (uid, kind).
        self.log = RateLimitedLog(Throttle(clock=clock), NullSink() if log is None else log)
        self.events = EventLog(
            config.daemon.events, on_event, per_uid=config.daemon.events_per_uid, log=self.log
        )
        self.daemon_pid = daemon_pid
        self._processes = processes
        self.started = now
        self._wall = wall
        self._render_metrics = render_metrics
        self.journal: Journal = NullJournal() if journal is None else journal
        self._on_deadline = on_deadline
        self._connections: Counter[int] = Counter()
        #: Timers whose policy is in progress, by store key: part of the state
        #: until the policy has finished.
        self._firing: dict[StoreKey, Timer] = {}
        self._firing_numbers = itertools.count(1)
        #: Seconds a restart may take at the timer cap (set once the state loaded).
        self.restart_estimate = 0.0
        self._command_lines: _CommandLines[P] = _CommandLines()
        self.history = History()
        self._configure_history(config)
        self.incidents = IncidentLog(
            host,
            keep=config.daemon.incidents,
            per_uid=config.daemon.incidents_per_uid,
            window=config.daemon.incident_window,
            new_id=new_id,
        )
        #: The fleet as this host sees it: "" without one (`fleet_changed`).
        self.fleet_state = ""

    @property
    def connections(self) -> int:
        return self._connections.total()

    @property
    def default_policy(self) -> str:
        return self.config.default_policy

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded config: policies, limits, the event ring's size. A timer
        whose policy is gone keeps its name; at expiry the default stands in."""
        self.policies = config.policy_set()
        self.config = config.daemon
        self.events.resize(config.daemon.events, config.daemon.events_per_uid)
        self._configure_history(config)
        self.incidents.resize(config.daemon.incidents, config.daemon.incidents_per_uid)
        self.incidents.window = config.daemon.incident_window

    def _configure_history(self, config: Config) -> None:
        """Apply the ``[history]`` bounds (lowered bounds apply as keys are added)."""
        history, table = self.history, config.history
        history.keys, history.keys_per_uid = table.keys, table.keys_per_uid
        history.min_samples, history.margin = table.min_samples, table.margin

    def open_connection(self, peer: Peer) -> Caller[P]:
        """Count a new connection; raises `Refusal` (and counts nothing) at a limit."""
        if self.connections >= self.config.max_connections:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"the daemon has {self.config.max_connections} connections open, its limit",
            )
        if peer.uid != ROOT and self._connections[peer.uid] >= self.config.max_connections_per_uid:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {peer.uid} has {self.config.max_connections_per_uid} connections open, "
                "its limit",
            )
        self._connections[peer.uid] += 1
        self.metrics.connections_total += 1
        caller: Caller[P] = Caller(peer)
        if peer.pidfd is None:
            # Without SO_PEERPIDFD the caller is found by pid: do it while it is
            # surely the process that just connected, not on its first request.
            with contextlib.suppress(Refusal):
                caller.process = self._processes.open(peer.pid, peer)
        return caller

    def close_connection(self, caller: Caller[P]) -> None:
        """Uncount a connection and drop its handle on the caller's process."""
        uid = caller.peer.uid
        self._connections[uid] -= 1
        if not self._connections[uid]:
            del self._connections[uid]
        if caller.process is not None:
            caller.process.close()
            caller.process = None

    def handle(self, request: RequestMessage, caller: Caller[P], now: float) -> ReplyMessage:
        """Answer one validated request. Raises `Refusal` to refuse it."""
        match request:
            case Acquire():
                return self._acquire(request, caller, now)
            case Release():
                return self._release(request, caller, now)
            case Status():
                return self._status(request, caller.peer, now)
            case Events():
                return self._events(request, caller.peer)
            case Policies():
                return self._policies(request)
            case Metrics():
                return MetricsReply(id=request.id, text=self.metrics_text())
            case Ping():
                return Pong(id=request.id)
            case Hello():
                return self.welcome(request)
            case Suggest():
                return self._suggest(request, caller.peer)
            case Why():
                return self._why(request, caller.peer, now)
            case Incidents() | Incident():
                return self._incidents(request, caller.peer)
            case _:
                assert_never(request)

    def welcome(self, hello: Hello) -> Welcome:
        """Answer a handshake; refuses a major version this daemon does not speak."""
        if hello.version != PROTOCOL_VERSION:
            raise Refusal(
                ErrorCode.UNSUPPORTED_VERSION,
                f"this daemon speaks protocol version {PROTOCOL_VERSION}, "
                f"the client speaks {hello.version}; upgrade the older of the two",
            )
        return Welcome(
            id=hello.id,
            version=PROTOCOL_VERSION,
            server=f"watchdogd/{__version__}",
            pid=self.daemon_pid,
            restart=self.restart_estimate,
        )

    def _acquire(self, request: Acquire, caller: Caller[P], now: float) -> Acquired:
        self._check_bounds(request)
        policy = self.default_policy if request.policy is None else request.policy
        chosen = self.policies.get(policy) or signal_policy(policy)
        if chosen is None:
            known = ", ".join([*sorted(self.policies), "signal:NAME"])
            raise Refusal(ErrorCode.UNKNOWN_POLICY, f"no policy {policy!r}; known: {known}")
        if chosen.root_only and caller.peer.uid != ROOT:
            raise Refusal(
                ErrorCode.PERMISSION_DENIED, f"policy {policy!r} may be chosen by root only"
            )
        # Authorization comes before the limits: whether the timer exists decides
        # whether a limit applies, so checking limits first would tell a caller at
        # its limit which scopes another user's process has armed.
        process = self._target(request.pid, caller)
        try:
            previous = self.table.get(process.pid, request.scope)
            if previous is None:
                self._check_timer_limits(caller.peer)
            timeout, timeout_from = request.timeout, ""
            if request.auto is not None:
                timeout, timeout_from = self.history.timeout(
                    self._history_key(process, request.scope), request.auto.floor, request.timeout
                )
            watch, deadline = None, None
            if request.progress is not None or chosen.stall or timeout_from or request.job:
                watch = _watch(request, chosen.stall, timeout_from, previous, now)
                deadline = now + timeout
                if watch.stall:
                    deadline = min(deadline, watch.progressed_at + watch.stall)
            entering = self.table.process(process.pid) is None
            timer, rearmed = self.table.arm(
                process,
                request.scope,
                timeout=timeout,
                policy=policy,
                uid=process.uid,
                owner=caller.peer.uid,
                now=now,
                exit_releases=request.exit_releases,
                watch=watch,
                deadline=deadline,
            )
            if entering:
                process.retain()
                self._processes.track(process)
            if request.job:
                # The name an incident of the job will carry, looked up off the
                # loop now: by its expiry it is known.
                self._processes.user_name(caller.peer.uid)
            timer = self._measure_for_starvation(timer, chosen, process)
            self.journal.put(timer)
        finally:
            process.close()
        self._on_deadline(timer.deadline)
        if watch is None:
            return Acquired(id=request.id, remaining=timeout, rearmed=rearmed)
        return Acquired(
            id=request.id,
            remaining=timer.deadline - now,
            rearmed=rearmed,
            timeout_from=timeout_from,
        )

    def _check_bounds(self, request: Acquire) -> None:
        """Refuse an `Acquire` whose scope, job or timeout is past a bound."""
        limits = self.config
        if "\0" in request.scope:
            raise Refusal(ErrorCode.INVALID_REQUEST, "scope contains a NUL character")
        scope_bytes = len(request.scope.encode())
        if scope_bytes > limits.max_scope_bytes:
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"scope is {scope_bytes} bytes long; the limit is {limits.max_scope_bytes}",
            )
        if request.job is not None and (
            "\0" in request.job or len(request.job.encode()) > MAX_JOB_BYTES
        ):
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"a job is at most {MAX_JOB_BYTES} UTF-8 bytes, without NUL characters",
            )
        if not (math.isfinite(request.timeout) and request.timeout <= limits.max_timeout):
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"timeout must be finite and at most {limits.max_timeout:g} s, "
                f"not {request.timeout!r}",
            )

    def _measure_for_starvation(self, timer: Timer, policy: Policy, process: P) -> Timer:
        """``timer``, just armed under ``policy``, as the table now holds it: with
        what the kernel says of its process kept in its `Watch` (``baseline``, and
        its grace back) when the policy has ``starvation_grace``; unchanged, at the
        cost of this call, otherwise (the path of every acquire)."""
        if not policy.starvation_grace:
            return timer
        watch = Watch() if timer.watch is None else timer.watch
        watch = msgspec.structs.replace(
            watch, baseline=self._processes.sample(process), extended=0.0
        )
        return self.table.put(process, msgspec.structs.replace(timer, watch=watch))

    def _release(self, request: Release, caller: Caller[P], now: float) -> Released:
        if request.pid is None and self.table.process(caller.peer.pid) is None:
            return Released(id=request.id, found=False)
        process = self._target(request.pid, caller)
        try:
            if self.table.process(process.pid) is not process:
                return Released(id=request.id, found=False)
            timer, gone = self.table.disarm(process.pid, request.scope)
            if timer is not None:
                self.journal.drop(timer)
                self.history.record(
                    self._history_key(process, timer.scope), max(0.0, now - timer.armed_at)
                )
            if gone is not None:
                self._processes.untrack(gone)
        finally:
            process.close()
        return Released(id=request.id, found=timer is not None)

    def _history_key(self, process: P, scope: str) -> HistoryKey:
        """Where the history of ``scope`` on ``process`` is kept: its uid, the
        executable it runs, the scope."""
        return (process.uid, self._processes.executable(process), scope)

    def _target(self, pid: int | None, caller: Caller[P]) -> P:
        """A handle on the process a request is about, after authorization, with a
        reference of its own that the request must `close`."""
        if pid is None:
            return self._caller_itself(caller)
        peer = caller.peer
        if pid <= 1:
            raise Refusal(ErrorCode.PERMISSION_DENIED, "pid 1 (init) is never a target")
        if pid == self.daemon_pid:
            raise Refusal(ErrorCode.PERMISSION_DENIED, "the daemon itself is never a target")
        process = self.table.process(pid)
        if process is not None and not self._processes.refresh(process):
            # Its exit is not processed yet and the pid may be someone else's by
            # now: settle it rather than attach a timer to a dead handle.
            self.process_exited(process)
            process = None
        if process is None:
            process = self._processes.open(pid, peer)
        else:
            process.retain()
        if not may_signal(peer.uid, process.uid, process.saved_uid):
            process.close()
            raise Refusal(
                ErrorCode.PERMISSION_DENIED,
                f"uid {peer.uid} may not signal pid {pid} (real uid {process.uid}, "
                f"saved uid {process.saved_uid}); only root or the owner may arm or release "
                "its timers",
            )
        return process

    def _caller_itself(self, caller: Caller[P]) -> P:
        """The exact process that opened the connection.

        Its handle comes from the connection (SO_PEERPIDFD), so a connection that
        outlives its process (a child kept the socket) never reaches whoever holds
        the pid next: the table's handle for the pid is used only when it is the
        same process (same pid and start time), or when the table's is the one
        that has gone.
        """
        own = caller.process
        if own is None:
            own = caller.process = self._processes.open(caller.peer.pid, caller.peer)
        held = self.table.process(own.pid)
        if held is None or held is own or held.start_time == own.start_time:
            process = held or own
        elif not self._processes.alive(held):
            self.process_exited(held)  # the table's process is the one that has gone
            process = own
        else:
            raise Refusal(
                ErrorCode.NO_SUCH_PROCESS,
                f"the process that opened this connection (pid {own.pid}) has exited; "
                "its pid now belongs to another process",
            )
        process.retain()
        return process

    def _check_timer_limits(self, peer: Peer) -> None:
        limits = self.config
        if len(self.table) >= limits.max_timers:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"the daemon holds {limits.max_timers} timers, its limit",
            )
        if peer.uid != ROOT and self.table.owned_by(peer.uid) >= limits.max_timers_per_uid:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {peer.uid} has {limits.max_timers_per_uid} timers armed, its limit",
            )

    def _status(self, request: Status, peer: Peer, now: float) -> StatusReply:
        """A page of the timers ``peer`` may see, soonest first: ``request.limit`` of
        them, or fewer when the next would take the reply past `MAX_REPLY_BYTES`
        (each timer's and each new command line's encoded size is bounded from
        above, so the bound holds without encoding twice). Each process's command
        line is sent once, cut to `MAX_COMMAND_BYTES`, and read from the system
        at most once a second (`_CommandLines`).

        Root's page is read from the table's order, from the cursor on: its cost
        is the page's, whatever the number of timers. Another uid's page is
        chosen among the timers that uid may see (`TimerTable.visible_to`): its
        cost follows that uid's timers, never the host's."""
        after = _parse_cursor(request.cursor)
        if peer.uid == ROOT:
            page = list(itertools.islice(self.table.soonest(after), request.limit + 1))
        else:
            visible = self.table.visible_to(peer.uid)
            if after is not None:
                visible = (timer for timer in visible if (timer.deadline, timer.seq) > after)
            page = heapq.nsmallest(request.limit + 1, visible)
        room = _STATUS_PAGE_BYTES
        commands: dict[int, str] = {}
        timers: list[TimerInfo] = []
        for timer in page[: request.limit]:
            cost = _TIMER_BYTES + len(timer.scope.encode()) + len(timer.policy.encode())
            job, rank = ("", None) if timer.watch is None else (timer.watch.job, timer.watch.rank)
            if job:
                cost += MAX_JOB_BYTES
            command = None
            if timer.pid not in commands:
                process = self.table.process(timer.pid)
                command = (
                    "?"
                    if process is None
                    else self._command_lines.get(process, now, self._processes.command)
                )
                cost += _COMMAND_BYTES + len(command.encode())
            if cost > room and timers:
                break
            room -= cost
            if command is not None:
                commands[timer.pid] = command
            timers.append(
                TimerInfo(
                    pid=timer.pid,
                    scope=timer.scope,
                    remaining=max(0.0, timer.deadline - now),
                    policy=timer.policy,
                    uid=timer.uid,
                    job=job,
                    rank=rank,
                )
            )
        self._command_lines.forget_old(now, keep=self.table.process_count)
        cursor = None
        if len(timers) < len(page):
            last = page[len(timers) - 1]
            cursor = f"{last.deadline!r}/{last.seq}"
        return StatusReply(
            id=request.id,
            daemon=self.info(now),
            timers=timers,
            cursor=cursor,
            commands=commands,
        )

    def _incidents(
        self, request: Incidents | Incident, peer: Peer
    ) -> IncidentsReply | IncidentReply:
        """The incidents ``peer`` may see, or one of them."""
        if isinstance(request, Incidents):
            listing = self.incidents.listing(peer.uid, request.limit)
            return IncidentsReply(id=request.id, incidents=listing)
        found = self.incidents.get(request.incident, peer.uid, peer.gid)
        if found is None:
            raise Refusal(
                ErrorCode.NO_SUCH_INCIDENT,
                f"no incident {request.incident!r} that you may see; "
                "watchdogctl incidents lists them",
            )
        return IncidentReply(id=request.id, incident=found)

    def _suggest(self, request: Suggest, peer: Peer) -> SuggestReply:
        """A page of what history says, the caller's own uid's (root: all), cut
        to fit a reply like a status page."""
        rows = self.history.suggestions(None if peer.uid == ROOT else peer.uid)
        page: list[SuggestionInfo] = []
        room = _STATUS_PAGE_BYTES
        cursor: int | None = None
        for index, row in enumerate(itertools.islice(rows, request.cursor, None)):
            cost = _SUGGESTION_BYTES + len(row.executable.encode()) + len(row.scope.encode())
            if len(page) == request.limit or (cost > room and page):
                cursor = request.cursor + index
                break
            room -= cost
            page.append(row)
        return SuggestReply(
            id=request.id,
            suggestions=page,
            min_samples=self.history.min_samples,
            margin=self.history.margin,
            cursor=cursor,
        )

    def _why(self, request: Why, peer: Peer, now: float) -> WhyReply:
        """What the daemon knows about process ``request.pid``, as ``peer`` may see it."""
        pid = request.pid
        process = self.table.process(pid)

        def mine(timer: Timer) -> bool:
            return peer.uid in (ROOT, timer.uid, timer.owner)

        armed = [] if process is None else self.table.timers_of(pid)
        held = [timer for timer in armed if mine(timer)]
        held += sorted(
            (timer for timer in self._firing.values() if timer.pid == pid and mine(timer)),
            key=lambda timer: timer.firing,
        )
        shown = held[: request.limit]
        timers = [self._why_timer(timer, now) for timer in shown]
        events = self.events.about(pid, request.limit, peer.uid)
        if peer.uid != ROOT:
            events = [_without_output(event) for event in events]
        suggestions: list[SuggestionInfo] = []
        executable = ""
        if process is not None and held:
            executable = self._processes.executable(process)
            for scope in sorted({timer.scope for timer in shown}):
                row = self.history.suggestion((process.uid, executable, scope))
                if row is not None:
                    suggestions.append(row)
        return WhyReply(
            id=request.id,
            pid=pid,
            command=""
            if process is None or not held
            else self._command_lines.get(process, now, self._processes.command),
            executable=executable,
            uid=None if process is None or not held else process.uid,
            timers=timers,
            more=len(held) - len(shown),
            events=events,
            suggestions=suggestions,
            incidents=self.incidents.about(pid, peer.uid)[-request.limit :],
        )

    def _why_timer(self, timer: Timer, now: float) -> WhyTimer:
        watch = timer.watch
        firing = ""
        if timer.firing:
            policy, _ = self.policy_for(timer.policy)
            steps = policy.steps
            firing = (
                f"step {timer.step + 1} of {len(steps)}: {steps[timer.step].describe()}"
                if timer.step < len(steps)
                else "finishing"
            )
        return WhyTimer(
            scope=timer.scope,
            policy=timer.policy,
            remaining=max(0.0, timer.deadline - now),
            timeout=timer.timeout,
            armed=now - timer.armed_at,
            due="stalled" if timer.stalled else "timeout",
            owner=timer.owner,
            timeout_from="" if watch is None else watch.timeout_from,
            progress=None if watch is None else watch.progress,
            progressed=None if watch is None else now - watch.progressed_at,
            stall=0.0 if watch is None else watch.stall,
            firing=firing,
            notes=_why_notes(watch),
        )

    def info(self, now: float) -> DaemonInfo:
        """The daemon summary sent with status."""
        return DaemonInfo(
            version=__version__,
            pid=self.daemon_pid,
            uptime=now - self.started,
            timers=len(self.table),
            processes=self.table.process_count,
            connections=self.connections,
            requests=self.metrics.requests_total,
            expired=self.metrics.expired,
            exited=self.metrics.exited,
            state_degraded=self.journal.degraded,
            fleet=self.fleet_state,
        )

    def _events(self, request: Events, peer: Peer) -> EventsReply:
        events = self.events.page(request.after, request.limit, peer.uid)
        if peer.uid != ROOT:
            events = [_without_output(event) for event in events]
        last = events[-1].seq if events else self.events.last
        return EventsReply(id=request.id, events=events, last=last)

    def _policies(self, request: Policies) -> PoliciesReply:
        infos = [
            PolicyInfo(
                name=policy.name,
                target=policy.target,
                steps=policy.describe(),
                root_only=policy.root_only,
                builtin=policy.builtin,
                stall=policy.stall,
            )
            for policy in sorted(self.policies.values(), key=lambda policy: policy.name)
        ]
        return PoliciesReply(id=request.id, policies=infos, default=self.default_policy)

    def metrics_text(self) -> str:
        """The metrics and the current gauges, as the renderer given at start
        writes them (the Prometheus text format, `watchdogd.runtime.metrics.exposition`)."""
        self.metrics.job_processes = _top_jobs(self.table.jobs(), Counters.JOB_LABELS)
        return self._render_metrics(
            self.metrics,
            {
                "timers_armed": ("Timers armed now.", len(self.table)),
                "processes_watched": ("Processes with timers armed now.", self.table.process_count),
                "connections_open": ("Connections open now.", self.connections),
                "events_kept": ("Events kept in memory now.", len(self.events)),
                "state_write_failures": (
                    "Writes of the state file that failed since start.",
                    self.journal.errors,
                ),
                "state_degraded": (
                    "1 while the state cannot be written: timers are kept in memory only.",
                    int(self.journal.degraded),
                ),
                "expiries_in_progress": (
                    "Expired timers whose policy is still being carried out.",
                    len(self._firing),
                ),
                "dumps_running": ("Dump steps running now.", self.metrics.dumps_running),
                "dumps_waiting": (
                    "Dump steps waiting for a turn now: at most max_dumps run at once.",
                    self.metrics.dumps_waiting,
                ),
                "dumps_max": ("Dump steps run at once at most (max_dumps).", self.config.max_dumps),
                **self._fleet_gauges(),
            },
        )

    def _fleet_gauges(self) -> dict[str, tuple[str, float]]:
        if not self.fleet_state:
            return {}
        return {
            "fleet_connected": (
                "1 while the fleet's store (etcd) answers.",
                int(self.fleet_state == "connected"),
            ),
            "fleet_errors": ("Calls to the fleet's store that failed.", self.metrics.fleet_errors),
            "fleet_dropped": (
                "Incident changes not published: more of their user's waited than its share.",
                self.metrics.fleet_dropped,
            ),
            "fleet_unexpected_errors": (
                "Errors of the fleet's task that nothing expected; it starts again.",
                self.metrics.fleet_unexpected,
            ),
        }

    def expire_due(self, now: float, limit: int | None = None) -> list[Expired[P]]:
        """Take out the timers due at ``now`` (the earliest ``limit``, when given);
        each stays in the state as firing (the returned timer) until
        `expiry_finished`. Each returned process handle is retained for the
        caller, who closes it when the action is done.

        A timer whose policy has ``starvation_grace`` is judged first
        (`_judge_starvation`): if its process was starved it is armed again for
        the grace instead (`_extend`), and is not returned."""
        expired = self.table.pop_due(now, limit)
        fired: list[Expired[P]] = []
        extended = False
        for item in expired:
            policy, _ = self.policy_for(item.timer.policy)
            note = ""
            if policy.starvation_grace:
                verdict = self._judge_starvation(item, policy)
                if verdict.starved:
                    self._extend(item, policy, verdict, now)
                    extended = True
                    continue
                note = verdict.note
            # A process whose last timer fell due is back in the table when
            # another of its timers was extended in this pass: it stays tracked.
            orphaned = item.orphaned and not (
                extended and self.table.process(item.timer.pid) is item.process
            )
            item.process.retain()
            if orphaned:
                self._processes.untrack(item.process)
            run = Run(fired_at=now, plan=policy.plan)
            peers: list[Expired[P]] = []
            watch = item.timer.watch
            if watch is not None and watch.job:
                run, peers = self._incident(item.timer, watch, policy, run, now)
            firing = msgspec.structs.replace(item.timer, firing=next(self._firing_numbers), run=run)
            # The armed record and the firing one go out in the same journal
            # record: a crash leaves one of the two, never neither.
            self.journal.drop(item.timer)
            self.journal.put(firing)
            self._firing[firing.store_key] = firing
            fired.append(Expired(firing, item.process, orphaned, note))
            fired += peers
        if expired:
            self.journal.commit_soon()
        return fired

    def _incident(
        self, timer: Timer, watch: Watch, policy: Policy, run: Run, now: float
    ) -> tuple[Run, list[Expired[P]]]:
        """``timer`` of a job expired under ``policy``: the run of its policy,
        which names the job's incident, and the peer policy's runs on the job's
        other processes that the incident does not list yet: all of them when it
        is new (`watchdogd.core.incidents`)."""
        job = (timer.owner, watch.job)
        reason = "stalled" if timer.stalled else "timeout"
        hung = RankInfo(
            host=self.incidents.host,
            pid=timer.pid,
            uid=timer.uid,
            role="hung",
            scope=timer.scope,
            rank=watch.rank,
            local_rank=watch.local_rank,
            group_rank=watch.group_rank,
            policy=policy.name,
            reason=reason,
        )
        user = self._processes.user_name(timer.owner)
        incident, new = self.incidents.expired(job, user, hung, reason, self._wall())
        if new:
            self.metrics.incidents += 1
        run = msgspec.structs.replace(run, incident=incident)
        listed = self.incidents.pids(incident) | {timer.pid}
        return run, self._peers(incident, job, policy.peers, listed, now)

    def _peers(
        self,
        incident: str,
        job: tuple[int, str],
        peers: str | None,
        listed: set[int],
        now: float,
    ) -> list[Expired[P]]:
        """Runs of the peer policy ``peers`` (None: each process's timer's policy's
        own) on each process not ``listed`` holding a timer of ``job``: firing
        records of their own, kept in the state like an expiry's until the policy
        has run. A peer policy only root may choose runs on a user's job as the
        built-in ``peer_dump``."""
        runs: list[Expired[P]] = []
        for pid in self.table.job_pids(*job):
            process = self.table.process(pid)
            if pid in listed or process is None:
                continue
            timer = next(
                timer
                for timer in self.table.timers_of(pid)
                if timer.owner == job[0] and timer.watch is not None and timer.watch.job == job[1]
            )
            name = self.policy_for(timer.policy)[0].peers if peers is None else peers
            if name == NO_PEERS:
                continue
            peer_policy = self.policies.get(name) or BUILTIN[PEER_DUMP]
            if peer_policy.root_only and job[0] != ROOT:
                peer_policy = BUILTIN[PEER_DUMP]
            firing = msgspec.structs.replace(
                timer,
                firing=next(self._firing_numbers),
                policy=peer_policy.name,
                run=Run(fired_at=now, plan=peer_policy.plan, incident=incident, peer=True),
            )
            self.journal.put(firing)
            self._firing[firing.store_key] = firing
            assert timer.watch is not None
            self.incidents.add(
                incident,
                RankInfo(
                    host=self.incidents.host,
                    pid=pid,
                    uid=timer.uid,
                    role="peer",
                    scope=timer.scope,
                    rank=timer.watch.rank,
                    local_rank=timer.watch.local_rank,
                    group_rank=timer.watch.group_rank,
                    policy=peer_policy.name,
                ),
            )
            process.retain()
            runs.append(Expired(firing, process, orphaned=False))
        return runs

    def held_jobs(self, limit: int, per_uid: int) -> list[tuple[int, str]]:
        """The jobs this host holds timers of, as (the uid that armed them, the
        job), at most ``limit``: root's first, then each other uid's, at most
        ``per_uid`` of each, in the order they came, a uid at a time in turn; so
        that one user's many jobs never crowd out another's."""
        root: list[tuple[int, str]] = []
        others: dict[int, list[tuple[int, str]]] = {}
        for key in self.table.job_keys():
            if key[0] == ROOT:
                if len(root) < limit:
                    root.append(key)
                continue
            held = others.get(key[0])
            if held is None:
                others[key[0]] = [key]
            elif len(held) < per_uid:
                held.append(key)
        turns = itertools.zip_longest(*(others[uid] for uid in sorted(others)))
        rest = (key for turn in turns for key in turn if key is not None)
        return root + list(itertools.islice(rest, max(0, limit - len(root))))

    def jobs_changed(self) -> int:
        """A number that changes whenever a job came or went."""
        return self.table.jobs_changed

    def fleet_incident(self, incident: IncidentInfo, uid: int, now: float) -> list[Expired[P]]:
        """An incident another host opened, of a job of the user this host knows as
        ``uid`` (the fleet maps the incident's user *name* to it): when this host
        holds timers of the job, the incident is kept here too, as ``uid``'s, and
        each local process of the job gets the peer policy of its own timer's
        policy (runs for the caller to carry out). Otherwise, or when it is known
        already, nothing."""
        if incident.id in self.incidents:
            return []
        job = (uid, incident.job)
        if not self.table.job_pids(*job):
            return []
        self.incidents.merge(msgspec.structs.replace(incident, uid=uid))
        return self._peers(incident.id, job, None, set(), now)

    def fleet_ranks(
        self, incident_id: str, host: str, ranks: list[RankInfo], now: float
    ) -> list[Expired[P]]:
        """The ranks ``host`` found of an incident kept here, their readers mapped
        to local uids already. When a new hung rank came with them (an expiry there
        joined the incident: a job restarted within the window hung again), the
        job's local processes the incident does not list yet get the peer policy,
        as a local expiry would give them."""
        if not self.incidents.merge_ranks(incident_id, host, ranks):
            return []
        head = self.incidents.head(incident_id)
        if head is None:
            return []
        listed = self.incidents.pids(incident_id)
        return self._peers(incident_id, (head.uid, head.job), None, listed, now)

    def host_lost(self, host: str, user: str, jobs: Iterable[tuple[int, str]]) -> None:
        """``host`` left the fleet without stopping (its lease lapsed): an incident
        of kind ``host_lost`` for each of its jobs this host holds too, as (local
        uid, job); ``user`` names each uid as the fleet does."""
        for uid, job in sorted(jobs):
            if not self.table.job_pids(uid, job):
                continue
            note = f"host {host} left the fleet (its lease lapsed: the daemon or the host is gone)"
            self.incidents.opened("host_lost", (uid, job), user, note, self._wall())
            self.metrics.incidents += 1

    def fleet_rejected(self, reason: str) -> None:
        """A key read from the fleet was not taken (`watchdogd.fleet.records`)."""
        self.metrics.fleet_rejected[reason] += 1

    def fleet_failed(self, *, unexpected: bool = False) -> None:
        """A call to the fleet's store failed (``unexpected``: the fleet's task met
        an error nothing expected, and starts again)."""
        if unexpected:
            self.metrics.fleet_unexpected += 1
        else:
            self.metrics.fleet_errors += 1

    def fleet_dropped(self) -> None:
        """An incident change was not published: its user's share of the queue
        was full."""
        self.metrics.fleet_dropped += 1

    def fleet_changed(self, connected: bool, note: str) -> None:
        """The fleet's store became unreachable, or reachable again."""
        self.fleet_state = "connected" if connected else f"disconnected: {note}"
        self._record_daemon_event(
            "fleet_restored" if connected else "fleet_degraded",
            note
            if connected
            else f"the fleet is unreachable ({note}); local timers "
            "protect as ever, incidents stay on this host until it is back",
        )

    def _judge_starvation(self, item: Expired[P], policy: Policy) -> Verdict:
        """Whether the process of ``item``, due under ``policy``, was starved since
        its timer was armed. Not judged (no words) once the timer was extended:
        its expiry says so."""
        watch = item.timer.watch
        if watch is not None and watch.extended:
            return Verdict(False)
        if watch is None or watch.baseline is None:
            return UNMEASURED
        sample = self._processes.sample(item.process)
        if sample is None:
            return Verdict(False)  # it has exited: its policy finds it gone
        return judge(
            watch.baseline,
            sample,
            pressure=policy.starvation_pressure,
            cpu=policy.starvation_cpu,
        )

    def _extend(self, item: Expired[P], policy: Policy, verdict: Verdict, now: float) -> None:
        """Arm the timer of ``item`` again for its policy's grace, its process
        being starved: an ``extended`` event says why, and its `Watch` that it was
        extended (it is not again until it is armed anew)."""
        timer, grace = item.timer, policy.starvation_grace
        watch = Watch() if timer.watch is None else timer.watch
        timer = self.table.put(
            item.process,
            msgspec.structs.replace(
                timer,
                deadline=now + grace,
                watch=msgspec.structs.replace(watch, extended=grace),
            ),
        )
        self.journal.put(timer)
        self.metrics.extensions[policy.name] += 1
        wall = self._wall()
        self.events.record(
            EventInfo(
                seq=0,
                kind="extended",
                time=wall,
                pid=timer.pid,
                uid=timer.uid,
                scope=timer.scope,
                policy=policy.name,
                command=self._processes.command(item.process),
                armed_at=wall - (now - timer.armed_at),
                deadline=wall + grace,
                note=f"{verdict.note}; given {grace:g}s more, once",
            )
        )
        self._on_deadline(timer.deadline)

    def step_started(self, timer: Timer, step: int, step_end: float = 0.0) -> Timer:
        """The policy of firing ``timer`` starts its step ``step`` (a wait ending at
        ``step_end``); returns the timer as now recorded."""
        timer = timer.at_step(step, step_end)
        if timer.store_key in self._firing:
            self._firing[timer.store_key] = timer
            self.journal.put(timer)
            self.journal.commit_soon()
        return timer

    def expiry_finished(self, timer: Timer) -> None:
        """The policy of firing ``timer`` has ended: it leaves the state."""
        if self._firing.pop(timer.store_key, None) is not None:
            self.journal.drop(timer)
            self.journal.commit_soon()

    @property
    def firing(self) -> int:
        """Timers whose policy is in progress."""
        return len(self._firing)

    def snapshot(self) -> list[Timer]:
        """Every timer the state must hold: the armed ones and the firing ones."""
        return [*self.table.timers(), *self._firing.values()]

    def restore(self, timers: Iterable[Timer]) -> Restored[P]:
        """Put back the timers read from the state (the daemon restarted).

        Armed timers are re-armed on their original deadlines. A timer is dropped
        when its process is gone or its pid now belongs to another process (its
        start time differs). A firing timer whose process is still there is
        returned, with a retained handle, for its policy to resume at the step it
        had reached; one whose process is gone is recorded as an expiry whose
        target had gone, and is not signalled."""
        restored = Restored[P]()
        by_pid: dict[int, list[Timer]] = {}
        for timer in timers:
            by_pid.setdefault(timer.pid, []).append(timer)
        handles: dict[int, P] = {}
        groups: list[tuple[P, list[Timer]]] = []
        firing: list[tuple[Timer, P | None]] = []
        for pid, held in by_pid.items():
            process = self._reopen(pid)
            if process is not None:
                handles[pid] = process
            armed = self._sort_restored(process, held, firing, restored)
            if process is not None and armed:
                groups.append((process, armed))
        self.table.restore(groups)
        for process, _ in groups:
            self._processes.track(process)
        earliest = self.table.next_deadline()
        if earliest is not None:
            self._on_deadline(earliest)
        numbers = [timer.firing for timer, _ in firing]
        self._firing_numbers = itertools.count(max(numbers, default=0) + 1)
        for timer, target in firing:
            self._firing[timer.store_key] = timer
            if target is None:
                self._record_gone_while_down(timer)
                self.expiry_finished(timer)
                continue
            target.retain()
            restored.resumed.append(Expired(timer, target, orphaned=False))
        self.journal.commit_soon()
        for process in handles.values():
            if self.table.process(process.pid) is not process:
                process.close()
        return restored

    def storage_changed(self, degraded: bool, reason: str) -> None:
        """The state store stopped (or started again) making changes durable."""
        if degraded:
            note = (
                f"the state cannot be written ({reason}); timers are protected from "
                "memory, and replies say their change is not durable, until it can"
            )
        else:
            note = "the state can be written again, and holds every timer once more"
        self._record_daemon_event("state_degraded" if degraded else "state_restored", note)

    def record_reload(self, ok: bool, note: str) -> None:
        """A reload of the config file was applied, or refused (``ok`` False)."""
        self.metrics.reloads["ok" if ok else "failed"] += 1
        self._record_daemon_event("reloaded" if ok else "reload_failed", note)

    def _record_daemon_event(self, kind: str, note: str) -> None:
        """An event about the daemon itself, which only root sees."""
        self.events.record(
            EventInfo(
                seq=0,
                kind=kind,
                time=self._wall(),
                pid=self.daemon_pid,
                uid=ROOT,
                scope="",
                policy="",
                note=note,
            )
        )

    def record_expiries(self, events: list[EventInfo]) -> None:
        """Policies ended: count expiries by policy and outcome, record the events
        (followers are woken once), and give each incident what its processes'
        policies found."""
        for event in events:
            if event.kind == "expired":
                self.metrics.expiries[(event.policy, event.outcome)] += 1
            if event.incident:
                self.incidents.finished(event)
        self.events.record_many(events)

    def dump_taken(self, timer: Timer, reader: tuple[int, int] | None) -> None:
        """The dump step of ``timer``'s policy ran; ``reader`` is the one (uid, gid)
        besides root that may read what it captured (None: root alone), as the
        kernel judged it then. Kept with the incident's rank, if it has one."""
        if timer.run is not None and timer.run.incident:
            role = "peer" if timer.run.peer else "hung"
            self.incidents.dumped(timer.run.incident, timer.pid, role, reader)

    def record_unkillable(self, event: EventInfo) -> None:
        """A target outlived SIGKILL."""
        self.metrics.unkillable += 1
        self.events.record(event)

    def observe_lateness(self, seconds: float) -> None:
        """The time from a deadline to its policy's first signal."""
        self.metrics.observe_lateness(seconds)

    def policy_for(self, name: str) -> tuple[Policy, str]:
        """The policy a timer armed with ``name`` runs now, and a note when a reload
        removed it and the default stands in."""
        policy = self.policies.get(name) or signal_policy(name)
        if policy is not None:
            return policy, ""
        default = self.policies[self.default_policy]
        note = (
            f"policy {name!r} is no longer configured; the default policy {default.name!r} was used"
        )
        return default, note

    def _record_gone_while_down(self, timer: Timer) -> None:
        self.metrics.expiries[(timer.policy, "gone")] += 1
        self.events.record(
            EventInfo(
                seq=0,
                kind="expired",
                time=self._wall(),
                pid=timer.pid,
                uid=timer.uid,
                scope=timer.scope,
                policy=timer.policy,
                outcome="gone",
                note=f"its policy was at step {timer.step + 1} when the daemon stopped; "
                "the process had exited by its restart, so nothing was sent again",
            )
        )

    def _sort_restored(
        self,
        process: P | None,
        held: list[Timer],
        firing: list[tuple[Timer, P | None]],
        restored: Restored[P],
    ) -> list[Timer]:
        """The armed timers of ``held`` that belong to ``process``; firing ones go
        to ``firing`` with the process, or None when theirs is gone; the rest are
        dropped. Each timer is checked on its own: the pid may have been reused,
        and a firing record of the old process may sit beside timers of the new."""
        armed = []
        for timer in held:
            same = process is not None and process.start_time == timer.start_time
            if timer.firing:
                firing.append((timer, process if same else None))
            elif same:
                armed.append(timer)
            else:
                self.journal.drop(timer)
                restored.dropped += 1
        restored.armed += len(armed)
        return armed

    def _reopen(self, pid: int) -> P | None:
        """A handle on whatever process holds ``pid`` now, if any."""
        try:
            return self._processes.open(pid, Peer(pid=0, uid=0, gid=0))
        except Refusal:
            return None

    def close(self) -> None:
        """Drop every timer and the table's handles (the daemon is stopping). The
        journal is not told: the timers stay in the store for the next start."""
        for timer in list(self.table.timers()):
            _, gone = self.table.disarm(timer.pid, timer.scope)
            if gone is not None:
                self._processes.untrack(gone)

    def process_exited(self, process: P) -> list[Timer]:
        """Drop every timer of a process that exited; returns them, and records the
        exit when it had any but those its exit releases (``exit_releases``)."""
        if self.table.process(process.pid) is not process:
            return []
        forgotten = self.table.forget(process.pid)
        assert forgotten is not None
        _, timers = forgotten
        self._processes.untrack(process)
        for timer in timers:
            self.journal.drop(timer)
        if timers:
            self.journal.commit_soon()
        held = [timer for timer in timers if not timer.exit_releases]
        if held:
            self.metrics.exited += 1
            scopes = sorted(timer.scope for timer in held)
            shown = ", ".join(scopes[:_LISTED_SCOPES])
            more = (
                f" and {len(scopes) - _LISTED_SCOPES} more" if len(scopes) > _LISTED_SCOPES else ""
            )
            self.events.record(
                EventInfo(
                    seq=0,
                    kind="exited",
                    time=self._wall(),
                    pid=process.pid,
                    uid=process.uid,
                    scope="",
                    policy="",
                    timers=len(held),
                    note=f"exited with {len(held)} timer(s) armed: {shown}{more}",
                )
            )
        return timers


def _watch(
    request: Acquire, stall: float, timeout_from: str, previous: Timer | None, now: float
) -> Watch:
    """The `Watch` of a timer armed now by ``request``, under a policy that allows
    ``stall`` seconds without progress, in place of ``previous`` (None: a new
    timer).

    Progress grows only past the highest value this timer has carried: a re-arm
    with the same value, a lower one or none leaves the time it last grew as it
    was. A new timer (one released and armed again is new) starts growing now."""
    progress, progressed_at = request.progress, now
    before = None if previous is None else previous.watch
    if before is not None and (
        progress is None or (before.progress is not None and progress <= before.progress)
    ):
        progress, progressed_at = before.progress, before.progressed_at
    return Watch(
        progress=progress,
        progressed_at=progressed_at,
        stall=stall,
        timeout_from=timeout_from,
        job=request.job or "",
        rank=request.rank,
        local_rank=request.local_rank,
        group_rank=request.group_rank,
    )


def _top_jobs(jobs: dict[tuple[int, str], int], labels: int) -> dict[tuple[int, str], int]:
    """The ``labels`` jobs with the most processes, and the rest summed as job
    ``(other)`` of uid 0."""
    ranked = sorted(jobs.items(), key=lambda item: (-item[1], item[0]))
    top = dict(ranked[:labels])
    rest = sum(count for _, count in ranked[labels:])
    if rest:
        top[(ROOT, "(other)")] = rest
    return top


def _why_notes(watch: Watch | None) -> list[str]:
    """What `Why` says of a timer beyond its fields: its job, and any extension."""
    if watch is None:
        return []
    notes = []
    if watch.job:
        rank = "" if watch.rank is None else f" as rank {watch.rank}"
        notes.append(f"of job {watch.job}{rank}")
    if watch.baseline is not None and not watch.extended:
        notes.append("its policy judges starvation at its deadline (measured when armed)")
    if watch.extended:
        notes.append(f"given {watch.extended:g}s more as starved (its extended event says why)")
    return notes


def _without_output(event: EventInfo) -> EventInfo:
    """``event`` as a non-root caller sees it: its steps without their output."""
    if not any(step.output for step in event.steps):
        return event
    steps = [StepResult(step=step.step, result=step.result) for step in event.steps]
    return msgspec.structs.replace(event, steps=steps)


class _CommandLines(Generic[P]):
    """The command lines status pages show, each kept `_COMMAND_SECONDS` after it
    was read, by process (pid and start time), cut to `MAX_COMMAND_BYTES`.

    Reading /proc/PID/cmdline costs some 10 µs (the kernel copies it out of the
    process's memory): a page of 1,000 timers on 1,000 processes spent most of
    its time there, and a walk of every page (``watchdogctl status``) meets the
    same processes page after page. A process that changes its command line
    (setproctitle, exec) shows the new one within that time."""

    __slots__ = ("_lines",)

    def __init__(self) -> None:
        self._lines: dict[tuple[int, int], tuple[float, str]] = {}

    def get(self, process: P, now: float, read: Callable[[P], str]) -> str:
        key = (process.pid, process.start_time)
        held = self._lines.get(key)
        if held is not None and now - held[0] < _COMMAND_SECONDS:
            return held[1]
        line = _clip(read(process), MAX_COMMAND_BYTES)
        self._lines[key] = (now, line)
        return line

    def forget_old(self, now: float, keep: int) -> None:
        """Drop the lines past their time once there are more than ``keep`` (the
        processes in the table) and a margin: bounded, and rarely a pass."""
        if len(self._lines) > 2 * keep + 1024:
            self._lines = {
                key: held for key, held in self._lines.items() if now - held[0] < _COMMAND_SECONDS
            }


def _clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes, ending in `_CLIPPED` if it was cut."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[: limit - len(_CLIPPED.encode())].decode(errors="ignore") + _CLIPPED


def _parse_cursor(cursor: str | None) -> tuple[float, int] | None:
    """The position ``deadline/seq`` a status page ends at, or None for the first.
    Only what `Service._status` writes is one: a finite deadline and a sequence
    number within 64 bits."""
    if cursor is None:
        return None
    found = _CURSOR.fullmatch(cursor)
    position = None
    if found is not None:
        with contextlib.suppress(ValueError):  # "1.2.3", "1e-" and the like
            position = (float(found["deadline"]), int(found["seq"]))
    if position is None or not math.isfinite(position[0]) or position[1] > _MAX_SEQ:
        raise Refusal(
            ErrorCode.INVALID_REQUEST,
            f"not a status cursor: {cursor!r}; pass the cursor of the page before "
            "(none for the first page)",
        )
    return position
