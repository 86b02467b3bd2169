"""Log lines in logfmt: ``event=expired pid=42 scope="train.py:10" ...``.

One line per event, keys in a fixed order, values quoted only when they need it, so
that both people and ``journalctl -o cat | grep`` can read them.
"""

from __future__ import annotations

import json
import logging
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
