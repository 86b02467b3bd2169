"""Slot pages as the kernel holds them (`watchdogd.host.slot_pages`): real sealed
memfds, found again among the descriptors of real child processes, and the check
that a process reads CLOCK_MONOTONIC as the daemon does, against real time
namespaces and a real unprivileged reader."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd.host.process import open_process
from watchdogd.host.slot_pages import (
    MEMFD_NAME,
    PageError,
    Search,
    SlotPage,
    adopt,
    clock_offset,
    new_page,
    shares_clock,
)
from watchdogd_protocol.slot_page import (
    BLOCKS,
    DEADLINE,
    MAGIC,
    PAGE_BYTES,
    SHMEM_PAGE,
    SLOTS,
    count_of,
    taken_of,
    word_of,
)

from helpers.processes import reap, sleeper
from helpers.users import NOBODY, nobody_sleeper
from helpers.waiting import wait_until

#: fcntl(2)'s sealing commands and seals.
F_ADD_SEALS = 1033
F_GET_SEALS = 1034
F_SEAL_SEAL = 0x0001
F_SEAL_SHRINK = 0x0002
F_SEAL_GROW = 0x0004
F_SEAL_WRITE = 0x0008
#: What /proc/PID/fd shows for a page's descriptor.
PAGE_LINK = f"/memfd:{MEMFD_NAME} (deleted)"
#: Seconds an adoption may take before it is taken to block.
BLOCKED = 10.0

#: A process that maps the descriptors it was given and writes a word into each
#: (``FD:WORD:VALUE``, the word's index in the page seen as 64-bit words), then
#: waits for its stdin to close.
HOLDER = textwrap.dedent(
    """
    import mmap, sys
    from watchdogd_protocol.slot_page import PAGE_BYTES
    for spec in sys.argv[1:]:
        fd, word, value = map(int, spec.split(":"))
        mapping = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        memoryview(mapping).cast("Q")[word] = value
    print("ready", flush=True)
    sys.stdin.read()
    """
)


@contextlib.contextmanager
def holder(
    writes: dict[int, tuple[int, int]], kept: tuple[int, ...] = ()
) -> Iterator[subprocess.Popen[str]]:
    """A child holding descriptors ``writes`` (each written as ``(word, value)``)
    and ``kept`` (only held), at the numbers they have here."""
    specs = [f"{fd}:{word}:{value}" for fd, (word, value) in writes.items()]
    with ready_child(HOLDER, specs, (*writes, *kept)) as child:
        yield child


@contextlib.contextmanager
def ready_child(
    script: str, args: list[str], fds: tuple[int, ...]
) -> Iterator[subprocess.Popen[str]]:
    """A child running ``script`` with ``args``, holding ``fds``, once it says it
    is ready; it waits for its stdin to close."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        pass_fds=fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        reap(child)


def word_of_deadline(index: int) -> int:
    """Slot ``index``'s deadline word, in the page seen as 64-bit words."""
    return word_of(index, DEADLINE)


def adopted(pid: int, page: int) -> SlotPage:
    """`adopt` of page ``page`` from process ``pid``, run where a blocked open
    cannot hold the test up: a thread given `BLOCKED` seconds."""
    outcome: list[SlotPage | BaseException] = []

    def search() -> None:
        process = open_process(pid)
        try:
            outcome.append(adopt(process, page))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            process.close()

    thread = threading.Thread(target=search, daemon=True)
    thread.start()
    thread.join(BLOCKED)
    assert not thread.is_alive(), f"adopting page {page} of pid {pid} blocked"
    [result] = outcome
    if isinstance(result, BaseException):
        raise result
    return result


def memfd_page(name: str = MEMFD_NAME, *, seals: int, size: int = PAGE_BYTES) -> int:
    """A memfd of ``size`` bytes with a slot page's header, sealed with ``seals``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, MAGIC.to_bytes(8, "little") + SLOTS.to_bytes(8, "little"), 0)
    if seals:
        fcntl.fcntl(fd, F_ADD_SEALS, seals)
    return fd


def test_a_new_page_is_sealed_against_shrinking_and_growing_and_carries_the_header() -> None:
    page = new_page()
    try:
        seals = fcntl.fcntl(page.fd, F_GET_SEALS)
        assert seals & (F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW) == (
            F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW
        )
        assert not seals & F_SEAL_WRITE  # its process writes it
        for size in (PAGE_BYTES // 2, 0, PAGE_BYTES * 2):
            with pytest.raises(PermissionError) as refused:
                os.ftruncate(page.fd, size)
            assert refused.value.errno == errno.EPERM
        with pytest.raises(PermissionError):
            fcntl.fcntl(page.fd, F_ADD_SEALS, 0)  # the seals themselves are sealed
        info = os.fstat(page.fd)
        assert (info.st_size, info.st_ino, page.id) == (PAGE_BYTES, page.id, info.st_ino)
        header = os.pread(page.fd, 16, 0)
        assert int.from_bytes(header[:8], "little") == MAGIC
        assert int.from_bytes(header[8:], "little") == SLOTS
        assert os.readlink(f"/proc/self/fd/{page.fd}") == PAGE_LINK
        # What the daemon writes is in the memory the descriptor names.
        page.write(5, deadline=123_456_789, period=7_000)
        page.write_auto(5, 42)
        assert page.read(5) == 123_456_789
        offset = 8 * word_of_deadline(5)
        words = os.pread(page.fd, 24, offset)
        assert [int.from_bytes(words[i : i + 8], "little") for i in (0, 8, 16)] == [
            123_456_789,
            7_000,
            42,
        ]
        assert fcntl.fcntl(page.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        page.close()


def test_a_child_holding_the_pages_descriptor_has_it_adopted_with_what_it_wrote() -> None:
    page = new_page()
    page_id = page.id
    with holder({page.fd: (word_of_deadline(3), 987_654_321)}) as child:
        page.close()  # the daemon that made it is gone
        found = adopted(child.pid, page_id)
        try:
            assert found.id == page_id
            assert found.read(3) == 987_654_321
            assert found.read(2) == 0
        finally:
            found.close()


def test_adopt_refuses_a_page_the_process_does_not_hold() -> None:
    held, elsewhere = new_page(), new_page()
    try:
        with holder({held.fd: (word_of_deadline(0), 1)}) as child:
            for page in (elsewhere.id, held.id + 10_000_000, 1):
                with pytest.raises(PageError, match="holds no descriptor"):
                    adopted(child.pid, page)
    finally:
        held.close()
        elsewhere.close()


@pytest.fixture
def spoofs(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A FIFO (open for reading only: a plain open of it for reading would wait
    for a writer) and a regular file of a page's size, whose descriptors show in
    /proc exactly as a page's do: each lived at the root of a tmpfs that was
    lazily unmounted after it was deleted."""
    fds: list[int] = []
    for make in ("fifo", "file"):
        mount = tmp_path / make
        mount.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
        try:
            path = mount / f"memfd:{MEMFD_NAME}"
            if make == "fifo":
                os.mkfifo(path)
                fds.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            else:
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
                os.ftruncate(fds[-1], PAGE_BYTES)
                os.pwrite(fds[-1], MAGIC.to_bytes(8, "little") + SLOTS.to_bytes(8, "little"), 0)
            path.unlink()
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=True)
    try:
        yield fds[0], fds[1]
    finally:
        for fd in fds:
            os.close(fd)


def test_descriptors_that_only_look_like_a_page_never_block_or_match(
    spoofs: tuple[int, int],
) -> None:
    fifo, regular = spoofs
    other_name = memfd_page("not-a-page", seals=F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW)
    same_name = new_page()  # a page, but another one: another inode
    page = new_page()  # made last: the search meets every other descriptor first
    writes = {same_name.fd: (word_of_deadline(0), 222), page.fd: (word_of_deadline(0), 111)}
    try:
        with holder(writes, kept=(fifo, regular, other_name)) as child:
            links = {fd: os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in (fifo, regular)}
            assert links == {fifo: PAGE_LINK, regular: PAGE_LINK}, "the spoofs are not set up"
            found = adopted(child.pid, page.id)
            try:
                assert found.read(0) == 111
            finally:
                found.close()
            other = adopted(child.pid, same_name.id)
            try:
                assert other.read(0) == 222
            finally:
                other.close()
            for impostor in (fifo, regular, other_name):
                inode = os.fstat(impostor).st_ino
                assert inode not in (page.id, same_name.id)
                with pytest.raises(PageError):
                    adopted(child.pid, inode).close()
    finally:
        os.close(other_name)
        same_name.close()
        page.close()


@pytest.mark.parametrize(
    ("seals", "size", "why"),
    [
        (F_SEAL_GROW, PAGE_BYTES, "not sealed"),
        (F_SEAL_SEAL | F_SEAL_SHRINK, PAGE_BYTES, "not sealed"),
        (0, PAGE_BYTES, "not sealed"),
        (F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE, PAGE_BYTES, "not sealed"),
        (F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW, 2 * PAGE_BYTES, "bytes"),
    ],
)
def test_a_memfd_not_sealed_and_sized_as_a_page_is_refused_by_adopt(
    seals: int, size: int, why: str
) -> None:
    fd = memfd_page(seals=seals, size=size)
    try:
        with holder({}, kept=(fd,)) as child, pytest.raises(PageError, match=why):
            adopted(child.pid, os.fstat(fd).st_ino)
    finally:
        os.close(fd)


def held_bytes(fd: int) -> int:
    """The bytes of memory the kernel holds for memfd ``fd``."""
    return os.fstat(fd).st_blocks * 512


def test_a_harvest_reads_only_the_memory_the_kernel_holds_for_the_page() -> None:
    page = new_page()
    try:
        assert held_bytes(page.fd) == SHMEM_PAGE  # the header's, and the control parts'
        # The process counts blocks of slot 5: one of a millisecond, three of minutes.
        for bucket, count in ((0, 1), (100, 3)):
            os.pwrite(page.fd, count.to_bytes(4, "little"), 4 * count_of(5, bucket))
        assert held_bytes(page.fd) == 2 * SHMEM_PAGE
        rows = page.rows()
        assert (rows[0], len(rows)) == (0, len(set(rows)))
        assert 100 in rows
        assert page.counts(5, rows) == [(0, 1, 0), (100, 3, 0)]
        assert page.counts(6, rows) == []
        page.took(5, 4, [(0, 1), (100, 3)])
        assert (page.counts(5, page.rows()), page.taken(5)) == ([], 4)
        taken = os.pread(page.fd, 4, 4 * taken_of(5, 100))
        assert int.from_bytes(taken, "little") == 3
        # Reading every slot's counts gave no other row memory.
        for index in range(SLOTS):
            page.counts(index, page.rows())
        assert held_bytes(page.fd) == 2 * SHMEM_PAGE
    finally:
        page.close()


def test_the_slots_a_harvest_takes_from_are_those_whose_block_count_moved() -> None:
    page = new_page()
    try:
        assert page.moved() == []
        # The process released blocks of slots 0, 7 and the last by stores.
        for index, blocks in ((0, 1), (7, 2**64 - 1), (SLOTS - 1, 5)):
            os.pwrite(page.fd, blocks.to_bytes(8, "little"), 8 * word_of(index, BLOCKS))
        assert page.moved() == [0, 7, SLOTS - 1]
        page.took(7, 2**64 - 1, [])
        assert page.moved() == [0, SLOTS - 1]
    finally:
        page.close()


def test_a_page_of_the_first_layout_is_refused_and_its_slots_closed() -> None:
    """A page an earlier daemon made (``WDSLOTS1``: 64 KiB, slots of 8 words) that
    its process still holds after an upgrade: its slots close, so the process's
    next blocks go over the socket, and nothing else of it is written."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    words = [0] * 8 * (1 + SLOTS)
    words[0], words[1] = int.from_bytes(b"WDSLOTS1", "little"), SLOTS
    for index in range(SLOTS):
        words[8 + index * 8 : 8 + index * 8 + 2] = [123_456_789 + index, 500_000]
    os.ftruncate(fd, 64 * 1024)
    os.pwrite(fd, b"".join(word.to_bytes(8, "little") for word in words), 0)
    fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW)
    try:
        with holder({}, kept=(fd,)) as child, pytest.raises(PageError, match="earlier daemon"):
            adopted(child.pid, os.fstat(fd).st_ino)
        data = os.pread(fd, 8 * len(words), 0)
        after = [int.from_bytes(data[at : at + 8], "little") for at in range(0, len(data), 8)]
        for index in range(SLOTS):
            assert after[8 + index * 8 : 8 + index * 8 + 2] == [123_456_789 + index, 0]
        assert after[:8] == words[:8]
    finally:
        os.close(fd)


def test_shares_clock_for_an_ordinary_child() -> None:
    child = sleeper()
    process = open_process(child.pid)
    try:
        assert shares_clock(process)
    finally:
        process.close()
        reap(child)


def test_a_process_in_another_time_namespace_shares_no_clock_and_its_offset_is_read() -> None:
    child = subprocess.Popen(["unshare", "--time", "--monotonic", "86400", "sleep", "60"])
    ours = os.readlink("/proc/self/ns/time")

    def moved() -> bool:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{child.pid}/comm").read_text().strip() == "sleep"
        return False

    try:
        wait_until(moved, what="unshare to exec sleep in its time namespace")
        assert os.readlink(f"/proc/{child.pid}/ns/time") != ours
        process = open_process(child.pid)
        ours_too = open_process(os.getpid())
        try:
            assert not shares_clock(process)
            assert clock_offset(process) == 86400.0
            assert clock_offset(ours_too) == 0.0
            reap(child)
            assert clock_offset(process) is None  # it exited
        finally:
            process.close()
            ours_too.close()
    finally:
        reap(child)


def test_shares_clock_is_false_for_a_process_the_daemon_may_not_read() -> None:
    """Run as uid 65534: root's child is out of its reach (its descriptors could
    not be searched after a restart), its own user's is not."""
    roots, nobodys = sleeper(), nobody_sleeper()
    processes = [open_process(roots.pid), open_process(nobodys.pid)]
    reading, writing = os.pipe()
    try:
        checker = os.fork()
        if checker == 0:  # pragma: no cover (reports through the pipe)
            try:
                os.close(reading)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                found = [shares_clock(process) for process in processes]
                os.write(writing, json.dumps(found).encode())
            finally:
                os._exit(0)
        os.close(writing)
        with os.fdopen(reading) as pipe:
            reported = pipe.read()
        assert os.waitpid(checker, 0)[1] == 0
        assert json.loads(reported) == [False, True]
    finally:
        for process in processes:
            process.close()
        reap(roots)
        reap(nobodys)


#: A process that holds `CROWD` descriptors of /dev/null, then the page it was
#: given (descriptor ``argv[1]``) moved past them, and waits for its stdin to close.
CROWDED = textwrap.dedent(
    """
    import os, resource, sys
    from watchdogd.host.slot_pages import MEMFD_NAME
    crowd = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (crowd + 64, crowd + 64))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(crowd)]
    os.dup2(int(sys.argv[1]), crowd + 32)
    os.close(int(sys.argv[1]))
    print("ready", flush=True)
    sys.stdin.read()
    """
)
CROWD = 3000


def test_a_search_goes_a_slice_at_a_time_through_a_crowd_of_descriptors() -> None:
    """Searched with a slice already over, each step reads one descriptor: a
    process holding thousands holds the daemon's loop up for none of them."""
    page = new_page()
    page_id = page.id
    with ready_child(CROWDED, [str(page.fd), str(CROWD)], (page.fd,)) as child:
        page.close()
        process = open_process(child.pid)
        search = Search(process, {page_id})
        try:
            steps = 0
            while (found := search.step(-math.inf)) is None:
                steps += 1
            assert steps >= CROWD
            assert list(found) == [page_id]
            found[page_id].close()
        finally:
            search.close()
            process.close()


def test_one_read_of_the_descriptors_finds_every_page_wanted_one_wanted_late_too() -> None:
    """A process holding pages a restart left it with: one search finds them all,
    a page wanted once the search had begun (its descriptor not read yet)
    included; one the process does not hold is not among them."""
    pages = [new_page() for _ in range(4)]
    writes = {page.fd: (word_of_deadline(index), 100 + index) for index, page in enumerate(pages)}
    ids = [page.id for page in pages]
    try:
        with holder(writes) as child:
            process = open_process(child.pid)
            wanted = {ids[0], ids[1], 12345}
            search = Search(process, wanted)
            found: dict[int, SlotPage] = {}
            try:
                assert search.step(-math.inf) is None  # one descriptor read: stdin
                wanted.add(ids[3])
                found = _search_to_the_end(search)
                assert sorted(found) == sorted([ids[0], ids[1], ids[3]])
                assert [found[page].read(ids.index(page)) for page in sorted(found)] == [
                    100 + ids.index(page) for page in sorted(found)
                ]
            finally:
                for page in found.values():
                    page.close()
                search.close()
                process.close()
    finally:
        for page in pages:
            page.close()


def test_a_search_of_a_process_that_holds_no_page_finds_none() -> None:
    victim = sleeper()
    process = open_process(victim.pid)
    search = Search(process, {12345})
    try:
        assert _search_to_the_end(search) == {}
    finally:
        search.close()
        process.close()
        reap(victim)


def test_a_search_of_a_process_that_exited_ends_in_a_page_error() -> None:
    victim = sleeper()
    process = open_process(victim.pid)
    search = Search(process, {12345})
    try:
        reap(victim)
        with pytest.raises(PageError):
            _search_to_the_end(search)
    finally:
        search.close()
        process.close()


def _search_to_the_end(search: Search) -> dict[int, SlotPage]:
    while (found := search.step(-math.inf)) is None:
        pass
    return found
