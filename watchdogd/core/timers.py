"""The table of armed timers, keyed by ``(pid, scope)``.

Pure and synchronous: times are passed in by the caller, on one monotonic clock, and
processes are opaque handles. Invariants:

- Every armed timer is in the table's order (`Deadlines`, soonest first) and in its
  process's list of timers (sorted by scope, each scope once), and nothing else is
  in either.
- A process is in the table exactly while it has at least one armed timer. The
  table holds one handle per process (not per timer); the methods that take a process
  out of the table return its handle so the caller can stop watching it and close it.
- ``owner`` counts (timers per arming uid) always equal a recount of the timers.
- The index of what each uid may see: ``_visible[uid][pid]`` counts the timers of
  process ``pid`` whose ``uid`` or ``owner`` is ``uid``, for every uid but root's
  (root sees every timer, through the order itself). So a user's status walks
  that user's processes, never the host's timers.

Memory is the point of this layout. A timer costs its `Timer`, its scope, its
deadline and arming time (a float each) and two pointers, one in its process's list
and one in the order: most of what the daemon holds per timer with a million armed
(bench/scale.py measures it; docs/benchmarks.md gives the figures). Values that
repeat from timer to timer are shared rather than copied: the pid and start time are
the process handle's, the policy name, timeout and scope (the processes of a program
arm the same scopes) come from small tables of the values seen lately (`Shared`), and
``seq`` is 0 for every timer but those that tie on a deadline (Python keeps small ints
as one object; a counter would cost an int a timer).
"""

from __future__ import annotations

import itertools
import operator
import struct
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import msgspec

from .deadlines import Deadlines
from .identity import ROOT
from .interning import Shared
from .starvation import Sample


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
#: An arming time as the 8 bytes of its IEEE 754 double (`Timer.arm`).
_DOUBLE = struct.Struct("<d")


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
    has ``firing`` 0 and no ``run``. A timer that fell due keeps its record, with a
    ``firing`` number of its own and its `Course`, until its policy has finished.
    ``watch`` holds what only some timers need (`Watch`): None for the others, and
    a registration's bare `SlotRef` when it needs nothing else (one object a
    registration fewer; `watched` and `slot` read either form).

    Timers order by ``(deadline, seq)``, their first two fields (``order=True``
    compares fields in turn, in C): the table's order holds the records
    themselves. ``seq`` tells apart the armed timers that share a deadline, in the
    order they were armed; it is 0 for all others (`Deadlines.insert`).

    Its arming's number (`arm`, sent as `Acquired.arm`) is its ``armed_at``, which
    the daemon keeps distinct from every other arming's (`Arming.acquire`): a
    release that names another number is late, or about an arming made before
    this one, and leaves it armed. (The arming time is a float the timer holds
    anyway; a counter of its own would be an int object a timer.)

    (A Struct without GC tracking: one is made per acquire, and it holds only
    scalars and Structs of scalars; its size moves in steps of 16 bytes, Python's
    allocator's size classes. Stored as the array of its fields in this order, the
    schema `watchdogd.storage.schema.SCHEMA`: a change of the fields or of their
    order is a new schema, with its migration from this one.)
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
    run: Course | None = None
    watch: Watch | SlotRef | None = None

    @property
    def key(self) -> Key:
        return (self.pid, self.scope)

    @property
    def arm(self) -> int:
        """The number of this arming: the bits of ``armed_at`` (a positive float,
        so a positive integer below 2**63, as `Release.arm` requires), one to one
        with the arming time, so exact through the state and the wire."""
        return int.from_bytes(_DOUBLE.pack(self.armed_at), "little")

    def armed_as(self, arm: int) -> bool:
        """Whether ``arm`` names this arming: its own number, or the number its
        client gave it under a daemon that kept clients' numbers
        (`Watch.client_arm`)."""
        watch = self.watched
        return arm == self.arm or (watch is not None and arm == watch.client_arm)

    @property
    def watched(self) -> Watch | None:
        """Its `Watch`, if it keeps one."""
        watch = self.watch
        return watch if isinstance(watch, Watch) else None

    @property
    def as_watch(self) -> Watch:
        """Its `Watch`, or one made of what it keeps (nothing, or its slot)."""
        watch = self.watch
        return watch if isinstance(watch, Watch) else Watch(slot=watch)

    @property
    def slot(self) -> SlotRef | None:
        """The slot of a scope registered for the fast path (`Watch.slot`)."""
        watch = self.watch
        return watch if watch is None or isinstance(watch, SlotRef) else watch.slot

    @property
    def store_key(self) -> StoreKey:
        return (self.pid, self.scope, self.firing)

    @property
    def step(self) -> int:
        """The policy step in progress (0 while armed)."""
        return 0 if self.run is None else self.run.step

    @property
    def step_end(self) -> float:
        return 0.0 if self.run is None else self.run.step_end

    @property
    def fired_at(self) -> float:
        return 0.0 if self.run is None else self.run.fired_at

    @property
    def plan(self) -> int:
        return 0 if self.run is None else self.run.plan

    @property
    def stalled(self) -> bool:
        """Whether it expires, at its deadline, as stalled: its deadline is its
        progress's (``stall`` seconds after its progress last grew), sooner than
        its timeout's."""
        watch = self.watched
        return (
            watch is not None
            and watch.stall > 0
            and self.deadline == watch.progressed_at + watch.stall
            and self.deadline < self.armed_at + self.timeout
        )

    def at_step(self, step: int, step_end: float = 0.0) -> Timer:
        """This firing timer with its policy at ``step`` (a wait ending at
        ``step_end``)."""
        run = Course() if self.run is None else self.run
        return msgspec.structs.replace(
            self, run=msgspec.structs.replace(run, step=step, step_end=step_end)
        )


class Course(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """The course of the policy of a timer that fell due, where it has got to: the index of the
    ``step`` in progress and, during a wait, when that wait ends (``step_end``);
    when it fell due (``fired_at``); the `Policy.plan` of the policy that fired
    it, so that a policy changed or removed by the time a restart resumes it
    starts again from its first step. A run that belongs to an ``incident`` of
    its job names it; ``peer`` says it is the job's peer policy, run on another
    process of the job, not the expiry of this timer."""

    step: int = 0
    step_end: float = 0.0
    fired_at: float = 0.0
    plan: int = 0
    incident: str = ""
    peer: bool = False


class Watch(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False, tag=1):
    """What a timer keeps beyond its deadline, when it needs to (stored led by its
    tag, which tells it from a bare `SlotRef`).

    - ``progress``: the highest progress counter its renewals carried, and when it
      last grew (``progressed_at``); ``stall`` the seconds its policy allows
      without growth, as armed. Its deadline is then the sooner of the timeout's
      and ``progressed_at + stall``.
    - ``timeout_from``: where a timeout the daemon chose came from (a request
      that asked for a learned one, `Acquire.auto`); empty for a timeout the
      request gave.
    - ``job`` and the ``rank``, ``local_rank`` and ``group_rank`` of its process
      in it: the distributed job an expiry opens an incident for.
    - ``baseline``: under a policy with ``starvation_grace``, what the kernel said
      of its process when it was armed (`watchdogd.core.starvation.Sample`), for
      its deadline to judge starvation by; ``extended`` the seconds of grace it
      was given as starved (0 until then: once per arming). Every arming measures
      anew and has its grace back.
    - ``client_arm``: the number its client gave this arming, for a timer armed
      before schema 7, when clients numbered their own armings (0: none). A
      release from that client names it (the daemon of the day echoed it); every
      arming since is named by the daemon (`Timer.arm`).
    - ``held_until``: when the restart grace this arming was given ends
      (`watchdogd.core.firing.RestartGrace`; None until a start gives it): a
      later start holds it no longer, so once an arming, however often the
      daemon restarts.
    - ``slot``: the slot of a scope registered for the fast path (`SlotRef`): its
      blocks arm and release by stores there, so this timer's ``deadline`` is the
      daemon's next look at the slot, not the block's (`watchdogd.core.slots`).
    """

    progress: int | None = None
    progressed_at: float = 0.0
    stall: float = 0.0
    timeout_from: str = ""
    job: str = ""
    rank: int | None = None
    local_rank: int | None = None
    group_rank: int | None = None
    baseline: Sample | None = None
    extended: float = 0.0
    client_arm: int = 0
    held_until: float | None = None
    slot: SlotRef | None = None


class SlotRef(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False, tag=2):
    """Where a registered scope's blocks store: slot ``index`` of slot page
    ``page`` (the page's inode, by which a restarted daemon finds it again among
    its process's descriptors), looked at least once every ``period`` seconds.
    Stored led by its tag."""

    page: int
    index: int
    period: float


@dataclass(slots=True)
class _Tracked(Generic[P]):
    """A process in the table and its timers, sorted by scope.

    A list searched by bisection (in C, keyed by scope): one pointer a timer, where
    a dict of scopes costs several an entry, and a whole table for a process with a
    single timer. A restart hands the timers of a process over already sorted
    (the database's key is ``(pid, scope, firing)``), so sorting them is a pass."""

    process: P
    timers: list[Timer] = field(default_factory=list)

    def get(self, scope: str) -> Timer | None:
        timers = self.timers
        at = bisect_left(timers, scope, key=_scope_of)
        if at < len(timers) and timers[at].scope == scope:
            return timers[at]
        return None

    def put(self, timer: Timer) -> Timer | None:
        """Add ``timer``, in place of the one of its scope if any (returned)."""
        timers = self.timers
        at = bisect_left(timers, timer.scope, key=_scope_of)
        if at < len(timers) and timers[at].scope == timer.scope:
            previous, timers[at] = timers[at], timer
            return previous
        timers.insert(at, timer)
        return None

    def pop(self, scope: str) -> Timer | None:
        timers = self.timers
        at = bisect_left(timers, scope, key=_scope_of)
        if at < len(timers) and timers[at].scope == scope:
            return timers.pop(at)
        return None


class Expired(msgspec.Struct, Generic[P], frozen=True):
    """A timer that reached its deadline, with its process. ``orphaned`` says the
    process left the table with it (it had no other timer); ``note``, what its
    event should say of how it came to fire (why it was not given more time).
    (A struct: made in C, where a named tuple's constructor runs in Python, once
    for each timer of a burst before its signal.)"""

    timer: Timer
    process: P
    orphaned: bool
    note: str = ""


class TimerTable(Generic[P]):
    """Armed timers, their deadlines, and the processes they belong to."""

    __slots__ = (
        "_by_owner",
        "_jobs",
        "_order",
        "_policies",
        "_processes",
        "_scopes",
        "_timeouts",
        "_visible",
        "jobs_changed",
    )

    def __init__(self) -> None:
        self._order: Deadlines[Timer] = Deadlines()
        self._processes: dict[int, _Tracked[P]] = {}
        self._by_owner: dict[int, int] = {}
        self._visible: dict[int, dict[int, int]] = {}
        #: (owner, job) -> pid -> how many of its timers are of that job.
        self._jobs: dict[tuple[int, str], dict[int, int]] = {}
        #: Counts every job that came or went: the fleet registers the jobs anew
        #: only when it moved.
        self.jobs_changed = 0
        self._policies: Shared[str] = Shared()
        self._timeouts: Shared[float] = Shared()
        self._scopes: Shared[str] = Shared()

    def __len__(self) -> int:
        return len(self._order)

    @property
    def process_count(self) -> int:
        return len(self._processes)

    def owned_by(self, uid: int) -> int:
        """How many timers ``uid`` has armed."""
        return self._by_owner.get(uid, 0)

    def process(self, pid: int) -> P | None:
        """The handle held for ``pid``, or None when it has no timer."""
        tracked = self._processes.get(pid)
        return None if tracked is None else tracked.process

    def get(self, pid: int, scope: str) -> Timer | None:
        tracked = self._processes.get(pid)
        return None if tracked is None else tracked.get(scope)

    def job_pids(self, owner: int, job: str) -> list[int]:
        """The processes holding a timer of ``job`` armed by ``owner``."""
        return list(self._jobs.get((owner, job), ()))

    def job_keys(self) -> Iterator[tuple[int, str]]:
        """Every (owner, job) held, in the order they came."""
        return iter(self._jobs)

    def jobs(self) -> dict[tuple[int, str], int]:
        """How many processes hold timers of each (owner, job)."""
        return {key: len(pids) for key, pids in self._jobs.items()}

    def timers_of(self, pid: int) -> list[Timer]:
        """The armed timers of process ``pid``, soonest first."""
        tracked = self._processes.get(pid)
        return [] if tracked is None else sorted(tracked.timers)

    def timers(self) -> Iterator[Timer]:
        """Every armed timer, in no particular order."""
        for tracked in self._processes.values():
            yield from tracked.timers

    def soonest(self, after: tuple[float, int] | None = None) -> Iterator[Timer]:
        """Every armed timer, soonest first (by ``(deadline, seq)``), from just
        after ``after`` when given: found by binary search, not by a walk. The
        table must not change while the iterator is in use."""
        if after is None:
            return iter(self._order)
        return self._order.after(*after)

    def visible_to(self, uid: int) -> Iterator[Timer]:
        """The timers a non-root ``uid`` may see (on its processes or armed by
        it), in no particular order. It walks the processes of the uid's index,
        so its cost follows that uid's timers, not the host's."""
        for pid in self._visible.get(uid, {}):
            for timer in self._processes[pid].timers:
                if uid in (timer.uid, timer.owner):
                    yield timer

    def next_deadline(self) -> float | None:
        first = self._order.first()
        return None if first is None else first.deadline

    def shared_scope(self, scope: str) -> str:
        """The one object the table's timers of ``scope`` hold (armed lately)."""
        return self._scopes[scope]

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
        watch: Watch | SlotRef | None = None,
        deadline: float | None = None,
    ) -> tuple[Timer, bool]:
        """Arm or re-arm ``(process.pid, scope)`` to expire at ``deadline``
        (``now + timeout`` unless given); returns the timer and whether it
        replaced one. A process new to the table is added with it; a process already
        in the table must be passed as the same handle."""
        pid = process.pid
        tracked = self._tracked(process)
        if deadline is None:
            deadline = now + timeout
        policy, timeout = self._policies[policy], self._timeouts[timeout]
        scope = self.shared_scope(scope)
        start_time = process.start_time
        timer = self._order.insert(
            deadline,
            lambda seq: Timer(
                deadline=deadline,
                seq=seq,
                pid=pid,
                scope=scope,
                policy=policy,
                uid=uid,
                owner=owner,
                timeout=timeout,
                armed_at=now,
                start_time=start_time,
                exit_releases=exit_releases,
                watch=watch,
            ),
        )
        previous = tracked.put(timer)
        if previous is not None:
            self._order.remove(previous)
            self._count(previous, -1)
        self._count(timer, 1)
        return timer, previous is not None

    def _tracked(self, process: P) -> _Tracked[P]:
        """The entry of ``process``, made if it has none; ValueError if its pid
        is held by another handle."""
        tracked = self._processes.get(process.pid)
        if tracked is None:
            tracked = self._processes[process.pid] = _Tracked(process)
        elif tracked.process is not process:
            raise ValueError(f"pid {process.pid} is already tracked with another handle")
        return tracked

    def put(self, process: P, timer: Timer) -> Timer:
        """Hold ``timer``, a record of this table's (armed, or taken out by
        `pop_due`), on its own deadline, in place of the timer of its key if one is
        armed; returns the record as held (its ``seq`` is the table's). Its process
        is added when it left the table, and must be the same handle otherwise.
        For a timer whose `Watch` changed after it was armed, and for one that fell
        due and was given more time."""
        tracked = self._tracked(process)
        held = self._order.insert(
            timer.deadline, lambda seq: msgspec.structs.replace(timer, seq=seq)
        )
        previous = tracked.put(held)
        if previous is not None:
            self._order.remove(previous)
            self._count(previous, -1)
        self._count(held, 1)
        return held

    def restore(self, stored: Iterable[tuple[P, list[Timer]]]) -> None:
        """Put back armed timers read from the state, by process (each process
        new to the table, each scope once), on their original deadlines and
        numbers. Each list of timers becomes the table's own (sorted in place):
        a copy of a million pointers would be memory the process keeps once
        freed. In bulk, with one sort and counts taken per process in C loops:
        a restart loads a million."""
        lists = [list(self._order)]
        for process, timers in stored:
            pid = process.pid
            if pid in self._processes:
                raise ValueError(f"pid {pid} is in the table already")
            timers.sort(key=_scope_of)
            scopes = map(_scope_of, timers)
            later = map(_scope_of, itertools.islice(timers, 1, None))
            if any(map(operator.eq, scopes, later)):
                raise ValueError(f"pid {pid}: a scope is restored twice")
            self._processes[pid] = _Tracked(process, timers)
            for owner, count in Counter(map(_owner_of, timers)).items():
                self._by_owner[owner] = self._by_owner.get(owner, 0) + count
            for timer in itertools.compress(timers, map(_watched, timers)):
                if (watch := timer.watched) is not None and watch.job:
                    self.jobs_changed += _tally(self._jobs, (timer.owner, watch.job), pid, 1)
            for viewer, count in _viewers(timers).items():
                self._visible.setdefault(viewer, {})[pid] = count
            lists.append(timers)
        # Every timer in one list made at its final size: a list grown step by
        # step leaves its earlier blocks in the heap, memory the process keeps.
        total = sum(map(len, lists))
        if not total:
            return
        restored = [next(itertools.chain.from_iterable(lists))] * total
        at = 0
        for timers in lists:
            restored[at : at + len(timers)] = timers
            at += len(timers)
        Deadlines.sort(restored)
        self._order = Deadlines(restored)

    def merge(self, later: TimerTable[P]) -> tuple[list[P], list[Timer]]:
        """Take over every timer of ``later`` (left empty), each due after every
        timer held: the rest of a restart's load. Returns the handles of
        ``later`` now in this table, and the timers left out: those of a pid
        held here for another process (its start time differs). Costs a move of
        the order's chunks and a pass per process, not one per timer."""
        dropped: list[Timer] = []
        for pid, tracked in list(later._processes.items()):
            mine = self._processes.get(pid)
            if mine is not None and mine.process.start_time != tracked.process.start_time:
                forgotten = later.forget(pid)
                assert forgotten is not None
                dropped += forgotten[1]
        self._order.extend(later._order)
        taken: list[P] = []
        for pid, tracked in later._processes.items():
            mine = self._processes.get(pid)
            if mine is None:
                self._processes[pid] = tracked
                taken.append(tracked.process)
            else:
                mine.timers += tracked.timers
                mine.timers.sort(key=_scope_of)
        for owner, count in later._by_owner.items():
            self._by_owner[owner] = self._by_owner.get(owner, 0) + count
        for viewer, counts in later._visible.items():
            mine_counts = self._visible.setdefault(viewer, {})
            for pid, count in counts.items():
                mine_counts[pid] = mine_counts.get(pid, 0) + count
        for key, pids in later._jobs.items():
            self.jobs_changed += key not in self._jobs
            mine_pids = self._jobs.setdefault(key, {})
            for pid, count in pids.items():
                mine_pids[pid] = mine_pids.get(pid, 0) + count
        later._processes, later._by_owner, later._visible, later._jobs = {}, {}, {}, {}
        return taken, dropped

    def clear(self) -> list[P]:
        """Drop every timer (the daemon stops); returns the handles held. One
        pass over the processes, none over the timers: a stop with a million
        armed takes no longer than one with none."""
        processes = [tracked.process for tracked in self._processes.values()]
        self.jobs_changed += bool(self._jobs)
        self._order = Deadlines()
        self._processes, self._by_owner, self._visible, self._jobs = {}, {}, {}, {}
        return processes

    def disarm(self, pid: int, scope: str, arm: int = 0) -> tuple[Timer | None, P | None]:
        """Disarm ``(pid, scope)``; with ``arm``, only the arming that number names
        (`Timer.armed_as`). Returns the timer (None if none was armed, or another
        arming is) and the process handle if it left the table (its last timer
        went)."""
        tracked = self._processes.get(pid)
        if tracked is None:
            return None, None
        if arm:
            armed = tracked.get(scope)
            if armed is not None and not armed.armed_as(arm):
                return None, None
        timer = tracked.pop(scope)
        if timer is None:
            return None, None
        self._order.remove(timer)
        self._count(timer, -1)
        if tracked.timers:
            return timer, None
        del self._processes[pid]
        return timer, tracked.process

    def pop_due(self, now: float, limit: int | None = None) -> list[Expired[P]]:
        """Take out every timer whose deadline is ``<= now`` (the earliest ``limit``
        of them, when given), earliest first."""
        expired: list[Expired[P]] = []
        for timer in self._order.pop_due(now, limit):
            tracked = self._processes[timer.pid]
            tracked.pop(timer.scope)
            self._count(timer, -1)
            orphaned = not tracked.timers
            if orphaned:
                del self._processes[timer.pid]
            expired.append(Expired(timer, tracked.process, orphaned))
        return expired

    def forget(self, pid: int) -> tuple[P, list[Timer]] | None:
        """Take out a process and all its timers (it exited)."""
        tracked = self._processes.pop(pid, None)
        if tracked is None:
            return None
        timers = tracked.timers
        for timer in timers:
            self._order.remove(timer)
            self._count(timer, -1)
        return tracked.process, timers

    def _count(self, timer: Timer, step: int) -> None:
        """Count ``timer`` in (``step`` 1) or out (-1) of the owner counts and of
        the index of who may see it. (On every arm and release: kept inline.)"""
        owner, uid = timer.owner, timer.uid
        if (watch := timer.watched) is not None and watch.job:
            self.jobs_changed += _tally(self._jobs, (owner, watch.job), timer.pid, step)
        by_owner = self._by_owner
        remaining = by_owner.get(owner, 0) + step
        if remaining:
            by_owner[owner] = remaining
        else:
            del by_owner[owner]
        if uid == owner == ROOT:
            return  # root's own timers: root sees them through the order
        visible, pid = self._visible, timer.pid
        for viewer in (uid,) if uid == owner else (uid, owner):
            if viewer == ROOT:
                continue
            pids = visible.get(viewer)
            if pids is None:
                pids = visible[viewer] = {}
            remaining = pids.get(pid, 0) + step
            if remaining:
                pids[pid] = remaining
            else:
                del pids[pid]
                if not pids:
                    del visible[viewer]


def _tally(
    index: dict[tuple[int, str], dict[int, int]], key: tuple[int, str], pid: int, step: int
) -> bool:
    """Count ``pid`` in or out of ``key``; whether ``key`` came or went."""
    pids = index.get(key)
    if pids is None:
        pids = index[key] = {pid: step}
        return True
    left = pids.get(pid, 0) + step
    if left:
        pids[pid] = left
        return False
    del pids[pid]
    if pids:
        return False
    del index[key]
    return True


_scope_of = operator.attrgetter("scope")
_watched = operator.attrgetter("watch")
_uid_of = operator.attrgetter("uid")
_owner_of = operator.attrgetter("owner")


def _viewers(timers: list[Timer]) -> Counter[int]:
    """How many of ``timers`` each uid but root's may see (its own, or armed by
    it): what `TimerTable._count` adds up one timer at a time."""
    seen = Counter(map(_uid_of, timers))
    seen.update(map(_owner_of, timers))
    # A timer whose uid is its owner was counted twice.
    own = map(operator.eq, map(_uid_of, timers), map(_owner_of, timers))
    for uid, twice in Counter(itertools.compress(map(_uid_of, timers), own)).items():
        seen[uid] -= twice
    del seen[ROOT]
    return +seen
