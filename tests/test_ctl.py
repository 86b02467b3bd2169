"""watchdogctl, run as an operator runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from watchdogd.ctl import format_duration

from conftest import (
    PATIENCE,
    RunningDaemon,
    ctl,
    ctl_command,
    reap,
    sleeper,
    wait_until,
    where_is,
)


def test_arm_status_release(daemon: RunningDaemon) -> None:
    victim = sleeper()
    try:
        pid = str(victim.pid)
        armed = ctl(daemon.socket_path, "arm", "--pid", pid, "--scope", "later", "--timeout", "300")
        assert armed.returncode == 0, armed.stderr
        assert "armed pid" in armed.stdout
        ctl(daemon.socket_path, "arm", "--pid", pid, "--scope", "sooner", "--timeout", "100")

        table = ctl(daemon.socket_path, "status")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].startswith("watchdogd 0.1.0  pid ")
        assert "timers 2  processes 1" in lines[1]
        header = lines[3].split()
        assert header == ["PID", "COMMAND", "SCOPE", "REMAINING", "POLICY", "UID"]
        # Soonest first; the command is "sleep 300".
        rows = [row.split() for row in lines[4:]]
        assert [row[:4] for row in rows] == [
            [pid, "sleep", "300", "sooner"],
            [pid, "sleep", "300", "later"],
        ]
        uid = str(os.getuid())
        assert [row[5:] for row in rows] == [["kill", uid], ["kill", uid]]

        released = ctl(daemon.socket_path, "release", "--pid", pid, "--scope", "later")
        assert released.stdout.startswith("released")
        again = ctl(daemon.socket_path, "release", "--pid", pid, "--scope", "later")
        assert again.returncode == 0
        assert again.stdout.startswith("no timer was armed")
    finally:
        reap(victim)


def test_status_json(daemon: RunningDaemon) -> None:
    victim = sleeper()
    try:
        ctl(daemon.socket_path, "arm", "--pid", str(victim.pid), "--scope", "s", "--timeout", "60")
        result = ctl(daemon.socket_path, "status", "--json")
        report = json.loads(result.stdout)
        assert report["daemon"]["pid"] == daemon.pid
        assert report["daemon"]["timers"] == 1
        [timer] = report["timers"]
        assert timer["pid"] == victim.pid
        assert timer["scope"] == "s"
        assert timer["policy"] == "kill"
        assert 50 < timer["remaining"] <= 60
        assert timer["command"] == "sleep 300"
    finally:
        reap(victim)


def test_status_entry_goes_when_its_process_exits(daemon: RunningDaemon) -> None:
    victim = sleeper()
    ctl(daemon.socket_path, "arm", "--pid", str(victim.pid), "--scope", "s", "--timeout", "60")
    assert len(json.loads(ctl(daemon.socket_path, "status", "--json").stdout)["timers"]) == 1
    reap(victim)
    exited = time.monotonic()
    with daemon.client() as client:
        wait_until(lambda: not client.status().timers, what="the timer to be dropped")
    # "A fraction of a second": the exit is noticed through the pidfd, not a poll.
    assert time.monotonic() - exited < 1.0


def test_events_lists_expiries_and_exits(daemon: RunningDaemon) -> None:
    victim, bystander = sleeper(), sleeper()
    try:
        ctl(
            daemon.socket_path,
            "arm",
            "--pid",
            str(victim.pid),
            "--scope",
            "hung",
            "--timeout",
            "0.1",
        )
        ctl(
            daemon.socket_path,
            "arm",
            "--pid",
            str(bystander.pid),
            "--scope",
            "a",
            "--timeout",
            "60",
        )
        assert victim.wait(timeout=PATIENCE) == -9
        bystander.kill()
        bystander.wait()
        with daemon.client() as client:
            wait_until(lambda: len(client.events().events) >= 2, what="the events")
    finally:
        reap(victim)
        reap(bystander)
    lines = ctl(daemon.socket_path, "events").stdout.splitlines()
    expired = next(line for line in lines if " expired " in line)
    assert f"pid={victim.pid}" in expired
    assert "scope=hung  policy=kill" in expired
    assert "[SIGKILL: sent SIGKILL]" in expired
    assert "outcome=exited" in expired
    exited = next(line for line in lines if " exited " in line and f"pid={bystander.pid}" in line)
    assert "exited with 1 timer(s) armed: a" in exited
    as_json = [
        json.loads(line) for line in ctl(daemon.socket_path, "events", "--json").stdout.splitlines()
    ]
    assert [event["seq"] for event in as_json] == sorted(event["seq"] for event in as_json)
    assert {"kind", "time", "pid", "scope", "policy"} <= set(as_json[-1])
    assert len(ctl(daemon.socket_path, "events", "--limit", "1").stdout.splitlines()) == 1


def test_ping(daemon: RunningDaemon) -> None:
    result = ctl(daemon.socket_path, "ping")
    assert result.returncode == 0
    assert f"watchdogd at {daemon.socket_path} answered in" in result.stdout
    assert json.loads(ctl(daemon.socket_path, "ping", "--json").stdout)["round_trip"] > 0


class TestRun:
    def test_a_hung_command_is_killed_and_exits_137(self, daemon: RunningDaemon) -> None:
        started = time.monotonic()
        result = ctl(daemon.socket_path, "run", "--timeout", "1", "--", "sleep", "30")
        elapsed = time.monotonic() - started
        assert result.returncode == 137
        assert 0.9 < elapsed < PATIENCE

    def test_a_command_that_finishes_exits_with_its_status(self, daemon: RunningDaemon) -> None:
        assert ctl(daemon.socket_path, "run", "--timeout", "5", "--", "true").returncode == 0
        code = ctl(daemon.socket_path, "run", "--timeout", "5", "--", "sh", "-c", "exit 3")
        assert code.returncode == 3
        killed = ctl(daemon.socket_path, "run", "--timeout", "5", "--", "sh", "-c", "kill -TERM $$")
        assert killed.returncode == 128 + signal.SIGTERM
        with daemon.client() as client:
            assert client.status().timers == []

    def test_options_of_the_command_are_its_own(self, daemon: RunningDaemon) -> None:
        result = ctl(
            daemon.socket_path,
            "run",
            "--timeout",
            "5",
            "--",
            "sh",
            "-c",
            "echo $0 $1",
            "x",
            "--timeout",
        )
        assert result.stdout.strip() == "x --timeout"

    def test_signals_are_forwarded(self, daemon: RunningDaemon) -> None:
        handler = (
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n"
        )
        run = subprocess.Popen(
            ctl_command(
                daemon.socket_path,
                "run",
                "--timeout",
                "60",
                "--",
                sys.executable,
                "-c",
                handler,
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert run.stdout is not None
        assert run.stdout.readline().strip() == "ready"
        run.send_signal(signal.SIGTERM)
        try:
            assert run.wait(timeout=PATIENCE) == 7
        except subprocess.TimeoutExpired:
            raise AssertionError(f"watchdogctl run did not end: {where_is(run.pid)}") from None
        finally:
            reap(run)

    def test_the_timer_is_on_the_child(self, daemon: RunningDaemon) -> None:
        run = subprocess.Popen(
            ctl_command(
                daemon.socket_path,
                "run",
                "--timeout",
                "60",
                "--scope",
                "job",
                "--",
                "sleep",
                "30",
            )
        )
        try:
            with daemon.client() as client:
                wait_until(lambda: bool(client.status().timers), what="the timer")
                [timer] = client.status().timers
            assert timer.scope == "job"
            assert timer.command == "sleep 30"
            assert timer.pid != run.pid
        finally:
            run.terminate()
            run.wait()

    def test_a_refused_timer_does_not_leave_the_command_running(
        self, daemon: RunningDaemon, tmp_path: Path
    ) -> None:
        marker = tmp_path / "ran-on"
        result = ctl(
            daemon.socket_path, "run", "--timeout", "5", "--policy", "nope", "--",
            "sh", "-c", f"sleep 1; touch {marker}",
        )  # fmt: skip
        assert result.returncode == 125
        assert "no policy 'nope'" in result.stderr
        time.sleep(1.5)
        assert not marker.exists()

    def test_a_command_that_cannot_start(self, daemon: RunningDaemon) -> None:
        result = ctl(daemon.socket_path, "run", "--timeout", "5", "--", "/nonexistent/program")
        assert result.returncode == 125
        assert "/nonexistent/program" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--json"],
        ["ping"],
        ["arm", "--pid", "2", "--scope", "s", "--timeout", "1"],
        ["release", "--pid", "2", "--scope", "s"],
        ["run", "--timeout", "1", "--", "true"],
    ],
)
def test_no_daemon_means_one_clear_line(tmp_path: Path, args: list[str]) -> None:
    result = ctl(tmp_path / "absent.sock", *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "watchdogd is not reachable" in lines[0]
    assert str(tmp_path / "absent.sock") in lines[0]


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.25, "0.25s"),
        (42.04, "42.0s"),
        (302, "5m02s"),
        (3 * 3600 + 420, "3h07m"),
        (52 * 3600, "2d04h"),
    ],
)
def test_durations_read_like_durations(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown
