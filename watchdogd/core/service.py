"""The core as the runtime holds it: its parts, wired, and the one dispatch of every
request.

Synchronous and free of sockets, clocks, logs and randomness: the caller passes
``now`` (on the monotonic clock the table uses) to each call, and the runtime
passes in at start the wall clock that stamps events, the monotonic clock of the
log throttle, the log sink, the incident id maker and the ports (`watchdogd.core.ports`)
that do the few system calls opening and watching a process need. That keeps every
rule testable with a fake port and numbers for the time.

Each part owns its state and is its own module:

- `watchdogd.core.timer_requests`: connections, the handshake, acquire and release with
  their authorization and limits;
- `watchdogd.core.pages`: the pages that only read (status, events, why, suggest,
  incidents, policies, metrics);
- `watchdogd.core.firing`: expiry, the starvation rule and incident peers, and the
  firing timers until their policy has run;
- `watchdogd.core.lifecycle`: restore after a restart, exits, the stop;
- `watchdogd.core.slots`: the fast path's registrations and the looks at their
  slots;
- `watchdogd.core.bridge`: what the fleet asks of the core and tells it;
- `watchdogd.core.hangs`: each settled verdict's hang counted toward its job's
  repeats (`watchdogd.core.repeats`), and the jobs' page.

They share one context (`watchdogd.core.context.CoreContext`): the config in
force (`watchdogd.core.rules`), the timer table's one writer
(`watchdogd.core.writer`), the process port, the events ring, the incident log,
the history, the counters, the responders and the log. Each part is an
attribute of `Service`, and the runtime calls the part itself (``service.arming``,
``service.firing``, ``service.lifecycle``...); `Service` does nothing itself but
make them, dispatch each request, and record the daemon's own events.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, assert_never

import msgspec

from watchdogd_protocol import (
    Acquire,
    ErrorCode,
    EventInfo,
    Events,
    Evidence,
    Hangs,
    Hello,
    Incident,
    IncidentInfo,
    IncidentReply,
    Incidents,
    IncidentsReply,
    MapPage,
    Metrics,
    MetricsReply,
    PageMapped,
    Ping,
    Policies,
    Pong,
    RankInfo,
    Release,
    ReplyMessage,
    RequestMessage,
    Respond,
    Status,
    Suggest,
    Unblocked,
    Why,
)

from ..errors import Refusal
from .bridge import FleetBridge
from .config import Config, DaemonConfig
from .context import CoreContext
from .counters import Counters
from .events import EventLog
from .firing import Firing
from .hangs import JobHangs
from .history import History
from .identity import ROOT
from .incidents import IncidentLog
from .lifecycle import Later, Lifecycle, Restored
from .logline import Level, LogSink, NullSink, RateLimitedLog, Throttle, logfmt
from .pages import Pages
from .ports import Journal, NoPages, NullJournal, P, PagePort, PageRef, ProcessPort, TargetProcess
from .repeats import Repeats
from .responders import Responders
from .rules import Rules
from .slots import Slots
from .timer_requests import Arming, Caller
from .timers import Timer, TimerTable
from .unblocks import Unblocks
from .user_frames import Library
from .verdict import Decision, for_viewer, nobody
from .writer import TableWriter

__all__ = [
    "ROOT",
    "Caller",
    "Journal",
    "Later",
    "NullJournal",
    "ProcessPort",
    "Restored",
    "Service",
    "TargetProcess",
]


class Service(Generic[P]):
    """The daemon's state and its answer to every request: the shared parts
    (`context`) and the parts made on them, each an attribute the runtime
    calls."""

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
        stdlib: frozenset[str] = frozenset(),
        pages: PagePort[P] | None = None,
        monotonic: bool = False,
    ) -> None:
        """``now`` is when the daemon starts, on the table's clock (``on_deadline``
        is told each deadline that moves the next wake-up on it); ``wall`` stamps
        events and ``clock`` paces the log's throttle. ``stdlib``: the standard
        library's top-level module names (``sys.stdlib_module_names``), whose
        frames are not where a rank waits. ``pages`` makes the slot pages of the
        fast path, offered when ``monotonic`` says the table's clock is
        CLOCK_MONOTONIC, the clock of a slot's deadlines."""
        self.daemon_pid = daemon_pid
        self.started = now
        self._wall = wall
        self._monotonic = monotonic
        self.rules = Rules(config)
        self.table: TimerTable[P] = TimerTable()
        self.metrics = Counters()
        #: The log of lines requests can cause, rate-limited per (uid, kind).
        self.log = RateLimitedLog(Throttle(clock=clock), NullSink() if log is None else log)
        daemon = config.daemon
        self.events = EventLog(daemon.events, on_event, per_uid=daemon.events_per_uid, log=self.log)
        self.history = History()
        self._configure_history(config)
        #: The processes that answer evidence requests, by job.
        self.responders = Responders()
        #: The jobs' hangs, by fingerprint (`watchdogd.core.repeats`).
        self.repeats = Repeats(
            limit=daemon.repeat_limit,
            window=daemon.repeat_window,
            same_within=daemon.incident_window,
        )
        self.incidents = self._incident_log(daemon, host, new_id, stdlib)
        #: The one writer of the timers (`watchdogd.core.writer`).
        self.writer = TableWriter(
            self.table, NullJournal() if journal is None else journal, on_deadline
        )
        #: What every part shares (`watchdogd.core.context`).
        self.context = self._context(processes)
        self._make_parts(config, NoPages() if pages is None else pages, render_metrics)

    def _context(self, processes: ProcessPort[P]) -> CoreContext[P]:
        return CoreContext(
            rules=self.rules,
            writer=self.writer,
            processes=processes,
            events=self.events,
            metrics=self.metrics,
            history=self.history,
            incidents=self.incidents,
            responders=self.responders,
            log=self.log,
            wall=self._wall,
            daemon_pid=self.daemon_pid,
            started=self.started,
        )

    def _incident_log(
        self,
        daemon: DaemonConfig,
        host: str,
        new_id: Callable[[], str] | None,
        stdlib: frozenset[str],
    ) -> IncidentLog:
        return IncidentLog(
            host,
            keep=daemon.incidents,
            per_uid=daemon.incidents_per_uid,
            window=daemon.incident_window,
            new_id=new_id,
            library=Library(stdlib),
            on_settled=self._verdict_settled,
            evidence=daemon.incident_bytes,
            evidence_per_uid=daemon.incident_bytes_per_uid,
            on_trimmed=self._evidence_trimmed,
        )

    def _make_parts(
        self,
        config: Config,
        pages: PagePort[P],
        render_metrics: Callable[[Counters, Mapping[str, tuple[str, float]]], str],
    ) -> None:
        """The parts, each on the context and the few parts it calls."""
        context = self.context
        self.slots = Slots(context, pages, offered=self._monotonic and config.daemon.fast_path)
        #: This host's ranks owed a cut out of the collective they wait in.
        self.unblocks = Unblocks(
            self.incidents,
            self.responders,
            self.events,
            self.metrics,
            wall=self._wall,
            waited=config.fleet.unblock_after,
        )
        self.firing = Firing(context, slots=self.slots)
        self.lifecycle = Lifecycle(context, self.firing, slots=self.slots)
        self.arming = Arming(
            context, self.lifecycle, slots=self.slots, record_taken=self.firing.record_taken
        )
        self.fleet = FleetBridge(context, self.firing, unblocks=self.unblocks)
        self.hangs = JobHangs(context, self.repeats, holds=self.fleet.holds)
        self.pages = Pages(
            context,
            firing=self.firing,
            arming=self.arming,
            slots=self.slots,
            fleet=self.fleet,
            render_metrics=render_metrics,
        )

    # The config in force.

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded config: policies, limits, the event ring's size. A timer
        whose policy is gone keeps its name; at expiry the default stands in. What
        changed is logged at the debug level, a line a setting."""
        changed = self.rules.reconfigure(config)
        if self.log.debugging:
            self.log.log("reload_diff", Level.DEBUG, logfmt("reload_diff", changes=len(changed)))
            for change in changed:
                line = logfmt("config_changed", key=change.key, old=change.old, new=change.new)
                self.log.log(("config_changed", change.key), Level.DEBUG, line)
        daemon = config.daemon
        self.events.resize(daemon.events, daemon.events_per_uid)
        self._configure_history(config)
        self.incidents.resize(daemon.incidents, daemon.incidents_per_uid)
        self.incidents.budget.resize(daemon.incident_bytes, daemon.incident_bytes_per_uid)
        self.incidents.window = daemon.incident_window
        self.slots.offered = self._monotonic and daemon.fast_path
        self.repeats.limit, self.repeats.window = daemon.repeat_limit, daemon.repeat_window
        self.repeats.same_within = daemon.incident_window

    def _configure_history(self, config: Config) -> None:
        """Apply the ``[history]`` bounds (lowered bounds apply as keys are added)."""
        history, table = self.history, config.history
        history.keys, history.keys_per_uid = table.keys, table.keys_per_uid
        history.min_samples, history.margin = table.min_samples, table.margin

    # Connections and requests.

    # One branch per request type, by design: the whole dispatch reads in one place.
    def handle(  # noqa: PLR0912
        self, request: RequestMessage, caller: Caller[P], now: float
    ) -> ReplyMessage:
        """Answer one validated request. Raises `Refusal` to refuse it."""
        match request:
            case Acquire():
                return self.arming.acquire(request, caller, now)
            case Release():
                return self.arming.release(request, caller, now)
            case Status():
                return self.pages.status(request, caller.peer, now)
            case Events():
                return self.pages.events(request, caller.peer)
            case Policies():
                return self.pages.policies(request)
            case Metrics():
                return MetricsReply(id=request.id, text=self.metrics_text(caller.peer.uid))
            case Ping():
                return Pong(id=request.id)
            case Hello():
                return self.arming.welcome(request)
            case Suggest():
                return self.pages.suggest(request, caller.peer, now)
            case Why():
                return self.pages.why(request, caller.peer, now)
            case Incidents() | Incident():
                return self._flagged(self.pages.incidents(request, caller.peer))
            case Hangs():
                return self.hangs.hangs(request, caller.peer)
            case Respond() | Evidence() | Unblocked():
                return self.arming.respond(request, caller)
            case MapPage():
                self.page_for(request, caller, now)
                return PageMapped(id=request.id, page=request.page, now=int(now * 1_000_000))
            case _:
                assert_never(request)

    def page_for(self, request: MapPage, caller: Caller[P], now: float) -> PageRef:
        """The slot page ``request`` names, of the caller's own process (its
        descriptor goes with the reply: `watchdogd.runtime.server`)."""
        process = self.arming.caller_itself(caller, now)
        try:
            page = self.slots.page_for(process, request.page)
        finally:
            process.close()
        if page is None:
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"no slot page {request.page} of this process; an arm that asks for a "
                "slot gets one",
            )
        return page

    def _flagged(self, reply: IncidentsReply | IncidentReply) -> IncidentsReply | IncidentReply:
        """``reply`` with each incident whose job repeats its hang flagged so."""
        if isinstance(reply, IncidentsReply):
            return msgspec.structs.replace(reply, incidents=self.hangs.flag(reply.incidents))
        [flagged] = self.hangs.flag([reply.incident])
        return msgspec.structs.replace(reply, incident=flagged)

    def metrics_text(self, reader: int | None = ROOT) -> str:
        """`Pages.metrics_text`, with the jobs marked repeating that ``reader`` may see."""
        self.metrics.jobs_repeating = self.hangs.gauge(reader)
        self.metrics.repeating = len(self.repeats.marked())
        return self.pages.metrics_text(reader)

    # What the incident log tells the service.

    def _evidence_trimmed(self, uid: int, size: int) -> None:
        """``size`` bytes of ``uid``'s incidents' evidence went to fit its budget:
        counted, and a line (rate-limited per uid) says so."""
        self.metrics.evidence_trimmed += size
        self.log.log(
            (uid, "evidence_trimmed"),
            Level.WARNING,
            lambda: logfmt(
                "evidence_trimmed", uid=uid, bytes=size, kept=self.incidents.budget.held(uid)
            ),
        )

    def _verdict_settled(
        self, incident: IncidentInfo, decision: Decision | None, ranks: list[RankInfo]
    ) -> tuple[str, str]:
        """An incident's verdict settled: counted by kind, an event of its owner's,
        and its hang counted toward its job's repeats (`JobHangs.settled`)."""
        if decision is None:
            return self.hangs.settled(incident, decision, ranks)
        verdict = for_viewer(decision, nobody)
        self.metrics.verdicts[verdict.kind] += 1
        here = [c for c in verdict.culprits if c.host == self.incidents.host]
        recorded = self.events.record(
            EventInfo(
                seq=0,
                kind="verdict",
                time=self._wall(),
                pid=here[0].pid if here else 0,
                uid=incident.uid,
                scope=incident.scope,
                policy="",
                job=incident.job,
                rank=verdict.culprits[0].rank if verdict.culprits else None,
                incident=incident.id,
                note=verdict.text,
                outcome=verdict.kind,
            )
        )
        return self.hangs.settled(incident, decision, ranks, recorded.seq)

    # The state.

    def snapshot(self) -> list[Timer]:
        """Every timer the state must hold: the armed ones and the firing ones."""
        return [*self.table.timers(), *self.firing.timers()]

    # The daemon's own events.

    def storage_changed(self, degraded: bool, reason: str) -> None:
        """The state store stopped (or started again) making changes durable."""
        if degraded:
            note = (
                f"the state cannot be written ({reason}); timers are protected from "
                "memory, and replies say their change is not durable, until it can"
            )
        else:
            note = "the state can be written again, and holds every timer once more"
        kind = "state_degraded" if degraded else "state_restored"
        self.events.record_daemon(kind, note, pid=self.daemon_pid, time=self._wall())

    def record_reload(self, ok: bool, note: str) -> None:
        """A reload of the config file was applied, or refused (``ok`` False)."""
        self.metrics.reloads["ok" if ok else "failed"] += 1
        kind = "reloaded" if ok else "reload_failed"
        self.events.record_daemon(kind, note, pid=self.daemon_pid, time=self._wall())
