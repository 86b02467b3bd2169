"""What happened: bounded, numbered rings of events, one share per uid.

Pure and synchronous; the caller passes the wall-clock time of each event. Every
event gets the next sequence number (one numbering for all uids), so a follower asks
for the events after the last one it saw; a follower that falls behind an eviction
misses events (the numbers show the gap).

Invariants:

- An event belongs to the uid of the process it is about (``EventInfo.uid``), which
  is also who may read it besides root. Root's events are kept in a ring of their
  own of ``size``; no other uid's activity evicts them.
- Every other uid keeps at most ``per_uid`` events, and all of them together at
  most ``size``. Past that, the oldest event of whoever holds the most goes (the
  recording uid on a tie), so a uid holding no more than its fair share never loses
  an event to another uid's activity (`watchdogd.core.shares`, which the incident
  log shares).
- Every event, once kept, encodes to at most `MAX_EVENT_BYTES` (long hook output is
  cut with a marker), and a page stops before it would pass ``max_bytes``, so a page
  always holds at least one event and always fits in a reply.
- Each kept event is handed to the log as one line, rate-limited per (uid, kind)
  (`watchdogd.core.logline`); without a log, none is.
- Events written to the state before a restart come back with their numbers
  (`restore`), and numbering goes on after the last of them: a follower's ``after``
  means the same to the restarted daemon.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Final, NamedTuple

import msgspec

from watchdogd_protocol import MAX_REPLY_BYTES, EventInfo, StepResult

from .identity import ROOT
from .logline import Level, RateLimitedLog, logfmt
from .shares import Shares

#: Room left in a reply for what surrounds the events (type, id, last).
_ENVELOPE_BYTES: Final = 4096
#: The most one event may take: a page of one event always fits in a reply.
MAX_EVENT_BYTES: Final = 512 * 1024
#: What the captured output of all of an event's steps may take together.
_OUTPUT_BYTES: Final = 256 * 1024
_CUT: Final = "\n…[output cut]"

#: An expiry means a worker was hung; the rest are for the record.
_LEVELS: Final = {
    "expired": Level.WARNING,
    "extended": Level.WARNING,
    "unblocked": Level.WARNING,
    "unkillable": Level.ERROR,
    "reload_failed": Level.ERROR,
    "state_degraded": Level.ERROR,
    "state_restored": Level.WARNING,
    "record_damaged": Level.ERROR,
    "record_cut": Level.WARNING,
}

_encoder = msgspec.msgpack.Encoder()


class _Kept(NamedTuple):
    event: EventInfo
    size: int  # encoded bytes


class EventLog:
    """The latest events, ``size`` for root and ``size`` shared by the other uids
    (at most ``per_uid`` each). ``notify`` is called after each one is recorded."""

    def __init__(
        self,
        size: int,
        notify: Callable[[], object] = lambda: None,
        *,
        per_uid: int | None = None,
        log: RateLimitedLog | None = None,
    ) -> None:
        self._shares = Shares(size, per_uid)
        self._rings: dict[int, deque[_Kept]] = {}
        self._seq = itertools.count(1)
        self._last = 0
        self._notify = notify
        self._log = log

    def __len__(self) -> int:
        return len(self._shares)

    @property
    def last(self) -> int:
        """The number of the newest event (0 before the first)."""
        return self._last

    def kept(self, uid: int) -> int:
        """How many events of ``uid`` are kept."""
        return self._shares.held(uid)

    def resize(self, size: int, per_uid: int | None = None) -> None:
        """Keep at most ``size`` (and ``per_uid`` per uid) from now on; the newest
        stay when a bound shrinks."""
        for uid in self._shares.resize(size, per_uid):
            self._drop_oldest(uid)

    def record(self, event: EventInfo) -> EventInfo:
        """Number ``event``, keep it, log it as one line, and wake followers."""
        event = self._keep(event)
        self._notify()
        return event

    def record_daemon(self, kind: str, note: str, *, pid: int, time: float) -> EventInfo:
        """`record` an event about the daemon itself (its ``pid``), which only root
        sees."""
        return self.record(
            EventInfo(
                seq=0, kind=kind, time=time, pid=pid, uid=ROOT, scope="", policy="", note=note
            )
        )

    def record_many(self, events: list[EventInfo]) -> None:
        """`record` each of ``events``, waking followers once."""
        for event in events:
            self._keep(event)
        if events:
            self._notify()

    def _keep(self, event: EventInfo) -> EventInfo:
        self._last = next(self._seq)
        event, size = _bounded(msgspec.structs.replace(event, seq=self._last))
        uid = event.uid
        victim = self._shares.add(uid)
        if victim is not None:
            self._drop_oldest(victim)
        self._rings.setdefault(uid, deque()).append(_Kept(event, size))
        if self._log is not None:
            self._log.log(
                (uid, event.kind),
                _LEVELS.get(event.kind, Level.INFO),
                lambda: logfmt(event.kind, **_loggable(event)),
            )
        return event

    def page(
        self,
        after: int | None,
        limit: int,
        viewer: int,
        max_bytes: int = MAX_REPLY_BYTES - _ENVELOPE_BYTES,
    ) -> list[EventInfo]:
        """Events uid ``viewer`` may see (root: all; another uid: its own): the
        latest ``limit`` when ``after`` is None, else the first ``limit`` numbered
        above ``after``; oldest first, and no more than ``max_bytes`` encoded (but
        always at least one when there is one)."""
        rings = list(self._rings.values()) if viewer == ROOT else [self._rings.get(viewer, deque())]
        kept: Iterator[_Kept]
        if after is None:
            kept = heapq.merge(*(reversed(ring) for ring in rings), key=_seq, reverse=True)
        else:
            kept = heapq.merge(*(_newer(ring, after) for ring in rings), key=_seq)
        page: list[EventInfo] = []
        room = max_bytes
        for item in itertools.islice(kept, limit):
            room -= item.size
            if room < 0 and page:
                break
            page.append(item.event)
        if after is None:
            page.reverse()
        return page

    def about(
        self, pid: int, limit: int, viewer: int, max_bytes: int = MAX_REPLY_BYTES // 2
    ) -> list[EventInfo]:
        """The latest ``limit`` events about ``pid`` that uid ``viewer`` may see,
        oldest first, in no more than ``max_bytes`` encoded (but at least one when
        there is one). A walk of the rings ``viewer`` may read: bounded by their
        size."""
        rings = list(self._rings.values()) if viewer == ROOT else [self._rings.get(viewer, deque())]
        newest = heapq.merge(*(reversed(ring) for ring in rings), key=_seq, reverse=True)
        page: list[EventInfo] = []
        room = max_bytes
        for item in newest:
            if item.event.pid != pid:
                continue
            room -= item.size
            if (room < 0 and page) or len(page) == limit:
                break
            page.append(item.event)
        page.reverse()
        return page

    def since(self, after: int) -> list[EventInfo]:
        """Every kept event numbered above ``after``, oldest first (what is still to
        be written to the state, or, from 0, all of it)."""
        kept = heapq.merge(*(_newer(ring, after) for ring in self._rings.values()), key=_seq)
        return [item.event for item in kept]

    def restore(self, events: Iterable[EventInfo]) -> None:
        """Keep ``events`` (read back from the state, oldest first, as they were
        numbered) under the bounds, without logging them again; the next event is
        numbered after the last."""
        for stored in events:
            if stored.seq <= self._last:
                continue  # out of order: damage the reader let through
            event, size = _bounded(stored)
            victim = self._shares.add(event.uid)
            if victim is not None:
                self._drop_oldest(victim)
            self._rings.setdefault(event.uid, deque()).append(_Kept(event, size))
            self._last = event.seq
        self._seq = itertools.count(self._last + 1)

    def _drop_oldest(self, uid: int) -> None:
        ring = self._rings[uid]
        ring.popleft()
        if not ring:
            del self._rings[uid]


def _seq(item: _Kept) -> int:
    return item.event.seq


def _newer(ring: deque[_Kept], after: int) -> Iterator[_Kept]:
    """The events of ``ring`` numbered above ``after``, found by bisection: a
    follower asks for the newest few of a ring of thousands at each poll, and the
    loop that answers it is the one that fires the deadlines."""
    return itertools.islice(ring, bisect.bisect_right(ring, after, key=_seq), None)


def _bounded(event: EventInfo) -> tuple[EventInfo, int]:
    """``event`` with its captured output cut to fit `MAX_EVENT_BYTES`, and its
    encoded size."""
    size = len(_encoder.encode(event))
    if size <= MAX_EVENT_BYTES:
        return event, size
    outputs = [step for step in event.steps if step.output]
    share = _OUTPUT_BYTES // max(1, len(outputs))
    steps = [_cut(step, share) for step in event.steps]
    event = msgspec.structs.replace(event, steps=steps)
    return event, len(_encoder.encode(event))


def _cut(step: StepResult, share: int) -> StepResult:
    raw = step.output.encode()
    if len(raw) <= share:
        return step
    kept = raw[: max(0, share - len(_CUT.encode()))].decode(errors="ignore")
    return msgspec.structs.replace(step, output=kept + _CUT)


def _loggable(event: EventInfo) -> dict[str, object]:
    fields: dict[str, object] = {"pid": event.pid, "uid": event.uid}
    for name in ("scope", "policy", "outcome", "note", "state", "wchan"):
        value = getattr(event, name)
        if value:
            fields[name] = value
    if event.late is not None:
        fields["late_ms"] = event.late * 1000
    if event.timers is not None:
        fields["timers"] = event.timers
    for index, step in enumerate(event.steps):
        fields[f"step{index}"] = f"{step.step}: {step.result}"
    return fields
