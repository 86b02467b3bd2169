"""A state disk that fails under a running daemon, each way caused for real: a
full tmpfs (ENOSPC), a btrfs quota reached (EDQUOT), a FUSE file system whose writes
fail (EIO) or that turned read-only under open files (EROFS), a read-only remount
(which the kernel refuses while the journal is open), and the state directory
deleted. Each time the daemon never exits, protects from memory, says so once, and
recovers on its own: the first change acknowledged once the disk is back (and a
reply may try it again) is durable, and a kill 0.3 s later loses no armed timer.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from watchdogd.core.events import EventLog
from watchdogd.core.incidents import IncidentLog
from watchdogd.storage.record_file import RecordFile, record_path

from helpers.daemon import RunningDaemon, ctl_command
from helpers.disks import (
    Raw,
    daemon_on,
    death_within,
    degraded,
    fill_quota,
    fill_space,
    free_quota,
    journal_files,
    quota_disk,
    remount,
    require,
    tmpfs,
)
from helpers.failing_fs import FailingDisk, failing_disk
from helpers.processes import reap, sleeper
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a file system needs root")

#: A fault: called once the daemon holds durable timers, it breaks the disk and
#: returns what mends it.
Fault = Callable[[], Callable[[], None]]


@pytest.fixture
def fuse_disk(tmp_path: Path) -> Iterator[FailingDisk]:
    require("fusermount3", modules=("mfusepy",), install="fuse3 (Debian) and mfusepy (PyPI)")
    with failing_disk(tmp_path / "fuse") as disk:
        yield disk


def a_fault_under_a_running_daemon(
    directory: Path,
    socket_path: Path,
    tmp_path: Path,
    fault: Fault,
    *,
    says: str,
    meanwhile: Callable[[RunningDaemon], None] = lambda daemon: None,
) -> None:
    """The whole episode: durable timers, the fault, timers acknowledged as not
    durable, one report, a deadline kept from memory, the disk mended, a durable
    acknowledgement as soon as a reply may try the disk again, a SIGKILL 0.3 s
    later, and every armed timer back.
    ``meanwhile`` checks more while the disk is broken."""
    daemon = daemon_on(directory, socket_path, tmp_path)
    daemon.start()
    workers = [subprocess.Popen(["sleep", "600"]) for _ in range(9)]
    raw = Raw(socket_path)
    try:
        armed = [f"before-{index}" for index in range(3)]
        for scope, worker in zip(armed, workers[:3], strict=True):
            assert raw.acquire(scope, 120, worker.pid).durable
        mend = fault()
        # A disk's last block may still take a record or two; then no more.
        for index in range(500):
            armed.append(f"during-{index}")
            if not raw.acquire(armed[-1], 120, workers[3 + index % 4].pid).durable:
                break
        else:
            pytest.fail("every change was durable on the broken disk")
        for index, worker in enumerate(workers[3:7]):
            armed.append(f"then-{index}")
            assert not raw.acquire(armed[-1], 120, worker.pid).durable
        assert degraded(daemon)
        with daemon.client() as client:
            reports = [e for e in client.events().events if e.kind == "state_degraded"]
        assert [says in report.note for report in reports] == [True], reports
        assert daemon.log().count("event=state_degraded") == 1
        meanwhile(daemon)
        started = time.monotonic()
        raw.acquire("fires-meanwhile", 0.5, workers[7].pid)
        # Its commit tried the disk once more, and took at most this long.
        attempt = time.monotonic() - started
        death_within(workers[7], PATIENCE)
        assert time.monotonic() - started < 0.5 + 2.0
        mend()
        # A reply's commit tries a degraded store's disk again once ten times its
        # last failed attempt has passed (`EAGER_RETRY`): a disk that fails slowly
        # (a FUSE server beside CPU hogs) is not tried again sooner.
        time.sleep(max(0.0, started + 10 * attempt - time.monotonic()))
        armed.append("after")
        assert raw.acquire("after", 120, workers[8].pid).durable
        assert not degraded(daemon)
        assert "event=state_restored" in daemon.log()
        time.sleep(0.3)
        assert daemon.process is not None
        assert daemon.process.poll() is None  # it never exited
        raw.close()
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            assert sorted(t.scope for t in client.status().timers) == sorted(armed)
    finally:
        raw.close()
        daemon.stop(signal.SIGKILL)
        for worker in workers:
            reap(worker)


def test_a_disk_filled_under_a_running_daemon(socket_path: Path, tmp_path: Path) -> None:
    def fault() -> Callable[[], None]:
        filler = fill_space(directory)
        return filler.unlink

    def meanwhile(daemon: RunningDaemon) -> None:
        with daemon.client() as client:
            assert "watchdogd_state_degraded 1.0" in client.metrics()
        shown = subprocess.run(
            ctl_command(socket_path, "status"), capture_output=True, text=True, check=True
        )
        assert "state degraded" in shown.stdout
        assert len(journal_files(directory)) <= 3

    with tmpfs() as directory:
        a_fault_under_a_running_daemon(
            directory,
            socket_path,
            tmp_path,
            fault,
            says="No space left on device",
            meanwhile=meanwhile,
        )
        assert len(journal_files(directory)) <= 3


def test_a_quota_reached_under_a_running_daemon(socket_path: Path, tmp_path: Path) -> None:
    with quota_disk() as directory:

        def fault() -> Callable[[], None]:
            filler = fill_quota(directory)
            return lambda: free_quota(filler)

        a_fault_under_a_running_daemon(
            directory, socket_path, tmp_path, fault, says="Disk quota exceeded"
        )


@pytest.mark.parametrize(
    ("code", "says"),
    [(errno.EIO, "Input/output error"), (errno.EROFS, "Read-only file system")],
    ids=["EIO", "EROFS"],
)
def test_a_file_system_whose_writes_fail(
    fuse_disk: FailingDisk, socket_path: Path, tmp_path: Path, code: int, says: str
) -> None:
    """EIO: a device that refuses writes. EROFS: what a file system's own errors
    do (ext4's ``errors=remount-ro``) to the daemon's open journal."""

    def fault() -> Callable[[], None]:
        fuse_disk.fail(code)
        return fuse_disk.heal

    a_fault_under_a_running_daemon(fuse_disk.path, socket_path, tmp_path, fault, says=says)


def test_a_read_only_remount_is_refused_while_the_daemon_writes(
    socket_path: Path, tmp_path: Path
) -> None:
    """An operator's ``mount -o remount,ro`` under a running daemon: the kernel
    refuses it (EBUSY) while the journal is open for writing, and the daemon goes
    on as before. (Once the daemon is stopped the remount works: the start on a
    read-only disk is in test_storage_faults.)"""
    with tmpfs() as disk:
        daemon = daemon_on(disk, socket_path, tmp_path)
        daemon.start()
        worker = sleeper()
        raw = Raw(socket_path)
        try:
            assert raw.acquire("before", 120, worker.pid).durable
            remounting = ["mount", "-o", "remount,ro", str(disk)]
            refused = subprocess.run(remounting, check=False, capture_output=True, text=True)
            assert refused.returncode != 0
            assert "busy" in refused.stderr
            assert raw.acquire("after", 120, worker.pid).durable
            assert not degraded(daemon)
        finally:
            raw.close()
            daemon.stop(signal.SIGKILL)
            reap(worker)
        remount(disk, "ro")  # no writer left
        remount(disk, "rw")


def state_in(directory: Path, socket_path: Path, tmp_path: Path) -> RunningDaemon:
    return RunningDaemon(
        socket_path, tmp_path / "watchdogd.log", ["--state", str(directory / "state.db")]
    )


def deletions(directory: Path) -> list[str]:
    """The notes of the ``state_degraded`` events the record in ``directory`` holds
    that say the state was deleted, read as a restarted daemon reads them."""
    events = EventLog(1000)
    RecordFile(record_path(str(directory / "state.db")), events, IncidentLog("here")).load()
    return [
        e.note for e in events.since(0) if e.kind == "state_degraded" and "was deleted" in e.note
    ]


def delete(directory: Path) -> None:
    """``rm -rf directory``, again when the daemon wrote a file into it meanwhile
    (its records are written in the background) or removed one of its own before
    this could (a fold drops the journals it folded), as an operator would."""
    for _ in range(10):
        try:
            shutil.rmtree(directory)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT):
                raise
        else:
            # Not looked at again: the daemon may be making the state anew by now.
            return
    raise AssertionError(f"{directory} could not be deleted in 10 tries")


def test_the_state_directory_deleted_under_a_running_daemon(
    socket_path: Path, tmp_path: Path
) -> None:
    """Writes into a deleted journal would succeed and be lost at the next start:
    the daemon sees the journal lost its name, says so, and writes the whole state
    into a new directory before it acknowledges the next change."""
    directory = tmp_path / "state"
    daemon = state_in(directory, socket_path, tmp_path)
    daemon.start()
    # A new state is folded into its database once, after the start: while that
    # fold's thread holds the database, a directory deleted cannot be written
    # anew (the change is acknowledged not durable, and written once it ends).
    first = directory / "state.db.journal.1"
    wait_until(lambda: not first.exists(), what="the start's fold")
    workers = [sleeper() for _ in range(3)]
    raw = Raw(socket_path)
    try:
        assert raw.acquire("before", 120, workers[0].pid).durable
        delete(directory)
        assert raw.acquire("after", 120, workers[1].pid).durable
        assert (directory / "state.db").exists()
        assert not degraded(daemon)
        with daemon.client() as client:
            kinds = [(e.kind, e.note) for e in client.events().events if "state" in e.kind]
        [(degraded_kind, note), (restored_kind, _)] = kinds
        assert (degraded_kind, restored_kind) == ("state_degraded", "state_restored")
        assert "was deleted" in note
        # Deleted while nothing is asked: the daemon's own check finds it.
        delete(directory)
        wait_until((directory / "state.db").exists, what="the state to be made again")
        wait_until(lambda: not degraded(daemon), what="the state to be written again")
        assert raw.acquire("last", 120, workers[2].pid).durable
        # The record of what happened is written anew there too, within its turn
        # (a second when a write of it met the directory gone).
        wait_until(lambda: len(deletions(directory)) == 2, what="the record written again")
        raw.close()
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            assert sorted(t.scope for t in client.status().timers) == ["after", "before", "last"]
            said = [e.note for e in client.events().events if e.kind == "state_degraded"]
        assert said == deletions(directory)
    finally:
        raw.close()
        daemon.stop(signal.SIGKILL)
        for worker in workers:
            reap(worker)
