"""Files the daemon reads and writes: only regular ones, opened without blocking, and
written whole when they are replaced.

Invariants:

- A file is opened with ``O_NONBLOCK`` and ``O_NOCTTY`` (and ``O_NOFOLLOW`` unless
  the caller follows symlinks), and its descriptor is checked with fstat(2) to be a
  regular file before a byte is read or written (`open_regular`): a FIFO, a
  socket, a directory or a device at its path is `NotRegular`, found in one
  non-blocking open, never waited on (an open(2) of a FIFO with no writer blocks
  until one comes, and a read of a device may never end). The descriptor decides,
  not a stat of the path before the open, which the path may change between;
  what plainly is no regular file (by lstat) is refused before any open, as a
  device's open(2) may act on it (a tape rewinds, a terminal hangs up).
- ``O_NONBLOCK`` stays on the descriptor: Linux ignores it for regular files.
- A file written whole (`replace_file`, `NewFile`) goes to a new file beside it,
  created afresh (``O_EXCL``, so never through a symlink or into a FIFO left
  there), then renamed over it, so that a crash of the daemon leaves the old or
  the new, never half of one (nothing is fsynced, as nothing of the state is:
  `watchdogd.storage.store`). It is readable by its owner alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from typing import Final

from .faults import NotRegular

#: What open(2) fails with on a path that names no regular file: a symlink under
#: ``O_NOFOLLOW`` (ELOOP), a socket, or a FIFO opened for writing with no reader
#: (ENXIO), a directory opened for writing (EISDIR), a device with no driver
#: (ENODEV, ENXIO).
_NOT_REGULAR_ERRORS = frozenset({errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV})


#: What each type of file is called in a log line, by the test of its mode.
_KINDS: Final = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words for a log line."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return f"a file of type {stat.S_IFMT(mode):#o}"


def _what_is_at(path: str, follow: bool) -> str | None:
    """What ``path`` names if it is no regular file; None if it is one, or is
    not there."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind_of(mode)


def open_regular(
    path: str, flags: int = os.O_RDONLY, mode: int = 0o600, *, follow: bool = False
) -> int:
    """Open ``path`` with ``flags`` (``mode`` if it is created) as a regular file,
    without blocking; raises `NotRegular` if it is anything else (a symlink too,
    unless ``follow``), and OSError as open(2) does otherwise."""
    kind = _what_is_at(path, follow)
    if kind is not None:
        raise NotRegular(path, kind)
    extra = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as exc:
        if exc.errno in _NOT_REGULAR_ERRORS and (kind := _what_is_at(path, follow)) is not None:
            raise NotRegular(path, kind) from None
        raise
    try:
        found = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(found):
        os.close(fd)
        raise NotRegular(path, kind_of(found))
    return fd


def read_regular(path: str, limit: int | None = None, *, follow: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (`open_regular`); at most
    ``limit`` + 1 of them when a limit is given, so that a caller sees a file
    over it without reading it whole."""
    with open(open_regular(path, follow=follow), "rb") as file:
        return file.read() if limit is None else file.read(limit + 1)


def empty_regular(path: str) -> int:
    """Empty the regular file at ``path`` (`open_regular`: nothing else is
    opened), so that its room comes back now even while another descriptor
    holds it open; the bytes it held, 0 when something else is there. Raises
    OSError as open(2) does (FileNotFoundError: nothing is there)."""
    try:
        fd = open_regular(path, os.O_WRONLY)
    except NotRegular:
        return 0
    try:
        size = os.fstat(fd).st_size
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    return size


def removed_now(path: str) -> int:
    """Remove the file at ``path``, its room given back now even while another
    descriptor holds it open (`empty_regular`, when it may be written): the bytes
    it held, 0 when nothing was removed."""
    try:
        size = os.stat(path).st_size
        with contextlib.suppress(OSError):
            empty_regular(path)
        os.unlink(path)
    except OSError:
        return 0
    return size


def replace_file(path: str, parts: Iterable[bytes | bytearray]) -> None:
    """Make ``path`` hold ``parts``, in order; raises OSError, leaving no partial
    file behind."""
    new = NewFile(path)
    try:
        new.open()
        for part in parts:
            new.write(part)
        new.commit()
    finally:
        new.discard()


class NewFile:
    """A file written whole in parts, in turn, so that its writer need not hold
    them all: ``path`` + ``.new``, made afresh by `open`, renamed over ``path`` by
    `commit`. Each call but `discard` raises OSError; each may be made in a worker
    thread, one at a time. `discard` after every write, committed or not: it
    removes an uncommitted file (a failure, a cancellation), so that no partial
    file is left behind."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._partial = path + ".new"
        self._fd: int | None = None
        self._committed = False

    def open(self) -> None:
        # What an earlier write left there (it died before the rename), or what
        # someone put in the way: the new file is made afresh, never opened
        # through what is there.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._partial)
        self._fd = os.open(
            self._partial,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )

    def write(self, part: bytes | bytearray) -> None:
        """Append ``part``."""
        view = memoryview(part)
        while view:
            view = view[os.write(self._opened(), view) :]

    def start_over(self) -> None:
        """Drop what was written: what follows is the whole file."""
        fd = self._opened()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)

    def commit(self) -> None:
        """``path`` holds what was written."""
        fd, self._fd = self._opened(), None
        os.close(fd)
        os.replace(self._partial, self._path)
        self._committed = True

    def discard(self) -> None:
        """Close it, and remove it unless it was committed; never raises."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if not self._committed:
            with contextlib.suppress(OSError):
                os.unlink(self._partial)

    def _opened(self) -> int:
        if self._fd is None:
            raise OSError(errno.EBADF, f"{self._partial} is not open")
        return self._fd
