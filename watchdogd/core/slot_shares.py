"""What each uid's registrations of the fast path take (`watchdogd.core.slots`):
the reads a second they ask of the daemon, how many are closing, and the orders
a reclaim picks from.

Invariants:

- A non-root uid's registrations ask for at most `LOOKS_PER_UID` reads a second,
  counting two a period each; root's are not counted.
- ``idle`` lists the registrations seen released at their last look, oldest
  first; ``owned``, every registration, least recently armed over the socket
  first. Both are kept by the registrations' slots (their `SlotRef`, which each
  registration holds already: a key of its own would be an object a
  registration) and may name one that went (a reader skips it).
- The closing count of a uid is what its closing registrations are: retiring,
  so not counted at its limit, but no more of them than its limit.
- A non-root uid's harvests read at most `ROWS_BURST` rows of counts at once and
  `ROWS_PER_UID` a second; root's are not counted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Final

from watchdogd_protocol.slot_page import BUCKETS

from .identity import ROOT
from .timers import SlotRef

#: The reads a second a non-root uid's registrations may ask for, at two a period
#: each (what a registration with a timeout of 10 s asks for is 0.23).
LOOKS_PER_UID: Final = 2_000
#: The rows of counts a non-root uid's harvests read a second at most, and at once
#: (looks, harvests asked for, an exit's): 200 and 20 harvests of pages whose every
#: row is held, as a process that writes all over its rows makes them (one that
#: counts honestly fills a few).
ROWS_PER_UID: Final = 200 * BUCKETS
ROWS_BURST: Final = 20 * BUCKETS
#: How many of a uid's least recently armed registrations a reclaim reads at most
#: for one released now (when none was seen released at a look): its cost is
#: bounded however many a uid keeps armed.
RECLAIM_READS: Final = 16


class SlotShares:
    """Each uid's share of the fast path: its reads, its closing registrations,
    and the orders a reclaim picks one of them from."""

    def __init__(self) -> None:
        #: Registrations seen released at their last look, by uid, oldest first.
        self._idle: dict[int, dict[SlotRef, None]] = {}
        #: Every registration by uid, least recently armed over the socket first.
        self._owned: dict[int, dict[SlotRef, None]] = {}
        #: The reads a second each non-root uid's registrations ask for.
        self._looks: dict[int, float] = {}
        #: Closing registrations by uid.
        self._closing: dict[int, int] = {}
        #: The rows each non-root uid's harvests may still read, and when that was.
        self._rows: dict[int, tuple[float, float]] = {}

    # Reads.

    def budget(self, owner: int) -> int | None:
        """The uid whose look budget a registration of ``owner`` counts against
        (None: root's count against none)."""
        return None if owner == ROOT else owner

    def room_for(self, budget: int | None, period: float) -> bool:
        """Whether a registration read every ``period`` seconds fits ``budget``."""
        return budget is None or self._looks.get(budget, 0.0) + 2 / period <= LOOKS_PER_UID

    def count_looks(self, budget: int | None, period: float, step: int) -> None:
        """Count a registration read every ``period`` in (``step`` 1) or out (-1)."""
        if budget is None:
            return
        left = self._looks.get(budget, 0.0) + step * 2 / period
        if left > 1e-9:
            self._looks[budget] = left
        else:
            self._looks.pop(budget, None)
            self._rows.pop(budget, None)

    def read(
        self, budget: int | None, now: float, rows: Callable[[], Sequence[int]]
    ) -> Sequence[int] | None:
        """The rows of counts a harvest at ``now`` of a registration counted against
        ``budget`` reads: ``rows()`` (its page's, looked for only while the share
        has room for a page's every row), counted; None past the share."""
        if budget is None:
            return rows()
        left, at = self._rows.get(budget, (ROWS_BURST, now))
        left = min(ROWS_BURST, left + max(now - at, 0.0) * ROWS_PER_UID)
        wanted = rows() if left >= BUCKETS else None
        if wanted is not None and len(wanted) <= left:
            left -= len(wanted)
        else:
            wanted = None
        self._rows[budget] = (left, now)
        return wanted

    # Closing.

    def closing_of(self, uid: int, limit: int) -> int:
        """How many of ``uid``'s registrations are closing, up to ``limit``."""
        return min(self._closing.get(uid, 0), limit)

    def count_closing(self, uid: int, step: int) -> None:
        left = self._closing.get(uid, 0) + step
        if left > 0:
            self._closing[uid] = left
        else:
            self._closing.pop(uid, None)

    # The orders a reclaim picks from.

    def idle(self, uid: int, key: SlotRef) -> None:
        """``key`` of ``uid`` was seen released: last of its idle ones."""
        self._idle.setdefault(uid, {})[key] = None

    def busy(self, uid: int, key: SlotRef) -> None:
        """``key`` of ``uid`` holds a block, or went: no longer idle."""
        idle = self._idle.get(uid)
        if idle is not None:
            idle.pop(key, None)
            if not idle:
                del self._idle[uid]

    def idle_first(self, uid: int) -> SlotRef | None:
        """``uid``'s registration seen released the longest, if any (the caller
        `busy`-es one that went, and asks again)."""
        idle = self._idle.get(uid)
        return next(iter(idle)) if idle else None

    def armed(self, uid: int, key: SlotRef) -> None:
        """``key`` of ``uid`` was armed over the socket: last of its owned ones."""
        owned = self._owned.setdefault(uid, {})
        owned.pop(key, None)
        owned[key] = None

    def disowned(self, uid: int, key: SlotRef) -> None:
        """``key`` of ``uid`` went, or closed: no reclaim picks it."""
        owned = self._owned.get(uid)
        if owned is not None:
            owned.pop(key, None)
            if not owned:
                del self._owned[uid]

    def owned_first(self, uid: int, count: int) -> list[SlotRef]:
        """``uid``'s ``count`` least recently armed registrations; each goes last,
        so that the next reclaim reads others."""
        owned = self._owned.get(uid)
        keys = list(itertools.islice(owned or (), count))
        for key in keys:
            self.armed(uid, key)
        return keys

    def reclaimable(self, uid: int, held: Callable[[SlotRef], bool | None]) -> SlotRef | None:
        """The registration of ``uid`` a reclaim closes: the one seen released the
        longest, or else one of its least recently armed (at most `RECLAIM_READS`
        of them read) that holds no block now; each read goes last, so the next
        reclaim reads others. ``held(key)``: whether ``key`` holds a block or
        closes, None when it is no registration of ``uid`` now."""
        while (key := self.idle_first(uid)) is not None:
            if held(key) is not None:
                return key
            self.busy(uid, key)
        for key in self.owned_first(uid, RECLAIM_READS):
            state = held(key)
            if state is None:
                self.disowned(uid, key)
            elif not state:
                return key
        return None

    def clear(self) -> None:
        self._idle.clear()
        self._owned.clear()
        self._looks.clear()
        self._closing.clear()
        self._rows.clear()
