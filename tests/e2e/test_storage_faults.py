"""A failing disk, for real: tmpfs mounts limited in size or inodes, and remounted
read-only, under a running daemon and under one that starts.

The daemon never exits for it, every armed timer still fires on time, an
acknowledgement that is not durable says so, and once the disk is back a restart
restores every timer. Needs root (to mount), as CI runs.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import BinaryIO

import pytest

from watchdogd.core.history import History
from watchdogd.core.timers import Timer
from watchdogd.storage.history_file import HistoryFile
from watchdogd.storage.store import EAGER_RETRY, StateError, Store
from watchdogd_client.protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    FrameReader,
    Hello,
    ReplyMessage,
    Request,
    decode_reply,
    encode_frame,
)

from helpers.daemon import RunningDaemon, ctl_command
from helpers.processes import reap
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@contextlib.contextmanager
def tmpfs(*, size: str = "4m", inodes: int = 64) -> Iterator[Path]:
    """A real tmpfs of ``size`` bytes and ``inodes`` inodes, unmounted after."""
    directory = Path(tempfile.mkdtemp(prefix="wd-disk-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes},mode=0755", "tmpfs",
         str(directory)],
        check=True,
    )  # fmt: skip
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)
        directory.rmdir()


def fill_space(directory: Path) -> Path:
    """Write a file until the disk refuses more; returns it (delete it to free)."""
    filler = directory / "filler"
    # Unbuffered: closing the file then flushes nothing, and cannot fail.
    with (
        open(filler, "wb", buffering=0) as out,
        pytest.raises(OSError, match="No space left") as refused,
    ):
        _write_forever(out, b"\0" * 65536)
    assert refused.value.errno == errno.ENOSPC
    with contextlib.suppress(OSError), open(filler, "ab") as out:  # the last partial block
        while True:
            out.write(b"\0")
            out.flush()
    return filler


def fill_inodes(directory: Path) -> list[Path]:
    """Create empty files until no inode is left; returns them."""
    made: list[Path] = []
    with pytest.raises(OSError, match="No space left"):
        _touch_forever(directory, made)
    return made


def _write_forever(out: BinaryIO | io.RawIOBase, block: bytes) -> None:
    while True:
        out.write(block)
        out.flush()


def _touch_forever(directory: Path, made: list[Path]) -> None:
    for index in count():
        path = directory / f"inode-{index}"
        path.touch()
        made.append(path)


def remount(directory: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True)


class Raw:
    """A connection speaking the protocol by hand, to read whole replies."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(PATIENCE)
        self.sock.connect(str(path))
        self.reader = FrameReader(16 * 1024 * 1024)
        self.ids = count(1)
        self.ask(Hello(id=0, version=PROTOCOL_VERSION))

    def ask(self, request: Request) -> ReplyMessage:
        self.sock.sendall(encode_frame(request))
        while True:
            data = self.sock.recv(65536)
            assert data, "the daemon closed the connection"
            frames = self.reader.feed(data)
            if frames:
                return decode_reply(frames[0])

    def acquire(self, scope: str, timeout: float, pid: int) -> Acquired:
        reply = self.ask(Acquire(id=next(self.ids), scope=scope, timeout=timeout, pid=pid))
        assert isinstance(reply, Acquired), reply
        return reply

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def disk() -> Iterator[Path]:
    with tmpfs() as directory:
        yield directory


def daemon_on(disk: Path, socket_path: Path, tmp_path: Path) -> RunningDaemon:
    return RunningDaemon(
        socket_path, tmp_path / "watchdogd.log", ["--state", str(disk / "state.db")]
    )


def journal_files(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if ".journal." in name]


def degraded(daemon: RunningDaemon) -> bool:
    with daemon.client() as client:
        return client.status().daemon.state_degraded


def death_within(worker: subprocess.Popen[bytes], seconds: float) -> None:
    assert worker.wait(timeout=seconds) == -signal.SIGKILL


def test_a_disk_filled_under_a_running_daemon(
    disk: Path, socket_path: Path, tmp_path: Path
) -> None:
    daemon = daemon_on(disk, socket_path, tmp_path)
    daemon.start()
    workers = [subprocess.Popen(["sleep", "600"]) for _ in range(12)]
    raw = Raw(socket_path)
    try:
        for index, worker in enumerate(workers[:4]):
            assert raw.acquire(f"before-{index}", 120, worker.pid).durable
        filler = fill_space(disk)
        # The journal's last page may still take a record or two; then no more.
        during = []
        for index in range(500):
            during.append(f"during-{index}")
            if not raw.acquire(during[-1], 120, workers[4 + index % 6].pid).durable:
                break
        for index, worker in enumerate(workers[4:10]):
            during.append(f"then-{index}")
            assert not raw.acquire(during[-1], 120, worker.pid).durable
        assert degraded(daemon)
        with daemon.client() as client:
            events = [e for e in client.events().events if e.kind == "state_degraded"]
            assert len(events) == 1
            assert "No space left on device" in events[0].note
            assert "watchdogd_state_degraded 1.0" in client.metrics()
        assert daemon.log().count("event=state_degraded") == 1
        shown = subprocess.run(
            ctl_command(socket_path, "status"), capture_output=True, text=True, check=True
        )
        assert "state degraded" in shown.stdout
        assert len(journal_files(disk)) <= 3
        # Protection goes on from memory: a timer armed now fires on time.
        started = time.monotonic()
        raw.acquire("fires-while-full", 0.5, workers[10].pid)
        death_within(workers[10], PATIENCE)
        assert time.monotonic() - started < 0.5 + 2.0
        # Space comes back: the next acknowledged change writes the whole state
        # itself and says it is durable; the flag clears with it. A kill 0.3 s
        # later loses nothing that was armed.
        filler.unlink()
        assert raw.acquire("after", 120, workers[11].pid).durable
        assert not degraded(daemon)
        assert "event=state_restored" in daemon.log()
        time.sleep(0.3)
        raw.close()
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            scopes = sorted(timer.scope for timer in client.status().timers)
        assert scopes == sorted([*(f"before-{i}" for i in range(4)), *during, "after"])
        assert len(journal_files(disk)) <= 3
    finally:
        raw.close()
        daemon.stop(signal.SIGKILL)
        for worker in workers:
            reap(worker)


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
        for armed in held:
            store.put(armed)
            if not store.commit(store.generation):
                break
        assert store.degraded
        backoff = store._retry_at
        errors, began = store.errors, time.monotonic()
        for armed in held:
            store.put(armed)
            assert not store.commit(store.generation)
        attempts, took = store.errors - errors, time.monotonic() - began
        assert 1 <= attempts <= 1 + took / EAGER_RETRY, (attempts, took)
        assert store._retry_at == backoff
        filler.unlink()
        time.sleep(EAGER_RETRY)
        store.put(held[0])
        assert store.commit(store.generation)
        assert not store.degraded
    finally:
        store.close()
    store, loaded = Store.open(str(disk / "state.db"))
    store.close()
    assert sorted(t.scope for t in loaded.timers) == sorted(t.scope for t in held)
