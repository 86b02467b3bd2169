"""Something other than a regular file where a daemon keeps its state, for real: a
FIFO, a directory, a socket, a device and a symlink to /dev/zero at the names of
the database, a journal, the record and the history, and a FIFO as SQLite's
rollback journal beside a database that holds a timer.

The daemon starts and serves: each is moved aside unread, with an ERROR line that
names the path, what it is and where it went, and the state is written anew where
it was (a FIFO at any of these names left it blocked in open(2) or read(2) for
ever, its socket bound and no reply to a ping, or degraded for good). The config
file is in test_cli (at start) and test_reload.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from watchdogd_protocol import RESTART_GRACE

from helpers.canaries import Canary
from helpers.daemon import RunningDaemon
from helpers.disks import Raw, journal_files
from helpers.processes import at_units_priority_all, death_time, reap, sleeper
from helpers.special_files import SPECIAL, make_special, moved_aside
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_daemon_starts_and_serves_whatever_sits_at_its_state_files_names(
    socket_path: Path, tmp_path: Path, kind: str
) -> None:
    state = tmp_path / "state" / "state.db"
    state.parent.mkdir()
    names = [state, *(Path(f"{state}.{suffix}") for suffix in ("journal.1", "record", "history"))]
    for name in names:
        make_special(kind, name)
    daemon = RunningDaemon(socket_path, tmp_path / "log", ["--state", str(state)])
    daemon.start(timeout=PATIENCE)  # today's waits in open(2) and never answers
    at_units_priority_all(daemon.pid)  # as deployed, as the canary is timed
    victim = sleeper()
    try:
        raw = Raw(socket_path)
        assert raw.acquire("kept", 120, victim.pid).durable
        raw.close()
        with daemon.client() as client:
            assert not client.status().daemon.state_degraded
            # Root's timers on time beside whatever sat at those names.
            canary = Canary(client, 0.5)
            try:
                assert canary.lateness() < 0.1
            finally:
                canary.close()
        log = daemon.log()
        for name in names:
            moved_aside(name, kind, log)
        assert "moved_aside=2" in log  # the database and the journal
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            assert [t.scope for t in client.status().timers] == ["kept"]
    finally:
        daemon.stop()
        reap(victim)


def test_a_fifo_as_sqlites_rollback_journal_neither_blocks_the_start_nor_loses_a_timer(
    socket_path: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state" / "state.db"
    state.parent.mkdir()
    daemon = RunningDaemon(socket_path, tmp_path / "log", ["--state", str(state)])
    daemon.start()
    kept, canary = sleeper(), sleeper()
    try:
        with daemon.client() as client:
            client.acquire("kept", 120, pid=kept.pid)
        daemon.stop()
        daemon.start()  # its first fold puts "kept" in the database itself
        wait_until(lambda: len(journal_files(state.parent)) == 1, what="the journals to be folded")
        with daemon.client() as client:
            # Due after the restart and its grace, whatever a loaded host takes.
            remaining = client.acquire("canary", 2.5 + RESTART_GRACE, pid=canary.pid)
            # The latest it can be: a slow answer never makes a canary late.
            deadline = time.monotonic() + remaining
        daemon.stop(signal.SIGKILL)
        rollback = Path(f"{state}-journal")
        os.mkfifo(rollback)
        daemon.start()  # today's waits in SQLite's first read for ever
        at_units_priority_all(daemon.pid)
        with daemon.client() as client:
            status = client.status()
        assert sorted(t.scope for t in status.timers) == ["canary", "kept"]
        assert not status.daemon.state_degraded
        moved_aside(rollback, "fifo", daemon.log())
        assert abs(death_time(canary) - deadline) < 0.1  # on time through the restart
    finally:
        daemon.stop()
        reap(kept)
        reap(canary)
