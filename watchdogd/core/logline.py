"""What the core wants logged, and how much of it.

The core writes no log itself: it formats a line (`logfmt`), judges whether it may
go (`Throttle`, on a clock the runtime passes) and hands it to a `LogSink`, which
the runtime implements (`watchdogd.logs.LoggingSink` writes to the ``watchdogd``
logger). Invariants:

- A line a request can cause goes through a `Throttle` keyed by who caused it
  (e.g. ``(uid, kind)``), so no caller can flood the log, and no caller's flood
  silences another's lines.
- A line is formatted only when it will be written: `RateLimitedLog.log` takes the
  line or a callable that makes it, and asks the sink first. A line at a level the
  sink does not write costs that one question (the throttle is not consulted).
- Debug lines on the request path cost one attribute read at the info level: the
  sink's level is read once, when it is set (`RateLimitedLog.debugging`, read again
  by `RateLimitedLog.reread_level` after a reload sets it), and a caller tests it
  before it makes even the key of its line.
- `Level` has the values of the standard library's levels, so a sink passes them on
  as they are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from enum import IntEnum
from typing import Final, Protocol

_PLAIN: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@+")


class Level(IntEnum):
    """How much a line matters; the values of `logging`'s levels."""

    DEBUG = 10
    INFO = 20
    WARNING = 30
    ERROR = 40


class LogSink(Protocol):
    """Where the core's log lines go (the runtime's logger)."""

    def enabled(self, level: int) -> bool:
        """Whether a line at ``level`` would be written (else it is not made)."""

    def write(self, level: int, line: str, error: BaseException | None = None) -> None:
        """Write ``line`` at ``level``, with the traceback of ``error`` if given."""


class NullSink:
    """A sink that writes nothing (a core without a log, in tests)."""

    def enabled(self, level: int) -> bool:
        return False

    def write(self, level: int, line: str, error: BaseException | None = None) -> None:
        pass


def logfmt(event: str, **fields: object) -> str:
    """Format one event and its fields as a logfmt line: keys in the order given,
    values quoted only when they need it, so that both people and ``journalctl -o
    cat | grep`` can read them."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        parts.append(f"{key}={_value(value)}")
    return " ".join(parts)


def _value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if text and all(char in _PLAIN for char in text):
        return text
    return json.dumps(text, ensure_ascii=False)


class Throttle:
    """Token buckets that rate-limit lines per key, counting what they hold back.

    Each key (e.g. ``(uid, kind)``) may pass ``burst`` times at once and then
    ``per_second`` times a second on ``clock`` (seconds, monotonic); what is over
    that is held back and counted, and the next admitted says how many went. Keys
    are independent. At most ``max_keys`` buckets are kept: beyond that, the ones
    with nothing held back are forgotten (they are full again soon anyway), so the
    table stays bounded.
    """

    __slots__ = ("_buckets", "_burst", "_clock", "_max_keys", "_rate")

    def __init__(
        self,
        burst: int = 20,
        per_second: float = 1.0,
        *,
        clock: Callable[[], float],
        max_keys: int = 4096,
    ) -> None:
        self._burst = float(burst)
        self._rate = per_second
        self._clock = clock
        self._max_keys = max_keys
        # key -> [tokens, time of the last refill, lines held back]
        self._buckets: dict[Hashable, list[float]] = {}

    def admit(self, key: Hashable) -> int | None:
        """None to hold back one for ``key``; else how many were held back before it."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._max_keys:
                self._buckets = {k: b for k, b in self._buckets.items() if b[2]}
            bucket = self._buckets[key] = [self._burst, now, 0]
        tokens = min(self._burst, bucket[0] + (now - bucket[1]) * self._rate)
        bucket[1] = now
        if tokens < 1:
            bucket[0] = tokens
            bucket[2] += 1
            return None
        bucket[0] = tokens - 1
        suppressed, bucket[2] = int(bucket[2]), 0
        return suppressed


class RateLimitedLog:
    """Lines handed to ``sink`` through ``throttle``: the log of lines that
    requests (or their timers) can cause."""

    __slots__ = ("debugging", "sink", "throttle")

    def __init__(self, throttle: Throttle, sink: LogSink) -> None:
        self.throttle = throttle
        self.sink = sink
        #: Whether the sink writes debug lines, as of its level's last change.
        self.debugging = sink.enabled(Level.DEBUG)

    def reread_level(self) -> None:
        """The sink's level was changed (a reload): read it again."""
        self.debugging = self.sink.enabled(Level.DEBUG)

    def log(
        self,
        key: Hashable,
        level: int,
        line: str | Callable[[], str],
        *,
        error: BaseException | None = None,
    ) -> None:
        """Log ``line`` at ``level`` unless ``key`` is over its rate (a callable is
        called for the line only when it is written); a line let through after some
        were held back ends in ``suppressed=N``."""
        if not self.sink.enabled(level):
            return
        suppressed = self.throttle.admit(key)
        if suppressed is None:
            return
        if callable(line):
            line = line()
        if suppressed:
            line = f"{line} suppressed={suppressed}"
        self.sink.write(level, line, error)
