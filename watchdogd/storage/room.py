"""The room the timers' state needs on its disk, which nothing else the daemon
writes there takes (`watchdogd.storage.store`, `watchdogd.storage.record_file`).

Invariants:

- A journal is folded once it holds `JOURNAL_BYTES`, or a `JOURNAL_SHARE`th of its
  file system if less (a small tmpfs), and no less than `JOURNAL_MIN`: a journal
  that filled a small disk would cost the state its durability by itself.
- What the state may still take (`Room.wanted`) is the rest of its journal and
  the next one's, and its database twice over (a fold's write, and a full write
  after a failure); the record beside it leaves that much free.
- A write of the state that its disk refuses for lack of room (ENOSPC, EDQUOT)
  first has room made (``make``: the record gives its room back), then is written
  again, once, from where it began: a record written in part would run into the
  next one. Only then is it a failure (`Room.append` raises as the write did).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from typing import Final

from .journal import write_all

#: A journal this large is folded into the database and a new one started.
JOURNAL_BYTES: Final = 8 * 1024 * 1024
#: ... or this share of its file system, if less, but no less than `JOURNAL_MIN`.
JOURNAL_SHARE: Final = 16
JOURNAL_MIN: Final = 64 * 1024
#: The errors that say a disk is short of room.
_NO_ROOM: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


class Room:
    """The room of the state ``path`` on its disk: how large a journal grows
    (``journal_bytes``, at most ``most``), what the state may still take, and its
    writes, which have room made (``make``) before they fail for want of it."""

    def __init__(self, path: str, most: int = JOURNAL_BYTES) -> None:
        self.path = path
        self.journal_bytes = most
        with contextlib.suppress(OSError):
            disk = os.statvfs(os.path.dirname(path) or ".")
            share = disk.f_blocks * disk.f_frsize // JOURNAL_SHARE
            self.journal_bytes = min(most, max(JOURNAL_MIN, share))
        #: Frees room on the disk; whether it freed any.
        self.make: Callable[[], bool] = lambda: False

    def wanted(self) -> int:
        """The bytes of its disk the state may still take."""
        database = 0
        for name in (self.path, self.path + "-wal"):
            with contextlib.suppress(OSError):
                database += os.stat(name).st_size
        return 2 * self.journal_bytes + 2 * database

    def append(self, fd: int | None, record: bytes, size: int) -> None:
        """Write ``record`` at the end of the journal ``fd``, which holds ``size``
        bytes. Raises OSError as the write does."""
        try:
            write_all(fd, record)
        except OSError as exc:
            if fd is None or exc.errno not in _NO_ROOM or not self.make():
                raise
            os.ftruncate(fd, size)
            write_all(fd, record)
