"""How timers come back from the state after a restart and leave with their process.

Invariants:

- A restored timer is re-armed on its original deadline when its process is still
  there: the same pid with the same start time. Otherwise it is dropped (its
  process is gone or the pid belongs to another process now). Each timer is checked
  on its own: the pid may have been reused, and a firing record of the old process
  may sit beside timers of the new.
- A firing timer whose process is still there resumes at the step its policy had
  reached; one whose process is gone is recorded as an expiry whose target had
  gone, and is not signalled.
- A process that exits takes all its timers with it at once; the exit is recorded
  (``exited``) when it held any but those its exit releases (``exit_releases``),
  or registered scopes whose slot held no block (`watchdogd.core.slots`), whose
  pages are read a last time and let go.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Generic

from watchdogd_protocol import EventInfo

from ..errors import Refusal
from .firing import Firing
from .identity import Peer
from .ports import P
from .slots import Slots
from .timers import Expired, Timer, TimerTable

if TYPE_CHECKING:
    from .context import CoreContext

#: Scopes named in an ``exited`` event; the count covers the rest.
_LISTED_SCOPES: Final = 10


@dataclass(slots=True)
class Restored(Generic[P]):
    """What `Lifecycle.restore` put back: armed timers, dropped ones (their process
    is gone), and expiries whose policy resumes."""

    armed: int = 0
    dropped: int = 0
    resumed: list[Expired[P]] = field(default_factory=list)


@dataclass(slots=True)
class Later(Generic[P]):
    """The timers a restart loads after the first ones, made ready off the event
    loop (`Lifecycle.prepare_later`): a table of their own, the timers dropped
    (their process is gone), and every handle opened."""

    table: TimerTable[P]
    dropped: list[Timer] = field(default_factory=list)
    handles: list[P] = field(default_factory=list)


class Lifecycle(Generic[P]):
    """Restore from the state, exits, and the stop."""

    def __init__(self, context: CoreContext[P], firing: Firing[P], *, slots: Slots[P]) -> None:
        self._writer = context.writer
        self._table = context.table
        self._processes = context.processes
        self._firing = firing
        self._slots = slots
        self._events = context.events
        self._metrics = context.metrics
        self._wall = context.wall

    def restore(self, timers: Iterable[Timer]) -> Restored[P]:
        """Put back the timers read from the state (the daemon restarted): armed
        ones in the table, firing ones (with a retained handle) in ``resumed``
        for their policy to go on."""
        restored = Restored[P]()
        firing: list[tuple[Timer, P | None]] = []
        dropped: list[Timer] = []
        groups, handles = self._reopen_all(timers, firing, dropped)
        self._writer.restore(groups, dropped)
        for process, _ in groups:
            self._processes.track(process)
        restored.armed = sum(len(armed) for _, armed in groups)
        restored.dropped += len(dropped)
        self._firing.resume(timer for timer, _ in firing)
        for timer, target in firing:
            if target is None:
                self._record_gone_while_down(timer)
                self._firing.finished(timer)
                continue
            target.retain()
            restored.resumed.append(Expired(timer, target, orphaned=False))
        for process in handles:
            if self._table.process(process.pid) is not process:
                process.close()
        return restored

    def prepare_later(self, timers: Iterable[Timer]) -> Later[P]:
        """In a worker thread, while the daemon fires what `restore` put back:
        the armed timers a restart loads after the first ones (every one due
        after them), checked against their processes and ordered in a table of
        their own, which `restore_later` merges. Touches nothing of the running
        service: it opens handles and reads /proc, and that is all."""
        firing: list[tuple[Timer, P | None]] = []
        later = Later[P](table=TimerTable())
        groups, later.handles = self._reopen_all(timers, firing, later.dropped)
        if firing:
            raise ValueError("a firing timer is restored first, never later")
        later.table.restore(groups)
        return later

    def restore_later(self, later: Later[P]) -> Restored[P]:
        """Merge what `prepare_later` made ready into the table: the restart's
        load is complete."""
        restored = Restored[P](armed=len(later.table))
        taken, dropped = self._writer.merge(later.table, later.dropped)
        restored.armed -= len(dropped)
        for process in taken:
            self._processes.track(process)
        restored.dropped += len(later.dropped) + len(dropped)
        for process in later.handles:
            if self._table.process(process.pid) is not process:
                process.close()
        return restored

    def _reopen_all(
        self,
        timers: Iterable[Timer],
        firing: list[tuple[Timer, P | None]],
        dropped: list[Timer],
    ) -> tuple[list[tuple[P, list[Timer]]], list[P]]:
        """The armed ``timers`` whose process is still there, by process (a new
        handle on each), and every handle opened; firing ones go to ``firing``
        and the rest to ``dropped``."""
        by_pid: dict[int, list[Timer]] = {}
        for timer in timers:
            by_pid.setdefault(timer.pid, []).append(timer)
        handles: list[P] = []
        groups: list[tuple[P, list[Timer]]] = []
        for pid, held in by_pid.items():
            process = self._reopen(pid)
            if process is not None:
                handles.append(process)
            armed = self._sort_restored(process, held, firing, dropped)
            if process is not None and armed:
                groups.append((process, armed))
        return groups, handles

    def _record_gone_while_down(self, timer: Timer) -> None:
        self._metrics.expiries[(timer.policy, "gone")] += 1
        self._events.record(
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
        dropped: list[Timer],
    ) -> list[Timer]:
        """The armed timers of ``held`` that belong to ``process``; firing ones go
        to ``firing`` with the process, or None when theirs is gone; the rest to
        ``dropped``."""
        armed = []
        for timer in held:
            same = process is not None and process.start_time == timer.start_time
            if timer.firing:
                firing.append((timer, process if same else None))
            elif same:
                armed.append(timer)
            else:
                dropped.append(timer)
        return armed

    def _reopen(self, pid: int) -> P | None:
        """A handle on whatever process holds ``pid`` now, if any."""
        try:
            return self._processes.open(pid, Peer(pid=0, uid=0, gid=0))
        except Refusal:
            return None

    def close(self) -> None:
        """Drop every timer and the table's handles (the daemon is stopping). The
        journal is not told: the timers stay in the store for the next start, and
        so do the registrations, whose slots close."""
        self._slots.close_all()
        for process in self._writer.clear():
            self._processes.untrack(process)

    def process_exited(self, process: P, now: float) -> list[Timer]:
        """Drop every timer of a process that exited; returns them, and records the
        exit when it had any armed but those its exit releases (``exit_releases``)."""
        if self._table.process(process.pid) is not process:
            return []
        forgotten = self._writer.forget(process.pid)
        assert forgotten is not None
        _, timers = forgotten
        self._processes.untrack(process)
        armed = self._slots.exited(process, timers, now)
        held = [timer for timer in armed if not timer.exit_releases]
        if held:
            self._metrics.exited += 1
            self._events.record(
                EventInfo(
                    seq=0,
                    kind="exited",
                    time=self._wall(),
                    pid=process.pid,
                    uid=process.uid,
                    scope="",
                    policy="",
                    timers=len(held),
                    note=f"exited with {len(held)} timer{'' if len(held) == 1 else 's'} armed",
                    # As scopes, not in the note: a reader shows them as it shows
                    # any scope (watchdogctl: relative to its working directory).
                    scopes=sorted(timer.scope for timer in held)[:_LISTED_SCOPES],
                )
            )
        return timers
