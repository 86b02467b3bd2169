"""The daemon's log: logfmt lines (``event=expired pid=42 scope="train.py:10" ...``)
on the ``watchdogd`` logger, to stderr (the journal, under systemd).

The core formats its lines and rate-limits them itself (`watchdogd.core.logline`:
`logfmt`, `Throttle`); `LoggingSink` is the sink it hands them to. The runtime uses
the same `logfmt` and `Throttle` for its own lines.
"""

from __future__ import annotations

import logging
from typing import Final

from .core import Throttle, logfmt

__all__ = ["LEVELS", "LoggingSink", "Throttle", "log", "logfmt", "set_level", "setup"]

log: Final = logging.getLogger("watchdogd")

LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


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


class LoggingSink:
    """The core's log sink (`watchdogd.core.logline.LogSink`): the ``watchdogd``
    logger."""

    __slots__ = ()

    def enabled(self, level: int) -> bool:
        return log.isEnabledFor(level)

    def write(self, level: int, line: str, error: BaseException | None = None) -> None:
        log.log(level, line, exc_info=error)
