"""Deadlines by key, on the daemon's `Deadlines`: the order the scheduler's tests and
the model tests of `Deadlines` arm and pop, for callers that have no record of their own.

The timer table keeps its `Timer` records in `Deadlines` directly; this keeps a
small frozen entry a key and a dict of the live ones, so that setting a key again
replaces its deadline."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

import msgspec

from watchdogd.core.deadlines import Deadlines

K = TypeVar("K", bound=Hashable)


class _Keyed(msgspec.Struct, Generic[K], frozen=True, order=True):
    """An entry; ``seq`` is unique among entries at one deadline, so keys are never
    compared."""

    deadline: float
    seq: int
    key: K


class KeyedDeadlines(Generic[K]):
    """Deadlines by key; the earliest one is found in O(1), set or removed in
    O(log n). Setting a key again replaces its deadline; equal deadlines come out
    in the order they were set."""

    __slots__ = ("_live", "_order")

    def __init__(self) -> None:
        self._order: Deadlines[_Keyed[K]] = Deadlines()
        self._live: dict[K, _Keyed[K]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __iter__(self) -> Iterator[tuple[K, float]]:
        """Every ``(key, deadline)``, earliest first."""
        for entry in self._order:
            yield entry.key, entry.deadline

    def get(self, key: K) -> float | None:
        """The deadline of ``key``, or None."""
        entry = self._live.get(key)
        return None if entry is None else entry.deadline

    def set(self, key: K, deadline: float) -> None:
        """Set (or replace) the deadline of ``key``."""
        self.remove(key)
        self._live[key] = self._order.insert(deadline, lambda seq: _Keyed(deadline, seq, key))

    def remove(self, key: K) -> bool:
        """Remove ``key``; returns whether it was present."""
        entry = self._live.pop(key, None)
        if entry is None:
            return False
        self._order.remove(entry)
        return True

    def peek(self) -> tuple[K, float] | None:
        """The key with the earliest deadline and that deadline, or None when empty."""
        entry = self._order.first()
        return None if entry is None else (entry.key, entry.deadline)

    def next_deadline(self) -> float | None:
        """The earliest deadline, or None when empty."""
        entry = self._order.first()
        return None if entry is None else entry.deadline

    def pop_due(self, now: float, limit: int | None = None) -> list[tuple[K, float]]:
        """Remove and return every ``(key, deadline)`` with ``deadline <= now``
        (the earliest ``limit`` of them, when given), earliest first."""
        due = self._order.pop_due(now, limit)
        for entry in due:
            del self._live[entry.key]
        return [(entry.key, entry.deadline) for entry in due]
