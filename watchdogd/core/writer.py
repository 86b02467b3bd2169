"""The one writer of the timers: every change of the timer table and of the
firing timers the state keeps goes through `TableWriter`, which journals it and
moves the scheduler's next wake-up, so that no part can forget either.

Invariants:

- The parts of the core (`watchdogd.core.context.CoreContext`) read the table
  through `TableView`, which has no method that changes it: a change made
  anywhere but here fails the type check.
- Each method makes the journal records its change needs, in the order the
  state's recovery relies on (an expiry's armed record dropped and its firing
  record put in one journal record: `fired`), and nothing else; the journal
  decides when they are written (`Journal.commit_soon`, or the reply that
  acknowledges them).
- A timer that comes into the table, or whose deadline changes, moves the next
  wake-up to its deadline; one that leaves it never does: the scheduler finds
  the next deadline after it by itself (`next_deadline`).
- Two changes are not journaled, by design: a deadline moved in memory only
  (`moved`: a look at a fast-path slot, which the state rebuilds from the slot
  itself, and a restored timer held for the restart's grace, whose state record
  says until when), and the table emptied at a stop (`clear`: its timers stay in
  the store for the next start). A fast-path slot's registration is an arming,
  journaled as any (`arm`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

import msgspec

from .ports import Journal, P, TargetProcess
from .timers import Expired, SlotRef, Timer, TimerTable, Watch

P_co = TypeVar("P_co", bound=TargetProcess, covariant=True)


class TableView(Protocol[P_co]):
    """What the parts of the core may read of the timer table
    (`watchdogd.core.timers.TimerTable`): all of it, and no change."""

    @property
    def jobs_changed(self) -> int: ...
    @property
    def process_count(self) -> int: ...
    def __len__(self) -> int: ...
    def owned_by(self, uid: int) -> int: ...
    def process(self, pid: int) -> P_co | None: ...
    def get(self, pid: int, scope: str) -> Timer | None: ...
    def job_pids(self, owner: int, job: str) -> list[int]: ...
    def job_keys(self) -> Iterator[tuple[int, str]]: ...
    def jobs(self) -> dict[tuple[int, str], int]: ...
    def timers_of(self, pid: int) -> list[Timer]: ...
    def timers(self) -> Iterator[Timer]: ...
    def soonest(self, after: tuple[float, int] | None = None) -> Iterator[Timer]: ...
    def visible_to(self, uid: int) -> Iterator[Timer]: ...
    def next_deadline(self) -> float | None: ...
    def shared_scope(self, scope: str) -> str: ...


class TableWriter(Generic[P]):
    """Every change of the timers the state keeps, journaled, with the wake-up
    it moves (``wake``: `watchdogd.runtime.scheduler.Scheduler.notify`)."""

    __slots__ = ("_journal", "_table", "_wake")

    def __init__(
        self, table: TimerTable[P], journal: Journal, wake: Callable[[float], None]
    ) -> None:
        self._table = table
        self._journal = journal
        self._wake = wake

    @property
    def table(self) -> TableView[P]:
        """The table, to read."""
        return self._table

    @property
    def degraded(self) -> bool:
        """Whether the journal makes changes durable no longer (a failing disk)."""
        return self._journal.degraded

    @property
    def errors(self) -> int:
        """The journal's writes that failed."""
        return self._journal.errors

    def next_deadline(self) -> float | None:
        """When the scheduler must wake next: the soonest deadline armed."""
        return self._table.next_deadline()

    # Arming and releasing.

    def arm(
        self,
        process: P,
        scope: str,
        *,
        rewatch: Callable[[Watch | None], Watch] | None = None,
        timeout: float,
        policy: str,
        uid: int,
        owner: int,
        now: float,
        exit_releases: bool,
        watch: Watch | SlotRef | None,
        deadline: float,
    ) -> tuple[Timer, bool]:
        """`TimerTable.arm`, journaled; ``rewatch`` makes the `Watch` the timer is
        kept with from the one it was armed with (what the kernel says of its
        process, for the starvation rule), after it is in the table. A fast-path
        registration is armed here too: its record holds its slot."""
        timer, rearmed = self._table.arm(
            process,
            scope,
            timeout=timeout,
            policy=policy,
            uid=uid,
            owner=owner,
            now=now,
            exit_releases=exit_releases,
            watch=watch,
            deadline=deadline,
        )
        if rewatch is not None:
            watched = msgspec.structs.replace(timer, watch=rewatch(timer.as_watch))
            timer = self._table.put(process, watched)
        self._journal.put(timer)
        self._wake(timer.deadline)
        return timer, rearmed

    def disarm(self, pid: int, scope: str, arm: int = 0) -> tuple[Timer | None, P | None]:
        """`TimerTable.disarm`, journaled."""
        timer, gone = self._table.disarm(pid, scope, arm)
        if timer is not None:
            self._journal.drop(timer)
        return timer, gone

    def rearm(self, process: P, timer: Timer, *, commit: bool = False) -> Timer:
        """``timer`` (taken out, or armed) held again on its own deadline, and
        journaled so (written soon with ``commit``); returns it as held."""
        held = self._table.put(process, timer)
        self._journal.put(held, soon=commit)
        self._wake(held.deadline)
        return held

    def moved(self, process: P, timer: Timer) -> Timer:
        """``timer`` back in the table on a deadline the state need not keep: the
        next look at a fast-path slot (the state keeps an earlier look, never a
        later one, and the slot says the rest), or the end of a restored timer's
        grace (which its record says). Not journaled, by design."""
        held = self._table.put(process, timer)
        self._wake(held.deadline)
        return held

    # Expiry: firing timers, in the state until their policy has run.

    def pop_due(self, now: float, limit: int | None = None) -> list[Expired[P]]:
        """`TimerTable.pop_due`. Not journaled here: what a taken timer becomes
        is (`fired`, `rearm`, `moved`, `dropped`)."""
        return self._table.pop_due(now, limit)

    def fired(self, armed: Timer, firing: Timer, *, commit: bool = False) -> None:
        """``armed``, taken out, is ``firing`` now: the armed record and the firing
        one go out in the same journal record, so a crash leaves one of the two,
        never neither. Written soon with ``commit``."""
        self._journal.put(firing, replacing=armed, soon=commit)

    def record(self, timer: Timer, *, commit: bool = False) -> None:
        """A record of ``timer`` that is not the table's: a firing timer (a
        peer's run, a step of its policy), or a held timer's arming. Written soon
        with ``commit``."""
        self._journal.put(timer, soon=commit)

    def dropped(self, timers: Iterable[Timer], *, commit: bool = True) -> int:
        """``timers`` left the state (their policy ended, their registration or
        process went); written soon when any did and ``commit``. How many."""
        gone = tuple(timers)
        self._journal.drop(*gone, soon=commit)
        return len(gone)

    def commit_soon(self) -> None:
        """Have the changes made so far written soon, though no reply waits for
        them (a pass of expiries)."""
        self._journal.commit_soon()

    # Restarts, exits and the stop.

    def restore(self, groups: list[tuple[P, list[Timer]]], dropped: Iterable[Timer]) -> None:
        """`TimerTable.restore` of what the state held, ``dropped`` out of it."""
        self._table.restore(groups)
        self._settle(dropped)

    def merge(self, later: TimerTable[P], dropped: Iterable[Timer]) -> tuple[list[P], list[Timer]]:
        """`TimerTable.merge` of the rest of a restart's load; ``dropped`` and
        the timers the merge leaves out go out of the state."""
        taken, left_out = self._table.merge(later)
        self._settle([*dropped, *left_out])
        return taken, left_out

    def _settle(self, dropped: Iterable[Timer]) -> None:
        self._journal.drop(*dropped)
        earliest = self._table.next_deadline()
        if earliest is not None:
            self._wake(earliest)
        self._journal.commit_soon()

    def forget(self, pid: int) -> tuple[P, list[Timer]] | None:
        """`TimerTable.forget` (the process exited), journaled."""
        forgotten = self._table.forget(pid)
        if forgotten is not None:
            self.dropped(forgotten[1])
        return forgotten

    def clear(self) -> list[P]:
        """`TimerTable.clear` (the daemon stops). Not journaled, by design: the
        timers stay in the store for the next start."""
        return self._table.clear()
