"""A CLOCK_MONOTONIC timerfd: wakes the trio loop at an absolute time, to the microsecond.

trio sleeps in epoll_wait, whose timeout is in whole milliseconds, rounded up: a
deadline met that way is on average half a millisecond late. A timerfd armed for the
deadline becomes readable when the kernel's high-resolution timer fires, and waiting
for it is an ordinary ``wait_readable``.

Python has ``os.timerfd_create`` from 3.13; before that libc is called through ctypes
(`watchdogd.host.libc`).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
from typing import Final

CLOCK_MONOTONIC: Final = 1
TFD_NONBLOCK: Final = os.O_NONBLOCK
TFD_CLOEXEC: Final = os.O_CLOEXEC
TFD_TIMER_ABSTIME: Final = 1
_NS: Final = 1_000_000_000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


if sys.version_info >= (3, 13):

    def _create() -> int:
        return os.timerfd_create(CLOCK_MONOTONIC, flags=TFD_NONBLOCK | TFD_CLOEXEC)

    def _set_ns(fd: int, ns: int) -> None:
        os.timerfd_settime_ns(fd, flags=TFD_TIMER_ABSTIME, initial=ns)

else:
    from .libc import libc, raise_errno

    def _create() -> int:
        fd: int = libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            raise_errno()
        return fd

    def _set_ns(fd: int, ns: int) -> None:
        spec = _Itimerspec()
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, _NS)
        if libc.timerfd_settime(fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) < 0:
            raise_errno()


class TimerFd:
    """One timer on CLOCK_MONOTONIC (the clock of ``time.monotonic``)."""

    def __init__(self) -> None:
        self.fd = _create()

    def fileno(self) -> int:
        return self.fd

    def set(self, deadline: float) -> None:
        """Become readable at ``deadline`` (``time.monotonic`` seconds; at once if it
        has passed). Infinity disarms it."""
        # An all-zero value disarms a timerfd.
        _set_ns(self.fd, 0 if math.isinf(deadline) else max(1, math.ceil(deadline * _NS)))

    def clear(self) -> None:
        """Consume an expiry, if one happened."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)

    def close(self) -> None:
        os.close(self.fd)
