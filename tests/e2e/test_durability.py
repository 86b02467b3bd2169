"""Timers survive the daemon: SIGKILL at any moment, SIGTERM, restarts."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from watchdogd.host.process import read_start_time
from watchdogd.storage.schema import SCHEMA
from watchdogd.storage.store import Store
from watchdogd_client import Client
from watchdogd_protocol import RESTART_GRACE, EventInfo

from helpers.daemon import RunningDaemon
from helpers.processes import death_time, python_worker, reap, sleeper, wait_ready
from helpers.state_files import PIDS, SCHEMAS, WRITTEN, make_own
from helpers.waiting import PATIENCE, wait_until


def arm(client: Client, scope: str, timeout: float, pid: int) -> float:
    """Arm and return the deadline on CLOCK_MONOTONIC (the daemon's clock too)."""
    remaining = client.acquire(scope, timeout, pid=pid)
    # The latest it can be: a slow answer never makes a canary late.
    return time.monotonic() + remaining


def expired_events(client: Client) -> list[EventInfo]:
    return [event for event in client.events(limit=1000).events if event.kind == "expired"]


def test_sigkill_and_restart_keeps_the_original_deadline(daemon: RunningDaemon) -> None:
    victim = sleeper()
    try:
        with daemon.client() as client:
            # Due after the restart grace of a slow restart (a busy machine's
            # takes over a second): a timer due within it waits for it.
            deadline = arm(client, "through-a-crash", 2.5 + RESTART_GRACE, victim.pid)
        time.sleep(0.3)
        daemon.stop(signal.SIGKILL)
        daemon.start()
        died = death_time(victim)
        assert abs(died - deadline) < 0.1, f"{(died - deadline) * 1000:.1f} ms off"
        with daemon.client() as client:
            wait_until(lambda: bool(expired_events(client)), what="the expiry")
            [event] = expired_events(client)
        assert event.note == ""  # on time, not a downtime catch-up
    finally:
        reap(victim)


def test_a_timer_due_during_the_downtime_fires_once_the_restart_grace_ends(
    daemon: RunningDaemon,
) -> None:
    victim = sleeper()
    try:
        with daemon.client() as client:
            arm(client, "overdue", 0.5, victim.pid)
        daemon.stop(signal.SIGKILL)
        time.sleep(1.0)  # the deadline passes while nothing runs
        started = time.monotonic()
        daemon.start()
        # It waits out the restart grace for a release on its way, and no longer.
        died = death_time(victim) - started
        assert RESTART_GRACE <= died < 2.0 + RESTART_GRACE
        assert victim.wait() == -signal.SIGKILL
        with daemon.client() as client:
            wait_until(lambda: bool(expired_events(client)), what="the expiry")
            [event] = expired_events(client)
        assert event.late is not None
        assert event.late > 0.5
        assert "fell due while the daemon was not running" in event.note
        assert f"held {RESTART_GRACE:g}s after the restart" in event.note
    finally:
        reap(victim)


def test_a_timer_whose_process_died_during_the_downtime_is_dropped(daemon: RunningDaemon) -> None:
    victim, survivor = sleeper(), sleeper()
    try:
        with daemon.client() as client:
            arm(client, "dead-by-then", 60, victim.pid)
            arm(client, "still-here", 60, survivor.pid)
        daemon.stop(signal.SIGKILL)
        reap(victim)
        daemon.start()
        with daemon.client() as client:
            assert [(t.pid, t.scope) for t in client.status().timers] == [
                (survivor.pid, "still-here")
            ]
        assert "restored=1 dropped=1" in daemon.log()
    finally:
        reap(victim)
        reap(survivor)


def test_a_recycled_pid_is_not_mistaken_for_the_armed_process(daemon: RunningDaemon) -> None:
    victim = sleeper()
    try:
        with daemon.client() as client:
            arm(client, "old-process", 0.5, victim.pid)
        daemon.stop(signal.SIGKILL)
        # As if the pid now belonged to a process that started at another time.
        store, loaded = Store.open(daemon.state_path)
        for timer in loaded.timers:
            store.put(msgspec.structs.replace(timer, start_time=timer.start_time + 1))
        store.write_now()
        store.close()
        daemon.start()
        with daemon.client() as client:
            assert client.status().timers == []
        with pytest.raises(subprocess.TimeoutExpired):
            victim.wait(timeout=1.0)  # never signalled
    finally:
        reap(victim)


def test_sigterm_and_restart_keeps_every_timer(daemon: RunningDaemon) -> None:
    victims = [sleeper(), sleeper()]
    try:
        with daemon.client() as client:
            for victim in victims:
                for scope, timeout in (("a", 60.0), ("b", 120.0)):
                    client.acquire(scope, timeout, pid=victim.pid, policy="term")
            before = {(t.pid, t.scope): t for t in client.status().timers}
        stopped = time.monotonic()
        assert daemon.stop(signal.SIGTERM) == 0
        daemon.start()
        elapsed = time.monotonic() - stopped
        with daemon.client() as client:
            after = {(t.pid, t.scope): t for t in client.status().timers}
        assert set(after) == set(before)
        for key, timer in after.items():
            assert timer.policy == "term"
            assert timer.uid == before[key].uid
            # The time the daemon was down counted.
            assert before[key].remaining - elapsed - 0.5 < timer.remaining <= before[key].remaining
        assert all(victim.poll() is None for victim in victims)
    finally:
        for victim in victims:
            reap(victim)


def test_a_corrupt_state_file_never_stops_the_daemon(daemon: RunningDaemon) -> None:
    daemon.stop(signal.SIGKILL)
    # SQLite's own journals too: killed while its first fold set up the database,
    # the daemon leaves a rollback journal that SQLite would rightly play back.
    for suffix in ("-wal", "-shm", "-journal"):
        Path(daemon.state_path + suffix).unlink(missing_ok=True)
    Path(daemon.state_path).write_bytes(os.urandom(8192))
    daemon.start()
    with daemon.client() as client:
        assert client.status().timers == []
    assert "event=state_damaged" in daemon.log()
    assert "moved_to=" in daemon.log()


def test_expires_blocks_span_a_daemon_restart(daemon: RunningDaemon) -> None:
    working = python_worker(
        """
        import time
        from watchdogd_client import expires
        with expires(after=3.0):
            print("ready", flush=True)
            time.sleep(1.5)  # the daemon is killed and restarted meanwhile
        print("released", flush=True)
        """,
        socket=daemon.socket_path,
    )
    hung = python_worker(
        """
        import time
        from watchdogd_client import expires
        with expires(after=1.5):
            print("ready", flush=True)
            time.sleep(30)
        """,
        socket=daemon.socket_path,
    )
    try:
        wait_ready(working)
        wait_ready(hung)
        daemon.stop(signal.SIGKILL)
        daemon.start()
        out, err = working.communicate(timeout=PATIENCE)
        assert working.returncode == 0, err
        assert out.strip() == "released"  # its release reached the new daemon
        assert hung.wait(timeout=PATIENCE) == -signal.SIGKILL
        with daemon.client() as client:
            assert client.status().timers == []
    finally:
        reap(working)
        reap(hung)


@pytest.mark.parametrize("stored", SCHEMAS)
def test_a_daemon_upgraded_from_each_released_schema_keeps_every_timer(
    stored: int, socket_path: Path, tmp_path: Path
) -> None:
    """A daemon starts on the state a daemon of schema N left when it was killed
    (tests/data/schemaN/, made this boot's for live processes): every armed timer
    is armed again, on its original deadline, with its policy and its job, and the
    expiry whose policy was in progress resumes and finishes."""
    victims = [sleeper() for _ in PIDS]
    daemon = RunningDaemon(socket_path, tmp_path / "watchdogd.log", [])
    try:
        pids = [victim.pid for victim in victims]
        state = make_own(stored, tmp_path / "state", pids, list(map(read_start_time, pids)))
        daemon.args = ["--state", str(state)]
        daemon.start()
        pid_of = dict(zip(PIDS, pids, strict=True))
        armed = {scope: t for scope, t in WRITTEN.items() if not t.firing}
        with daemon.client() as client:
            now = time.monotonic()
            timers = {t.scope: t for t in client.status().timers}
            assert set(timers) == set(armed)
            for scope, written in armed.items():
                shown = timers[scope]
                assert (shown.pid, shown.policy, shown.uid) == (
                    pid_of[written.pid],
                    written.policy,
                    os.getuid(),
                )
                assert shown.remaining == pytest.approx(written.deadline - now, abs=PATIENCE)
                assert (shown.job, shown.rank) == (
                    ("", None)
                    if written.watched is None
                    else (written.watched.job, written.watched.rank)
                )
            wait_until(
                lambda: any(event.scope == "hung" for event in expired_events(client)),
                what="the expiry in progress to finish",
            )
        assert "restored=4 dropped=0 resumed=1" in daemon.log()
        assert "ERROR" not in daemon.log()
        assert all(victim.poll() is None for victim in victims)
        assert daemon.stop(signal.SIGTERM) == 0
        daemon.start()  # and kept again, now in this schema
        with daemon.client() as client:
            assert {t.scope for t in client.status().timers} == set(armed)
    finally:
        daemon.stop(signal.SIGKILL)
        for victim in victims:
            reap(victim)


def test_a_state_of_a_newer_schema_is_moved_aside_and_the_daemon_starts_empty(
    daemon: RunningDaemon,
) -> None:
    victim = sleeper()
    try:
        with daemon.client() as client:
            client.acquire("of-the-newer-daemon", 60.0, pid=victim.pid)
        assert daemon.stop(signal.SIGTERM) == 0
        store, loaded = Store.open(daemon.state_path)
        # The whole state in the database, as a newer daemon's fold would leave it.
        store._write_database({t.store_key: t for t in loaded.timers}, reset=True)
        store.close()
        for journal in Path(daemon.state_path).parent.glob("*.journal.*"):
            journal.unlink()
        raw = sqlite3.connect(daemon.state_path)
        raw.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
        raw.commit()
        raw.close()
        daemon.start()
        with daemon.client() as client:
            assert client.status().timers == []
        log = daemon.log()
        [line] = [line for line in log.splitlines() if "event=state_schema_unreadable" in line]
        assert " ERROR " in line
        assert f"newer than this daemon's {SCHEMA}: none of its timers are restored" in line
        [aside] = Path(daemon.state_path).parent.glob("*.state.db.schema-99-*")
        assert f"moved_to={aside}" in line
        raw = sqlite3.connect(aside)  # moved whole: its timer is still in it
        assert raw.execute("SELECT scope FROM timers").fetchall() == [("of-the-newer-daemon",)]
        raw.close()
        assert "restored=0 dropped=0 resumed=0 moved_aside=1" in log
    finally:
        reap(victim)
