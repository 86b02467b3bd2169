"""What happened: a bounded, numbered ring of events.

Pure and synchronous; the caller passes the wall-clock time of each event. Every
event gets the next sequence number, so a follower asks for the events after the
last one it saw. When the ring is full the oldest event goes; a follower that falls
that far behind misses it (the numbers show the gap).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final

import msgspec

from watchdogd_client.protocol import EventInfo

from ..logs import log, logfmt

#: An expiry means a worker was hung; the rest are for the record.
_LEVELS: Final = {
    "expired": logging.WARNING,
    "unkillable": logging.ERROR,
    "reload_failed": logging.ERROR,
    "state_degraded": logging.ERROR,
    "state_restored": logging.WARNING,
}


class EventLog:
    """The last ``size`` events. ``notify`` is called after each one is recorded."""

    def __init__(self, size: int, notify: Callable[[], object] = lambda: None) -> None:
        self._events: deque[EventInfo] = deque(maxlen=size)
        self._seq = itertools.count(1)
        self._last = 0
        self._notify = notify

    def __len__(self) -> int:
        return len(self._events)

    @property
    def last(self) -> int:
        """The number of the newest event (0 before the first)."""
        return self._last

    def resize(self, size: int) -> None:
        """Keep at most ``size`` events from now on (the newest, if it shrinks)."""
        if size != self._events.maxlen:
            self._events = deque(self._events, maxlen=size)

    def record(self, event: EventInfo) -> EventInfo:
        """Number ``event``, keep it, log it as one line, and wake followers."""
        self._last = next(self._seq)
        event = msgspec.structs.replace(event, seq=self._last)
        self._events.append(event)
        log.log(_LEVELS.get(event.kind, logging.INFO), logfmt(event.kind, **_loggable(event)))
        self._notify()
        return event

    def page(
        self, after: int | None, limit: int, visible: Callable[[EventInfo], bool]
    ) -> list[EventInfo]:
        """Events the caller may see: the latest ``limit`` when ``after`` is None,
        else the first ``limit`` numbered above ``after``; oldest first."""
        if after is None:
            latest = list(itertools.islice(filter(visible, reversed(self._events)), limit))
            latest.reverse()
            return latest
        newer: Iterable[EventInfo] = (event for event in self._events if event.seq > after)
        return list(itertools.islice(filter(visible, newer), limit))


def _loggable(event: EventInfo) -> dict[str, object]:
    fields: dict[str, object] = {"pid": event.pid, "uid": event.uid}
    for name in ("scope", "policy", "outcome", "note", "state", "wchan"):
        value = getattr(event, name)
        if value:
            fields[name] = value
    if event.late is not None:
        fields["late_ms"] = event.late * 1000
    if event.timers is not None:
        fields["timers"] = event.timers
    for index, step in enumerate(event.steps):
        fields[f"step{index}"] = f"{step.step}: {step.result}"
    return fields
