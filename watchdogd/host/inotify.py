"""Whether the state's journal may have lost its name, without an fstat(2) a write.

A journal unlinked under the daemon (its directory removed, say) takes every write
after that with it at the next start, so the store looks at the journal's link
count before it acknowledges a write. fstat(2) right after a write costs more than
the write on ext4; an inotify watch on the journal says the same for a quarter of
that: an unlink raises IN_ATTRIB (the link count changed) before unlink(2) returns,
so a request sent after a deletion finds the event queued when its write is
checked, and FIONREAD tells whether anything is queued. An event only says "look":
the store's fstat decides.

Python has no inotify: libc is called through ctypes (`watchdogd.host.libc`).
"""

from __future__ import annotations

import fcntl
import os
import termios
from typing import Final

from .libc import libc

_IN_ATTRIB: Final = 0x00000004
_IN_MOVE_SELF: Final = 0x00000800
_IN_DELETE_SELF: Final = 0x00000400
_IN_NONBLOCK: Final = os.O_NONBLOCK
_IN_CLOEXEC: Final = os.O_CLOEXEC


class NameWatch:
    """Watches the journal a `watchdogd.storage.store.Store` writes to. Its inotify
    instance is made for the first journal it follows: a store that failed to open
    holds none. Where the kernel gives none, it says "look" every time."""

    def __init__(self) -> None:
        self._fd = -1  # the inotify instance; -1: none (yet)
        self._number = -1  # the journal watched, by number and descriptor
        self._journal_fd = -1
        self._watch = -1  # its watch descriptor; -1: none, look every time
        self._queued = bytearray(4)

    def stirred(self, number: int, journal_fd: int | None) -> bool:
        """Whether journal ``number`` (open as ``journal_fd``) may have lost its
        name since the last call: something happened to it, or it is a new one."""
        if journal_fd is None:
            return True
        if number != self._number or journal_fd != self._journal_fd:
            self._follow(number, journal_fd)
            return True
        if self._watch < 0:
            return True
        fcntl.ioctl(self._fd, termios.FIONREAD, self._queued)
        if self._queued == b"\0\0\0\0":
            return False
        self._drain()
        return True

    def _follow(self, number: int, journal_fd: int) -> None:
        self._number, self._journal_fd = number, journal_fd
        if self._fd < 0:
            self._fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if self._fd < 0:
                return
        if self._watch >= 0:
            libc.inotify_rm_watch(self._fd, self._watch)  # gone already if it was deleted
        self._drain()
        # The open file itself, whatever its name has become meanwhile.
        path = f"/proc/self/fd/{journal_fd}".encode()
        self._watch = libc.inotify_add_watch(
            self._fd, path, _IN_ATTRIB | _IN_MOVE_SELF | _IN_DELETE_SELF
        )

    def _drain(self) -> None:
        try:
            while os.read(self._fd, 65536):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
