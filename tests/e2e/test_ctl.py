"""watchdogctl, run as an operator runs it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from watchdogd.cli.render import _summary, format_duration, shown_scope
from watchdogd.cli.watchdogctl import main
from watchdogd_client import Client
from watchdogd_protocol import DaemonInfo

from helpers.daemon import (
    WATCHDOGCTL,
    RunningDaemon,
    configured_daemon,
    ctl,
    ctl_command,
    expired_event,
)
from helpers.fake_daemon import fake_daemon_as
from helpers.namespaces import in_private_mounts
from helpers.per_user import IMPOSTOR, PER_USER, become_worker_of_other
from helpers.processes import forked, gone, in_session, reap, sleeper, where_is
from helpers.users import NOBODY
from helpers.waiting import PATIENCE, wait_until


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
    assert "scope=a  (exited with 1 timer armed)" in exited
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

    def test_says_what_the_daemon_did_to_the_command(self, daemon: RunningDaemon) -> None:
        result = ctl(daemon.socket_path, "run", "--timeout", "0.5", "--json", "--", "sleep", "30")
        assert result.returncode == 137
        report = json.loads(result.stdout)
        pid = report["pid"]
        assert result.stderr == (
            f"watchdogctl: the daemon killed sleep 30 (pid {pid}) with SIGKILL after 0.5 s "
            "(policy group:kill)\n"
        )
        assert report["status"] == 137
        assert report["expired"]["kind"] == "expired"
        assert report["expired"]["scope"] == "run:sleep"
        steps = report["expired"]["steps"]
        assert [step["result"] for step in steps] == [f"sent SIGKILL to group {pid}"]

    def test_a_policy_the_command_survives_is_reported_too(self, daemon: RunningDaemon) -> None:
        result = ctl(
            daemon.socket_path, "run", "--timeout", "0.2", "--policy", "log", "--",
            "sh", "-c", "sleep 0.6; exit 4",
        )  # fmt: skip
        assert result.returncode == 4
        assert "the daemon's timer on sh -c 'sleep 0.6; exit 4' (pid " in result.stderr
        assert (
            "expired after 0.2 s (policy group:log, alive); the command exited with status 4"
        ) in result.stderr

    def test_a_command_that_is_not_killed_runs_quietly(self, daemon: RunningDaemon) -> None:
        result = ctl(daemon.socket_path, "run", "--timeout", "5", "--", "sh", "-c", "kill -9 $$")
        assert result.returncode == 137  # killed, but not by the daemon
        assert result.stderr == ""
        clean = ctl(daemon.socket_path, "run", "--json", "--timeout", "5", "--", "true")
        assert (clean.returncode, clean.stderr) == (0, "")
        assert json.loads(clean.stdout)["expired"] is None
        # Its exit released the timer: no "exited with 1 timer armed" record.
        with daemon.client() as client:
            assert [e.kind for e in client.events().events if e.kind == "exited"] == []
            assert client.status().daemon.timers == 0

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
        # It takes the signal twice, as under timeout(1): through its pidfd, and as
        # its group's leader; the second must not find it exiting with the default
        # disposition back, so it ignores the signal from the first on.
        handler = (
            "import signal, sys, time\n"
            "def stop(*_):\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "    sys.exit(7)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
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
                wait_until(
                    lambda: [t.command for t in client.status().timers] == ["sleep 30"],
                    what="the timer, with its command line",
                )
                [timer] = client.status().timers
            assert timer.scope == "job"
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
        assert "no policy 'nope' (in 'group:nope')" in result.stderr
        time.sleep(1.5)
        assert not marker.exists()

    @pytest.mark.parametrize(
        ("command", "status", "reason"),
        [
            ("./missing.sh", 127, "No such file or directory"),
            ("./not-executable.sh", 126, "Permission denied"),
            (".", 126, "Permission denied"),
        ],
    )
    def test_a_command_that_cannot_be_run_exits_as_timeout_does(
        self, daemon: RunningDaemon, tmp_path: Path, command: str, status: int, reason: str
    ) -> None:
        (tmp_path / "not-executable.sh").write_text("#!/bin/sh\nexit 0\n")
        result = subprocess.run(
            [*ctl_command(daemon.socket_path, "run", "--timeout", "5", "--"), command],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
            timeout=PATIENCE,
        )
        assert (result.returncode, result.stderr) == (
            status,
            f"Error: failed to run command {command!r}: {reason}\n",
        )
        if shutil.which("timeout") is not None:
            timeout = subprocess.run(
                ["timeout", "5", command], cwd=tmp_path, capture_output=True, check=False
            )
            assert timeout.returncode == status


NIGHTLY_JOB = "#!/bin/sh\nsleep 100\n"


def run_alone(socket: Path, cwd: Path, *args: str) -> subprocess.Popen[str]:
    """``watchdogctl run ARGS`` in a session of its own (its sid is its pid), as a
    job started from cron or a script would be. Its output goes to the files
    ``out`` and ``err`` in ``cwd``, not to pipes: a process it leaves behind holds
    them open (as under GNU timeout)."""
    with (cwd / "out").open("w") as out, (cwd / "err").open("w") as err:
        return subprocess.Popen(
            ctl_command(socket, "run", *args),
            cwd=cwd,
            start_new_session=True,
            stdout=out,
            stderr=err,
            text=True,
        )


def ended(run: subprocess.Popen[str], cwd: Path) -> tuple[int, str, str]:
    """How ``run`` ended: its exit status, stdout and stderr."""
    status = run.wait(timeout=PATIENCE)
    return status, (cwd / "out").read_text(), (cwd / "err").read_text()


def end_session(run: subprocess.Popen[str], *also: int) -> None:
    """Kill whatever a test left of ``run``'s session (and the pids ``also``)."""
    # (A pid of 0 would be kill(0): the test's own group.)
    for pid in [*in_session(run.pid), *(pid for pid in also if pid > 0)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap(run)


class TestRunTargets:
    """What ``watchdogctl run`` acts on, checked against GNU timeout's rules: the
    command's process group by default, the command alone with --foreground, its
    whole tree with --tree."""

    @pytest.fixture
    def job(self, tmp_path: Path) -> Path:
        script = tmp_path / "nightly-job.sh"
        script.write_text(NIGHTLY_JOB)
        script.chmod(0o755)
        return tmp_path

    def test_a_script_dies_with_what_it_started(self, daemon: RunningDaemon, job: Path) -> None:
        run = run_alone(daemon.socket_path, job, "--timeout", "0.5", "--", "./nightly-job.sh")
        try:
            status, _, err = ended(run, job)
            assert status == 137
            assert "with SIGKILL after 0.5 s (policy group:kill)" in err
            # Its sleep 100 went with it, rather than on under PID 1.
            wait_until(lambda: in_session(run.pid) == [], what="the script's sleep to die")
        finally:
            end_session(run)

    def test_the_command_runs_in_a_process_group_of_its_own(
        self, daemon: RunningDaemon, job: Path
    ) -> None:
        (job / "show.sh").write_text("#!/bin/sh\nps -o pgid= -p $$\n")
        (job / "show.sh").chmod(0o755)
        run = run_alone(daemon.socket_path, job, "--timeout", "5", "--", "./show.sh")
        status, out, _ = ended(run, job)
        assert status == 0
        assert int(out) not in (run.pid, os.getpgrp())
        run = run_alone(daemon.socket_path, job, "--foreground", "--timeout", "5", "./show.sh")
        status, out, _ = ended(run, job)
        assert int(out) == run.pid  # watchdogctl's own group, where its terminal is

    def test_foreground_acts_on_the_command_alone(self, daemon: RunningDaemon, job: Path) -> None:
        run = run_alone(
            daemon.socket_path, job, "--foreground", "--timeout", "0.5", "--", "./nightly-job.sh"
        )
        try:
            status, _, err = ended(run, job)
            assert status == 137
            assert "(policy process:kill)" in err
            # As under timeout --foreground, what the command started is left running.
            [left] = in_session(run.pid)
            assert Path(f"/proc/{left}/cmdline").read_bytes() == b"sleep\x00100\x00"
        finally:
            end_session(run)

    def test_tree_also_takes_what_left_the_group(self, daemon: RunningDaemon, job: Path) -> None:
        escaped = job / "escaped"
        (job / "escaping.sh").write_text(
            f"#!/bin/sh\nsetsid sleep 100 &\necho $! > {escaped}.tmp\n"
            f"mv {escaped}.tmp {escaped}\nsleep 100\n"
        )
        (job / "escaping.sh").chmod(0o755)
        run = run_alone(
            daemon.socket_path, job, "--tree", "--policy", "term", "--timeout", "1", "./escaping.sh"
        )
        away = 0
        try:
            wait_until(escaped.exists, what="the escaped sleep's pid")
            away = int(escaped.read_text())
            wait_until(lambda: os.getsid(away) == away, what="the sleep to leave the session")
            status, _, err = ended(run, job)
            assert status == 128 + signal.SIGTERM
            assert "with SIGTERM after 1 s (policy tree:term)" in err
            wait_until(lambda: gone(away), what="the sleep in a session of its own to die")
            wait_until(lambda: in_session(run.pid) == [], what="the script's sleep to die")
        finally:
            end_session(run, away)

    def test_foreground_and_tree_exclude_each_other(self, daemon: RunningDaemon) -> None:
        result = ctl(daemon.socket_path, "run", "--foreground", "--tree", "--timeout", "1", "true")
        assert result.returncode == 2
        assert "--foreground and --tree exclude each other" in result.stderr

    def test_a_signal_reaches_the_group_and_wakes_a_stopped_command(
        self, daemon: RunningDaemon, job: Path
    ) -> None:
        """SIGTERM to watchdogctl: to the command, to its group, then SIGCONT, as
        timeout sends them. The script stopped itself (as SIGTTIN stops a read from
        the terminal): its trap runs only once it is continued."""
        (job / "stopped.sh").write_text(
            "#!/bin/sh\ntrap 'echo term > got; exit 0' TERM\nsleep 100 &\n"
            "echo $$ > pid.tmp; mv pid.tmp pid\nkill -STOP $$\nwait\n"
        )
        (job / "stopped.sh").chmod(0o755)
        run = run_alone(daemon.socket_path, job, "--timeout", "60", "--", "./stopped.sh")
        try:
            wait_until((job / "pid").exists, what="the script to start")
            script = int((job / "pid").read_text())
            wait_until(lambda: state_of(script) == "T", what="the script to stop itself")
            # Until the shell's fork runs sleep, it takes a SIGTERM with the trap it
            # inherited, and drops it: the sleep would run on (as under timeout).
            wait_until(lambda: runs_sleep(run.pid), what="the script's sleep to start")
            run.send_signal(signal.SIGTERM)
            assert ended(run, job)[0] == 0
            assert (job / "got").read_text() == "term\n"
            wait_until(lambda: in_session(run.pid) == [], what="the script's sleep to die")
        finally:
            end_session(run)


def runs_sleep(sid: int) -> bool:
    """Whether a process of session ``sid`` runs ``sleep 100`` (has exec'd it)."""
    for pid in in_session(sid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00100\x00":
                return True
    return False


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


#: Every command, with the options it needs; --socket and --json go around them.
COMMANDS = [
    ["status"],
    ["ping"],
    ["events"],
    ["policies"],
    ["metrics"],
    ["arm", "--pid", "2", "--scope", "s", "--timeout", "1"],
    ["release", "--pid", "2", "--scope", "s"],
    ["run", "--timeout", "5"],
]


def _placed(socket: Path, command: list[str], *, before: bool) -> list[str]:
    """``command`` with --socket and --json before or after its name (for `run`,
    after its options and before the ``--`` of the command it runs)."""
    options = ["--socket", str(socket), "--json"]
    line = [*options, *command] if before else [command[0], *options, *command[1:]]
    return line + (["--", "true"] if command[0] == "run" else [])


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_socket_and_json_go_before_or_after_every_command(
    daemon: RunningDaemon, command: list[str], before: bool
) -> None:
    victim = sleeper()
    try:
        command = [str(victim.pid) if arg == "2" else arg for arg in command]
        result = subprocess.run(
            [WATCHDOGCTL, *_placed(daemon.socket_path, command, before=before)],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
            env={**os.environ, "WATCHDOGD_SOCKET": "/nonexistent/watchdogd.sock"},
        )
        assert result.returncode == 0, result.stderr
        for line in result.stdout.splitlines():
            json.loads(line)  # events print one object per line
    finally:
        reap(victim)


def test_the_socket_after_the_command_name_wins(daemon: RunningDaemon, tmp_path: Path) -> None:
    result = subprocess.run(
        [WATCHDOGCTL, "--socket", str(tmp_path / "absent.sock"), "ping",
         "--socket", str(daemon.socket_path)],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert str(daemon.socket_path) in result.stdout


def test_metrics_json_is_the_parsed_families(daemon: RunningDaemon) -> None:
    families = json.loads(ctl(daemon.socket_path, "metrics", "--json").stdout)
    by_name = {family["name"]: family for family in families}
    armed = by_name["watchdogd_timers_armed"]
    assert armed["type"] == "gauge"
    assert armed["help"]
    assert armed["samples"] == [{"name": "watchdogd_timers_armed", "labels": {}, "value": 0.0}]
    requests = by_name["watchdogd_requests"]
    assert all({"op", "result"} <= set(sample["labels"]) for sample in requests["samples"])


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_no_daemon_means_one_clear_line(tmp_path: Path, command: list[str], before: bool) -> None:
    absent = tmp_path / "absent.sock"
    result = subprocess.run(
        [WATCHDOGCTL, *_placed(absent, command, before=before)],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    args = command
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "watchdogd is not reachable" in lines[0]
    assert str(tmp_path / "absent.sock") in lines[0]
    assert result.returncode == (125 if args[0] == "run" else 1)


class TestScopesForPeople:
    def test_under_the_working_directory_relative(self) -> None:
        shown = shown_scope("/srv/job/train.py:88", cwd="/srv/job", home="/home/me")
        assert shown == "train.py:88"
        assert shown_scope("/srv/job/sub/x.py:3@worker", cwd="/srv/job/", home="/") == (
            "sub/x.py:3@worker"
        )

    def test_under_home_with_a_tilde(self) -> None:
        assert shown_scope("/home/me/t.py:1", cwd="/srv", home="/home/me") == "~/t.py:1"

    def test_anything_else_as_it_is(self) -> None:
        for scope in ("load", "run:sleep", "/srv/jobs/t.py:1", "/srv/job", "...b/t.py:1"):
            assert shown_scope(scope, cwd="/srv/job", home="/home/me") == scope
        # A working directory of / (or a home of /) shortens nothing.
        assert shown_scope("/srv/t.py:1", cwd="/", home="/") == "/srv/t.py:1"

    def test_status_shows_them_and_json_keeps_them_whole(
        self, daemon: RunningDaemon, tmp_path: Path
    ) -> None:
        full = f"{tmp_path}/train.py:88"
        with Client(daemon.socket_path) as client:
            victim = sleeper()
            try:
                client.acquire(full, 60, pid=victim.pid)
                table = subprocess.run(
                    ctl_command(daemon.socket_path, "status"),
                    capture_output=True, text=True, check=True, cwd=tmp_path,
                )  # fmt: skip
                [row] = table.stdout.splitlines()[4:]
                assert row.split()[3] == "train.py:88"
                whole = subprocess.run(
                    ctl_command(daemon.socket_path, "status", "--json"),
                    capture_output=True, text=True, check=True, cwd=tmp_path,
                )  # fmt: skip
                assert json.loads(whole.stdout)["timers"][0]["scope"] == full
            finally:
                reap(victim)


def _info(timers: int) -> DaemonInfo:
    return DaemonInfo(
        version="0.1.0", pid=10, uptime=5.0, timers=timers, processes=1, connections=1,
        requests=9, expired=0, exited=0,
    )  # fmt: skip


def test_the_header_counts_what_the_table_shows() -> None:
    assert "\ntimers 3  processes 1" in _summary(_info(3), visible=3)
    assert "\ntimers 0 of yours, 1 on the host  processes 1" in _summary(_info(1), visible=0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run watchdogctl as uid 65534")
def test_a_non_root_status_does_not_count_timers_it_cannot_show(
    socket_path: Path, tmp_path: Path
) -> None:
    with configured_daemon(socket_path, tmp_path, "", for_everyone=True) as daemon:
        victim = sleeper()  # root's
        try:
            with daemon.client() as client:
                client.acquire("roots", 60, pid=victim.pid)
            output = _as_nobody(socket_path)
        finally:
            reap(victim)
    lines = output.splitlines()
    assert lines[1].startswith("timers 0 of yours, 1 on the host  ")
    assert lines[3] == "No timers armed."


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


def _as_nobody(socket: Path, *args: str) -> str:
    """``watchdogctl status`` (or ``args``) run by uid 65534, in a fork of this
    process (which has the interpreter loaded: uid 65534 may not read it from where
    it lives)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = CliRunner().invoke(main, ["--socket", str(socket), *(args or ["status"])])
            output = result.output if result.exit_code == 0 else f"failed: {result.output}"
        except BaseException as exc:
            output = f"failed: {exc!r}"
        os.write(write_end, output.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        output = pipe.read()
    os.waitpid(child, 0)
    assert not output.startswith("failed"), output
    return output


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: other users, mounts")
def test_watchdogctl_never_speaks_to_another_users_socket_at_its_own_path() -> None:
    # tests/e2e/test_client.py's worker of uid 4321, asking its daemon for a ping.
    def ping() -> list[Any]:
        become_worker_of_other()
        result = CliRunner().invoke(main, ["ping"])
        return [result.exit_code, result.stdout, result.stderr]

    def scenario() -> Any:
        with fake_daemon_as(NOBODY, PER_USER, directory_mode=0o755) as impostor:
            return forked(ping), impostor()

    (status, stdout, stderr), seen = in_private_mounts(scenario)
    assert (status, stdout) == (1, "")
    [line] = stderr.splitlines()
    assert line.startswith(f"Error: {IMPOSTOR}")
    assert seen["connections"] == 0


def test_shell_completion_comes_from_click(tmp_path: Path) -> None:
    env = {**os.environ, "_WATCHDOGCTL_COMPLETE": "bash_source"}
    script = subprocess.run(
        [WATCHDOGCTL], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert "_watchdogctl_completion()" in script
    assert "complete -o nosort -F _watchdogctl_completion watchdogctl" in script
    # What the script asks for when the user presses tab after "watchdogctl st":
    assert _completed("watchdogctl st") == ["plain,status"]
    # bash itself accepts the script.
    if (bash := shutil.which("bash")) is not None:
        loaded = subprocess.run(
            [bash, "-c", f'eval "$({WATCHDOGCTL} )" && complete -p watchdogctl'],
            capture_output=True, text=True, check=True, env=env,
        )  # fmt: skip
        assert "_watchdogctl_completion" in loaded.stdout


def _completed(words: str, **env: str) -> list[str]:
    """What bash's completion gets when the user presses tab after ``words``."""
    return subprocess.run(
        [WATCHDOGCTL],
        capture_output=True,
        text=True,
        check=True,
        env={
            **os.environ,
            **env,
            "_WATCHDOGCTL_COMPLETE": "bash_complete",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
        },
        timeout=PATIENCE,
    ).stdout.split()


def test_policy_completion_asks_the_daemon(daemon: RunningDaemon, tmp_path: Path) -> None:
    socket = str(daemon.socket_path)
    assert "plain,peer_dump" in _completed(f"watchdogctl --socket {socket} run --policy ")
    assert _completed("watchdogctl arm --policy t", WATCHDOGD_SOCKET=socket) == ["plain,term"]
    # No daemon: nothing to offer, and no error in the shell.
    nowhere = str(tmp_path / "none.sock")
    assert _completed(f"watchdogctl --socket {nowhere} run --policy ") == []


#: A policy whose dump prints two lines (and names the pid it was run for), then
#: kills.
DUMPING = """\
[policies.dumping]
steps = [ { dump = ["printf", 'stack of %s\\nsecond line\\n', "{pid}"] }, { signal = "SIGKILL" } ]
"""


def _expired(daemon: RunningDaemon, scope: str, policy: str = "kill") -> int:
    """The pid of a sleeper whose timer ``scope`` expired, once its event is in."""
    victim = sleeper()
    try:
        with daemon.client() as client:
            client.acquire(scope, 0.1, pid=victim.pid, policy=policy)
            assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
            expired_event(client, victim.pid)
    finally:
        reap(victim)
    return victim.pid


def test_events_are_one_line_each_with_their_stacks_behind_an_option(
    socket_path: Path, tmp_path: Path
) -> None:
    with configured_daemon(socket_path, tmp_path, DUMPING) as daemon:
        first = _expired(daemon, "first", "dumping")
        second = _expired(daemon, "second", "dumping")
        lines = ctl(socket_path, "events").stdout.splitlines()
        # `events | tail -2` is the last two events, each named for what its dump ran.
        assert [line.split()[3] for line in lines[-2:]] == [f"pid={first}", f"pid={second}"]
        assert (
            f"[dump printf 'stack of %s\\nsecond line\\n' {second}: exit 0 (2 lines)]"
            in (lines[-1])
        )
        assert "{pid}" not in "".join(lines)
        stacks = ctl(socket_path, "events", "--stacks").stdout.splitlines()
        assert stacks[-3:] == [lines[-1], f"    | stack of {second}", "    | second line"]
        # JSON is as the daemon sent it: the output in the event, one event a line.
        as_json = ctl(socket_path, "events", "--json").stdout.splitlines()
        assert len(as_json) == len(lines)
        last = json.loads(as_json[-1])
        assert last["steps"][0]["output"] == f"stack of {second}\nsecond line\n"


def test_an_empty_listing_says_so(daemon: RunningDaemon) -> None:
    assert ctl(daemon.socket_path, "events").stdout == "No events.\n"
    assert ctl(daemon.socket_path, "events", "--json").stdout == ""
    assert ctl(daemon.socket_path, "incidents").stdout == "No incidents.\n"


def test_an_exit_shows_its_scopes_as_status_shows_them(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    scopes = [f"{tmp_path}/job.py:6", f"{tmp_path}/job.py:9"]
    victim = sleeper()
    try:
        with daemon.client() as client:
            for scope in scopes:
                client.acquire(scope, 60, pid=victim.pid)
            status = subprocess.run(
                ctl_command(daemon.socket_path, "status"),
                capture_output=True, text=True, check=True, cwd=tmp_path,
            ).stdout  # fmt: skip
            assert [row.split()[3] for row in status.splitlines()[4:]] == ["job.py:6", "job.py:9"]
    finally:
        reap(victim)
    with daemon.client() as client:
        wait_until(lambda: client.status().daemon.exited == 1, what="the exit recorded")
    events = subprocess.run(
        ctl_command(daemon.socket_path, "events"),
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    [exited] = events.splitlines()
    assert exited.endswith(
        f"exited  pid={victim.pid}  scopes=job.py:6, job.py:9  (exited with 2 timers armed)"
    )
    [event] = json.loads(f"[{ctl(daemon.socket_path, 'events', '--json').stdout}]")
    assert (event["scopes"], event["timers"]) == (scopes, 2)


def test_why_says_when_a_process_does_not_exist(daemon: RunningDaemon) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert ctl(daemon.socket_path, "why", str(gone.pid)).stdout == (
        f"pid {gone.pid}: no such process (it exited, or never ran)\n"
    )
    # One that exists, with no timer: said so, as before.
    assert ctl(daemon.socket_path, "why", str(os.getpid())).stdout == (
        f"pid {os.getpid()}\n  no timer armed that you may see\n"
    )


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run watchdogctl as uid 65534")
def test_why_tells_another_user_no_more_than_kill_does(socket_path: Path, tmp_path: Path) -> None:
    with configured_daemon(socket_path, tmp_path, "", for_everyone=True) as daemon:
        victim = sleeper()  # root's, with a timer
        gone = subprocess.Popen(["true"])
        gone.wait()
        try:
            with daemon.client() as client:
                client.acquire("roots", 60, pid=victim.pid)
            # It exists, as kill(2) would tell uid 65534 (EPERM); nothing more.
            assert _as_nobody(socket_path, "why", str(victim.pid)) == (
                f"pid {victim.pid}\n  no timer armed that you may see\n"
            )
            assert _as_nobody(socket_path, "why", str(gone.pid)) == (
                f"pid {gone.pid}: no such process (it exited, or never ran)\n"
            )
        finally:
            reap(victim)


def _long_status(daemon: RunningDaemon, victim: subprocess.Popen[bytes]) -> None:
    with daemon.client() as client:
        client.acquire("/srv/training/projects/a-rather-long-project/train.py:123", 300,
                       pid=victim.pid)  # fmt: skip


def _on_a_terminal(command: list[str], columns: int) -> str:
    """What ``command`` prints with its stdout on a terminal ``columns`` wide (a
    real pty, its size set as a terminal emulator sets it), COLUMNS unset."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    process = subprocess.Popen(command, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    output = bytearray()
    try:
        while chunk := _read(master):
            output += chunk
    finally:
        os.close(master)
        assert process.wait(timeout=PATIENCE) == 0, process.stderr
        assert process.stderr is not None
        process.stderr.close()
    return output.decode().replace("\r\n", "\n")


def _read(master: int) -> bytes:
    try:
        return os.read(master, 65536)
    except OSError:  # EIO: the other side is closed
        return b""


def test_tables_fit_the_terminals_width_and_a_pipe_gets_them_whole(
    daemon: RunningDaemon,
) -> None:
    long_argument = "--an-argument-that-makes-the-command-line-long=" + "x" * 40
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", long_argument])
    try:
        cmdline = Path(f"/proc/{victim.pid}/cmdline")
        wait_until(lambda: b"--an-argument" in cmdline.read_bytes(), what="its command line")
        _long_status(daemon, victim)
        command = ctl_command(daemon.socket_path, "status")
        piped = ctl(daemon.socket_path, "status").stdout.splitlines()
        assert max(len(line) for line in piped) > 112
        assert "…" not in "".join(piped)
        assert "  /srv/training/projects/a-rather-long-project/train.py:123  " in piped[4]
        for columns in (80, 60):
            table = _on_a_terminal(command, columns).splitlines()
            assert max(len(line) for line in table) <= columns, table
            header = next(n for n, line in enumerate(table) if line.startswith("PID"))
            row = table[header + 1].split()
            # A command loses its end, a scope its start.
            assert row[1].startswith(sys.executable[:5])
            assert row[1].endswith("…")
            assert row[2].startswith("…")
            assert row[2].endswith("train.py:123")
        with_columns = subprocess.run(command, capture_output=True, text=True, check=True,
                                      env={**os.environ, "COLUMNS": "70"}).stdout  # fmt: skip
        assert max(len(line) for line in with_columns.splitlines()) <= 70
        # JSON is never cut.
        whole = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True,
                               env={**os.environ, "COLUMNS": "70"}).stdout  # fmt: skip
        [timer] = json.loads(whole)["timers"]
        assert timer["scope"] == "/srv/training/projects/a-rather-long-project/train.py:123"
        assert timer["command"].endswith("x" * 40)
    finally:
        reap(victim)


def test_a_socket_path_that_is_a_directory_is_said_to_be_one(tmp_path: Path) -> None:
    result = ctl(tmp_path, "status")
    assert result.returncode == 1
    assert f"not reachable at {tmp_path}: not a socket but a directory." in result.stderr
