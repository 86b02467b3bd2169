"""What can be wrong with the state's files, and what is done about it.

Invariants:

- A state file is never deleted because it cannot be read: it is renamed beside
  itself (``NAME.damaged-TIMESTAMP``), with an ERROR line naming where it went.
- A file that cannot be renamed (a read-only disk) is kept where it is, remembered
  (`Aside.stuck`), never removed by the store, and moved at the next recovery.
- Another daemon holding the state is the only fault that stops a start
  (`StateError`); damage moves a file aside, and a failing disk degrades the store.
"""

from __future__ import annotations

import errno
import os
import time

from ..errors import DaemonError
from ..logs import log, logfmt


class StateError(DaemonError):
    """Raised at start when another running daemon holds the state file. (A file
    that is damaged is moved aside, and a disk that fails starts the daemon
    degraded, instead.)"""


class Damaged(Exception):
    """A state file that is damaged, not merely unwritable."""


def reason(exc: BaseException) -> str:
    """What went wrong, for a log line or the degraded state: an OSError as its
    message and errno name."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    return str(exc) or type(exc).__name__


class Aside:
    """Moves state files aside. ``moved`` lists where they went; ``stuck`` the
    ones still to move (a rename that failed, a journal unreadable at start)."""

    def __init__(self) -> None:
        self.moved: list[str] = []
        self.stuck: list[str] = []

    def move(self, name: str, why: str) -> None:
        aside = f"{name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            os.replace(name, aside)
        except OSError as exc:
            self.stuck.append(name)
            log.error(logfmt("state_damaged", path=name, error=why, not_moved=reason(exc)))
            return
        self.moved.append(aside)
        log.error(logfmt("state_damaged", path=name, error=why, moved_to=aside))

    def keep(self, name: str) -> None:
        """Leave ``name`` in place for now (unreadable is not proof of damage)."""
        self.stuck.append(name)

    def move_stuck(self) -> None:
        """Try again to move the files that stayed in place."""
        stuck, self.stuck = self.stuck, []
        for name in stuck:
            if os.path.exists(name):
                self.move(name, "damaged or unreadable at start")
