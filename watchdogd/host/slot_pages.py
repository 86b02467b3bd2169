"""Slot pages as the kernel holds them: sealed memfds the daemon shares with one
process each (`watchdogd_protocol.slot_page` is their layout).

A page is made here (`SlotPages.new_page`): a memfd of `PAGE_BYTES`, sealed so
that neither side can shrink or grow it (so no mapping of it can ever fault), and
mapped here. Its descriptor goes to its process over the socket (`MapPage`), which
maps it too and keeps a descriptor of it open. That descriptor is what makes a
page outlive the daemon: after a crash or a restart, the next daemon finds the pages
of a process among its open descriptors by their inodes (`Search`: one read of its
descriptors for all of them, a slice at a time), as /proc/PID/fd shows them to
anyone who may read the process's memory (root, the shipped unit's
CAP_SYS_PTRACE, or the process's own user), checks that each is the same sealed
memfd, and maps it again. So a page lives exactly as long as its process keeps
it, and nothing of it is left on any disk.

Nothing found at a path or in a descriptor is trusted: a descriptor is first
opened with O_PATH (which opens nothing: no FIFO can block, no device act) and
checked by its inode before it is reopened, and a page is used only with the seals
and the size of a slot page. Every read of a word bounds what it returns.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Final

from watchdogd_protocol.slot_page import (
    AUTO,
    BLOCKS,
    DEADLINE,
    HEADER_MAGIC,
    HEADER_SLOTS,
    LARGEST,
    MAGIC,
    PAGE_BYTES,
    PERIOD,
    ROWS,
    SHMEM_PAGE,
    SLOTS,
    TAKEN,
    buckets_in,
    moved_slots,
    word_of,
)

from .process import Process

#: The name every page's memfd carries (/proc/PID/fd shows it as a link to
#: ``/memfd:NAME (deleted)``): what a search for a page after a restart looks at.
MEMFD_NAME: Final = "watchdogd-slots"
_LINK: Final = f"/memfd:{MEMFD_NAME} (deleted)"
#: fcntl(2) F_ADD_SEALS, F_GET_SEALS and the seals (Python 3.11 lacks the names).
_F_ADD_SEALS: Final = 1033
_F_GET_SEALS: Final = 1034
_F_SEAL_SEAL: Final = 0x0001
_F_SEAL_SHRINK: Final = 0x0002
_F_SEAL_GROW: Final = 0x0004
_F_SEAL_WRITE: Final = 0x0008
_F_SEAL_FUTURE_WRITE: Final = 0x0010
_SEALS: Final = _F_SEAL_SEAL | _F_SEAL_SHRINK | _F_SEAL_GROW
#: The most descriptors of one process looked at to find its page again: a search
#: costs a readlink(2) each, on the event loop.
_SEARCHED: Final = 65_536
#: The first layout of a page: 64 KiB, 63 slots of 8 words from the ninth word,
#: their period the second of each.
_FIRST_LAYOUT_BYTES: Final = 64 * 1024
_FIRST_LAYOUT_SLOTS: Final = 63
_FIRST_LAYOUT_MAGIC: Final = int.from_bytes(b"WDSLOTS1", "little")
_FIRST_LAYOUT_PERIOD: Final = 8 + 1
_FIRST_LAYOUT_SLOT_WORDS: Final = 8
#: More than a timens_offsets file ever holds (two short lines).
_OFFSETS_BYTES: Final = 512
#: The largest offset a time namespace may have (the kernel bounds it by
#: KTIME_SEC_MAX / 2; anything past ~146 years is no clock to read deadlines by).
_MOST_OFFSET: Final = 2**32


class PageError(Exception):
    """A page could not be made or found again; the message says why."""


class SlotPage:
    """One mapped page: its inode (the page's id on the wire and in the state), a
    descriptor of it (to hand to its process), and its words."""

    __slots__ = ("_counts", "_mapping", "_words", "fd", "id")

    def __init__(self, fd: int, mapping: mmap.mmap) -> None:
        self.fd = fd
        self.id = os.fstat(fd).st_ino
        self._mapping = mapping
        self._words = memoryview(mapping).cast("Q")
        self._counts = memoryview(mapping).cast("I")

    def __repr__(self) -> str:
        return f"<SlotPage {self.id}>"

    def read(self, index: int) -> int:
        """The deadline word of slot ``index`` (the process's to write)."""
        return self._words[word_of(index, DEADLINE)]

    def blocks(self, index: int) -> int:
        """How many blocks slot ``index``'s process says it released by a store."""
        return self._words[word_of(index, BLOCKS)]

    def largest(self, index: int) -> int:
        """The longest block of slot ``index``, as its process wrote it (us)."""
        return self._words[word_of(index, LARGEST)]

    def taken(self, index: int) -> int:
        """The blocks of slot ``index`` the last harvest took (the daemon's word)."""
        return self._words[word_of(index, TAKEN)]

    def moved(self) -> list[int]:
        return moved_slots(self._words)

    def rows(self) -> list[int]:
        """The buckets whose rows of counts lie in the memory the kernel holds for
        the page: the only rows read, since a read through the mapping of any
        other would make the kernel give it memory."""
        return [bucket for shmem_page in self._held() for bucket in buckets_in(shmem_page)]

    def counts(self, index: int, rows: Iterable[int]) -> Sequence[tuple[int, int, int]]:
        """The duration counts of slot ``index`` in ``rows`` (buckets) that differ
        from what the last harvest took: ``(bucket, count, taken)``."""
        counts = self._counts
        moved = []
        for bucket in rows:
            at = ROWS[bucket] + index
            count, taken = counts[at], counts[at + SLOTS]
            if count != taken:
                moved.append((bucket, count, taken))
        return moved

    def took(self, index: int, blocks: int, counts: Iterable[tuple[int, int]]) -> None:
        """Write what a harvest of slot ``index`` took: its blocks and its counts."""
        for bucket, count in counts:
            self._counts[ROWS[bucket] + SLOTS + index] = count
        self._words[word_of(index, TAKEN)] = blocks

    def _held(self) -> Iterator[int]:
        """The `SHMEM_PAGE`s of the page that hold data (SEEK_DATA, SEEK_HOLE: the
        kernel's record, which a process's writes only ever add to, or its punched
        holes take from, within the page's sealed size)."""
        offset = 0
        while offset < PAGE_BYTES:
            try:
                start = os.lseek(self.fd, offset, os.SEEK_DATA)
                offset = os.lseek(self.fd, start, os.SEEK_HOLE)
            except OSError:  # ENXIO: no data past ``offset``
                return
            yield from range(start // SHMEM_PAGE, -(-offset // SHMEM_PAGE))

    def write(self, index: int, *, deadline: int | None = None, period: int | None = None) -> None:
        """Write slot ``index``'s deadline (for an arm made over the socket) and
        its period (0: closed)."""
        if deadline is not None:
            self._words[word_of(index, DEADLINE)] = deadline
        if period is not None:
            self._words[word_of(index, PERIOD)] = period

    def write_auto(self, index: int, timeout: int) -> None:
        """The timeout slot ``index`` arms with ``after="auto"``, in microseconds."""
        self._words[word_of(index, AUTO)] = timeout

    def close_all(self) -> None:
        """Close every slot (the daemon stops for good): each block goes over the
        socket from now on."""
        for index in range(SLOTS):
            self._words[word_of(index, PERIOD)] = 0

    def close(self) -> None:
        """Unmap it and close the descriptor."""
        self._words.release()
        self._counts.release()
        with contextlib.suppress(BufferError):
            self._mapping.close()
        os.close(self.fd)


def new_page() -> SlotPage:
    """A fresh page: sealed, mapped, its header written. Raises `PageError`."""
    try:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise PageError(f"memfd_create: {exc.strerror}") from None
    try:
        os.ftruncate(fd, PAGE_BYTES)
        fcntl.fcntl(fd, _F_ADD_SEALS, _SEALS)
        mapping = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise PageError(f"a slot page: {exc.strerror}") from None
    header = memoryview(mapping).cast("Q")
    header[HEADER_SLOTS] = SLOTS
    header[HEADER_MAGIC] = MAGIC
    header.release()
    return SlotPage(fd, mapping)


class Search:
    """A search for the pages ``wanted`` (their inodes) among the descriptors
    ``process`` holds (a restart), all of them in one read of its descriptors, a
    slice at a time: a process may hold tens of thousands of descriptors, and
    each costs a readlink(2), so no search holds the event loop for more than a
    slice whatever the process holds, and a process holding many pages has its
    descriptors read once, not once a page.

    ``wanted`` is the caller's set, read as each descriptor is: it may grow while
    the search goes on, and a page added once its descriptor was read is not
    found (the caller searches for it again)."""

    def __init__(self, process: Process, wanted: AbstractSet[int]) -> None:
        self._process = process
        self._wanted = wanted
        self._directory = f"/proc/{process.pid}/fd"
        self._entries: Iterator[os.DirEntry[str]] = iter(())
        self._close_entries: Callable[[], None] | None = None
        self._searched = 0
        self._found: dict[int, SlotPage] = {}
        #: Why each wanted descriptor that was no slot page was refused, by inode.
        self.refused: dict[int, str] = {}

    def step(self, until: float) -> dict[int, SlotPage] | None:
        """Search on until CLOCK_MONOTONIC reads ``until`` (one descriptor at
        least): once every descriptor is read (or the most a search reads), the
        wanted pages found, by inode; None while the search goes on. Raises
        `PageError` once the descriptors cannot be read, or the process exited
        meanwhile (its pid may be another's: nothing read is kept)."""
        try:
            if self._close_entries is None:
                entries = os.scandir(self._directory)
                self._entries, self._close_entries = entries, entries.close
            while True:
                entry = next(self._entries, None)
                if entry is None:
                    break
                self._searched += 1
                if self._searched > _SEARCHED:
                    break
                self._take(entry.path)
                if time.monotonic() >= until:
                    return None
        except OSError as exc:
            self.close()
            raise PageError(f"{self._directory}: {exc.strerror}") from None
        self._end()
        if not self._process.alive():
            self.close()
            raise PageError(f"pid {self._process.pid} exited while its pages were searched for")
        found, self._found = self._found, {}
        return found

    def _take(self, path: str) -> None:
        """Keep the page at descriptor link ``path`` when it is a wanted one."""
        opened = _opened(path, self._wanted)
        if opened is None:
            return
        inode, fd = opened
        if inode in self._found:
            os.close(fd)  # another descriptor of a page found already
            return
        try:
            self._found[inode] = _checked(fd, inode)
        except PageError as exc:
            self.refused[inode] = str(exc)

    def _end(self) -> None:
        if self._close_entries is not None:
            self._close_entries()
            self._close_entries = None
        self._entries = iter(())

    def close(self) -> None:
        """Let go of the directory it reads and of the pages found and not
        handed over (at its end, or when given up)."""
        self._end()
        for page in self._found.values():
            page.close()
        self._found = {}


def adopt(process: Process, page: int) -> SlotPage:
    """Page ``page`` again, from the descriptors ``process`` holds, searched in
    one go. Raises `PageError` when it holds none, or it is not a slot page."""
    search = Search(process, {page})
    try:
        while (found := search.step(math.inf)) is None:
            pass
    finally:
        search.close()
    if page in found:
        return found[page]
    for other in found.values():
        other.close()
    raise PageError(
        search.refused.get(page) or f"pid {process.pid} holds no descriptor of slot page {page}"
    )


def _opened(path: str, wanted: AbstractSet[int]) -> tuple[int, int] | None:
    """The inode and a read-write descriptor of the memfd at descriptor link
    ``path`` when it is a memfd of a slot page whose inode is ``wanted``; None
    otherwise."""
    try:
        if os.readlink(path) != _LINK:
            return None
        # O_PATH opens nothing: it only names what the link points to.
        found = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(found)
        if (
            info.st_ino not in wanted
            or info.st_dev != _memfd_device()
            or not stat.S_ISREG(info.st_mode)
        ):
            return None
        fd = os.open(f"/proc/self/fd/{found}", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    finally:
        os.close(found)
    return info.st_ino, fd


@functools.cache
def _memfd_device() -> int:
    """The device every memfd is on (the kernel's internal shmem mount): a page's
    inode number is looked for there only."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def _checked(fd: int, page: int) -> SlotPage:
    """The page of ``fd`` mapped, once it is seen to be a slot page; closes ``fd``
    and raises `PageError` otherwise."""
    try:
        mapping = _mapped(fd, page)
    except BaseException:
        os.close(fd)
        raise
    return SlotPage(fd, mapping)


def _mapped(fd: int, page: int) -> mmap.mmap:
    try:
        seals = fcntl.fcntl(fd, _F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise PageError(f"slot page {page}: {exc.strerror}") from None
    if seals & _SEALS != _SEALS or seals & (_F_SEAL_WRITE | _F_SEAL_FUTURE_WRITE):
        raise PageError(f"slot page {page} is not sealed as a slot page ({seals:#x})")
    if size == _FIRST_LAYOUT_BYTES:
        _close_first_layout(fd)
        raise PageError(
            f"slot page {page} has the layout of an earlier daemon: its slots are closed, "
            "its blocks go over the socket"
        )
    if size != PAGE_BYTES:
        raise PageError(f"slot page {page} is {size} bytes, not {PAGE_BYTES}")
    try:
        mapping = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise PageError(f"slot page {page}: {exc.strerror}") from None
    header = memoryview(mapping).cast("Q")
    ours = header[HEADER_MAGIC] == MAGIC and header[HEADER_SLOTS] == SLOTS
    header.release()
    if not ours:
        mapping.close()
        raise PageError(f"slot page {page} has another layout")
    return mapping


def _close_first_layout(fd: int) -> None:
    """Close every slot of a page of the first layout (``WDSLOTS1``, which a daemon
    before this one made), so that its process, which reads its slot's period again
    after each store, arms its blocks over the socket from then on, rather than
    storing into a page no daemon reads."""
    try:
        mapping = mmap.mmap(
            fd, _FIRST_LAYOUT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
    except OSError:
        return
    words = memoryview(mapping).cast("Q")
    if words[HEADER_MAGIC] == _FIRST_LAYOUT_MAGIC:
        for index in range(_FIRST_LAYOUT_SLOTS):
            words[_FIRST_LAYOUT_PERIOD + index * _FIRST_LAYOUT_SLOT_WORDS] = 0
    words.release()
    mapping.close()


def shares_clock(process: Process) -> bool:
    """Whether the page's deadlines, CLOCK_MONOTONIC's, are ``process``'s own (it
    is in the daemon's time namespace), and the daemon may read its descriptors
    (so that its page survives a restart of the daemon)."""
    try:
        same = os.readlink(f"/proc/{process.pid}/ns/time") == os.readlink("/proc/self/ns/time")
        directory = os.open(f"/proc/{process.pid}/fd", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    os.close(directory)
    return same and process.alive()


def clock_offset(process: Process) -> float | None:
    """How far ``process``'s CLOCK_MONOTONIC reads ahead of the daemon's, in
    seconds: 0.0 while it is in the daemon's time namespace (a readlink(2), cheap
    enough for every look at its slots), else what the two namespaces' offsets
    say; None when that cannot be read (it exited, or its offsets make no sense)."""
    try:
        if os.readlink(f"/proc/{process.pid}/ns/time") == _own_time_namespace():
            return 0.0
        theirs = _monotonic_offset(f"/proc/{process.pid}/timens_offsets")
        ours = _monotonic_offset("/proc/self/timens_offsets")
    except OSError:
        return None
    if theirs is None or ours is None or not process.alive():
        return None
    return theirs - ours


@functools.cache
def _own_time_namespace() -> str:
    return os.readlink("/proc/self/ns/time")


def _monotonic_offset(path: str) -> float | None:
    """The CLOCK_MONOTONIC offset a timens_offsets file (time_namespaces(7))
    gives, in seconds; None when it gives none that makes sense."""
    with open(path, "rb") as file:
        text = file.read(_OFFSETS_BYTES)
    for line in text.decode("ascii", "replace").splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] in ("monotonic", "1"):
            try:
                seconds, nanoseconds = int(fields[1]), int(fields[2])
            except ValueError:
                return None
            if abs(seconds) > _MOST_OFFSET or not 0 <= nanoseconds < 1_000_000_000:
                return None
            return seconds + nanoseconds / 1e9
    return None
