"""Slot pages in plain memory, for the core's rules without memfds: a page port
(`FakePages`) whose pages (`FakePage`, the daemon's handle) share a `Memory` with
the process that holds them, which the tests write as that process would
(`Memory.store`, `Memory.release`), through the layout of
`watchdogd_protocol.slot_page`.

A page is held by a process once it was handed to it (`FakePages.hand`, as a
`MapPage` does), and only a held page can be adopted again (after a restart:
`FakePages.restarted` is the next daemon's port onto the same processes). A
daemon's handle that was closed refuses every read and write, as a real page's
released mapping does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from watchdogd.core.ports import SEARCHING, PageRef, Searching, TargetProcess
from watchdogd_protocol.slot_page import (
    AUTO,
    BLOCKS,
    BUCKETS,
    DEADLINE,
    HEADER_MAGIC,
    HEADER_SLOTS,
    LARGEST,
    MAGIC,
    PAGE_BYTES,
    PERIOD,
    SLOTS,
    TAKEN,
    bucket_of,
    count_of,
    moved_slots,
    taken_of,
    word_of,
)


def microseconds(seconds: float) -> int:
    """``seconds`` as a slot word holds them."""
    return round(seconds * 1_000_000)


class Memory:
    """The bytes of one page, as both its daemon and its process map them."""

    def __init__(self) -> None:
        self.data = bytearray(PAGE_BYTES)
        self.words = memoryview(self.data).cast("Q")
        self.counts = memoryview(self.data).cast("I")
        self.words[HEADER_MAGIC] = MAGIC
        self.words[HEADER_SLOTS] = SLOTS

    # What the process reads.

    def period(self, index: int) -> int:
        """The period the daemon wrote in slot ``index`` (0: closed), microseconds."""
        return self.words[word_of(index, PERIOD)]

    def deadline(self, index: int) -> int:
        """The deadline word of slot ``index``."""
        return self.words[word_of(index, DEADLINE)]

    def auto(self, index: int) -> int:
        """The timeout the daemon wrote for ``after="auto"``, microseconds."""
        return self.words[word_of(index, AUTO)]

    # What the process writes.

    def store(self, index: int, deadline: float) -> None:
        """Arm slot ``index`` until ``deadline`` (seconds of the daemon's clock)."""
        self.words[word_of(index, DEADLINE)] = microseconds(deadline)

    def word(self, index: int, value: int) -> None:
        """Store ``value``, whatever it is, as slot ``index``'s deadline word."""
        self.words[word_of(index, DEADLINE)] = value

    def release(self, index: int, held: float | None = None) -> None:
        """Release slot ``index`` by a store; with ``held``, count a block of that
        many seconds as the client does (its bucket, the largest, the blocks)."""
        if held is not None:
            took = microseconds(held)
            at = count_of(index, bucket_of(took))
            self.counts[at] = (self.counts[at] + 1) & (2**32 - 1)
            largest = word_of(index, LARGEST)
            self.words[largest] = max(self.words[largest], took)
            blocks = word_of(index, BLOCKS)
            self.words[blocks] = (self.words[blocks] + 1) & (2**64 - 1)
        self.words[word_of(index, DEADLINE)] = 0

    def scribble_counts(self, index: int, bucket: int, count: int, blocks: int) -> None:
        """Write a count and a block count no release made."""
        self.counts[count_of(index, bucket)] = count
        self.words[word_of(index, BLOCKS)] = blocks

    # What the daemon wrote.

    def taken(self, index: int, bucket: int) -> int:
        """What the daemon took of slot ``index``'s count of ``bucket``."""
        return self.counts[taken_of(index, bucket)]


class FakePage:
    """The daemon's handle on a page (`watchdogd.core.ports.PageRef`)."""

    def __init__(self, page_id: int, memory: Memory) -> None:
        self._id = page_id
        self.memory = memory
        self.closed = False
        #: How many times `close_all` was called.
        self.closed_all = 0

    @property
    def id(self) -> int:
        return self._id

    @property
    def fd(self) -> int:
        return -1

    def _words(self) -> memoryview:
        if self.closed:
            raise ValueError(f"slot page {self._id} used after its close")
        return self.memory.words

    def read(self, index: int) -> int:
        return self._words()[word_of(index, DEADLINE)]

    def blocks(self, index: int) -> int:
        return self._words()[word_of(index, BLOCKS)]

    def largest(self, index: int) -> int:
        return self._words()[word_of(index, LARGEST)]

    def taken(self, index: int) -> int:
        return self._words()[word_of(index, TAKEN)]

    def moved(self) -> Sequence[int]:
        return moved_slots(self._words())

    def rows(self) -> Sequence[int]:
        self._words()
        return range(BUCKETS)  # the memory is a bytearray: every row is held

    def counts(self, index: int, rows: Iterable[int]) -> Sequence[tuple[int, int, int]]:
        self._words()
        counts = self.memory.counts
        pairs = ((b, counts[count_of(index, b)], counts[taken_of(index, b)]) for b in rows)
        return [(b, count, taken) for b, count, taken in pairs if count != taken]

    def took(self, index: int, blocks: int, counts: Iterable[tuple[int, int]]) -> None:
        for bucket, count in counts:
            self.memory.counts[taken_of(index, bucket)] = count
        self._words()[word_of(index, TAKEN)] = blocks

    def write(self, index: int, *, deadline: int | None = None, period: int | None = None) -> None:
        words = self._words()
        if deadline is not None:
            words[word_of(index, DEADLINE)] = deadline
        if period is not None:
            words[word_of(index, PERIOD)] = period

    def write_auto(self, index: int, timeout: int) -> None:
        self._words()[word_of(index, AUTO)] = timeout

    def close_all(self) -> None:
        words = self._words()
        self.closed_all += 1
        for index in range(SLOTS):
            words[word_of(index, PERIOD)] = 0

    def close(self) -> None:
        self._words()
        self.closed = True


class FakeSearch:
    """A search of `FakePages`: it ends at its last step, whatever the clock,
    finding the pages wanted then that its process holds (a page it was asked
    for after its first step is found only when ``late_found``: a real search
    may have read its descriptor already)."""

    def __init__(self, port: FakePages, pid: int, wanted: AbstractSet[int], steps: int) -> None:
        self._port, self.pid = port, pid
        self.wanted = wanted
        self.first = set(wanted)
        self.steps_left = steps
        self.stepped = False
        self.closed = False

    def step(self, until: float) -> Mapping[int, PageRef] | Searching:
        assert not self.closed, "a search stepped after it was closed"
        if not self.stepped:
            self.stepped = True
            self.first = set(self.wanted)
        self.steps_left -= 1
        if self.steps_left > 0:
            return SEARCHING
        found: dict[int, PageRef] = {}
        for page in sorted(self.wanted):
            if page in self.first or self._port.late_found:
                held = self._port.found(self.pid, page)
                if held is not None:
                    found[page] = held
        return found

    def close(self) -> None:
        self.closed = True


class FakePages:
    """A page port (`watchdogd.core.ports.PagePort`) on plain memory."""

    def __init__(self, *, first_id: int = 1) -> None:
        self._ids = itertools.count(first_id)
        #: Every page made, by id, and the daemon's handle on it.
        self.made: dict[int, FakePage] = {}
        #: The pages each process holds (mapped), by pid and page id.
        self.held: dict[int, dict[int, Memory]] = {}
        #: Pids in another time namespace: offered no page.
        self.other_clock: set[int] = set()
        #: How far each process's clock reads ahead of the daemon's, by pid
        #: (after it moved to another time namespace; None: not known).
        self.offsets: dict[int, float | None] = {}
        #: Whether no page can be made now (memfd_create failing).
        self.exhausted = False
        #: The handles searches gave.
        self.adopted: list[FakePage] = []
        #: How many steps a search takes (a process with many descriptors).
        self.search_steps = 1
        #: Every search begun, in turn.
        self.searches: list[FakeSearch] = []
        #: Whether a page asked for after a search's first step is found by it.
        self.late_found = True

    @property
    def adoptions(self) -> list[tuple[int, int]]:
        """The pages searched for, in turn: (pid, page id), each search's in order."""
        return [(search.pid, page) for search in self.searches for page in sorted(search.wanted)]

    def shares_clock(self, process: TargetProcess) -> bool:
        return process.pid not in self.other_clock

    def clock_offset(self, process: TargetProcess) -> float | None:
        return self.offsets.get(process.pid, 0.0)

    def new_page(self) -> PageRef | None:
        if self.exhausted:
            return None
        page = FakePage(next(self._ids), Memory())
        self.made[page.id] = page
        return page

    def search(self, process: TargetProcess, wanted: AbstractSet[int]) -> FakeSearch:
        search = FakeSearch(self, process.pid, wanted, self.search_steps)
        self.searches.append(search)
        return search

    def found(self, pid: int, page: int) -> PageRef | None:
        """Page ``page`` as process ``pid`` holds it now: what a search finds."""
        memory = self.held.get(pid, {}).get(page)
        if memory is None:
            return None
        found = FakePage(page, memory)
        self.adopted.append(found)
        return found

    # What the tests do as the process or the host.

    def hand(self, pid: int, page: int) -> Memory:
        """Process ``pid`` maps page ``page`` (its `MapPage`): its memory."""
        memory = self.made[page].memory
        self.held.setdefault(pid, {})[page] = memory
        return memory

    def memory(self, page: int) -> Memory:
        """The memory of page ``page``, made by this port or adopted by it."""
        if page in self.made:
            return self.made[page].memory
        return next(found.memory for found in self.adopted if found.id == page)

    def restarted(self) -> FakePages:
        """The port of the daemon that starts next: the pages the processes hold
        are theirs still; the new daemon has made none."""
        port = FakePages(first_id=max([*self.made, *(p.id for p in self.adopted), 0]) + 1)
        port.held = {pid: dict(pages) for pid, pages in self.held.items()}
        port.other_clock = set(self.other_clock)
        port.offsets = dict(self.offsets)
        return port
