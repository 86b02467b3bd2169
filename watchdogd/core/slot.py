"""What the daemon knows of the slots of a page between its looks (`PageSlots`: one
object a page, whose registrations cost it a few numbers each in its arrays, not
objects of their own), the view of one slot that an arm or a look works through
(`Slot`: made when needed, never kept), and what they write to and take from a
slot (`watchdogd.core.slots` keeps them all, through
`watchdogd.core.process_pages`).

Invariants:

- A slot of a `PageSlots` is `FREE` (no registration of this daemon's: never
  given, gone, or not found again yet after a restart), `OPEN` or `CLOSING`; what
  the arrays hold at a free slot's index means nothing. ``live`` counts the open
  and closing slots its registrations let go of only once.
- Every count read from a slot is bounded: the process may write anything there.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar, overload

from watchdogd_protocol import SlotGrant
from watchdogd_protocol.slot_page import MAX_MICROSECONDS

from .ports import PageRef
from .timers import SlotRef

_V = TypeVar("_V", int, float)

#: The most blocks a harvest takes for each second since the last: more than any
#: process can run, so a count past it was scribbled, not counted.
_BLOCKS_A_SECOND: Final = 5_000_000
#: How long looks leave alone the counts of a slot whose counts were refused as
#: scribbled: a read of them reads every row of counts its page holds, and a
#: process that writes all over its page would have every look pay for it. A
#: harvest asked for (`suggest`, an ``after="auto"`` arm, its process's exit)
#: reads them all the same.
SCRIBBLED_PAUSE: Final = 60.0
#: A slot's state in `PageSlots.state`.
FREE: Final = 0
OPEN: Final = 1
CLOSING: Final = 2
#: A slot's look budget when it counts against none (root's): (uid_t)-1 is no uid.
_NO_BUDGET: Final = 2**32 - 1


@dataclass(frozen=True, slots=True)
class Taken:
    """The blocks a process released since the last take: how many, by bucket;
    ``scribbled`` when more were counted than any process could release."""

    added: dict[int, int]
    scribbled: bool = False
    #: Its rows were not read: past its uid's share of reads (`take`'s ``share``).
    deferred: bool = False


#: A take that read no row, its uid's share of reads spent: the counts stay in the
#: page, totals the next take reads whole.
DEFERRED: Final = Taken({}, deferred=True)


class PageSlots:
    """A page and what the daemon knows of each of its slots, by index: arrays
    grown as its indexes are given (in turn) or found again."""

    __slots__ = (
        "budget",
        "closing",
        "due",
        "executable",
        "harvested",
        "idle_since",
        "live",
        "looked",
        "page",
        "pid",
        "refused",
        "scopes",
        "state",
        "word",
    )

    def __init__(self, page: PageRef, pid: int, executable: str) -> None:
        self.page = page
        #: Its process's pid (a page is one process's alone).
        self.pid = pid
        #: The executable its process ran when the page was made, or found again:
        #: the key of its slots' history, read while the process was known to be
        #: there (a last harvest comes after its exit, when its pidfd may be closed).
        self.executable = executable
        #: Its open and closing slots.
        self.live = 0
        #: Each slot's `FREE`, `OPEN` or `CLOSING`, and its registration's scope.
        self.state = bytearray()
        self.scopes: list[str] = []
        #: The block's deadline as last read (bounded); 0.0 while released.
        self.due = array("d")
        #: The deadline word it was read from: while the word stays, so does the
        #: deadline (one clamped once stays where it was clamped).
        self.word = array("Q")
        #: When it was first seen released, since it last was armed (0.0: armed).
        self.idle_since = array("d")
        #: When it closed (0.0: open).
        self.closing = array("d")
        #: When its word was last read, or written over the socket (-inf: not yet).
        self.looked = array("d")
        #: When its counts were last taken, or refused (or, for a slot found again
        #: after a restart, a time before: its registration's arming).
        self.harvested = array("d")
        #: The slots whose counts the last take refused as scribbled: looks leave
        #: them alone until `SCRIBBLED_PAUSE` after it.
        self.refused: set[int] = set()
        #: The uid whose look budget it counts against (`LOOKS_PER_UID`), if any.
        self.budget = array("I")

    def __repr__(self) -> str:
        return f"<PageSlots {self.page.id}: {self.live} live>"

    def known(self, index: int) -> bool:
        """Whether slot ``index`` is a registration's, to this daemon."""
        return index < len(self.state) and self.state[index] != FREE

    def open(self, index: int, scope: str, budget: int | None, harvested: float) -> None:
        """Slot ``index`` becomes the registration of ``scope`` (given now, or
        found again after a restart): open, read as released, never looked at,
        counted against ``budget``, its counts taken at ``harvested``."""
        grow = index + 1 - len(self.state)
        if grow > 0:
            self.state.extend(bytes(grow))
            self.scopes.extend([""] * grow)
            for numbers in self._arrays():
                numbers.frombytes(bytes(grow * numbers.itemsize))
        self.state[index] = OPEN
        self.scopes[index] = scope
        self.due[index] = self.idle_since[index] = self.closing[index] = 0.0
        self.word[index] = 0
        self.looked[index] = -math.inf
        self.harvested[index] = harvested
        self.refused.discard(index)
        self.budget[index] = _NO_BUDGET if budget is None else budget

    def free(self, index: int) -> None:
        """Slot ``index`` is no registration's any more."""
        self.state[index] = FREE
        self.scopes[index] = ""
        self.refused.discard(index)

    def _arrays(self) -> tuple[array[float] | array[int], ...]:
        return (
            self.due,
            self.word,
            self.idle_since,
            self.closing,
            self.looked,
            self.harvested,
            self.budget,
        )


class _Column(Generic[_V]):
    """A field of `Slot` kept at the slot's index in its page's array of the
    same name (`PageSlots`)."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, slot: None, owner: type) -> _Column[_V]: ...
    @overload
    def __get__(self, slot: Slot, owner: type) -> _V: ...
    def __get__(self, slot: Slot | None, owner: type) -> _V | _Column[_V]:
        if slot is None:
            return self
        column: MutableSequence[_V] = getattr(slot.slots, self.name)
        return column[slot.index]

    def __set__(self, slot: Slot, value: _V) -> None:
        column: MutableSequence[_V] = getattr(slot.slots, self.name)
        column[slot.index] = value


class Slot:
    """The slot ``ref`` names, seen through its page's `PageSlots`: made for an arm
    or a look, never kept (what it knows lives in the arrays)."""

    __slots__ = ("index", "period", "ref", "slots")

    #: What the daemon knows of it, each in its page's array of that name.
    due = _Column[float]()
    word = _Column[int]()
    idle_since = _Column[float]()
    looked = _Column[float]()

    def __init__(self, slots: PageSlots, ref: SlotRef) -> None:
        self.slots = slots
        self.ref = ref
        self.index = ref.index
        self.period = ref.period

    @property
    def page(self) -> PageRef:
        return self.slots.page

    @property
    def executable(self) -> str:
        return self.slots.executable

    @property
    def budget(self) -> int | None:
        budget = self.slots.budget[self.index]
        return None if budget == _NO_BUDGET else budget

    @property
    def closing(self) -> float:
        return self.slots.closing[self.index]

    @closing.setter
    def closing(self, value: float) -> None:
        self.slots.closing[self.index] = value
        self.slots.state[self.index] = CLOSING if value else OPEN

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

    def take(
        self,
        now: float,
        *,
        looking: bool = False,
        share: Callable[[Callable[[], Sequence[int]]], Sequence[int] | None] | None = None,
    ) -> Taken | None:
        """The blocks its process released by a store since the last take, as
        its slot counts them (what was taken is written in the page, so the next
        take, this daemon's or the next one's, adds only what came since); None
        when it released none, or when a look (``looking``) comes within
        `SCRIBBLED_PAUSE` of a take that refused its counts. ``share`` gives the
        rows it may read, given how to find the page's, or None: `DEFERRED`."""
        page, index, slots = self.page, self.index, self.slots
        since = slots.harvested[index]
        if looking and index in slots.refused and now < since + SCRIBBLED_PAUSE:
            return None
        blocks, taken_blocks = page.blocks(index), page.taken(index)
        if blocks == taken_blocks:
            return None
        # Counted before the blocks are judged: a take refused costs the share as
        # one read, so a walk over slots whose blocks are written over and over
        # stops where any other does.
        rows = page.rows() if share is None else share(page.rows)
        if rows is None:
            return DEFERRED
        slots.harvested[index] = now
        bound = _BLOCKS_A_SECOND * max(now - since, 0.0) + 1000
        if (blocks - taken_blocks) % 2**64 > bound:
            # More blocks than any process could release: refused before a row
            # of counts is read.
            page.took(index, blocks, ())
            slots.refused.add(index)
            return Taken({}, scribbled=True)
        counts = page.counts(index, rows)
        page.took(index, blocks, [(bucket, count) for bucket, count, _ in counts])
        added = {bucket: (count - taken) % 2**32 for bucket, count, taken in counts}
        if sum(added.values()) > bound:
            slots.refused.add(index)
            return Taken({}, scribbled=True)
        slots.refused.discard(index)
        return Taken(added)


def microseconds(seconds: float) -> int:
    """``seconds`` as a slot's word holds them, bounded."""
    return max(0, min(int(seconds * 1_000_000), MAX_MICROSECONDS))
