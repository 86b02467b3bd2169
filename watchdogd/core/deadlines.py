"""Deadlines kept in order: the earliest found in O(1), any position in O(log n).

Pure and synchronous: no clock reads, no I/O.

`Deadlines` holds entries that order themselves by ``(deadline, seq)`` (``seq``
tells apart entries with the same deadline; no two entries held are equal). They
sit sorted in a list of chunks of at most ``2 * _CHUNK`` entries, beside a list of
each chunk's last entry: the layout of sortedcontainers' ``SortedList``. Adding or
removing an entry is a binary search over the chunks' last entries, then one in a
chunk, then a move of at most a chunk of pointers, all in C; an entry with the
latest deadline (a timer armed with the usual timeout) is appended without a
search. Against a binary heap of ``(deadline, seq, key)`` tuples beside a dict of
the live keys (trio's ``Deadlines``):

- the order is total, so a status page starts at its cursor in O(log n) and reads
  on from there, where a heap must be walked whole;
- a removal removes: no stale entries to skip, and no rebuild of the whole heap
  (a pass over every timer in one go) when they pile up;
- the entries are the caller's own records (the timer table holds its `Timer`
  records, which order themselves by their first two fields): one pointer an
  entry, no tuple, no key, no second dict.
"""

from __future__ import annotations

import itertools
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, Generic, Protocol, TypeVar

#: Entries per chunk after a split; a chunk splits past twice this, and one that
#: falls under a quarter of it merges with a neighbour. At a million entries the
#: index of chunks has about a thousand, and a move within a chunk stays a
#: memmove of a few kilobytes.
_CHUNK: Final = 1000


class Entry(Protocol):
    """What `Deadlines` holds: an object ordered by ``(deadline, seq)`` first."""

    @property
    def deadline(self) -> float: ...
    @property
    def seq(self) -> int: ...
    def __lt__(self, other: Any, /) -> bool: ...


E = TypeVar("E", bound=Entry)

_deadline_of = operator.attrgetter("deadline")
_position_of = operator.attrgetter("deadline", "seq")
_seq_of = operator.attrgetter("seq")


def _any_adjacent_equal(values: Iterator[object]) -> bool:
    first, second = itertools.tee(values)
    next(second, None)
    return any(map(operator.eq, first, second))


class Deadlines(Generic[E]):
    """Entries in ``(deadline, seq)`` order. Invariants: every chunk is sorted and
    non-empty, each chunk's entries come before the next chunk's, ``_lasts[i]`` is
    ``_chunks[i][-1]``, and ``_len`` counts the entries. No chunk holds more than
    twice ``chunk`` entries, and none but the first and the last fewer than a
    quarter of it (`pop_due` shortens the first; a restart may leave the last
    short)."""

    __slots__ = ("_chunk", "_chunks", "_lasts", "_len")

    def __init__(self, entries: Iterable[E] = (), *, chunk: int = _CHUNK) -> None:
        """Hold ``entries``, which must be in order already (a restart sorts them
        once, with `sort`, rather than inserting a million one by one). ``chunk``
        is for tests, which exercise splits and merges with small chunks."""
        self._chunk = chunk
        self._fill(list(entries))

    def _fill(self, ordered: list[E]) -> None:
        size = self._chunk
        self._chunks = [ordered[i : i + size] for i in range(0, len(ordered), size)]
        self._lasts = [chunk[-1] for chunk in self._chunks]
        self._len = len(ordered)

    @staticmethod
    def sort(entries: list[E]) -> None:
        """Sort ``entries`` in place into the order `Deadlines` keeps.

        Sorts on one plain number at a time, which CPython runs without calling
        back into Python, as a comparison of the entries would for each pair. The
        deadline first; only if some share one (rare: timers armed by requests
        have distinct deadlines) by ``seq`` and then the deadline again, and only
        if some tie on both (records of a schema that had no ``seq``) by comparing
        them whole. The checks are C loops that allocate nothing that outlives an
        entry: the memory of a restart's temporaries stays with the process."""
        entries.sort(key=_deadline_of)
        if not _any_adjacent_equal(map(_deadline_of, entries)):
            return
        entries.sort(key=_seq_of)
        entries.sort(key=_deadline_of)
        if _any_adjacent_equal(map(_position_of, entries)):
            entries.sort()

    def __len__(self) -> int:
        return self._len

    def extend(self, later: Deadlines[E]) -> None:
        """Take over every entry of ``later`` (which is left empty): the timers a
        restart loads after the first ones. When they all come after every entry
        held, as a restart's do, it is a move of chunks, whatever their number;
        otherwise both are sorted together."""
        if not later._chunks:
            return
        if self._chunks and not self._lasts[-1] < later._chunks[0][0]:
            merged = [*self, *later]
            Deadlines.sort(merged)
            self._fill(merged)
            later._fill([])
            return
        chunks, lasts = later._chunks, later._lasts
        if self._chunks and len(self._chunks[-1]) < self._chunk // 4 and len(self._chunks) > 1:
            # A short last chunk would sit in the middle: it joins the next one.
            merged = self._chunks.pop() + chunks[0]
            self._lasts.pop()
            halves = (
                [merged]
                if len(merged) <= 2 * self._chunk
                else [
                    merged[: len(merged) // 2],
                    merged[len(merged) // 2 :],
                ]
            )
            chunks = halves + chunks[1:]
            lasts = [half[-1] for half in halves] + lasts[1:]
        self._chunks += chunks
        self._lasts += lasts
        self._len += later._len
        later._fill([])

    def __iter__(self) -> Iterator[E]:
        """Every entry, earliest first."""
        return itertools.chain.from_iterable(self._chunks)

    def first(self) -> E | None:
        """The earliest entry, or None when empty."""
        return self._chunks[0][0] if self._chunks else None

    def insert(self, deadline: float, make: Callable[[int], E]) -> E:
        """Add the entry ``make(seq)``, whose deadline is ``deadline``, and return
        it. ``seq`` is one more than that of the last entry held at exactly that
        deadline, else 0: so equal deadlines come out in the order they were
        added, and ``seq`` is almost always 0, which Python keeps as one shared
        object (a counter would cost an int an entry). One search finds both the
        number and the place; a deadline later than every other (a timer armed
        with the usual timeout) needs none."""
        chunks, lasts = self._chunks, self._lasts
        self._len += 1
        if not chunks:
            entry = make(0)
            chunks.append([entry])
            lasts.append(entry)
            return entry
        if lasts[-1].deadline < deadline:
            entry = make(0)
            index = len(chunks) - 1
            chunk = chunks[index]
            chunk.append(entry)
            lasts[index] = entry
        else:
            # After every entry at or before the deadline, in the first chunk
            # whose last entry is later (or at the end of the last one, when its
            # last entry has that very deadline).
            index = min(bisect_right(lasts, deadline, key=_deadline_of), len(chunks) - 1)
            chunk = chunks[index]
            at = bisect_right(chunk, deadline, key=_deadline_of)
            before = chunk[at - 1] if at else lasts[index - 1] if index else None
            entry = make(before.seq + 1 if before and before.deadline == deadline else 0)
            chunk.insert(at, entry)
            if at == len(chunk) - 1:
                lasts[index] = entry
        size = self._chunk
        if len(chunk) > 2 * size:
            chunks[index : index + 1] = [chunk[:size], chunk[size:]]
            lasts.insert(index, chunk[size - 1])
        return entry

    def remove(self, entry: E) -> None:
        """Remove ``entry`` (this very object); ValueError if it is not held."""
        chunks, lasts = self._chunks, self._lasts
        index = bisect_left(lasts, entry)
        if index < len(chunks):
            chunk = chunks[index]
            at = bisect_left(chunk, entry)
            if at < len(chunk) and chunk[at] is entry:
                del chunk[at]
                self._len -= 1
                if at == len(chunk) or len(chunk) < self._chunk // 4:
                    self._repair(index)  # its last entry went, or it is small
                return
        raise ValueError("entry not held")

    def pop_due(self, now: float, limit: int | None = None) -> list[E]:
        """Remove and return the entries with ``deadline <= now`` (the earliest
        ``limit`` of them, when given), earliest first."""
        due: list[E] = []
        room = self._len if limit is None else limit
        chunks = self._chunks
        while chunks and len(due) < room:
            chunk = chunks[0]
            count = min(bisect_right(chunk, now, key=_deadline_of), room - len(due))
            if count == len(chunk):
                due += chunk
                del chunks[0]
                del self._lasts[0]
                continue
            due += chunk[:count]
            del chunk[:count]
            break
        self._len -= len(due)
        return due

    def after(self, deadline: float, seq: int) -> Iterator[E]:
        """The entries after ``(deadline, seq)``, in order, from a binary search:
        where a status page resumes from its cursor. The entries must not change
        while the iterator is in use."""
        position = (deadline, seq)
        index = bisect_right(self._lasts, position, key=_position_of)
        if index == len(self._chunks):
            return iter(())
        chunk = self._chunks[index]
        at = bisect_right(chunk, position, key=_position_of)
        return itertools.chain(
            itertools.islice(chunk, at, None),
            itertools.chain.from_iterable(itertools.islice(self._chunks, index + 1, None)),
        )

    def _repair(self, index: int) -> None:
        """Restore the invariants at chunk ``index`` after entries left it: drop
        it when empty, fix its last entry, merge it into a neighbour when small
        (so a million removals cannot leave a million one-entry chunks)."""
        chunks, lasts = self._chunks, self._lasts
        chunk = chunks[index]
        if not chunk:
            del chunks[index]
            del lasts[index]
            return
        lasts[index] = chunk[-1]
        if len(chunk) >= self._chunk // 4 or len(chunks) == 1:
            return
        low = index if index + 1 < len(chunks) else index - 1
        merged = chunks[low] + chunks[low + 1]
        if len(merged) > 2 * self._chunk:
            half = len(merged) // 2
            chunks[low : low + 2] = [merged[:half], merged[half:]]
            lasts[low] = merged[half - 1]
        else:
            chunks[low : low + 2] = [merged]
            del lasts[low]

    def chunk_sizes(self) -> list[int]:
        """The length of each chunk (for tests of the layout's bounds)."""
        return [len(chunk) for chunk in self._chunks]
