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
- A page is searched for among a process's descriptors once: a search reads every
  descriptor, and one that found nothing finds nothing the next time either. A
  search goes a slice at a time (`search`), between the passes that fire timers:
  a process holding tens of thousands of descriptors delays no timer. A slot
  closed while its page is being searched for (another caller armed its scope)
  is closed in the page once it is found, so its process sees it closed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Generic

from watchdogd_protocol.slot_page import SLOTS

from .ports import SEARCHING, P, PagePort, PageSearch, Searching, TargetProcess
from .slot import FREE, PageSlots, Slot
from .timers import SlotRef

ProcessKey = tuple[int, int]


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
class _Search:
    """A page being searched for: the registrations whose looks wait for it, the
    slots to close in it once found (by index), and the executable of its
    process when the search began."""

    search: PageSearch
    executable: str
    waiting: set[int] = field(default_factory=set)
    closes: set[int] = field(default_factory=set)


class ProcessPages(Generic[P]):
    """Every process's slot pages, made and found again through ``port``."""

    def __init__(self, port: PagePort[P]) -> None:
        self._port = port
        self._pages: dict[ProcessKey, _Pages] = {}
        #: Every page, by id.
        self._by_id: dict[int, PageSlots] = {}
        #: Pages searched for and not found, by process.
        self._lost: dict[ProcessKey, set[int]] = {}
        #: Pages being searched for, the oldest search first.
        self._searches: dict[tuple[ProcessKey, int], _Search] = {}

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
        self, process: P, page_id: int, index: int, executable: str
    ) -> PageSlots | Searching | None:
        """Page ``page_id`` of ``process`` (which runs ``executable``) for its
        registration on slot ``index`` read from the state: one it has already, or
        found again among its descriptors; None when it holds no such page,
        `SEARCHING` while it is searched for (a first slice is searched at once)."""
        key = process_key(process)
        slots = self.page_for(process, page_id)
        if slots is None:
            if page_id in self._lost.get(key, ()):
                return None
            pending = self._searches.get((key, page_id))
            if pending is None:
                pending = self._searches[key, page_id] = _Search(
                    self._port.search(process, page_id), executable
                )
                pending.waiting.add(index)
                # As much as one descriptor's worth: a process that holds few is
                # found at once.
                if self._step(key, page_id, pending, -math.inf):
                    return SEARCHING
                return self.found(process, page_id, index, executable)
            pending.waiting.add(index)
            return SEARCHING
        slots.live += 1
        return slots

    def close_found(self, process: P, page_id: int, index: int, executable: str) -> None:
        """Slot ``index`` of page ``page_id``, which ``process`` holds perhaps,
        closes: now if its page is known, else once its search finds it."""
        key = process_key(process)
        slots = self.page_for(process, page_id)
        if slots is not None:
            slots.page.write(index, period=0)
            return
        if page_id in self._lost.get(key, ()):
            return
        pending = self._searches.get((key, page_id))
        if pending is None:
            pending = self._searches[key, page_id] = _Search(
                self._port.search(process, page_id), executable
            )
        pending.waiting.discard(index)
        pending.closes.add(index)

    def search(self, until: float) -> bool:
        """Search for the pages asked for, the oldest search first, until the
        clock reads ``until``; whether any is still searched for."""
        for (key, page_id), pending in list(self._searches.items()):
            if self._step(key, page_id, pending, until):
                return True
        return False

    def _step(self, key: ProcessKey, page_id: int, pending: _Search, until: float) -> bool:
        """Search on for ``page_id`` of the process of ``key``; whether it goes on."""
        page = pending.search.step(until)
        if page is SEARCHING:
            return True
        del self._searches[key, page_id]
        pending.search.close()
        if page is None:
            self._lost.setdefault(key, set()).add(page_id)
            return False
        for index in pending.closes:
            page.write(index, period=0)
        if not pending.waiting:
            page.close()  # no registration of it is left
            return False
        own = self._pages.get(key)
        if own is None:
            own = self._pages[key] = _Pages()
        own.pages[page.id] = self._by_id[page.id] = PageSlots(page, key[0], pending.executable)
        return False

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

    def processes(self) -> list[ProcessKey]:
        """The key of every process that has pages."""
        return list(self._pages)

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
        for search_key in [found for found in self._searches if found[0] == key]:
            self._searches.pop(search_key).search.close()

    def close_all(self) -> None:
        """The daemon stops: every slot of every page closes, and the pages go."""
        for own in self._pages.values():
            for slots in own.pages.values():
                slots.page.close_all()
                slots.page.close()
        self._pages.clear()
        self._by_id.clear()
        self._lost.clear()
        for pending in self._searches.values():
            pending.search.close()
        self._searches.clear()
