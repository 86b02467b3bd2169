"""The service's page port on a real host: sealed memfds
(`watchdogd.host.slot_pages`), searched for after a restart a slice at a time,
each failure said in the log once a minute."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet

from ..core import SEARCHING, PageRef, Searching
from ..host import slot_pages
from ..host.process import Process
from ..logs import log, logfmt


class HostPages:
    """The page port (`watchdogd.core.ports.PagePort`) of a daemon on a host."""

    def __init__(self) -> None:
        self._said: dict[str, float] = {}

    def shares_clock(self, process: Process) -> bool:
        return slot_pages.shares_clock(process)

    def clock_offset(self, process: Process) -> float | None:
        return slot_pages.clock_offset(process)

    def new_page(self) -> PageRef | None:
        try:
            return slot_pages.new_page()
        except slot_pages.PageError as exc:
            self._say("slot_page_failed", str(exc))
            return None

    def search(self, process: Process, wanted: AbstractSet[int]) -> _HostSearch:
        return _HostSearch(slot_pages.Search(process, wanted), self._say)

    def _say(self, event: str, error: str) -> None:
        now = time.monotonic()
        if now >= self._said.get(event, -math.inf) + 60.0:
            self._said[event] = now
            log.warning(logfmt(event, error=error))


class _HostSearch:
    """A search of `HostPages`: what it could not find said in the log."""

    def __init__(self, search: slot_pages.Search, say: Callable[[str, str], None]) -> None:
        self._search = search
        self._say = say

    def step(self, until: float) -> Mapping[int, PageRef] | Searching:
        try:
            found = self._search.step(until)
        except slot_pages.PageError as exc:
            self._say("slot_page_lost", str(exc))
            return {}
        if found is None:
            return SEARCHING
        for error in self._search.refused.values():
            self._say("slot_page_lost", error)
        return found

    def close(self) -> None:
        self._search.close()
