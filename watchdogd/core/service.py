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

They share the timer table, the config in force (`watchdogd.core.rules`), the
events ring, the incident log, the history and the counters, each passed to the
parts that need it. `Service` keeps the calls the runtime makes under one name
each, and does nothing itself but dispatch and the daemon's own events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, assert_never

import msgspec

from watchdogd_protocol import (
    Acquire,
    ErrorCode,
    EventInfo,
    Events,
    Evidence,
    GroupState,
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
    Responding,
    Status,
    Suggest,
    Unblocked,
    Why,
)

from ..errors import Refusal
from .bridge import FleetBridge
from .config import Config, DaemonConfig
from .counters import Counters
from .events import EventLog
from .firing import Due, Firing
from .hangs import JobHangs
from .history import History
from .identity import ROOT, Peer
from .incidents import IncidentLog
from .lifecycle import Later, Lifecycle, Restored
from .logline import Level, LogSink, NullSink, RateLimitedLog, Throttle, logfmt
from .pages import Pages
from .policies import Policy
from .ports import Journal, NoPages, NullJournal, P, PagePort, PageRef, ProcessPort, TargetProcess
from .repeats import Repeats
from .responders import Responders
from .rules import Rules
from .slots import Slots
from .timer_requests import Arming, Caller
from .timers import Expired, Timer, TimerTable
from .unblocks import Unblocks
from .user_frames import Library
from .verdict import Decision, for_viewer, nobody

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
        stdlib: frozenset[str] = frozenset(),
        pages: PagePort[P] | None = None,
        monotonic: bool = False,
    ) -> None:
        """``stdlib``: the standard library's top-level module names
        (``sys.stdlib_module_names``), whose frames are not where a rank waits.
        ``pages`` makes the slot pages of the fast path, offered when ``monotonic``
        says the table's clock is CLOCK_MONOTONIC, the clock of a slot's deadlines."""
        daemon = config.daemon
        self.rules = Rules(config)
        self.table: TimerTable[P] = TimerTable()
        self.metrics = Counters()
        self.journal: Journal = NullJournal() if journal is None else journal
        #: The log of lines requests can cause, rate-limited per (uid, kind).
        self.log = RateLimitedLog(Throttle(clock=clock), NullSink() if log is None else log)
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
        self.incidents = IncidentLog(
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
        self.daemon_pid = daemon_pid
        self.started = now
        self._wall = wall
        self._clock = clock
        self._monotonic = monotonic
        self.slots = Slots(
            self.rules,
            self.table,
            processes,
            NoPages() if pages is None else pages,
            self.journal,
            history=self.history,
            metrics=self.metrics,
            log=self.log,
            on_deadline=on_deadline,
            offered=monotonic and daemon.fast_path,
        )
        #: This host's ranks owed a cut out of the collective they wait in.
        self.unblocks = Unblocks(
            self.incidents,
            self.responders,
            self.events,
            self.metrics,
            wall=wall,
            waited=config.fleet.unblock_after,
        )
        self.firing = Firing(
            self.rules,
            self.table,
            processes,
            self.journal,
            responders=self.responders,
            slots=self.slots,
            incidents=self.incidents,
            on_deadline=on_deadline,
            events=self.events,
            metrics=self.metrics,
            wall=wall,
            started=now,
        )
        self.lifecycle = Lifecycle(
            self.table,
            processes,
            self.journal,
            self.firing,
            slots=self.slots,
            on_deadline=on_deadline,
            events=self.events,
            metrics=self.metrics,
            wall=wall,
        )
        self.arming = Arming(
            self.rules,
            self.table,
            processes,
            self.journal,
            self.lifecycle,
            slots=self.slots,
            history=self.history,
            metrics=self.metrics,
            daemon_pid=daemon_pid,
            on_deadline=on_deadline,
            record_taken=self.firing.record_taken,
        )
        self.fleet = FleetBridge(
            self.table,
            self.firing,
            self.incidents,
            unblocks=self.unblocks,
            responders=self.responders,
            daemon_pid=daemon_pid,
            events=self.events,
            metrics=self.metrics,
            wall=wall,
        )
        self.hangs = JobHangs(
            self.repeats,
            self.incidents,
            holds=self.fleet.holds,
            events=self.events,
            wall=wall,
        )
        self.pages = Pages(
            self.rules,
            self.table,
            processes,
            self.journal,
            firing=self.firing,
            arming=self.arming,
            slots=self.slots,
            fleet=self.fleet,
            events=self.events,
            history=self.history,
            incidents=self.incidents,
            metrics=self.metrics,
            render_metrics=render_metrics,
            daemon_pid=daemon_pid,
            started=now,
        )

    # The config in force.

    @property
    def config(self) -> DaemonConfig:
        return self.rules.daemon

    @property
    def policies(self) -> Mapping[str, Policy]:
        return self.rules.policies

    @property
    def default_policy(self) -> str:
        return self.rules.default_policy

    def policy_for(self, name: str) -> tuple[Policy, str]:
        """`Rules.policy_for`."""
        return self.rules.policy_for(name)

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

    @property
    def connections(self) -> int:
        return self.arming.connections

    @property
    def restart_estimate(self) -> float:
        """Seconds a restart may take at the timer cap (set once the state loaded)."""
        return self.arming.restart_estimate

    @restart_estimate.setter
    def restart_estimate(self, seconds: float) -> None:
        self.arming.restart_estimate = seconds

    def open_connection(self, peer: Peer) -> Caller[P]:
        """`Arming.open_connection`."""
        return self.arming.open_connection(peer)

    def close_connection(self, caller: Caller[P]) -> None:
        """`Arming.close_connection`."""
        self.arming.close_connection(caller)

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
                return self._responding(request, caller)
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

    def _responding(self, request: Respond | Evidence | Unblocked, caller: Caller[P]) -> Responding:
        """A responder's `Respond`, which binds it to the exact process that opened
        its connection, alive (`Arming.connecting_process`); or its `Evidence` or
        `Unblocked`, taken only on the connection its process responds on now
        (whoever asked for it takes it from there: `watchdogd.runtime.asks`)."""
        if isinstance(request, Respond):
            process = self.arming.connecting_process(caller)
            self.responders.register(process, caller.peer.uid, request)
        elif caller.process is None or not self.responders.registered(caller.process):
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                "an answer to the daemon's ask is taken only on the connection a process "
                "responds on, after respond",
            )
        return Responding(id=request.id)

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

    # Expiry, as the runtime's executor of policies calls it.

    def expire_due(self, now: float, limit: int | None = None) -> list[Expired[P]]:
        """`Firing.expire_due`."""
        return self.firing.expire_due(now, limit)

    def take_due(self, now: float, limit: int | None = None) -> list[Expired[P] | Due[P]]:
        """`Firing.take_due`."""
        return self.firing.take_due(now, limit)

    def record_fired(self, due: Due[P]) -> Expired[P]:
        """`Firing.record`."""
        return self.firing.record(due)

    def expiry_finished(self, timer: Timer) -> None:
        """`Firing.finished`."""
        self.firing.finished(timer)

    @property
    def firing_count(self) -> int:
        """How many timers have their policy in progress."""
        return len(self.firing)

    def record_expiries(self, events: list[EventInfo]) -> None:
        """`Firing.record_expiries`."""
        self.firing.record_expiries(events)

    def dump_taken(
        self,
        timer: Timer,
        reader: tuple[int, int] | None,
        evidence: str = "",
        flight: Sequence[GroupState] = (),
    ) -> None:
        """`Firing.dump_taken`."""
        self.firing.dump_taken(timer, reader, evidence, flight)

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

    def settle_incidents(self) -> None:
        """`IncidentLog.tick`, now."""
        self.incidents.tick(self._wall())

    # The state, restarts and exits.

    def snapshot(self) -> list[Timer]:
        """Every timer the state must hold: the armed ones and the firing ones."""
        return [*self.table.timers(), *self.firing.timers()]

    def restore(self, timers: Iterable[Timer]) -> Restored[P]:
        """`Lifecycle.restore`."""
        return self.lifecycle.restore(timers)

    def prepare_later(self, timers: Iterable[Timer]) -> Later[P]:
        """`Lifecycle.prepare_later` (in a worker thread)."""
        return self.lifecycle.prepare_later(timers)

    def restore_later(self, later: Later[P]) -> Restored[P]:
        """`Lifecycle.restore_later`."""
        return self.lifecycle.restore_later(later)

    def process_exited(self, process: P) -> list[Timer]:
        """`Lifecycle.process_exited`."""
        return self.lifecycle.process_exited(process, self._clock())

    def close(self) -> None:
        """`Lifecycle.close`."""
        self.lifecycle.close()

    # The daemon's own events.

    @property
    def fleet_state(self) -> str:
        """The fleet as this host sees it: "" without one."""
        return self.fleet.state

    def fleet_changed(self, connected: bool, note: str) -> None:
        """`FleetBridge.fleet_changed`."""
        self.fleet.fleet_changed(connected, note)

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
