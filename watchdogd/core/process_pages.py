"""The slot pages each process has: which page its next registration takes a slot
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
  before. A slot closed while its page is being searched for (another caller armed its
  scope) is closed in the page once it is found, so its process sees it closed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic

from watchdogd_protocol.slot_page import SLOTS

from .ports import SEARCHING, P, PagePort, PageRef, PageSearch, Searching, TargetProcess
from .timers import Key

ProcessKey = tuple[int, int]


def process_key(process: TargetProcess) -> ProcessKey:
    """What keeps a process's pages: its pid, and its start time, which tells it
    from every other process that held or will hold that pid."""
    return process.pid, process.start_time


@dataclass(slots=True, eq=False)
class _Pages:
    """A process's pages, the newest last, and the next index of the newest."""

    pages: list[PageRef] = field(default_factory=list)
    next_index: int = SLOTS
    #: Open or closing slots on each page, by page id.
    live: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Search(Generic[P]):
    """A search for pages of one process: the pages it looks for (the set the
    search reads, which grows while it goes on), those asked for once it had
    begun (their descriptors may have been read already), the registrations
    whose looks wait for each page (their indexes), and the slots to close in
    each once found."""

    process: P
    search: PageSearch
    wanted: set[int]
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
        #: Pages searched for and not found, by process.
        self._lost: dict[ProcessKey, set[int]] = {}
        #: The search of each process whose pages are searched for, the oldest
        #: first.
        self._searches: dict[ProcessKey, _Search[P]] = {}
        #: The looks that wait for each process's search: when each looked, by
        #: registration.
        self._waiting: dict[ProcessKey, dict[Key, float]] = {}

    def new_slot(self, process: P) -> tuple[PageRef, int] | None:
        """A slot for a registration of ``process``: its page and index; None when
        it may have none (another clock, no page to be had)."""
        key = process_key(process)
        own = self._pages.get(key)
        if own is None:
            if not self._port.shares_clock(process):
                return None
            own = self._pages[key] = _Pages()
        if own.next_index >= SLOTS:
            page = self._port.new_page()
            if page is None:
                if not own.pages:
                    del self._pages[key]
                return None
            own.pages.append(page)
            own.live[page.id] = 0
            own.next_index = 0
        page = own.pages[-1]
        index = own.next_index
        own.next_index += 1
        own.live[page.id] += 1
        return page, index

    def found(
        self,
        process: P,
        page_id: int,
        index: int,
        unread: Callable[[], Iterable[tuple[int, int]]] = tuple,
    ) -> PageRef | Searching | None:
        """Page ``page_id`` of ``process`` for its registration on slot ``index``
        read from the state: one it has already, or found again among its
        descriptors; None when it holds no such page, `SEARCHING` while it is
        searched for (a first slice is searched at once). ``unread()``: the
        pages and indexes of its process's other registrations not read yet,
        looked for in the same read of its descriptors."""
        key = process_key(process)
        page = self.page_for(process, page_id)
        if page is None:
            if page_id in self._lost.get(key, ()):
                return None
            pending = self._searches.get(key)
            if pending is None:
                pending = self._begin(process, key, {page_id})
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
                return self.found(process, page_id, index)
            self._want(pending, page_id)
            pending.waiting.setdefault(page_id, set()).add(index)
            return SEARCHING
        own = self._pages[key]
        own.live[page.id] = own.live.get(page.id, 0) + 1
        return page

    def close_found(self, process: P, page_id: int, index: int) -> None:
        """Slot ``index`` of page ``page_id``, which ``process`` holds perhaps,
        closes: now if its page is known, else once its search finds it."""
        key = process_key(process)
        page = self.page_for(process, page_id)
        if page is not None:
            page.write(index, period=0)
            return
        if page_id in self._lost.get(key, ()):
            return
        pending = self._searches.get(key)
        if pending is None:
            pending = self._begin(process, key, {page_id})
        self._want(pending, page_id)
        pending.waiting.get(page_id, set()).discard(index)
        pending.closes.setdefault(page_id, set()).add(index)

    def _begin(self, process: P, key: ProcessKey, wanted: set[int]) -> _Search[P]:
        """A search of ``process``'s descriptors for the pages ``wanted``."""
        pending = _Search(process, self._port.search(process, wanted), wanted)
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
        retry = self._begin(pending.process, key, again)
        for page_id in again:
            retry.waiting[page_id] = pending.waiting.get(page_id, set())
            retry.closes[page_id] = pending.closes.get(page_id, set())
        return True

    def wait(self, process: TargetProcess, key: Key, looked: float) -> None:
        """The look at registration ``key`` at ``looked`` waits for the search of
        ``process``'s pages: it comes back once that ends (``come_back``)."""
        self._waiting.setdefault(process_key(process), {})[key] = looked

    def _found(self, key: ProcessKey, pending: _Search[P], page_id: int, page: PageRef) -> None:
        """``page`` was found: its closed slots written, kept while a registration
        waits for it."""
        for index in pending.closes.get(page_id, ()):
            page.write(index, period=0)
        own = self._pages.get(key)
        held = own is not None and any(other.id == page_id for other in own.pages)
        if not pending.waiting.get(page_id) or held:
            page.close()  # no registration of it is left, or it is held already
            return
        if own is None:
            own = self._pages[key] = _Pages()
        own.pages.insert(0, page)
        own.live[page.id] = 0

    def let_go(self, process: TargetProcess, page: PageRef) -> None:
        """A slot of ``page`` is no longer a registration's."""
        key = process_key(process)
        own = self._pages.get(key)
        if own is None:
            return
        live = own.live.get(page.id, 0) - 1
        own.live[page.id] = max(live, 0)
        if not any(own.live.values()):
            # Its process may have left the table, and then its exit goes unseen:
            # nothing of it may stay behind.
            del self._pages[key]
            for held in own.pages:
                held.close()
            return
        newest = own.pages[-1] if own.pages else None
        if live > 0 or (newest is page and own.next_index < SLOTS):
            return
        own.live.pop(page.id, None)
        own.pages = [held for held in own.pages if held is not page]
        page.close()

    def page_for(self, process: TargetProcess, page_id: int) -> PageRef | None:
        """Page ``page_id`` of ``process``, if it has one."""
        own = self._pages.get(process_key(process))
        return None if own is None else next((p for p in own.pages if p.id == page_id), None)

    def forget(self, process: TargetProcess) -> None:
        """``process`` is gone: its pages go, and what was not found of them."""
        key = process_key(process)
        self._lost.pop(key, None)
        self._give_up(key)
        own = self._pages.pop(key, None)
        for page in () if own is None else own.pages:
            page.close()

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
            for page in own.pages:
                page.close_all()
                page.close()
        self._pages.clear()
        self._lost.clear()
        self._waiting.clear()
        for pending in self._searches.values():
            pending.search.close()
        self._searches.clear()
