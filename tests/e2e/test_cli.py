"""The watchdogd command: start-up errors, clean stops, the default socket, signals
while it starts, and the command line's log level across reloads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from watchdogd_client import Client, DaemonUnavailable

from helpers.daemon import RunningDaemon
from helpers.processes import reap, sleeper
from helpers.waiting import PATIENCE, wait_until

WATCHDOGD = [sys.executable, "-m", "watchdogd"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stops_cleanly_and_fires_nothing(daemon: RunningDaemon, signum: int) -> None:
    victim = sleeper()
    try:
        with daemon.client() as client:
            client.acquire("s", 0.5, pid=victim.pid)
        assert daemon.stop(signum) == 0
        assert not daemon.socket_path.exists()
        with pytest.raises(subprocess.TimeoutExpired):
            victim.wait(timeout=1.0)  # its timer did not fire on the way out
        assert "event=stopped timers=1" in daemon.log()
    finally:
        reap(victim)


def test_the_state_stays_beside_the_socket_and_its_glob_removes_it(
    socket_path: Path, tmp_path: Path
) -> None:
    # The README's `make run ARGS="--socket /tmp/wd.sock"`, and its `rm` after.
    running = RunningDaemon(socket_path, tmp_path / "watchdogd.log", [])
    running.start()
    with running.client() as client:
        client.acquire("s", 60)
    assert running.stop(signal.SIGINT) == 0
    state = socket_path.with_name("watchdogd.state.db")
    assert f"event=stopped timers=1 firing=0 state={state}" in running.log()
    left = sorted(path.name for path in socket_path.parent.iterdir())
    assert state.name in left
    assert all(name.startswith(state.name) for name in left), left
    subprocess.run(["bash", "-c", f"rm {state}*"], check=True)
    assert list(socket_path.parent.iterdir()) == []


def test_says_where_it_listens(daemon: RunningDaemon) -> None:
    assert f"event=listening socket={daemon.socket_path}" in daemon.log()


def test_bad_config_stops_it_at_start_naming_file_and_key(
    tmp_path: Path, socket_path: Path
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[daemon]\nmax_timers_per_user = 5\n")
    result = subprocess.run(
        [*WATCHDOGD, "--socket", str(socket_path), "--config", str(config)],
        capture_output=True,
        text=True,
        check=False,
        timeout=PATIENCE,
    )
    assert result.returncode == 1
    assert str(config) in result.stderr
    assert "max_timers_per_user" in result.stderr
    assert "Traceback" not in result.stderr


def test_refuses_a_socket_path_another_daemon_answers_on(daemon: RunningDaemon) -> None:
    result = subprocess.run(
        [*WATCHDOGD, "--socket", str(daemon.socket_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=PATIENCE,
    )
    assert result.returncode == 1
    assert "another daemon is listening" in result.stderr
    with daemon.client() as client:
        client.ping()  # the first one is untouched


def test_config_file_sets_limits(tmp_path: Path, socket_path: Path) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text('[daemon]\nmax_scope_bytes = 4\nlog_level = "warning"\n')
    running = RunningDaemon(socket_path, tmp_path / "log", ["--config", str(config)])
    running.start()
    try:
        with running.client() as client:
            client.acquire("four", 5)
            with pytest.raises(Exception, match="5 bytes long; the limit is 4"):
                client.acquire("fives", 5)
            client.release("four")
    finally:
        assert running.stop() == 0
    assert "event=listening" not in running.log()  # log_level = warning


def test_environment_names_the_socket(tmp_path: Path, socket_path: Path) -> None:
    process = subprocess.Popen(
        WATCHDOGD,
        env={"WATCHDOGD_SOCKET": str(socket_path), "PATH": "/usr/bin:/bin"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        seen = [process.stderr.readline() for _ in range(1)]
        while "event=listening" not in seen[-1] and len(seen) < 10:
            seen.append(process.stderr.readline())
        assert f"socket={socket_path}" in seen[-1], seen
    finally:
        process.terminate()
        assert process.wait(timeout=PATIENCE) == 0
        process.stderr.close()  # type: ignore[union-attr]


def test_version() -> None:
    result = subprocess.run([*WATCHDOGD, "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "watchdogd, version 0.1.0"


def _reloaded(client: Client) -> bool:
    return any(event.kind == "reloaded" for event in client.events().events)


def test_a_reload_keeps_the_command_lines_log_level(tmp_path: Path, socket_path: Path) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text('[daemon]\nlog_level = "info"\n')
    running = RunningDaemon(
        socket_path, tmp_path / "log", ["--config", str(config), "--log-level", "warning"]
    )
    running.start()
    try:
        os.kill(running.pid, signal.SIGHUP)
        with running.client() as client:
            wait_until(lambda: _reloaded(client), what="the reload")
    finally:
        assert running.stop() == 0
    log = running.log()
    # Both are info lines: the file's level did not replace the command line's.
    assert "event=reloaded" not in log
    assert "event=stopped" not in log


def test_a_daemon_refused_its_state_file_removes_the_socket_it_created(
    daemon: RunningDaemon,
) -> None:
    second = daemon.socket_path.parent / "second.sock"
    result = subprocess.run(
        [*WATCHDOGD, "--socket", str(second), "--state", daemon.state_path],
        capture_output=True,
        text=True,
        check=False,
        timeout=PATIENCE,
    )
    assert result.returncode == 1
    assert "is in use by another watchdogd" in result.stderr
    assert not second.exists()
    with daemon.client() as client:
        client.ping()  # the first one is untouched


def _signals(pid: int, field: str) -> int:
    """A signal mask of /proc/PID/status (``SigBlk``, ``ShdPnd``, ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} for pid {pid}")


def _has(mask: int, signum: int) -> bool:
    return bool(mask >> (signum - 1) & 1)


def _holds_sighup(pid: int) -> bool:
    """Whether the daemon's own code blocked SIGHUP, and only it: after the exec
    (until then the child of a vfork has every signal blocked), and not while a
    module it imports runs a subprocess (the parent of a vfork, too, blocks every
    signal for a moment, then restores its mask, SIGHUP unblocked)."""
    started = b"-m\0watchdogd\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return started and _signals(pid, "SigBlk") == 1 << (signal.SIGHUP - 1)


def test_a_sighup_while_it_starts_is_a_reload_once_it_is_up(
    tmp_path: Path, socket_path: Path
) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text("[daemon]\nevents = 50\n")
    # The daemon's log goes to a pipe the test filled: its first line, written
    # while it starts (once it holds SIGHUP), waits for as long as the test likes.
    reader, writer = os.pipe()
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(writer, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(writer, b"x" * 4096)
    os.set_blocking(writer, True)
    process = subprocess.Popen(
        [*WATCHDOGD, "--socket", str(socket_path), "--config", str(config)],
        stdout=writer,
        stderr=writer,
    )
    os.close(writer)
    drained: list[bytes] = []
    try:
        wait_until(lambda: _holds_sighup(process.pid), what="the daemon to hold SIGHUP")
        os.kill(process.pid, signal.SIGHUP)
        # Held while it starts, not taken: it is still pending.
        assert _has(_signals(process.pid, "ShdPnd"), signal.SIGHUP)
        drain = threading.Thread(target=_drain, args=(reader, drained), daemon=True)
        drain.start()

        def answers() -> bool:
            assert process.poll() is None, b"".join(drained)[4096:].decode()
            try:
                with Client(socket_path, timeout=1.0) as client:
                    return _reloaded(client)
            except DaemonUnavailable:
                return False

        wait_until(answers, what="the daemon to start and reload")
    finally:
        if process.poll() is None:
            process.terminate()
        status = process.wait(timeout=PATIENCE)
    assert status == 0, b"".join(drained)[4096:].decode()


def _drain(fd: int, into: list[bytes]) -> None:
    with open(fd, "rb", buffering=0) as pipe:
        while data := pipe.read(65536):
            into.append(data)


def test_a_config_that_is_a_fifo_stops_the_start_plainly(tmp_path: Path, socket_path: Path) -> None:
    config = tmp_path / "watchdogd.toml"
    os.mkfifo(config)
    result = subprocess.run(
        [*WATCHDOGD, "--socket", str(socket_path), "--config", str(config)],
        capture_output=True,
        text=True,
        check=False,
        timeout=PATIENCE,  # today's daemon waits in open(2) for a writer for ever
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"Error: {config}: cannot read the config file: it is a FIFO, not a regular file\n"
    )
    assert not socket_path.exists()


def test_without_xdg_runtime_dir_a_user_daemon_listens_under_tmp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from watchdogd.cli.watchdogd import daemon_socket_path
    from watchdogd.core.config import Config
    from watchdogd_client.paths import client_socket_path

    monkeypatch.delenv("WATCHDOGD_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("os.getuid", lambda: 4242)
    assert daemon_socket_path(None, Config()) == "/tmp/watchdogd-4242/watchdogd.sock"
    # The same user's clients look there first (the README's fallback paragraph).
    assert client_socket_path() == "/run/watchdogd/watchdogd.sock"  # nothing listens yet
    directory = Path("/tmp/watchdogd-4242")
    directory.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(directory / "watchdogd.sock"))
        assert client_socket_path() == "/tmp/watchdogd-4242/watchdogd.sock"
    finally:
        listener.close()
        (directory / "watchdogd.sock").unlink(missing_ok=True)
        directory.rmdir()


def _start_fails(*args: str) -> str:
    result = subprocess.run(
        [*WATCHDOGD, *args], capture_output=True, text=True, check=False, timeout=PATIENCE
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (
            '[daemon]\nsocket_mode = 0o660\nlog_level = "everything"\n',
            "line 3: daemon.log_level: Invalid enum value 'everything'; valid: 'debug', "
            "'info', 'warning', 'error'",
        ),
        (
            '[daemon]\nsocket_group = "no-such-group-here"\n',
            "daemon.socket_group: no group named 'no-such-group-here'",
        ),
        ("[daemon]\nevents = 0\n", "line 2: daemon.events: Expected `int` >= 1"),
        (
            '[daemon]\nsocket_mode = 0o660\nlog_level = "debgu"\n',
            "watchdogd.toml, line 3: daemon.log_level: Invalid enum value 'debgu'; valid: "
            "'debug', 'info', 'warning', 'error'; did you mean `debug`?",
        ),
        (
            "[daemon]\nsocket_mode = 666\n",
            "line 2: daemon.socket_mode: 666 is a decimal number; a file mode is octal in "
            "TOML: write socket_mode = 0o666",
        ),
        (
            '[policies.x]\ntarget = "everything"\n',
            "policies.x.target: Invalid enum value 'everything'; valid: 'process', 'group'",
        ),
        ("[daemon\n", "not valid TOML"),
    ],
)
def test_config_errors_name_the_file_the_key_the_line_and_the_choices(
    tmp_path: Path, socket_path: Path, document: str, expected: str
) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text(document)
    stderr = _start_fails("--socket", str(socket_path), "--config", str(config))
    assert f"{config}" in stderr
    assert expected in " ".join(stderr.split())


def test_a_config_with_several_errors_stops_the_start_naming_each_in_file_order(
    tmp_path: Path, socket_path: Path
) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text(
        '[policies.graceful]\nsteps = [ { signal = "SIGTREM" } ]\n\n'
        '[daemon]\nmax_timers = 0\ndefault_policy = "trem"\n'
    )
    stderr = _start_fails("--socket", str(socket_path), "--config", str(config))
    assert stderr.splitlines() == [
        f"Error: {config}, line 2: policies.graceful.steps[0].signal: no signal named "
        "'SIGTREM'; did you mean `SIGTERM`?",
        f"{config}, line 5: daemon.max_timers: Expected `int` >= 1",
        f"{config}, line 6: daemon.default_policy: no policy 'trem'; known: abort, graceful, "
        "kill, log, peer_dump, term; did you mean `term`?",
    ]


def test_a_config_that_locks_non_root_users_out_is_warned_of(
    tmp_path: Path, socket_path: Path
) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text(
        '[daemon]\ndefault_policy = "graceful"\n\n'
        '[policies.graceful]\nsteps = [{ signal = "SIGTERM" }]\nroot_only = true\n'
    )
    daemon = RunningDaemon(socket_path, tmp_path / "log", ["--config", str(config)])
    daemon.start()
    try:
        assert "WARNING event=config_warning" in daemon.log()
        assert "every timer a non-root user arms without naming a policy is refused" in (
            daemon.log()
        )
    finally:
        daemon.stop()


def test_a_socket_path_under_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    stderr = _start_fails("--socket", str(missing / "wd.sock"), "--no-state")
    assert f"{missing.parent} does not exist" in stderr
    assert not missing.parent.exists()


def test_a_metrics_textfile_that_cannot_be_written_stops_the_start(
    tmp_path: Path, socket_path: Path
) -> None:
    stderr = _start_fails(
        "--socket", str(socket_path), "--metrics-textfile", str(tmp_path / "no" / "m.prom")
    )
    assert "--metrics-textfile" in stderr
    assert "No such file or directory" in stderr
