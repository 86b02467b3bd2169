"""One registration's slot as the daemon knows it between its looks, and what it
writes to and takes from the slot (`watchdogd.core.slots` keeps them all).

Every count read from a slot is bounded: the process may write anything there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from watchdogd_protocol import SlotGrant
from watchdogd_protocol.slot_page import MAX_MICROSECONDS

from .ports import PageRef

#: The most blocks a harvest takes for each second since the last: more than any
#: process can run, so a count past it was scribbled, not counted.
_BLOCKS_A_SECOND: Final = 5_000_000


@dataclass(frozen=True, slots=True)
class Taken:
    """The blocks a process released since the last take: how many, by bucket;
    ``scribbled`` when more were counted than any process could release."""

    added: dict[int, int]
    scribbled: bool = False


@dataclass(slots=True, eq=False)
class Slot:
    """What the daemon knows of one registration between its looks."""

    page: PageRef
    index: int
    period: float
    #: The executable its process ran when the slot was made: the key of its
    #: history, read while the process is known to be there (its last harvest
    #: comes after its exit, when its pidfd may be closed).
    executable: str
    #: The block's deadline as last read (bounded); 0.0 while released.
    due: float = 0.0
    #: The deadline word it was read from: while the word stays, so does ``due``
    #: (a deadline clamped once stays where it was clamped).
    word: int = 0
    #: When it was first seen released, since it last was armed (0.0: armed).
    idle_since: float = 0.0
    #: When it closed (0.0: open).
    closing: float = 0.0
    #: When its word was last read, or written over the socket (-inf: not yet).
    looked: float = -math.inf
    #: The uid whose look budget it counts against (`LOOKS_PER_UID`), if any.
    budget: int | None = None
    #: When its counts were last taken (or, for a slot found again after a
    #: restart, a time before: its registration's arming).
    harvested: float = 0.0

    def arm(self, deadline: float, auto: float | None, at: float) -> SlotGrant:
        """Armed over the socket at ``at`` until ``deadline`` (``auto``: the timeout
        learned, for ``after="auto"``): written to the slot, which opens again."""
        period = microseconds(self.period)
        self.word = microseconds(deadline)
        self.looked = at
        self.page.write(self.index, deadline=self.word, period=period)
        if auto is not None:
            self.page.write_auto(self.index, microseconds(auto))
        self.closing = 0.0
        return SlotGrant(page=self.page.id, index=self.index, period=period)

    def release(self) -> bool:
        """Released over the socket: whether it held a block."""
        armed = self.page.read(self.index) != 0
        self.page.write(self.index, deadline=0)
        self.due = 0.0
        self.word = 0
        return armed

    def take(self, now: float) -> Taken | None:
        """The blocks its process released by a store since the last take, as
        its slot counts them (what was taken is written in the page, so the next
        take, this daemon's or the next one's, adds only what came since); None
        when it released none."""
        page, index = self.page, self.index
        blocks = page.blocks(index)
        if blocks == page.taken(index):
            return None
        counts = page.counts(index)
        page.took(index, blocks, [(bucket, count) for bucket, count, _ in counts])
        added = {bucket: (count - taken) % 2**32 for bucket, count, taken in counts}
        since, self.harvested = self.harvested, now
        if sum(added.values()) > _BLOCKS_A_SECOND * max(now - since, 0.0) + 1000:
            return Taken({}, scribbled=True)
        return Taken(added)


def microseconds(seconds: float) -> int:
    """``seconds`` as a slot's word holds them, bounded."""
    return max(0, min(int(seconds * 1_000_000), MAX_MICROSECONDS))
