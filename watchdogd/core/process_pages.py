"""The slot pages each process has (each with what the daemon knows of its slots,
`watchdogd.core.slot.PageSlots`): which page its next registration takes a slot
of, how many open or closing slots each page holds, and when a page goes.

Invariants:

- A page is its process's alone: pages are kept by process (its pid and start
  time), never by pid, so a process that holds a pid after another never gets a
  page of the one before (whose descriptors a child of it may still hold).
- A process keeps its pages only while one of them holds an open or closing slot,
  so one that left the table (its exit then unwatched) leaves none behind; a
  page that gives no new slot goes as soon as it holds none.
- A slot's index is given once: a late store of an old scope cannot land on a
  new one. A page found again after a restart gives no new slot (which of its
  indexes the daemon before gave is not known).
- The slots of a page are of one executable's (the key of their history): a
  registration of a process that runs another since its newest page was made
  (it exec'd) takes a slot of a new page.
- A process's descriptors are read once for all the pages its registrations
  name (`found`: those of every registration not read yet, and any asked for
  while the read goes on): a worker that outlived restarts, each of which began
  a page for its next registration, has its descriptors read once, not once a
  page. A page that read did not find is lost (a later read finds nothing
  either), unless it was asked for once the read had begun: it is searched for
  again. A page is held once: one found again while held already is let go.
  A search goes a slice at a time (`search`), between the passes that fire
  timers: a process holding tens of thousands of descriptors delays no timer.
  The looks that wait for a search come back once it ends (``come_back``), not
  before. A slot closed while its page is being searched for (another caller
  armed its scope) is closed in the page once it is found, so its process sees
  it closed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Final, Generic

from watchdogd_protocol.slot_page import SLOTS

from .ports import SEARCHING, P, PagePort, PageRef, PageSearch, Searching, TargetProcess
from .slot import FREE, PageSlots, Slot
from .timers import Key, SlotRef

ProcessKey = tuple[int, int]

#: How soon a look whose page is being searched for after a restart comes again
#: unless the search ends first: its end brings every look that waits for it
#: back at once (`ProcessPages.wait`), so a look is never polled while the
#: search goes on.
SEARCH_PAUSE: Final = 0.25


def process_key(process: TargetProcess) -> ProcessKey:
    """What keeps a process's pages: its pid, and its start time, which tells it
    from every other process that held or will hold that pid."""
    return process.pid, process.start_time


@dataclass(slots=True, eq=False)
class _Pages:
    """A process's pages by id, the one that gives its new slots (none found again
    after a restart ever does), and the next index it gives."""

    pages: dict[int, PageSlots] = field(default_factory=dict)
    newest: PageSlots | None = None
    next_index: int = SLOTS


@dataclass(slots=True, eq=False)
class _Search(Generic[P]):
    """A search for pages of one process: the pages it looks for (the set the
    search reads, which grows while it goes on), those asked for once it had
    begun (their descriptors may have been read already), the registrations
    whose looks wait for each page (their indexes), the slots to close in each
    once found, and the executable of its process when the search began."""

    process: P
    search: PageSearch
    wanted: set[int]
    executable: str
    begun: bool = False
    late: set[int] = field(default_factory=set)
    waiting: dict[int, set[int]] = field(default_factory=dict)
    closes: dict[int, set[int]] = field(default_factory=dict)


class ProcessPages(Generic[P]):
    """Every process's slot pages, made and found again through ``port``."""

    def __init__(self, port: PagePort[P], come_back: Callable[[Key, float], None]) -> None:
        """``come_back(key, looked)``: the look at registration ``key`` at
        ``looked`` waited for a search that ended; it may come now."""
        self._port = port
        self._come_back = come_back
        self._pages: dict[ProcessKey, _Pages] = {}
        #: Every page, by id.
        self._by_id: dict[int, PageSlots] = {}
        #: Pages searched for and not found, by process.
        self._lost: dict[ProcessKey, set[int]] = {}
        #: The search of each process whose pages are searched for, the oldest
        #: first.
        self._searches: dict[ProcessKey, _Search[P]] = {}
        #: The looks that wait for each process's search: when each looked, by
        #: registration.
        self._waiting: dict[ProcessKey, dict[Key, float]] = {}

    def new_slot(self, process: P, executable: str) -> tuple[PageSlots, int] | None:
        """A slot for a registration of ``process``, which runs ``executable``: its
        page and index; None when it may have none (another clock, no page to be
        had)."""
        key = process_key(process)
        own = self._pages.get(key)
        if own is None:
            if not self._port.shares_clock(process):
                return None
            own = self._pages[key] = _Pages()
        slots = own.newest
        if slots is None or own.next_index >= SLOTS or slots.executable != executable:
            page = self._port.new_page()
            if page is None:
                if not own.pages:
                    del self._pages[key]
                return None
            if slots is not None and not slots.live:
                # Kept only to give slots, which it gives no more.
                del own.pages[slots.page.id]
                self._close(slots)
            slots = own.newest = own.pages[page.id] = PageSlots(page, process.pid, executable)
            self._by_id[page.id] = slots
            own.next_index = 0
        index = own.next_index
        own.next_index += 1
        slots.live += 1
        return slots, index

    def found(
        self,
        process: P,
        page_id: int,
        index: int,
        executable: str,
        unread: Callable[[], Iterable[tuple[int, int]]] = tuple,
    ) -> PageSlots | Searching | None:
        """Page ``page_id`` of ``process`` (which runs ``executable``) for its
        registration on slot ``index`` read from the state: one it has already, or
        found again among its descriptors; None when it holds no such page,
        `SEARCHING` while it is searched for (a first slice is searched at once).
        ``unread()``: the pages and indexes of its process's other registrations
        not read yet, looked for in the same read of its descriptors."""
        key = process_key(process)
        slots = self.page_for(process, page_id)
        if slots is None:
            if page_id in self._lost.get(key, ()):
                return None
            pending = self._searches.get(key)
            if pending is None:
                pending = self._begin(process, key, {page_id}, executable)
                lost = self._lost.get(key, ())
                for other, other_index in unread():
                    if other not in lost and self.page_for(process, other) is None:
                        pending.wanted.add(other)
                        pending.waiting.setdefault(other, set()).add(other_index)
                pending.waiting.setdefault(page_id, set()).add(index)
                # As much as one descriptor's worth: a process that holds few is
                # found at once.
                if self._step(key, pending, -math.inf):
                    return SEARCHING
                return self.found(process, page_id, index, executable)
            self._want(pending, page_id)
            pending.waiting.setdefault(page_id, set()).add(index)
            return SEARCHING
        slots.live += 1
        return slots

    def close_found(self, process: P, ref: SlotRef, executable: str) -> None:
        """Slot ``ref``, of a page ``process`` holds perhaps, closes: now if its page
        is known, else once its search finds it."""
        key, page_id, index = process_key(process), ref.page, ref.index
        slots = self.page_for(process, page_id)
        if slots is not None:
            slots.page.write(index, period=0)
            return
        if page_id in self._lost.get(key, ()):
            return
        pending = self._searches.get(key)
        if pending is None:
            pending = self._begin(process, key, {page_id}, executable)
        self._want(pending, page_id)
        pending.waiting.get(page_id, set()).discard(index)
        pending.closes.setdefault(page_id, set()).add(index)

    def _begin(self, process: P, key: ProcessKey, wanted: set[int], executable: str) -> _Search[P]:
        """A search of ``process``'s descriptors for the pages ``wanted``."""
        pending = _Search(process, self._port.search(process, wanted), wanted, executable)
        self._searches[key] = pending
        return pending

    @staticmethod
    def _want(pending: _Search[P], page_id: int) -> None:
        if page_id not in pending.wanted:
            pending.wanted.add(page_id)
            if pending.begun:
                pending.late.add(page_id)

    def search(self, until: float) -> bool:
        """Search on for the pages asked for, the oldest search first, until the
        clock reads ``until``; whether any is still searched for."""
        return any(self._step(key, pending, until) for key, pending in list(self._searches.items()))

    def _step(self, key: ProcessKey, pending: _Search[P], until: float) -> bool:
        """Search on for the pages of the process of ``key``; whether it goes on
        (a search again for the pages asked for too late to be found)."""
        pending.begun = True
        found = pending.search.step(until)
        if found is SEARCHING:
            return True
        del self._searches[key]
        pending.search.close()
        again = {page_id for page_id in pending.late if page_id not in found}
        lost = pending.wanted - found.keys() - again
        if lost:
            self._lost.setdefault(key, set()).update(lost)
        for page_id, page in found.items():
            self._found(key, pending, page_id, page)
        if not again:
            for waiting, looked in self._waiting.pop(key, {}).items():
                self._come_back(waiting, looked)
            return False
        retry = self._begin(pending.process, key, again, pending.executable)
        for page_id in again:
            retry.waiting[page_id] = pending.waiting.get(page_id, set())
            retry.closes[page_id] = pending.closes.get(page_id, set())
        return True

    def wait(self, process: TargetProcess, key: Key, looked: float) -> float:
        """The look at registration ``key`` at ``looked`` waits for the search of
        ``process``'s pages: it comes back once that ends (``come_back``). When it
        comes again if the search has not ended by then."""
        self._waiting.setdefault(process_key(process), {})[key] = looked
        return looked + SEARCH_PAUSE

    def _found(self, key: ProcessKey, pending: _Search[P], page_id: int, page: PageRef) -> None:
        """``page`` was found: its closed slots written, kept while a registration
        waits for it."""
        for index in pending.closes.get(page_id, ()):
            page.write(index, period=0)
        own = self._pages.get(key)
        if not pending.waiting.get(page_id) or (own is not None and page_id in own.pages):
            page.close()  # no registration of it is left, or it is held already
            return
        if own is None:
            own = self._pages[key] = _Pages()
        own.pages[page.id] = self._by_id[page.id] = PageSlots(page, key[0], pending.executable)

    def let_go(self, process: TargetProcess, slots: PageSlots) -> None:
        """A slot of ``slots``'s page is no longer a registration's."""
        key = process_key(process)
        own = self._pages.get(key)
        if own is None:
            return
        slots.live = max(slots.live - 1, 0)
        if not any(held.live for held in own.pages.values()):
            # Its process may have left the table, and then its exit goes unseen:
            # nothing of it may stay behind.
            del self._pages[key]
            for held in own.pages.values():
                self._close(held)
            return
        if slots.live > 0 or (own.newest is slots and own.next_index < SLOTS):
            return
        if own.pages.get(slots.page.id) is slots:
            del own.pages[slots.page.id]
        if own.newest is slots:
            own.newest = None
        self._close(slots)

    def _close(self, slots: PageSlots) -> None:
        if self._by_id.get(slots.page.id) is slots:
            del self._by_id[slots.page.id]
        slots.page.close()

    def page_for(self, process: TargetProcess, page_id: int) -> PageSlots | None:
        """Page ``page_id`` of ``process``, if it has one."""
        own = self._pages.get(process_key(process))
        return None if own is None else own.pages.get(page_id)

    def deadline(
        self, process: TargetProcess | None, ref: SlotRef | None, look: float, latest: float
    ) -> float | None:
        """The deadline of the block on slot ``ref`` of ``process``, read now: None
        while it holds none, or none known (its page is still searched for after
        a restart). No later than four periods past ``look``, its registration's
        next look, or ``latest`` for one not read yet since a restart."""
        if process is None or ref is None or not 0 <= ref.index < SLOTS:
            return None
        slots = self.page_for(process, ref.page)
        word = 0 if slots is None else slots.page.read(ref.index)
        if not word or slots is None:
            return None
        return min(word / 1_000_000, look + ref.period * 4 if slots.known(ref.index) else latest)

    def named(self, ref: SlotRef) -> tuple[int, str, Slot] | None:
        """The pid and scope of the registration on slot ``ref``, whichever
        process's page it is on (no two pages open at once have one inode), and its
        slot; None when this daemon knows no registration there."""
        slots = self._by_id.get(ref.page)
        if slots is None or not slots.known(ref.index):
            return None
        return slots.pid, slots.scopes[ref.index], Slot(slots, ref)

    def slot(self, process: TargetProcess, ref: SlotRef | None) -> Slot | None:
        """The slot ``ref`` names, when this daemon knows it as a registration's."""
        if ref is None:
            return None
        slots = self.page_for(process, ref.page)
        if slots is None or not slots.known(ref.index):
            return None
        return Slot(slots, ref)

    def released(self) -> int:
        """How many registrations hold no block now, read from their slots."""
        return sum(
            not slots.page.read(index)
            for own in self._pages.values()
            for slots in own.pages.values()
            for index, state in enumerate(slots.state)
            if state != FREE
        )

    def moved(
        self, uid: int | None, spent: AbstractSet[int]
    ) -> Iterator[tuple[ProcessKey, PageSlots, int]]:
        """The slot of each registration released by a store since its last
        harvest (`PageRef.moved`), with its process's key: ``uid``'s only when
        given, none counted against a budget in ``spent`` (which the caller grows
        as it goes: a page of a uid whose budget is spent is not read)."""
        pages = [(key, slots) for key, own in self._pages.items() for slots in own.pages.values()]
        for key, slots in pages:
            if uid is not None and (uid in spent or uid not in slots.budget):
                continue
            for index in slots.page.moved():
                budget = slots.budget[index] if slots.known(index) else None
                if budget is not None and budget not in spent and uid in (None, budget):
                    yield key, slots, index

    def forget(self, process: TargetProcess) -> None:
        """``process`` is gone: its pages go, and what was not found of them."""
        key = process_key(process)
        self._lost.pop(key, None)
        self._give_up(key)
        own = self._pages.pop(key, None)
        for slots in () if own is None else own.pages.values():
            self._close(slots)

    def forget_lost(self, process: TargetProcess) -> None:
        """``process`` left the table: what was not found of it may be sought again."""
        key = process_key(process)
        self._lost.pop(key, None)
        self._give_up(key)

    def _give_up(self, key: ProcessKey) -> None:
        self._waiting.pop(key, None)
        pending = self._searches.pop(key, None)
        if pending is not None:
            pending.search.close()

    def close_all(self) -> None:
        """The daemon stops: every slot of every page closes, and the pages go."""
        for own in self._pages.values():
            for slots in own.pages.values():
                slots.page.close_all()
                slots.page.close()
        self._pages.clear()
        self._by_id.clear()
        self._lost.clear()
        self._waiting.clear()
        for pending in self._searches.values():
            pending.search.close()
        self._searches.clear()
