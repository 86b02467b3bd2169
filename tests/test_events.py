"""The event ring: numbering, pages, bounds, visibility."""

from __future__ import annotations

from watchdogd.core.events import EventLog
from watchdogd_client.protocol import EventInfo


def event(pid: int, uid: int = 0, kind: str = "expired") -> EventInfo:
    return EventInfo(seq=0, kind=kind, time=1.0, pid=pid, uid=uid, scope="s", policy="kill")


def everyone(_: EventInfo) -> bool:
    return True


def test_events_are_numbered_and_paged() -> None:
    woken: list[int] = []
    log = EventLog(100, notify=lambda: woken.append(1))
    for pid in range(1, 8):
        log.record(event(pid))
    assert log.last == 7
    assert len(woken) == 7
    assert [e.pid for e in log.page(None, 3, everyone)] == [5, 6, 7]  # the latest, oldest first
    assert [e.seq for e in log.page(2, 3, everyone)] == [3, 4, 5]  # after a number
    assert log.page(7, 10, everyone) == []


def test_the_ring_is_bounded_and_can_be_resized() -> None:
    log = EventLog(5)
    for pid in range(1, 21):
        log.record(event(pid))
    assert len(log) == 5
    assert [e.seq for e in log.page(0, 100, everyone)] == [16, 17, 18, 19, 20]
    log.resize(2)
    assert [e.seq for e in log.page(None, 100, everyone)] == [19, 20]
    log.resize(10)
    log.record(event(21))
    assert len(log) == 3


def test_visibility_filters_before_the_limit() -> None:
    log = EventLog(100)
    for pid in range(1, 11):
        log.record(event(pid, uid=1000 if pid % 2 else 2000))
    mine = log.page(None, 2, lambda e: e.uid == 1000)
    assert [e.pid for e in mine] == [7, 9]
