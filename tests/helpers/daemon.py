"""A real ``watchdogd`` started as a user would start it, and ``watchdogctl`` run as an
operator would run it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from watchdogd.storage.store import default_state_path
from watchdogd_client import Client, DaemonUnavailable
from watchdogd_protocol import EventInfo

from helpers.launcher import Forked, forking, launcher, run_captured
from helpers.waiting import PATIENCE, wait_until


class RunningDaemon:
    """A ``watchdogd`` process started as a user would start it."""

    def __init__(
        self,
        socket_path: Path,
        log_path: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.log_path = log_path
        self.args = args
        self.env = env
        #: Forked from the test process's launcher (`helpers.launcher`) unless a
        #: command of the test's own is given.
        self.forked = command is None and forking()
        self.command = command or [sys.executable, "-m", "watchdogd", "--socket", str(socket_path)]
        self.process: subprocess.Popen[bytes] | Forked | None = None

    def start(self, timeout: float = PATIENCE) -> None:
        """Start it and wait, up to ``timeout`` seconds, until it answers."""
        env = None if self.env is None else {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            if self.forked:
                with open(os.devnull, "rb") as devnull:
                    self.process = launcher().start(
                        "watchdogd",
                        [*self.command[3:], *self.args],
                        stdin=devnull.fileno(),
                        stdout=log.fileno(),
                        stderr=log.fileno(),
                        env=env,
                    )
            else:
                self.process = subprocess.Popen(
                    [*self.command, *self.args], stdout=log, stderr=subprocess.STDOUT, env=env
                )
        wait_until(
            self._answers, what=f"the daemon to answer on {self.socket_path}", timeout=timeout
        )

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"watchdogd exited at start:\n{self.log()}")
        try:
            with Client(self.socket_path, timeout=1.0) as client:
                client.ping()
        except DaemonUnavailable:
            return False
        return True

    def stop(self, signum: int = signal.SIGTERM) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=PATIENCE)

    @property
    def state_path(self) -> str:
        """Where the daemon keeps its timers by default: beside its socket."""
        return default_state_path(str(self.socket_path))

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def client(self, **options: object) -> Client:
        return Client(self.socket_path, **options)  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


#: A config whose daemon says a restart of it takes about a second: its timer cap is
#: small. A client waits that long for a daemon that went away for good.
SHORT_RESTART = "[daemon]\nmax_timers = 1000\n"


@contextlib.contextmanager
def configured_daemon(
    socket_path: Path, tmp_path: Path, config: str, *, for_everyone: bool = False
) -> Iterator[RunningDaemon]:
    """A daemon started with ``--config`` (the file is ``tmp_path/watchdogd.toml``);
    ``for_everyone`` lets other users, uid 65534 among them, reach its socket."""
    if for_everyone:
        os.chmod(socket_path.parent, 0o755)
    config_file = tmp_path / "watchdogd.toml"
    config_file.write_text(config)
    running = RunningDaemon(socket_path, tmp_path / "log", ["--config", str(config_file)])
    running.start()
    try:
        yield running
    finally:
        # Stopped when the test failed as well: a failure must not leave it running.
        status = running.stop()
    assert status == 0, running.log()


WATCHDOGCTL = str(Path(sys.executable).parent / "watchdogctl")


def ctl_command(socket: Path, *args: str) -> list[str]:
    return [WATCHDOGCTL, "--socket", str(socket), *args]


def ctl(socket: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run watchdogctl as an operator would (forked from the launcher, `helpers.launcher`);
    never raises on its exit status."""
    if forking():
        return run_captured("watchdogctl", ["--socket", str(socket), *args], timeout=timeout)
    return subprocess.run(
        ctl_command(socket, *args), capture_output=True, text=True, check=False, timeout=timeout
    )


def expired_event(client: Client, pid: int) -> EventInfo:
    """Wait for the ``expired`` event of ``pid`` and return it."""
    found: list[EventInfo] = []

    def recorded() -> bool:
        found[:] = [
            e for e in client.events(limit=1000).events if e.kind == "expired" and e.pid == pid
        ]
        return bool(found)

    wait_until(recorded, what=f"the expiry of pid {pid}")
    return found[0]
