"""Log lines in logfmt: ``event=expired pid=42 scope="train.py:10" ...``.

One line per event, keys in a fixed order, values quoted only when they need it, so
that both people and ``journalctl -o cat | grep`` can read them. Lines a request
can cause go through a `Throttle`, so no caller can flood the log.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Hashable
from typing import Final

log: Final = logging.getLogger("watchdogd")

_PLAIN: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@+")

LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def logfmt(event: str, **fields: object) -> str:
    """Format one event and its fields as a logfmt line."""
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


def set_level(level: str) -> None:
    """Change the daemon's log level (a reloaded config may)."""
    logging.getLogger().setLevel(LEVELS[level])


def setup(level: str) -> None:
    """Send the daemon's log lines to stderr (the journal, under systemd)."""
    logging.basicConfig(
        level=LEVELS[level],
        format="%(asctime)s %(levelname)s %(message)s",
        force=True,
    )


class Throttle:
    """Token buckets that rate-limit log lines per key, counting what they hold back.

    Each key (e.g. ``(uid, kind)``) may log ``burst`` lines at once and then
    ``per_second`` lines a second; a line over that is dropped and counted, and the
    next line let through says how many went (``suppressed=N``). Keys are
    independent, so one user's flood never silences another's lines. At most
    ``max_keys`` buckets are kept: beyond that, the ones with nothing held back are
    forgotten (they are full again soon anyway), so the table stays bounded.
    """

    __slots__ = ("_buckets", "_burst", "_clock", "_max_keys", "_rate")

    def __init__(
        self,
        burst: int = 20,
        per_second: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
    ) -> None:
        self._burst = float(burst)
        self._rate = per_second
        self._clock = clock
        self._max_keys = max_keys
        # key -> [tokens, time of the last refill, lines held back]
        self._buckets: dict[Hashable, list[float]] = {}

    def admit(self, key: Hashable) -> int | None:
        """None to drop a line for ``key``; else how many were dropped before it."""
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

    def log(
        self, key: Hashable, level: int, line: str | Callable[[], str], *, exc_info: bool = False
    ) -> None:
        """Log ``line`` at ``level`` unless ``key`` is over its rate (a callable is
        called for the line only when it is logged)."""
        suppressed = self.admit(key)
        if suppressed is None or not log.isEnabledFor(level):
            return
        if callable(line):
            line = line()
        if suppressed:
            line = f"{line} suppressed={suppressed}"
        log.log(level, line, exc_info=exc_info)
