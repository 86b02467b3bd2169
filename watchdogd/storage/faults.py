"""What can be wrong with the state's files, and what is done about it.

Invariants:

- A state file is never deleted because it cannot be read (`Unreadable`): it is
  renamed beside itself, with a suffix that says why and when
  (``NAME.damaged-20260101T120000``, ``NAME.schema-9-20260101T120000``), and an
  ERROR line names where it went.
- A state file that is no regular file (a FIFO, a socket, a directory, a device,
  a symlink: `NotRegular`) is moved aside as well, unread, under the suffix
  ``not-regular``, its ERROR line naming what it is.
- A file that cannot be renamed (a read-only disk) is kept where it is, remembered
  (`Aside.stuck`), never removed by the store, and moved at the next recovery.
- Another daemon holding the state is the only fault that stops a start
  (`StateError`); a file that cannot be read is moved aside, and a failing disk
  degrades the store.
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


class Unreadable(Exception):
    """A state file this daemon cannot read, whatever the disk does: it is moved
    aside under ``suffix``, and its ERROR line is ``event``."""

    suffix = "damaged"
    event = "state_damaged"


class Damaged(Unreadable):
    """A state file that is damaged, not merely unwritable."""


class NotRegular(Unreadable):
    """A path that names something other than a regular file, found when it was
    opened (`watchdogd.storage.files.open_regular`): never read, and, in the
    state's directory, moved aside."""

    suffix = "not-regular"
    event = "not_a_regular_file"

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{kind}, not a regular file")
        self.path = path
        self.kind = kind


def reason(exc: BaseException) -> str:
    """What went wrong, for a log line or the degraded state: an OSError as its
    message and errno name, a path that names no regular file as the path and
    what it is."""
    if isinstance(exc, NotRegular):
        return f"{exc.path} is {exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    return str(exc) or type(exc).__name__


class Aside:
    """Moves state files aside. ``moved`` lists where they went; ``stuck`` the
    ones still to move (a rename that failed, a journal unreadable at start), with
    what is wrong with each."""

    def __init__(self) -> None:
        self.moved: list[str] = []
        self.stuck: dict[str, Unreadable] = {}

    def move(self, name: str, problem: Unreadable) -> None:
        aside = f"{name}.{problem.suffix}-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            os.replace(name, aside)
        except OSError as exc:
            self.stuck[name] = problem
            log.error(logfmt(problem.event, path=name, error=problem, not_moved=reason(exc)))
            return
        self.moved.append(aside)
        log.error(logfmt(problem.event, path=name, error=problem, moved_to=aside))

    def keep(self, name: str) -> None:
        """Leave ``name`` in place for now (unreadable is not proof of damage)."""
        self.stuck[name] = Damaged("damaged or unreadable at start")

    def move_stuck(self) -> None:
        """Try again to move the files that stayed in place."""
        stuck, self.stuck = self.stuck, {}
        for name, problem in stuck.items():
            if os.path.lexists(name):  # a dangling symlink is there too
                self.move(name, problem)
