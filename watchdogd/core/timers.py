"""The table of armed timers, keyed by ``(pid, scope)``.

Pure and synchronous: times are passed in by the caller, on one monotonic clock, and
processes are opaque handles. Invariants:

- Every armed timer is in the deadline heap under its key, and every key in the heap
  is an armed timer.
- A process is in the table exactly while it has at least one armed timer. The
  table holds one handle per process (not per timer); the methods that take a process
  out of the table return its handle so the caller can stop watching it and close it.
- ``owner`` counts (timers per arming uid) always equal a recount of the timers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import msgspec

from .heap import DeadlineHeap


class ProcessRef(Protocol):
    """What the table needs of a process handle."""

    @property
    def pid(self) -> int: ...
    @property
    def start_time(self) -> int: ...


P = TypeVar("P", bound=ProcessRef)
Key = tuple[int, str]
#: Where the state keeps a timer: its key, and 0 while it is armed or its firing
#: number once it fell due (so a firing record and a re-arm of the same key coexist).
StoreKey = tuple[int, str, int]


class Timer(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    array_like=True,
    gc=False,
    order=True,
):
    """One timer: the in-memory and the stored form alike.

    ``uid`` is the target process's uid, ``owner`` the uid of the caller that armed
    it, ``start_time`` its process's start (clock ticks since boot, which tells a
    recycled pid apart); times are on the table's monotonic clock. An armed timer
    has ``firing`` 0. A timer that fell due keeps its record, with a ``firing``
    number of its own, the index of the policy ``step`` in progress and, during a
    wait, when that wait ends (``step_end``), until its policy has finished.

    Timers order by ``(deadline, seq)``, their first two fields (``order=True``
    compares fields in turn, in C). ``seq`` numbers the timers in the order they
    were armed.

    (A Struct without GC tracking: one is made per acquire, and it holds only
    scalars. Stored as the array of its fields in this order, schema 3 of
    `watchdogd.store`: a change of the fields or of their order is a new schema,
    and the store still reads the old ones.)
    """

    deadline: float
    seq: int = 0
    pid: int
    scope: str
    policy: str
    uid: int
    owner: int
    timeout: float
    armed_at: float
    start_time: int = 0
    #: Its process's exit releases it quietly (see `Acquire.exit_releases`).
    exit_releases: bool = False
    firing: int = 0
    step: int = 0
    step_end: float = 0.0
    fired_at: float = 0.0
    #: The `Policy.plan` of the policy that fired it: a policy changed or removed
    #: by the time a restart resumes it starts again from its first step.
    plan: int = 0

    @property
    def key(self) -> Key:
        return (self.pid, self.scope)

    @property
    def store_key(self) -> StoreKey:
        return (self.pid, self.scope, self.firing)


@dataclass(slots=True)
class _Tracked(Generic[P]):
    process: P
    scopes: dict[str, Timer] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Expired(Generic[P]):
    """A timer that reached its deadline, with its process. ``orphaned`` says the
    process left the table with it (it had no other timer)."""

    timer: Timer
    process: P
    orphaned: bool


class TimerTable(Generic[P]):
    """Armed timers, their deadlines, and the processes they belong to."""

    __slots__ = ("_by_owner", "_deadlines", "_next_seq", "_processes")

    def __init__(self) -> None:
        self._deadlines: DeadlineHeap[Key] = DeadlineHeap()
        self._processes: dict[int, _Tracked[P]] = {}
        self._by_owner: Counter[int] = Counter()
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._deadlines)

    @property
    def process_count(self) -> int:
        return len(self._processes)

    def owned_by(self, uid: int) -> int:
        """How many timers ``uid`` has armed."""
        return self._by_owner[uid]

    def process(self, pid: int) -> P | None:
        """The handle held for ``pid``, or None when it has no timer."""
        tracked = self._processes.get(pid)
        return None if tracked is None else tracked.process

    def get(self, pid: int, scope: str) -> Timer | None:
        tracked = self._processes.get(pid)
        return None if tracked is None else tracked.scopes.get(scope)

    def timers(self) -> Iterator[Timer]:
        """Every armed timer, in no particular order."""
        for tracked in self._processes.values():
            yield from tracked.scopes.values()

    def next_deadline(self) -> float | None:
        return self._deadlines.next_deadline()

    def arm(
        self,
        process: P,
        scope: str,
        *,
        timeout: float,
        policy: str,
        uid: int,
        owner: int,
        now: float,
        exit_releases: bool = False,
    ) -> tuple[Timer, bool]:
        """Arm or re-arm ``(process.pid, scope)``; returns the timer and whether it
        replaced one. A process new to the table is added with it; a process already
        in the table must be passed as the same handle."""
        timer = Timer(
            pid=process.pid,
            scope=scope,
            policy=policy,
            uid=uid,
            owner=owner,
            timeout=timeout,
            armed_at=now,
            deadline=now + timeout,
            start_time=process.start_time,
            seq=self._next_seq,
            exit_releases=exit_releases,
        )
        self._next_seq += 1
        return timer, self._insert(process, timer)

    def restore(self, stored: Iterable[tuple[P, list[Timer]]]) -> None:
        """Put back armed timers read from the state, by process (each process
        new to the table, each scope once), on their original deadlines, keeping
        their numbers (later timers are numbered above them). In bulk, with one
        heapify: a restart loads a million."""
        keys: list[Key] = []
        deadlines: list[float] = []
        top = self._next_seq - 1
        for process, timers in stored:
            if process.pid in self._processes:
                raise ValueError(f"pid {process.pid} is in the table already")
            scopes = {timer.scope: timer for timer in timers}
            if len(scopes) != len(timers):
                raise ValueError(f"pid {process.pid}: a scope is restored twice")
            self._processes[process.pid] = _Tracked(process, scopes)
            self._by_owner.update(timer.owner for timer in timers)
            keys += [(timer.pid, timer.scope) for timer in timers]
            deadlines += [timer.deadline for timer in timers]
            top = max(top, *(timer.seq for timer in timers))
        self._deadlines.set_many(keys, deadlines)
        self._next_seq = top + 1

    def _insert(self, process: P, timer: Timer) -> bool:
        pid = process.pid
        tracked = self._processes.get(pid)
        if tracked is None:
            tracked = self._processes[pid] = _Tracked(process)
        elif tracked.process is not process:
            raise ValueError(f"pid {pid} is already tracked with another handle")
        previous = tracked.scopes.get(timer.scope)
        if previous is not None:
            self._by_owner[previous.owner] -= 1
        tracked.scopes[timer.scope] = timer
        self._by_owner[timer.owner] += 1
        self._deadlines.set(timer.key, timer.deadline)
        return previous is not None

    def disarm(self, pid: int, scope: str) -> tuple[Timer | None, P | None]:
        """Disarm ``(pid, scope)``. Returns the timer (None if none was armed) and the
        process handle if it left the table (its last timer went)."""
        tracked = self._processes.get(pid)
        if tracked is None:
            return None, None
        timer = tracked.scopes.pop(scope, None)
        if timer is None:
            return None, None
        self._deadlines.remove(timer.key)
        self._uncount(timer.owner)
        if tracked.scopes:
            return timer, None
        del self._processes[pid]
        return timer, tracked.process

    def pop_due(self, now: float, limit: int | None = None) -> list[Expired[P]]:
        """Take out every timer whose deadline is ``<= now`` (the earliest ``limit``
        of them, when given), earliest first."""
        expired: list[Expired[P]] = []
        for (pid, scope), _ in self._deadlines.pop_due(now, limit):
            tracked = self._processes[pid]
            timer = tracked.scopes.pop(scope)
            self._uncount(timer.owner)
            orphaned = not tracked.scopes
            if orphaned:
                del self._processes[pid]
            expired.append(Expired(timer, tracked.process, orphaned))
        return expired

    def forget(self, pid: int) -> tuple[P, list[Timer]] | None:
        """Take out a process and all its timers (it exited)."""
        tracked = self._processes.pop(pid, None)
        if tracked is None:
            return None
        timers = list(tracked.scopes.values())
        for timer in timers:
            self._deadlines.remove(timer.key)
            self._uncount(timer.owner)
        return tracked.process, timers

    def _uncount(self, owner: int) -> None:
        remaining = self._by_owner[owner] - 1
        if remaining:
            self._by_owner[owner] = remaining
        else:
            del self._by_owner[owner]
