"""The event ring: numbering, pages, bounds, visibility."""

from __future__ import annotations

import msgspec

from watchdogd.core.events import MAX_EVENT_BYTES, EventLog
from watchdogd.core.identity import ROOT
from watchdogd_protocol import (
    MAX_REPLY_BYTES,
    EventInfo,
    EventsReply,
    StepResult,
    encode_frame,
)


def event(pid: int, uid: int = 0, kind: str = "expired") -> EventInfo:
    return EventInfo(seq=0, kind=kind, time=1.0, pid=pid, uid=uid, scope="s", policy="kill")


def test_events_are_numbered_and_paged() -> None:
    woken: list[int] = []
    log = EventLog(100, notify=lambda: woken.append(1))
    for pid in range(1, 8):
        log.record(event(pid))
    assert log.last == 7
    assert len(woken) == 7
    assert [e.pid for e in log.page(None, 3, ROOT)] == [5, 6, 7]  # the latest, oldest first
    assert [e.seq for e in log.page(2, 3, ROOT)] == [3, 4, 5]  # after a number
    assert log.page(7, 10, ROOT) == []


def test_the_ring_is_bounded_and_can_be_resized() -> None:
    log = EventLog(5)
    for pid in range(1, 21):
        log.record(event(pid))
    assert len(log) == 5
    assert [e.seq for e in log.page(0, 100, ROOT)] == [16, 17, 18, 19, 20]
    log.resize(2)
    assert [e.seq for e in log.page(None, 100, ROOT)] == [19, 20]
    log.resize(10)
    log.record(event(21))
    assert len(log) == 3


def test_visibility_filters_before_the_limit() -> None:
    log = EventLog(100)
    for pid in range(1, 11):
        log.record(event(pid, uid=1000 if pid % 2 else 2000))
    mine = log.page(None, 2, 1000)
    assert [e.pid for e in mine] == [7, 9]


def test_a_page_after_any_number_is_the_next_events_each_viewer_may_see() -> None:
    log = EventLog(40)
    for pid in range(1, 301):
        log.record(event(pid, uid=(0, 1000, 2000)[pid % 3]))
    kept = log.page(None, 1000, ROOT)  # the latest, by a walk from the newest
    assert 40 <= len(kept) < 300  # the rings dropped their oldest
    for viewer in (ROOT, 1000, 2000, 3000):
        visible = [e for e in kept if viewer in (ROOT, e.uid)]
        for after in range(-1, 303):
            expected = [e.seq for e in visible if e.seq > after][:4]
            assert [e.seq for e in log.page(after, 4, viewer)] == expected, (viewer, after)


def noisy(pid: int, uid: int, steps: int = 1, output: int = 64 * 1024) -> EventInfo:
    hooks = [
        StepResult(step=f"exec {i}", result="exit 0", output="o" * output) for i in range(steps)
    ]
    return msgspec.structs.replace(event(pid, uid), steps=hooks)


def test_a_page_stops_before_the_reply_bound() -> None:
    log = EventLog(1000)
    for pid in range(1, 101):
        log.record(noisy(pid, uid=1000))
    seen: list[int] = []
    after = 0
    while page := log.page(after, 100, 1000):
        reply = EventsReply(id=2**63 - 1, events=page, last=page[-1].seq)
        assert len(encode_frame(reply)) - 4 <= MAX_REPLY_BYTES
        assert len(page) < 20  # cut by bytes, not by the count
        seen += [e.pid for e in page]
        after = page[-1].seq
    assert seen == list(range(1, 101))
    latest = log.page(None, 100, ROOT)
    assert [e.pid for e in latest] == list(range(101 - len(latest), 101))


def test_an_event_too_big_for_a_reply_has_its_output_cut() -> None:
    log = EventLog(10)
    kept = log.record(noisy(1, uid=0, steps=20))
    assert len(msgspec.msgpack.encode(kept)) <= MAX_EVENT_BYTES
    assert all(step.output.endswith("…[output cut]") for step in kept.steps)
    assert log.page(None, 1, ROOT) == [kept]


def test_one_uids_flood_never_evicts_another_uids_events() -> None:
    log = EventLog(100, per_uid=100)
    log.record(event(1, uid=0))
    for pid in range(2, 12):
        log.record(event(pid, uid=1000))
    for pid in range(100, 10_000):
        log.record(event(pid, uid=65534))
    assert [e.pid for e in log.page(None, 100, 1000)] == list(range(2, 12))
    assert log.page(None, 1, ROOT)[0].pid == 9_999
    assert 1 in [e.pid for e in log.page(0, 1000, ROOT)]  # root's own ring
    assert log.kept(65534) == 90  # the rest of the shared 100
    assert len(log) == 101
    # The numbering stays global: a follower of everything sees one sequence.
    seqs = [e.seq for e in log.page(0, 1000, ROOT)]
    assert seqs == sorted(seqs)
    assert seqs[:11] == list(range(1, 12))


def test_the_largest_share_gives_way() -> None:
    log = EventLog(10, per_uid=10)
    for pid in range(8):
        log.record(event(pid, uid=2000))
    for pid in range(100, 110):
        log.record(event(pid, uid=1000))
    # uid 2000 held more than its share; it gave way until both hold five.
    assert (log.kept(1000), log.kept(2000)) == (5, 5)
    log.resize(4)
    assert (log.kept(1000), log.kept(2000)) == (2, 2)
