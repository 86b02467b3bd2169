"""libc through ctypes, for the system calls Python (3.11) has no function for:
timerfd (`watchdogd.host.timerfd`, before 3.13) and inotify
(`watchdogd.host.inotify`)."""

from __future__ import annotations

import ctypes
import os

#: The C library of this process, with errno kept for `raise_errno`.
libc = ctypes.CDLL(None, use_errno=True)


def raise_errno() -> None:
    """Raise the OSError of the errno the last failed call of `libc` left."""
    errno = ctypes.get_errno()
    raise OSError(errno, os.strerror(errno))
