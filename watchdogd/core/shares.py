"""Per-uid shares of a bounded store: whose oldest item gives way to a new one.

A store of items that each belong to a uid (the events ring, the incident log)
keeps at most ``size`` of root's items, a share of their own, and at most ``size``
of all other uids' items together, ``per_uid`` of any one of them. `Shares` counts
what each uid holds and, for each item added, names the uid whose oldest item must
go to make room:

- root, when root holds ``size`` already: no other uid's item ever evicts root's;
- the adding uid itself, when it holds its ``per_uid``;
- else, when the other uids hold ``size`` together, the uid holding the most (the
  adding uid on a tie). So a uid holding no more than its fair share (the shared
  ``size`` over the uids holding any) never loses an item to another uid's, and a
  flood from one uid evicts that uid's own items once it holds the most.

Pure bookkeeping, constant time an item whatever the number of uids: the store
keeps the items and drops the oldest of the uid it is told.

`ByteShares` bounds the bytes the items hold by the same rule (the incident log's
evidence, `watchdogd.core.incidents`): root's own ``size``, ``size`` for every
other uid together and ``per_uid`` for any one. An item's bytes change after it
is kept (a rank's stack comes later), so instead of a victim per addition it names
the uid that must give bytes back (`ByteShares.over`), until none must: a uid over
its own bound first, then, when the other uids together hold more than ``size``,
the one holding the most. A scan of the uids holding any: the stores it serves
keep a bounded number of items, so of uids.
"""

from __future__ import annotations

from .identity import ROOT


class Shares:
    """What each uid holds of a store bounded as the module says."""

    def __init__(self, size: int, per_uid: int | None = None) -> None:
        self._size = size
        self._per_uid = size if per_uid is None else per_uid
        self._held: dict[int, int] = {}
        #: The non-root uids by what they hold; each count's in the order they reached it.
        self._holding: dict[int, dict[int, None]] = {}
        self._most = 0
        self._others = 0

    def __len__(self) -> int:
        """Items held by every uid, root's included."""
        return self._others + self.held(ROOT)

    def held(self, uid: int) -> int:
        """How many items ``uid`` holds."""
        return self._held.get(uid, 0)

    def bound(self, uid: int) -> int:
        """The most items ``uid`` may hold."""
        return self._size if uid == ROOT else min(self._per_uid, self._size)

    def add(self, uid: int) -> int | None:
        """Count one more item of ``uid``: the uid whose oldest item must go to
        make room for it, or None when there is room."""
        if self.held(uid) >= self.bound(uid):
            return uid  # its own oldest goes: what it holds stays the same
        victim = None
        if uid != ROOT and self._others >= self._size:
            victim = self._largest(uid)
            self._count(victim, -1)
        self._count(uid, +1)
        return victim

    def remove(self, uid: int) -> None:
        """Count one item of ``uid`` fewer: the store dropped it itself."""
        if self.held(uid):
            self._count(uid, -1)

    def resize(self, size: int, per_uid: int | None = None) -> list[int]:
        """Bound the store anew: the uids whose oldest items must go to fit, a uid
        for each item, in order (so the newest stay)."""
        self._size = size
        self._per_uid = size if per_uid is None else per_uid
        victims: list[int] = []
        for uid in list(self._held):
            for _ in range(self.held(uid) - self.bound(uid)):
                victims.append(uid)
                self._count(uid, -1)
        while self._others > self._size:
            victim = self._largest(None)
            victims.append(victim)
            self._count(victim, -1)
        return victims

    def _largest(self, adding: int | None) -> int:
        """The non-root uid holding the most (``adding`` on a tie); some must hold any."""
        if adding is not None and self.held(adding) == self._most:
            return adding
        return next(iter(self._holding[self._most]))

    def _count(self, uid: int, delta: int) -> None:
        before = self.held(uid)
        after = before + delta
        if after:
            self._held[uid] = after
        else:
            del self._held[uid]
        if uid == ROOT:
            return
        self._others += delta
        if before:
            peers = self._holding[before]
            del peers[uid]
            if not peers:
                del self._holding[before]
        if after:
            self._holding.setdefault(after, {})[uid] = None
        # Counts move by one: a new most is this uid's, and when the last uid at
        # the most steps down, the most is one less.
        if after > self._most or (before == self._most and before not in self._holding):
            self._most = after


class ByteShares:
    """The bytes each uid holds of a store bounded as the module says."""

    def __init__(self, size: int, per_uid: int | None = None) -> None:
        self._size = size
        self._per_uid = size if per_uid is None else per_uid
        self._held: dict[int, int] = {}
        self._others = 0

    def held(self, uid: int) -> int:
        """How many bytes ``uid`` holds."""
        return self._held.get(uid, 0)

    def bound(self, uid: int) -> int:
        """The most bytes ``uid`` may hold."""
        return self._size if uid == ROOT else min(self._per_uid, self._size)

    def add(self, uid: int, delta: int) -> None:
        """``uid`` holds ``delta`` bytes more (fewer, when negative)."""
        if not delta:
            return
        after = self.held(uid) + delta
        if after > 0:
            self._held[uid] = after
        else:
            self._held.pop(uid, None)
        if uid != ROOT:
            self._others += delta

    def over(self, first: int | None = None) -> int | None:
        """The uid that must give bytes back for the store to fit, or None: ``first``
        when it is over its own bound, else any uid that is, else, when the other
        uids hold more than ``size`` together, the one holding the most (``first``
        on a tie)."""
        if first is not None and self.held(first) > self.bound(first):
            return first
        for uid, held in self._held.items():
            if held > self.bound(uid):
                return uid
        if self._others <= self._size:
            return None
        most = max(held for uid, held in self._held.items() if uid != ROOT)
        if first is not None and first != ROOT and self.held(first) == most:
            return first
        return next(uid for uid, held in self._held.items() if uid != ROOT and held == most)

    def resize(self, size: int, per_uid: int | None = None) -> None:
        """Bound the store anew (`over` then names who must give bytes back)."""
        self._size = size
        self._per_uid = size if per_uid is None else per_uid
