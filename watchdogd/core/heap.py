"""A min-heap of deadlines keyed by an arbitrary hashable key.

Pure and synchronous: no clock reads, no I/O. Setting a key again replaces its
deadline; removing a key is O(1). Both leave the old heap entry in place, marked stale
by its sequence number, and stale entries are skipped when they reach the top. When
stale entries outnumber live ones the heap is rebuilt from the live set, so its size
stays within a constant factor of the number of live keys.

Entries are ``(deadline, seq, key)``; ``seq`` is unique, so keys are never compared and
equal deadlines come out in the order they were set.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: Stale entries tolerated beyond the live count before a rebuild; avoids rebuilding
#: tiny heaps over and over.
_PRUNE_SLACK: Final = 64


class DeadlineHeap(Generic[K]):
    """Deadlines by key; the earliest one is found in O(1), set or removed in O(log n)."""

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._live: dict[K, tuple[float, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __iter__(self) -> Iterator[tuple[K, float]]:
        """Every live ``(key, deadline)``, in no particular order."""
        for key, (deadline, _) in self._live.items():
            yield key, deadline

    def get(self, key: K) -> float | None:
        """The deadline of ``key``, or None."""
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def set(self, key: K, deadline: float) -> None:
        """Set (or replace) the deadline of ``key``."""
        seq = next(self._seq)
        self._live[key] = (deadline, seq)
        heapq.heappush(self._heap, (deadline, seq, key))
        self._prune_if_needed()

    def set_many(self, keys: list[K], deadlines: list[float]) -> None:
        """Set the deadlines of many keys new to the heap at once: one heapify,
        not a push each (a restart loads a million)."""
        first = next(self._seq)
        numbers = range(first, first + len(keys))
        self._seq = itertools.count(first + len(keys))
        self._live.update(zip(keys, zip(deadlines, numbers, strict=True), strict=True))
        self._heap.extend(zip(deadlines, numbers, keys, strict=True))
        heapq.heapify(self._heap)
        self._prune_if_needed()

    def remove(self, key: K) -> bool:
        """Remove ``key``; returns whether it was present."""
        if self._live.pop(key, None) is None:
            return False
        self._prune_if_needed()
        return True

    def peek(self) -> tuple[K, float] | None:
        """The key with the earliest deadline and that deadline, or None when empty."""
        heap = self._heap
        while heap:
            deadline, seq, key = heap[0]
            if self._is_live(seq, key):
                return key, deadline
            heapq.heappop(heap)
        return None

    def next_deadline(self) -> float | None:
        """The earliest deadline, or None when empty."""
        top = self.peek()
        return None if top is None else top[1]

    def pop_due(self, now: float, limit: int | None = None) -> list[tuple[K, float]]:
        """Remove and return every ``(key, deadline)`` with ``deadline <= now``
        (the earliest ``limit`` of them, when given), earliest first."""
        due: list[tuple[K, float]] = []
        heap = self._heap
        room = -1 if limit is None else limit
        while heap and heap[0][0] <= now and len(due) != room:
            deadline, seq, key = heapq.heappop(heap)
            if self._is_live(seq, key):
                del self._live[key]
                due.append((key, deadline))
        return due

    def _is_live(self, seq: int, key: K) -> bool:
        entry = self._live.get(key)
        return entry is not None and entry[1] == seq

    def _prune_if_needed(self) -> None:
        if len(self._heap) > 2 * len(self._live) + _PRUNE_SLACK:
            self._heap = [(deadline, seq, key) for key, (deadline, seq) in self._live.items()]
            heapq.heapify(self._heap)

    def heap_size(self) -> int:
        """Entries held, stale ones included (for tests and statistics)."""
        return len(self._heap)
