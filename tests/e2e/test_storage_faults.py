"""A failing disk, for real: tmpfs mounts limited in size or inodes, and remounted
read-only, under a daemon that starts and under its store (a disk that fails under
a running daemon, in each of the ways it can, is in test_disk_faults).

The daemon never exits for it, every armed timer still fires on time, an
acknowledgement that is not durable says so, and once the disk is back a restart
restores every timer. Needs root (to mount), as CI runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd.core.history import History
from watchdogd.core.timers import Timer
from watchdogd.storage.history_file import HistoryFile
from watchdogd.storage.store import EAGER_RETRY, StateError, Store

from helpers.daemon import RunningDaemon
from helpers.disks import (
    Raw,
    daemon_on,
    death_within,
    degraded,
    fill_inodes,
    fill_space,
    journal_files,
    remount,
    tmpfs,
)
from helpers.processes import reap
from helpers.special_files import freed_after, moved_aside
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def disk() -> Iterator[Path]:
    with tmpfs() as directory:
        yield directory


def test_a_daemon_started_on_a_full_disk_restores_what_it_can_read(
    disk: Path, socket_path: Path, tmp_path: Path
) -> None:
    daemon = daemon_on(disk, socket_path, tmp_path)
    daemon.start()
    workers = [subprocess.Popen(["sleep", "600"]) for _ in range(6)]
    try:
        deadline = time.monotonic() + 4.0
        with daemon.client() as client:
            for index, worker in enumerate(workers[:5]):
                client.acquire(f"kept-{index}", 120, pid=worker.pid)
            client.acquire("due-soon", deadline - time.monotonic(), pid=workers[5].pid)
        daemon.stop(signal.SIGKILL)
        filler = fill_space(disk)
        daemon.start()  # it starts, and never exits because it cannot write
        assert daemon.process is not None
        assert daemon.process.poll() is None
        assert degraded(daemon)
        with daemon.client() as client:
            assert client.status().daemon.timers == 6
        death_within(workers[5], PATIENCE)
        assert time.monotonic() - deadline < 1.0  # on time, from memory
        assert not [name for name in os.listdir(disk) if "damaged" in name]
        filler.unlink()
        wait_until(lambda: not degraded(daemon), what="the state to be written again")
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            assert sorted(t.scope for t in client.status().timers) == [
                f"kept-{i}" for i in range(5)
            ]
    finally:
        daemon.stop(signal.SIGKILL)
        for worker in workers:
            reap(worker)


def test_no_inodes_left_at_start_and_at_run_time(socket_path: Path, tmp_path: Path) -> None:
    with tmpfs(inodes=16) as disk:
        daemon = daemon_on(disk, socket_path, tmp_path)
        daemon.start()
        workers = [subprocess.Popen(["sleep", "600"]) for _ in range(4)]
        try:
            with daemon.client() as client:
                client.acquire("first", 120, pid=workers[0].pid)
            daemon.stop(signal.SIGKILL)
            made = fill_inodes(disk)
            daemon.start()  # no inode for a new journal: degraded, serving
            assert degraded(daemon)
            raw = Raw(socket_path)
            assert not raw.acquire("second", 120, workers[1].pid).durable
            # Every reply decodes as the reply to its request: no stray bytes.
            for index in range(50):
                assert not raw.acquire(f"more-{index}", 120, workers[2].pid).durable
            raw.close()
            for path in made:
                path.unlink()
            wait_until(lambda: not degraded(daemon), what="the state to be written again")
            assert len(journal_files(disk)) <= 3
            daemon.stop(signal.SIGKILL)
            daemon.start()
            with daemon.client() as client:
                assert client.status().daemon.timers == 52
        finally:
            daemon.stop(signal.SIGKILL)
            for worker in workers:
                reap(worker)


def test_a_read_only_disk_at_start(disk: Path, socket_path: Path, tmp_path: Path) -> None:
    """(A running daemon keeps its journal open for writing, and the kernel refuses
    to remount a file system read-only under an open writer: only its own errors
    do that, which is the run-time failure the full-disk tests stand in for.)"""
    daemon = daemon_on(disk, socket_path, tmp_path)
    daemon.start()
    worker = subprocess.Popen(["sleep", "600"])
    try:
        with daemon.client() as client:
            client.acquire("before", 120, pid=worker.pid)
        daemon.stop(signal.SIGTERM)
        daemon.start()  # its first fold puts "before" in the database itself
        wait_until(lambda: len(journal_files(disk)) == 1, what="the journals to be folded")
        daemon.stop(signal.SIGKILL)
        remount(disk, "ro")
        daemon.start()
        assert degraded(daemon)
        raw = Raw(socket_path)
        assert not raw.acquire("while-read-only", 120, worker.pid).durable
        raw.close()
        with daemon.client() as client:
            assert client.status().daemon.timers == 2  # what the disk held, and the new one
        remount(disk, "rw")
        wait_until(lambda: not degraded(daemon), what="the state to be written again")
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            assert sorted(t.scope for t in client.status().timers) == [
                "before",
                "while-read-only",
            ]
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            remount(disk, "rw")
        daemon.stop(signal.SIGKILL)
        reap(worker)


async def test_the_journal_descriptor_is_never_left_stale(tmp_path: Path) -> None:
    """Inodes run out when a fold wants a new journal: the store keeps writing to
    the journal it has, and its descriptor is always one of its own journals."""
    with tmpfs(inodes=8) as disk:
        store, _ = Store.open(str(disk / "state.db"), journal_bytes=256)
        made = fill_inodes(disk)
        for index in range(40):
            store.put(Timer(pid=index + 2, scope="s", policy="kill", uid=0, owner=0,
                            timeout=1.0, armed_at=0.0, deadline=1.0))  # fmt: skip
            store.commit(store.generation)
            await store._fold()
            assert store._fd is not None
            assert ".journal." in os.readlink(f"/proc/self/fd/{store._fd}")
        assert len(journal_files(disk)) <= 3
        for path in made:
            path.unlink()
        store.close()
        _, loaded = Store.open(str(disk / "state.db"))
        assert len(loaded.timers) == 40


def test_the_service_manager_is_told(disk: Path, socket_path: Path, tmp_path: Path) -> None:
    """sd_notify STATUS= says the daemon is degraded, from READY on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(str(tmp_path / "notify"))
        manager.settimeout(PATIENCE)
        remount(disk, "ro")
        daemon = RunningDaemon(
            socket_path,
            tmp_path / "watchdogd.log",
            ["--state", str(disk / "state.db")],
            env={"NOTIFY_SOCKET": str(tmp_path / "notify")},
        )
        try:
            daemon.start()
            statuses: list[str] = []
            while not any("READY=1" in status for status in statuses):
                statuses.append(manager.recv(4096).decode())
            assert "STATUS=DEGRADED: the state cannot be written" in statuses[-1]
        finally:
            remount(disk, "rw")
            daemon.stop(signal.SIGKILL)


def test_a_state_file_made_late_is_still_locked(tmp_path: Path) -> None:
    """Started with no inode for its state file, a daemon takes the file's lock
    when it makes it: a second daemon on the same state is refused then."""
    with tmpfs(inodes=3) as disk:
        made = fill_inodes(disk)
        store, _ = Store.open(str(disk / "state.db"))
        assert store.degraded
        assert store._database.lock_fd is None
        for path in made:
            path.unlink()
        assert store.recover()
        with pytest.raises(StateError, match="in use by another watchdogd"):
            Store.open(str(disk / "state.db"))
        assert stat.S_IMODE(os.stat(disk / "state.db").st_mode) == 0o600
        store.close()


#: A key of the history: uid, executable, scope.
KEY = (1000, "/usr/bin/python3", "step")


def test_the_history_on_a_full_then_a_read_only_disk(disk: Path) -> None:
    """What the daemon learned stays in memory while its file cannot be written
    (a full tmpfs, then one remounted read-only), the file it had stays whole,
    and the next write once the disk is back holds everything."""
    path = disk / "state.db.history"
    history = History()
    history.record(KEY, 0.25)
    file = HistoryFile(str(path), history)
    file.write_now()
    written = path.read_bytes()
    filler = fill_space(disk)
    for _ in range(50):
        history.record(KEY, 0.5)
    file.write_now()  # ENOSPC: kept in memory
    assert path.read_bytes() == written
    assert not (disk / "state.db.history.new").exists()
    filler.unlink()
    remount(disk, "ro")
    try:
        file.write_now()  # EROFS
        assert path.read_bytes() == written
    finally:
        remount(disk, "rw")
    file.write_now()
    loaded = History()
    HistoryFile(str(path), loaded).load()
    assert list(loaded.suggestions()) == list(history.suggestions())
    [row] = loaded.suggestions()
    assert row.count == 51


def test_a_reply_on_a_full_disk_tries_the_write_itself_at_most_every_tenth_of_a_second(
    disk: Path,
) -> None:
    """Each acknowledgement waits for a commit; while the disk is full that commit
    tries the recovery's full write, but not more than once per `EAGER_RETRY`, and
    not on the schedule of the background task's backoff."""
    store, _ = Store.open(str(disk / "state.db"))
    now = time.monotonic()
    held = [
        Timer(pid=4242, scope=f"s{index}", policy="kill", uid=0, owner=0, timeout=60.0,
              armed_at=now, deadline=now + 60 + index, start_time=1)
        for index in range(200)
    ]  # fmt: skip
    store.snapshot = lambda: held
    filler = fill_space(disk)
    try:
        began = time.monotonic()
        for armed in held:
            store.put(armed)
            if not store.commit(store.generation):
                break
        assert store.degraded
        backoff = store._retry_at
        for armed in held:
            store.put(armed)
            assert not store.commit(store.generation)
        # The write that failed, then the attempts: the first at once.
        attempts, took = store.errors - 1, time.monotonic() - began
        assert 1 <= attempts <= 1 + took / EAGER_RETRY, (attempts, took)
        assert store._retry_at == backoff
        filler.unlink()
        # The next attempt's time: a tenth of a second on, or ten times the last
        # failed attempt's length (a busy machine's attempts are slower).
        time.sleep(max(EAGER_RETRY, store._eager_at - time.monotonic()))
        store.put(held[0])
        assert store.commit(store.generation)
        assert not store.degraded
    finally:
        store.close()
    store, loaded = Store.open(str(disk / "state.db"))
    store.close()
    assert sorted(t.scope for t in loaded.timers) == sorted(t.scope for t in held)


def test_a_fifo_beside_the_database_on_a_read_only_disk_is_never_opened(
    disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It cannot be moved aside: the database is read as it is, without SQLite's
    files (immutable), and the store is degraded until the disk takes writes,
    when the FIFO goes aside and the state is written anew."""
    path = str(disk / "state.db")
    store, _ = Store.open(path)
    kept = Timer(pid=2, scope="kept", policy="kill", uid=0, owner=0, timeout=1.0,
                 armed_at=0.0, deadline=1.0)  # fmt: skip
    store._write_database({kept.store_key: kept}, reset=True)
    store.close()
    for name in journal_files(disk):
        os.unlink(disk / name)
    rollback = disk / "state.db-journal"
    os.mkfifo(rollback)
    remount(disk, "ro")
    try:
        started = time.monotonic()
        with freed_after(rollback, 5.0):
            store, loaded = Store.open(path)
        assert time.monotonic() - started < 2.0  # no read of the FIFO was waited on
        assert [t.scope for t in loaded.timers] == ["kept"]
        assert store.degraded
        assert stat.S_ISFIFO(os.lstat(rollback).st_mode)  # still there, never opened
        assert f"path={rollback}" in caplog.text
    finally:
        remount(disk, "rw")
    store.snapshot = lambda: [kept]
    assert store.recover()
    store.close()
    moved_aside(rollback, "fifo", caplog.text)


def armed(scope: str, now: float) -> Timer:
    return Timer(pid=4242, scope=scope, policy="kill", uid=0, owner=0, timeout=60.0,
                 armed_at=now, deadline=now + 60, start_time=1)  # fmt: skip


def test_a_write_the_full_disk_refuses_first_has_the_record_give_its_room_back() -> None:
    """The record beside the state filled its disk: the state's next write has it
    give its room back and is written, durable, where a disk filled by anything
    else degrades the store as before. The journal of a state on a small disk is
    folded at a sixteenth of it, and what the state may still take is left free."""
    with tmpfs(size="2m", inodes=64) as disk:
        store, _ = Store.open(str(disk / "state.db"))
        assert store.room.journal_bytes == 2 * 1024 * 1024 // 16
        assert store.room.wanted() >= 2 * store.room.journal_bytes + 2 * os.path.getsize(
            disk / "state.db"
        )
        record = disk / "state.db.record"
        fill_space(disk).rename(record)
        given_back: list[int] = []

        def give_way() -> bool:
            given_back.append(record.stat().st_size)
            record.unlink()
            return True

        store.room.make = give_way
        now = time.monotonic()
        for index in range(200):  # some 20 KiB: pages the full disk has no room for
            store.put(armed(f"s{index}", now))
            assert store.commit(store.generation), index
        assert not store.degraded
        assert len(given_back) == 1
        filler = fill_space(disk)
        store.room.make = lambda: False
        for index in range(200):
            store.put(armed(f"t{index}", now))
            if not store.commit(store.generation):
                break
        assert store.degraded
        filler.unlink()
        store.close()
        store, loaded = Store.open(str(disk / "state.db"))
        store.close()
        assert {f"s{index}" for index in range(200)} <= {t.scope for t in loaded.timers}
