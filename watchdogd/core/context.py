"""The parts of the core that its parts share, as one object handed to each.

Arming, the pages, expiry, restarts and exits, the fast path's slots, the fleet
bridge and the jobs' hangs each take a `CoreContext` and the few parts of their
own kind they call (the pages call arming, say), rather than a dozen arguments
each: the config in force, the table through its one writer, the process port,
the events ring, the counters, the history, the incident log, the responders,
the rate-limited log, the wall clock, and the daemon's pid and start.

Invariants: one context a service, made before its parts and never changed
(frozen: no part swaps another's collaborator); it holds parts, never state of
its own; the table is read through it (`table`) and changed through its writer
alone (`watchdogd.core.writer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

from .counters import Counters
from .events import EventLog
from .history import History
from .incidents import IncidentLog
from .logline import RateLimitedLog
from .ports import P, ProcessPort
from .responders import Responders
from .rules import Rules
from .writer import TableView, TableWriter


@dataclass(frozen=True, slots=True, eq=False)
class CoreContext(Generic[P]):
    """What the core's parts share (`watchdogd.core.service.Service` makes it)."""

    #: The config in force: policies, limits.
    rules: Rules
    #: The one writer of the timer table and of the firing timers' records.
    writer: TableWriter[P]
    #: The system calls opening and watching a process takes.
    processes: ProcessPort[P]
    events: EventLog
    metrics: Counters
    history: History
    incidents: IncidentLog
    #: The processes that answer evidence requests, by job.
    responders: Responders
    #: The log of lines requests can cause, rate-limited per (uid, kind).
    log: RateLimitedLog
    #: The wall clock that stamps events.
    wall: Callable[[], float]
    daemon_pid: int
    #: When this daemon started, on the table's clock.
    started: float

    @property
    def table(self) -> TableView[P]:
        """The timer table, to read (`TableWriter` changes it)."""
        return self.writer.table
