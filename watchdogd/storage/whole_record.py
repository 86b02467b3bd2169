"""A whole write of the record (`watchdogd.storage.record_file`): its records
framed a few milliseconds of CPU at a time, cut to fit the file's bound when they
do not (`_Fit`), and handed out in parts of about `PART` bytes to be written in
turn as they are framed (`WholeWrite.framed`): the daemon holds a part of the file
at a time, never a copy of all of it (a record of one user's stacks at its budget,
or of hundreds of MiB, would double in memory while it is written).

Invariants:

- The parts handed out are the file, in order. A part goes out only while every
  part so far fits the target; once one would not, the rest are framed for their
  sizes alone, the records are cut to fit (`_Fit`), and `START_OVER` comes before
  the parts of what was kept. So no more than the target is written (the disk's
  room is the state's first), but for what is never left off (the header, the
  jobs' rows of hangs, the newest event) when that alone passes it; the parts
  after the last `START_OVER` are the whole file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final, final

import msgspec

from ..core import ROOT, trimmed
from .record_entries import Entry, EventRecord, IncidentRecord, RowRecord, framed

#: The frames of a whole write are joined into parts of about this size.
PART: Final = 1024 * 1024
#: In a step's output, where the record left it off.
_LEFT_OFF: Final = "…(left off the record: its bound, or its disk's room)"


@final
class StartOver:
    """What was written of the file so far is to be dropped: the parts that follow
    are the whole file."""

    __slots__ = ()


START_OVER: Final = StartOver()
#: What a whole write hands out, in turn: a part to write next, `START_OVER`, or
#: None when its turn is over (other tasks run before it goes on).
Step = bytes | bytearray | StartOver | None


class WholeWrite:
    """A whole write of the file: ``entries`` framed, cut to fit ``target`` bytes
    when they do not (``left``: the bytes left off), the last event in it
    numbered ``written``; ``size`` is the file's, once written."""

    def __init__(self, entries: list[Entry], written: int, target: int) -> None:
        self.entries = entries
        self.written = written
        self.target = target
        self.size = 0
        self.left = 0

    def framed(self, turn: float) -> Iterator[Step]:
        """The write's steps (`Step`), a pause every ``turn`` seconds of CPU."""
        parts = _Parts()
        for step in parts.framed(self.entries, turn):
            # The size framed only grows: once a part does not fit, none does.
            if step is None or parts.size <= self.target:
                yield step
        if parts.size > self.target:
            fit = _Fit(self.entries, parts.sizes, self.target)
            yield from fit.run(turn)
            self.left = fit.left
            yield START_OVER
            parts = _Parts()
            yield from parts.framed(fit.chosen, turn)
        self.size = parts.size
        self.entries = []


class _Parts:
    """Frames joined into parts of about `PART` bytes, handed out as they fill."""

    def __init__(self) -> None:
        #: The bytes framed so far.
        self.size = 0
        #: The framed size of each entry, in order.
        self.sizes: list[int] = []
        self._batch: list[bytearray] = []
        self._batched = 0

    def framed(self, entries: Iterable[Entry], turn: float) -> Iterator[bytes | bytearray | None]:
        """Frame ``entries`` in, handing out each part as it fills and the last at
        the end; a pause (None) whenever ``turn`` seconds of this thread's CPU have
        gone since the last."""
        due = _paced(turn)
        for entry in entries:
            frame = framed(entry)
            self._batch.append(frame)
            self._batched += len(frame)
            self.size += len(frame)
            self.sizes.append(len(frame))
            if self._batched >= PART:
                yield self._part()
            if due():
                yield None
        if self._batch:
            yield self._part()

    def _part(self) -> bytes | bytearray:
        # A record of a part's size or more goes as it is, not copied.
        batch, self._batch, self._batched = self._batch, [], 0
        return batch[0] if len(batch) == 1 else b"".join(batch)


def _paced(turn: float) -> Callable[[], bool]:
    """Whether ``turn`` seconds of this thread's CPU have gone since it last said so."""
    ends = time.thread_time() + turn

    def due() -> bool:
        nonlocal ends
        if time.thread_time() < ends:
            return False
        ends = time.thread_time() + turn
        return True

    return due


def _cut(entry: Entry) -> Entry | None:
    """``entry`` with each stack or output cut to its main thread's innermost
    frames (`watchdogd.core.ranks.trimmed`), or None when nothing is to cut."""
    match entry:
        case EventRecord(event=event) if any(step.output for step in event.steps):
            steps = [
                msgspec.structs.replace(step, output=trimmed(step.output)) for step in event.steps
            ]
            if steps == event.steps:
                return None
            return EventRecord(msgspec.structs.replace(event, steps=steps, note=_noted(event.note)))
        case IncidentRecord(incident=stored):
            ranks = [
                msgspec.structs.replace(rank, stack=cut, note=_noted(rank.note))
                if (cut := trimmed(rank.stack)) != rank.stack
                else rank
                for rank in stored.ranks
            ]
            if ranks == stored.ranks:
                return None
            return IncidentRecord(msgspec.structs.replace(stored, ranks=ranks))
    return None


def _noted(note: str) -> str:
    return f"{note}; {_LEFT_OFF}" if note else _LEFT_OFF


def _first_left_off(entry: Entry) -> tuple[bool, bool]:
    """The order whole records are left off in: other users' before root's, their
    incidents before their events (then the oldest first)."""
    match entry:
        case EventRecord(event=event):
            return (event.uid == ROOT, True)
        case IncidentRecord(incident=stored):
            return (stored.info.uid == ROOT, False)
    return (True, True)


class _Fit:
    """Which of a whole write's ``entries`` (framed to ``sizes``) fit ``target``
    bytes, and how: `watchdogd.storage.record_file` says in which order stacks are cut and records
    left off. ``chosen`` are the entries to write, ``left`` the bytes left off."""

    def __init__(self, entries: list[Entry], sizes: list[int], target: int) -> None:
        self.entries = entries
        self.sizes = sizes
        self.target = target
        self.chosen: list[Entry] = []
        self.left = 0

    def run(self, turn: float) -> Iterator[None]:
        """Choose, pausing (a yield) every ``turn`` CPU seconds."""
        due = _paced(turn)
        cuts: list[Entry | None] = []
        small: list[int] = []
        for entry, size in zip(self.entries, self.sizes, strict=True):
            cut = _cut(entry)
            cuts.append(cut)
            small.append(size if cut is None else len(framed(cut)))
            if due():
                yield
        self._choose(cuts, small)

    def _choose(self, cuts: list[Entry | None], small: list[int]) -> None:
        """Leave off whole records, in order, until the cut ones fit; then put
        back whole the cut ones that still fit, the other way round."""
        entries = self.entries
        total = sum(small)
        events = [i for i, entry in enumerate(entries) if isinstance(entry, EventRecord)]
        rows = [i for i, entry in enumerate(entries) if isinstance(entry, RowRecord)]
        spared = {0, *events[-1:], *rows}  # the header, the newest event, the jobs' rows
        order = sorted(range(len(entries)), key=lambda i: (*_first_left_off(entries[i]), i))
        kept = [True] * len(entries)
        for index in order:
            if total <= self.target:
                break
            if index not in spared:
                kept[index] = False
                total -= small[index]
        whole = [cut is None for cut in cuts]
        for index in reversed(order):
            grown = total - small[index] + self.sizes[index]
            if kept[index] and not whole[index] and grown <= self.target:
                whole[index], total = True, grown
        self.chosen = [
            entry if whole[index] else cuts[index] or entry
            for index, entry in enumerate(entries)
            if kept[index]
        ]
        self.left = sum(self.sizes) - total
