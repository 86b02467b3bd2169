"""The requests behind the clients' methods, written once as plans of the engine
(`watchdogd_client.engine`): the blocking `watchdogd_client.Client` runs each with
blocking I/O, the trio `watchdogd_client.trio.AsyncClient` awaits it, so both
clients offer the same methods with the same parameters and the same answers.

Invariants:

- Each plan is `Engine.call` of one request, or of several in turn for a method
  that reads pages (`status`, `suggest`): every page is a request of its own, so
  one lost to a daemon's restart is sent once more, as any request is.
- Nothing here touches a socket, a clock or a thread; `ping` asks its driver for
  the time (`engine.Clock`), and `acquire` hands a reply that granted a slot to the
  driver's fast path (`Grant`), which maps the slot's page as the driver may.
- An arm whose slot's page could not be had is armed once more without a slot,
  whichever client sent it.
"""

from __future__ import annotations

from typing import Final

import msgspec

from watchdogd_protocol import (
    Acquire,
    Acquired,
    Events,
    EventsReply,
    Hangs,
    HangsReply,
    Incident,
    IncidentInfo,
    IncidentReply,
    Incidents,
    IncidentsReply,
    Metrics,
    MetricsReply,
    Ping,
    Policies,
    PoliciesReply,
    Pong,
    Release,
    Released,
    Status,
    StatusReply,
    Suggest,
    SuggestionInfo,
    SuggestReply,
    TimerInfo,
    Why,
    WhyReply,
)

from .arming import Arming
from .base import DaemonStatus
from .engine import CLOCK, Engine, Plan, Step

__all__ = [
    "STATUS_PAGE",
    "Grant",
    "acquire",
    "events",
    "hangs",
    "incident",
    "incidents",
    "metrics",
    "ping",
    "policies",
    "release",
    "status",
    "status_page",
    "suggest",
    "why",
]

#: The timers a `status` page asks for: the daemon's own bound on a page.
STATUS_PAGE: Final = 1000


class Grant(Step):
    """Hand ``reply``, the answer to the socket arm ``request`` armed with
    ``arming``, to the driver's fast path (`watchdogd_client.fastpath.FastPath.answered`:
    a slot it grants takes the scope's later blocks), mapping the slot's page if it
    is new; send back whether that page could not be had."""

    __slots__ = ("arming", "reply", "request")

    def __init__(self, request: Acquire, arming: Arming, reply: Acquired) -> None:
        self.request = request
        self.arming = arming
        self.reply = reply


def acquire(engine: Engine, request: Acquire, arming: Arming, *, fast: bool) -> Plan[Acquired]:
    """`Acquire` ``request``, armed with ``arming``; with a ``fast`` path, its reply
    goes to it (`Grant`), and an arm whose slot's page could not be had (the
    daemon went meanwhile) is armed again without a slot, so that the block is
    protected wherever the page is."""
    reply = yield from engine.call(request, Acquired)
    if fast and (yield Grant(request, arming, reply)):
        again = msgspec.structs.replace(request, id=engine.next_id(), slot=False)
        reply = yield from engine.call(again, Acquired)
    return reply


def release(engine: Engine, scope: str, pid: int | None, *, stored: bool = False) -> Plan[bool]:
    """`Release` of ``(pid, scope)``: whether a timer was armed."""
    request = Release(id=engine.next_id(), scope=scope, pid=pid, stored=stored)
    return (yield from engine.call(request, Released)).found


def ping(engine: Engine) -> Plan[float]:
    """A round trip to the daemon, in seconds of the driver's clock."""
    started: float = yield CLOCK
    yield from engine.call(Ping(id=engine.next_id()), Pong)
    ended: float = yield CLOCK
    return ended - started


def status(engine: Engine) -> Plan[DaemonStatus]:
    """The daemon's summary and every timer the caller may see, page after page."""
    timers: list[TimerInfo] = []
    cursor: str | None = None
    while True:
        page = yield from status_page(engine, limit=STATUS_PAGE, cursor=cursor)
        timers.extend(page.timers_with_commands())
        cursor = page.cursor
        if cursor is None:
            return DaemonStatus(daemon=page.daemon, timers=timers)


def status_page(engine: Engine, *, limit: int, cursor: str | None) -> Plan[StatusReply]:
    """One page of `status`, as the daemon sent it."""
    request = Status(id=engine.next_id(), limit=limit, cursor=cursor)
    return (yield from engine.call(request, StatusReply))


def events(engine: Engine, *, after: int | None, limit: int, wait: float) -> Plan[EventsReply]:
    """Recorded events; the daemon holds the reply up to ``wait`` seconds."""
    request = Events(id=engine.next_id(), after=after, limit=limit, wait=wait)
    return (yield from engine.call(request, EventsReply, wait=wait))


def policies(engine: Engine) -> Plan[PoliciesReply]:
    """The daemon's policies and its default."""
    return (yield from engine.call(Policies(id=engine.next_id()), PoliciesReply))


def metrics(engine: Engine) -> Plan[str]:
    """The daemon's metrics, in Prometheus's text format."""
    return (yield from engine.call(Metrics(id=engine.next_id()), MetricsReply)).text


def suggest(engine: Engine) -> Plan[list[SuggestionInfo]]:
    """Every suggestion the caller may see, page after page."""
    rows: list[SuggestionInfo] = []
    cursor: int | None = 0
    while cursor is not None:
        request = Suggest(id=engine.next_id(), cursor=cursor)
        page = yield from engine.call(request, SuggestReply)
        rows += page.suggestions
        cursor = page.cursor
    return rows


def incidents(engine: Engine, *, limit: int) -> Plan[list[IncidentInfo]]:
    """The latest incidents the caller may see, without their stacks."""
    request = Incidents(id=engine.next_id(), limit=limit)
    return (yield from engine.call(request, IncidentsReply)).incidents


def incident(engine: Engine, incident: str) -> Plan[IncidentInfo]:
    """One incident, with the stacks the caller may see."""
    request = Incident(id=engine.next_id(), incident=incident)
    return (yield from engine.call(request, IncidentReply)).incident


def hangs(engine: Engine, job: str, *, uid: int | None, reset: bool) -> Plan[HangsReply]:
    """The hangs of a job, after its repeating mark is cleared with ``reset``."""
    request = Hangs(id=engine.next_id(), job=job, uid=uid, reset=reset)
    return (yield from engine.call(request, HangsReply))


def why(engine: Engine, pid: int, *, limit: int) -> Plan[WhyReply]:
    """What the daemon knows of why ``pid`` was, or would be, acted on."""
    request = Why(id=engine.next_id(), pid=pid, limit=limit)
    return (yield from engine.call(request, WhyReply))
