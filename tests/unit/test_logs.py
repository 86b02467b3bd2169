"""Log lines: logfmt, and the throttle on lines that requests can cause."""

from __future__ import annotations

import logging

import pytest

from watchdogd.core.logline import RateLimitedLog
from watchdogd.logs import LoggingSink, Throttle, logfmt


def test_logfmt_quotes_only_what_needs_it() -> None:
    assert logfmt("expired", pid=42, scope="train.py:10", note="a b") == (
        'event=expired pid=42 scope=train.py:10 note="a b"'
    )


def test_a_bucket_lets_a_burst_through_then_its_rate_and_counts_the_rest() -> None:
    now = [0.0]
    throttle = Throttle(burst=3, per_second=2.0, clock=lambda: now[0])
    assert [throttle.admit("k") for _ in range(5)] == [0, 0, 0, None, None]
    now[0] += 0.5  # one token back
    assert throttle.admit("k") == 2  # says how many went before it
    assert throttle.admit("k") is None
    now[0] += 100.0
    assert [throttle.admit("k") for _ in range(3)] == [1, 0, 0]


def test_keys_are_independent() -> None:
    throttle = Throttle(burst=1, per_second=0.0, clock=lambda: 0.0)
    assert throttle.admit((65534, "internal")) == 0
    assert throttle.admit((65534, "internal")) is None
    assert throttle.admit((0, "internal")) == 0
    assert throttle.admit((65534, "unread_replies")) == 0


def test_the_table_of_buckets_stays_bounded() -> None:
    throttle = Throttle(burst=1, per_second=0.0, clock=lambda: 0.0, max_keys=10)
    throttle.admit("held")
    throttle.admit("held")  # one held back: this bucket is kept
    for key in range(1000):
        throttle.admit(key)
    assert len(throttle._buckets) <= 10
    assert throttle.admit("held") is None


def test_a_let_through_line_says_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    throttle = RateLimitedLog(
        Throttle(burst=1, per_second=1.0, clock=lambda: now[0]), LoggingSink()
    )
    with caplog.at_level(logging.INFO, logger="watchdogd"):
        for _ in range(4):
            throttle.log("k", logging.INFO, "event=unread_replies uid=65534")
        now[0] += 1.0
        throttle.log("k", logging.INFO, "event=unread_replies uid=65534")
    assert caplog.messages == [
        "event=unread_replies uid=65534",
        "event=unread_replies uid=65534 suppressed=3",
    ]


class _Sink:
    """A sink at a level of the test's choosing that keeps what it is given."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.written: list[str] = []

    def enabled(self, level: int) -> bool:
        return level >= self.level

    def write(self, level: int, line: str, error: BaseException | None = None) -> None:
        self.written.append(line)


def test_a_debug_line_at_the_info_level_costs_an_attribute_read_and_nothing_more() -> None:
    made: list[str] = []
    admitted: list[object] = []

    class Counting(Throttle):
        def admit(self, key: object) -> int | None:
            admitted.append(key)
            return super().admit(key)

    sink = _Sink(logging.INFO)
    log = RateLimitedLog(Counting(clock=lambda: 0.0), sink)
    assert not log.debugging

    def line() -> str:
        made.append("made")
        return "event=x"

    log.log("k", logging.DEBUG, line)
    assert (made, admitted, sink.written) == ([], [], [])
    # The level is read when it changes (a reload), not for each line; debug lines
    # held back at the info level do not count against the rate later.
    sink.level = logging.DEBUG
    assert not log.debugging
    log.reread_level()
    assert log.debugging
    assert [log.log("k", logging.DEBUG, "event=x") for _ in range(3)] == [None] * 3
    assert sink.written == ["event=x"] * 3
