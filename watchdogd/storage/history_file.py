"""The history of how long scopes were held (`watchdogd.core.history`), kept in a
file beside the state (``STATE.history``), so that what the daemon learned survives
its restarts and the host's.

It is statistics, not a promise: it is written whole (to a new file renamed over the
old, so a crash leaves the old or the new, never half of one) every
`WRITE_INTERVAL` seconds when it changed, and at stop. A crash loses at most the
releases of the last interval. A write that fails (a full or read-only disk) is
logged once per run of failures and tried again at the next interval; the history
stays in memory, bounded as ever. A file that cannot be decoded is moved aside
(``.damaged``) with an ERROR, and the daemon starts learning anew; so is anything
but a regular file at its name (a FIFO, a device, a symlink: ``.not-regular-TIME``,
`watchdogd.storage.faults.NotRegular`), unread: it is opened without blocking and
checked before a byte is read.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Final

import msgspec
import trio

from ..core import History
from ..logs import logfmt
from .faults import Aside, NotRegular
from .files import read_regular, replace_file

log = logging.getLogger("watchdogd")

#: Seconds between writes of a history that changed.
WRITE_INTERVAL: Final = 5.0
#: The largest file read back: far above what the bounds on keys allow.
_MAX_BYTES: Final = 256 * 1024 * 1024


def history_path(state_path: str) -> str:
    return state_path + ".history"


class HistoryFile:
    """Reads ``path`` into ``history`` at start; writes it back as it changes."""

    def __init__(self, path: str, history: History) -> None:
        self.path = path
        self.history = history
        self._written = -1
        self._failing = False

    def load(self) -> None:
        try:
            problem = self._read()
        except NotRegular as exc:
            # Written whole at the next write, by a rename over what is left if
            # it cannot be moved.
            Aside().move(self.path, exc)
            return
        if problem is None:
            self._written = self.history.generation
            return
        event, error = problem
        if event != "history_damaged":
            log.error(logfmt(event, path=self.path, error=error))
            return
        aside = self.path + ".damaged"
        with contextlib.suppress(OSError):
            os.replace(self.path, aside)
        log.error(logfmt(event, path=self.path, error=error, moved_to=aside))

    def _read(self) -> tuple[str, str] | None:
        """Load the file into the history; what went wrong, if anything. Raises
        `NotRegular` for what is no regular file."""
        try:
            data = read_regular(self.path, _MAX_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return "history_unreadable", exc.strerror or str(exc)
        if len(data) > _MAX_BYTES:
            return "history_damaged", f"over {_MAX_BYTES} bytes"
        try:
            self.history.load(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return "history_damaged", str(exc)
        return None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(WRITE_INTERVAL)
            if self.history.generation != self._written:
                generation, data = self.history.generation, self.history.encode()
                if await trio.to_thread.run_sync(self._write, data):
                    self._written = generation

    def write_now(self) -> None:
        """Write what changed since the last write (the daemon stops)."""
        if self.history.generation != self._written and self._write(self.history.encode()):
            self._written = self.history.generation

    def _write(self, data: bytes) -> bool:
        try:
            replace_file(self.path, [data])
        except OSError as exc:
            if not self._failing:
                self._failing = True
                log.warning(
                    logfmt(
                        "history_write_failed",
                        path=self.path,
                        error=exc.strerror,
                        note="kept in memory; tried again every 5 s",
                    )
                )
            return False
        if self._failing:
            self._failing = False
            log.info(logfmt("history_written", path=self.path))
        return True
