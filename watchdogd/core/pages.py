"""The query pages: status, events, why, suggest, incidents, policies and metrics.

Each page shows what its caller may see and fits in one reply. Invariants:

- A non-root caller sees only the timers on its own uid's processes or that it
  armed, the events of its own uid, and the incidents of its own jobs.
- The output of a hook (``exec`` and ``dump`` steps) is shown to root only: it ran
  with the daemon's privileges and may say anything the daemon can read. Everyone
  else who may see the event sees each step and its result (the exit status). The
  record keeps the output; only the reply to a non-root caller leaves it out.
- A page stops before it would take the reply past `MAX_REPLY_BYTES`: each entry's
  encoded size is bounded from above, so the bound holds without encoding twice.
- A cursor is only what a page wrote; anything else is refused, never trusted.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final, Generic

import msgspec

from watchdogd_protocol import (
    MAX_COMMAND_BYTES,
    MAX_JOB_BYTES,
    MAX_REPLY_BYTES,
    DaemonInfo,
    ErrorCode,
    EventInfo,
    Events,
    EventsReply,
    Incident,
    IncidentReply,
    Incidents,
    IncidentsReply,
    Policies,
    PoliciesReply,
    PolicyInfo,
    Status,
    StatusReply,
    StepResult,
    Suggest,
    SuggestionInfo,
    SuggestReply,
    TimerInfo,
    Why,
    WhyReply,
    WhyTimer,
)

from .._version import __version__
from ..errors import Refusal
from .bridge import FleetBridge
from .counters import Counters
from .firing import Firing
from .identity import ROOT, Peer
from .policies import placeholders, step_name
from .ports import P
from .slots import Slots
from .timer_requests import Arming
from .timers import Timer, Watch

if TYPE_CHECKING:
    from .context import CoreContext

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
#: How long a command line read for a status page is shown again without being
#: read again (`_CommandLines`).
_COMMAND_SECONDS: Final = 1.0
#: A status cursor: a deadline as ``repr`` writes a float, then its timer's sequence
#: number.
_CURSOR: Final = re.compile(r"(?P<deadline>-?[0-9][0-9.e+-]{0,31})/(?P<seq>[0-9]{1,19})")
_MAX_SEQ: Final = 2**63 - 1


class Pages(Generic[P]):
    """The answers to the requests that only read."""

    def __init__(
        self,
        context: CoreContext[P],
        *,
        firing: Firing[P],
        arming: Arming[P],
        slots: Slots[P],
        fleet: FleetBridge[P],
        render_metrics: Callable[[Counters, Mapping[str, tuple[str, float]]], str],
    ) -> None:
        """``render_metrics`` writes the metrics page (`watchdogd.runtime.metrics`)."""
        self._rules = context.rules
        self._writer = context.writer
        self._table = context.table
        self._processes = context.processes
        self._firing = firing
        self._arming = arming
        self._slots = slots
        self._fleet = fleet
        self._events = context.events
        self._history = context.history
        self._incidents = context.incidents
        self._metrics = context.metrics
        self._render_metrics = render_metrics
        self._daemon_pid = context.daemon_pid
        self._started = context.started
        self._command_lines: _CommandLines[P] = _CommandLines()

    def status(self, request: Status, peer: Peer, now: float) -> StatusReply:
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
            page = list(itertools.islice(self._table.soonest(after), request.limit + 1))
        else:
            visible = self._table.visible_to(peer.uid)
            if after is not None:
                visible = (timer for timer in visible if (timer.deadline, timer.seq) > after)
            page = heapq.nsmallest(request.limit + 1, visible)
        timers, commands, taken = self._status_timers(page[: request.limit], now)
        self._command_lines.forget_old(now, keep=self._table.process_count)
        cursor = None
        if taken < len(page):
            last = page[taken - 1]
            cursor = f"{last.deadline!r}/{last.seq}"
        return StatusReply(
            id=request.id,
            daemon=self.info(now),
            timers=timers,
            cursor=cursor,
            commands=commands,
        )

    def _status_timers(
        self, page: list[Timer], now: float
    ) -> tuple[list[TimerInfo], dict[int, str], int]:
        """The entries of a status page for ``page``, the command lines they
        name, and how many of ``page`` they take, as many as fit in the page's
        room (`status`)."""
        room = _STATUS_PAGE_BYTES
        commands: dict[int, str] = {}
        timers: list[TimerInfo] = []
        taken = 0
        for timer in page:
            deadline = self._deadline(timer, now)
            if deadline is None:
                taken += 1  # a registered scope's slot holds no block: none armed
                continue
            cost = _TIMER_BYTES + len(timer.scope.encode()) + len(timer.policy.encode())
            job, rank = (
                ("", None) if timer.watched is None else (timer.watched.job, timer.watched.rank)
            )
            if job:
                cost += MAX_JOB_BYTES
            command = None
            if timer.pid not in commands:
                process = self._table.process(timer.pid)
                command = (
                    "?"
                    if process is None
                    else self._command_lines.get(process, now, self._processes.command)
                )
                cost += _COMMAND_BYTES + len(command.encode())
            if cost > room and timers:
                break
            taken += 1
            room -= cost
            if command is not None:
                commands[timer.pid] = command
            timers.append(
                TimerInfo(
                    pid=timer.pid,
                    scope=timer.scope,
                    remaining=max(0.0, deadline - now),
                    policy=timer.policy,
                    uid=timer.uid,
                    job=job,
                    rank=rank,
                )
            )
        return timers, commands, taken

    def _deadline(self, timer: Timer, now: float) -> float | None:
        """``timer``'s deadline: a registered scope's read from its slot ``now``
        (None while it holds no block that is known: `Slots.deadline_of`)."""
        if timer.slot is None:
            return timer.deadline
        return self._slots.deadline_of(timer, now)

    def incidents(
        self, request: Incidents | Incident, peer: Peer
    ) -> IncidentsReply | IncidentReply:
        """The incidents ``peer`` may see, or one of them."""
        if isinstance(request, Incidents):
            listing = self._incidents.listing(peer.uid, request.limit)
            return IncidentsReply(id=request.id, incidents=listing)
        found = self._incidents.get(request.incident, peer.uid, peer.gid)
        if found is None:
            raise Refusal(
                ErrorCode.NO_SUCH_INCIDENT,
                f"no incident {request.incident!r} that you may see; "
                "watchdogctl incidents lists them",
            )
        return IncidentReply(id=request.id, incident=found)

    def suggest(self, request: Suggest, peer: Peer, now: float) -> SuggestReply:
        """A page of what history says, the caller's own uid's (root: all), cut
        to fit a reply like a status page; the blocks the slots of the fast path
        counted are harvested first, within each owner's share of rows, so every
        block released so far counts unless its uid's harvests are past it."""
        uid = None if peer.uid == ROOT else peer.uid
        if not request.cursor:
            self._slots.harvest_all(now, uid)
        rows = self._history.suggestions(uid, request.cursor)
        page: list[SuggestionInfo] = []
        room = _STATUS_PAGE_BYTES
        cursor: int | None = None
        for index, row in enumerate(rows):
            cost = _SUGGESTION_BYTES + len(row.executable.encode()) + len(row.scope.encode())
            if len(page) == request.limit or (cost > room and page):
                cursor = request.cursor + index
                break
            room -= cost
            page.append(row)
        return SuggestReply(
            id=request.id,
            suggestions=page,
            min_samples=self._history.min_samples,
            margin=self._history.margin,
            cursor=cursor,
        )

    def why(self, request: Why, peer: Peer, now: float) -> WhyReply:
        """What the daemon knows about process ``request.pid``, as ``peer`` may see it."""
        pid = request.pid
        process = self._table.process(pid)

        def mine(timer: Timer) -> bool:
            return peer.uid in (ROOT, timer.uid, timer.owner)

        armed = [] if process is None else self._table.timers_of(pid)
        held = [timer for timer in armed if mine(timer) and self._deadline(timer, now) is not None]
        held += [timer for timer in self._firing.of_pid(pid) if mine(timer)]
        shown = held[: request.limit]
        timers = [self._why_timer(timer, now) for timer in shown]
        events = self._events.about(pid, request.limit, peer.uid)
        if peer.uid != ROOT:
            events = [_without_output(event) for event in events]
        suggestions: list[SuggestionInfo] = []
        executable = ""
        if process is not None and held:
            executable = self._processes.executable(process)
            for scope in sorted({timer.scope for timer in shown}):
                row = self._history.suggestion((process.uid, executable, scope))
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
            incidents=self._incidents.about(pid, peer.uid)[-request.limit :],
        )

    def _why_timer(self, timer: Timer, now: float) -> WhyTimer:
        watch = timer.watched
        firing = ""
        if timer.firing:
            policy, _ = self._rules.policy_for(timer.policy)
            steps = policy.steps
            firing = (
                f"step {timer.step + 1} of {len(steps)}: "
                + step_name(steps[timer.step], placeholders(timer.pid, timer.scope))
                if timer.step < len(steps)
                else "finishing"
            )
        deadline = timer.deadline if timer.firing else self._deadline(timer, now)
        return WhyTimer(
            scope=timer.scope,
            policy=timer.policy,
            remaining=max(0.0, (timer.deadline if deadline is None else deadline) - now),
            timeout=timer.timeout,
            armed=now - timer.armed_at,
            due="stalled" if timer.stalled else "timeout",
            owner=timer.owner,
            timeout_from="" if watch is None else watch.timeout_from,
            progress=None if watch is None else watch.progress,
            progressed=None if watch is None else now - watch.progressed_at,
            stall=0.0 if watch is None else watch.stall,
            firing=firing,
            notes=_why_notes(timer.as_watch),
        )

    def info(self, now: float) -> DaemonInfo:
        """The daemon summary sent with status."""
        return DaemonInfo(
            version=__version__,
            pid=self._daemon_pid,
            uptime=now - self._started,
            timers=len(self._table) - self._slots.released_count(),
            processes=self._table.process_count,
            connections=self._arming.connections,
            requests=self._metrics.requests_total,
            expired=self._metrics.expired,
            exited=self._metrics.exited,
            state_degraded=self._writer.degraded,
            fleet=self._fleet.state,
        )

    def status_line(self) -> str:
        """The daemon's status in one line, for its service manager (sd_notify's
        ``STATUS=``): the timers and processes held, the connections, and the
        state and the fleet when something is wrong with them or there is one."""
        line = (
            f"{len(self._table)} timers on {self._table.process_count} processes, "
            f"{self._arming.connections} connections"
        )
        if self._writer.degraded:
            line = "DEGRADED: the state cannot be written, timers are in memory only; " + line
        if self._fleet.state:
            line += f"; fleet {self._fleet.state}"
        return line

    def events(self, request: Events, peer: Peer) -> EventsReply:
        events = self._events.page(request.after, request.limit, peer.uid)
        if peer.uid != ROOT:
            events = [_without_output(event) for event in events]
        last = events[-1].seq if events else self._events.last
        return EventsReply(id=request.id, events=events, last=last)

    def policies(self, request: Policies) -> PoliciesReply:
        infos = [
            PolicyInfo(
                name=policy.name,
                target=policy.target,
                steps=policy.describe(),
                root_only=policy.root_only,
                builtin=policy.builtin,
                stall=policy.stall,
                peers=policy.peers,
            )
            for policy in sorted(self._rules.policies.values(), key=lambda policy: policy.name)
        ]
        return PoliciesReply(id=request.id, policies=infos, default=self._rules.default_policy)

    def metrics_text(self, reader: int | None = ROOT) -> str:
        """The metrics and the current gauges, as the renderer given at start
        writes them (the Prometheus text format, `watchdogd.runtime.metrics.exposition`).
        The series that name jobs and their owners' uids name, for a ``reader``
        that is root, every job; for another uid, its own jobs; for None (a page
        anyone may read), none."""
        jobs = self._table.jobs()
        if reader != ROOT:
            jobs = {key: n for key, n in jobs.items() if reader is not None and key[0] == reader}
        self._metrics.job_processes = _top_jobs(jobs, Counters.JOB_LABELS)
        # A policy that may extend a timer has its series from the start, at 0, so
        # that a rate over it is a number before the first extension.
        for policy in self._rules.policies.values():
            if policy.starvation_grace:
                self._metrics.extensions.setdefault(policy.name, 0)
        return self._render_metrics(
            self._metrics,
            {
                "timers_armed": (
                    "Timers armed now (a scope registered for the fast path while its "
                    "slot holds a block).",
                    len(self._table) - self._slots.released_count(),
                ),
                "slots_registered": (
                    "Scopes registered for the fast path now, whose blocks arm and "
                    "release by stores into their process's slot page.",
                    len(self._slots),
                ),
                "processes_watched": (
                    "Processes with timers armed now.",
                    self._table.process_count,
                ),
                "connections_open": ("Connections open now.", self._arming.connections),
                "events_kept": ("Events kept in memory now.", len(self._events)),
                "state_write_failures": (
                    "Writes of the state file that failed since start.",
                    self._writer.errors,
                ),
                "state_degraded": (
                    "1 while the state cannot be written: timers are kept in memory only.",
                    int(self._writer.degraded),
                ),
                "expiries_in_progress": (
                    "Expired timers whose policy is still being carried out.",
                    len(self._firing),
                ),
                "dumps_running": ("Dump steps running now.", self._metrics.dumps_running),
                "dumps_waiting": (
                    "Dump steps waiting for a turn now: at most max_dumps run at once.",
                    self._metrics.dumps_waiting,
                ),
                "dumps_max": (
                    "Dump steps run at once at most (max_dumps).",
                    self._rules.daemon.max_dumps,
                ),
                **self._fleet.gauges(),
            },
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


def _why_notes(watch: Watch) -> list[str]:
    """What `Why` says of a timer beyond its fields: its job, and any extension."""
    notes = []
    if watch.job:
        rank = "" if watch.rank is None else f" as rank {watch.rank}"
        notes.append(f"of job {watch.job}{rank}")
    if watch.baseline is not None and not watch.extended:
        notes.append("its policy judges starvation at its deadline (measured when armed)")
    if watch.extended:
        notes.append(f"given {watch.extended:g}s more as starved (its extended event says why)")
    if watch.slot is not None:
        notes.append(
            f"armed and released by stores into its slot page (slot {watch.slot.index}, "
            f"read at least every {watch.slot.period:.3g}s)"
        )
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
    Only what `Pages.status` writes is one: a finite deadline and a sequence
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
