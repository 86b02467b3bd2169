"""Shared fixtures: a real daemon on a socket under tmp_path, and real workers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from watchdogd.host.cgroups import host_hierarchy
from watchdogd.storage.store import default_state_path
from watchdogd_client import Client, DaemonUnavailable
from watchdogd_client.protocol import EventInfo, IncidentInfo

from etcd_server import EtcdServer, running_etcd

#: Generous bound for things that should take milliseconds, so a loaded CI machine
#: does not turn a working feature into a failure.
PATIENCE = 10.0


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
        self.command = command or [sys.executable, "-m", "watchdogd", "--socket", str(socket_path)]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self.command, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if self.env is None else {**os.environ, **self.env},
            )
        wait_until(self._answers, what=f"the daemon to answer on {self.socket_path}")

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


def wait_until(condition: object, *, what: str, timeout: float = PATIENCE) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``timeout`` s."""
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="wd-", dir="/tmp"))
    yield directory / "watchdogd.sock"
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    running = RunningDaemon(socket_path, tmp_path / "watchdogd.log", [])
    running.start()
    yield running
    status = running.stop()
    assert status == 0, f"watchdogd exited {status}:\n{running.log()}"


#: A config whose daemon says a restart of it takes about a second: its timer cap is
#: small. A client waits that long for a daemon that went away for good.
SHORT_RESTART = "[daemon]\nmax_timers = 1000\n"


@pytest.fixture
def short_lived_daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon for tests that stop it for good (`SHORT_RESTART`)."""
    with configured_daemon(socket_path, tmp_path, SHORT_RESTART) as running:
        yield running


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


@pytest.fixture
def client(daemon: RunningDaemon) -> Iterator[Client]:
    with daemon.client() as connected:
        yield connected


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A single-member etcd shared by the tests of a module: each test keeps to keys
    of its own, and none stops it (`own_etcd` is for that)."""
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A single-member etcd for one test, which may stop, kill and start it again."""
    with running_etcd(tmp_path / "etcd") as server:
        yield server


def python_worker(
    source: str,
    *args: str,
    socket: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen[str]:
    """Start a Python process running ``source`` with WATCHDOGD_SOCKET set.

    The worker prints "ready" on stdout once its set-up is done; its stdin, stdout
    and stderr are pipes.
    """
    full_env = {**os.environ, "WATCHDOGD_SOCKET": str(socket), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        env=full_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def wait_ready(worker: subprocess.Popen[str]) -> None:
    """Block until the worker printed its "ready" line."""
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if line.strip() != "ready":
        _, err = worker.communicate(timeout=PATIENCE)
        raise AssertionError(f"worker failed before ready: {line!r}\n{err}")


def sleeper() -> subprocess.Popen[bytes]:
    """A victim that sleeps and dies by whatever signal reaches it. Returned once
    its command line shows in /proc: Popen returns when exec began, and the kernel
    fills in the new program's arguments a moment later."""
    process = subprocess.Popen(["sleep", "300"])
    wait_until(lambda: _has_arguments(process.pid), what="the sleeper's command line")
    return process


def _has_arguments(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return bool(cmdline.read(1))


WATCHDOGCTL = str(Path(sys.executable).parent / "watchdogctl")


def ctl_command(socket: Path, *args: str) -> list[str]:
    return [WATCHDOGCTL, "--socket", str(socket), *args]


def ctl(socket: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run watchdogctl as an operator would; never raises on its exit status."""
    return subprocess.run(
        ctl_command(socket, *args), capture_output=True, text=True, check=False, timeout=timeout
    )


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: it will never run again)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def where_is(pid: int) -> str:
    """What a process that should have ended is doing: state, wait channel, kernel stack."""
    parts = []
    for name in ("status", "wchan", "stack"):
        try:
            text = Path(f"/proc/{pid}/{name}").read_text()
        except OSError as exc:
            text = f"({exc.strerror})"
        if name == "status":
            text = next((line for line in text.splitlines() if line.startswith("State")), text)
        parts.append(f"{name}: {text.strip()}")
    return "; ".join(parts)


def reap(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """Kill (if need be) and reap a child, and close its pipes."""
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


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


#: Python source of ``daemonize()``: start a daemon the classic way (fork, setsid,
#: fork again, stdio on /dev/null) and return its pid once it runs. It is then in no
#: tree and no process group of its caller's, but in its caller's cgroup.
DAEMONIZE = """
import os
def daemonize():
    told, tell = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.write(tell, str(os.getpid()).encode())
            os.close(tell)
            import time
            time.sleep(300)
        os._exit(0)
    os.close(tell)
    os.waitpid(child, 0)
    with os.fdopen(told) as pipe:
        return int(pipe.read())
"""


class ScratchCgroup:
    """A cgroup v2 made for one test, directly under the hierarchy's root."""

    def __init__(self, directory: Path, path: str) -> None:
        #: Its directory, and its path as /proc/PID/cgroup shows it.
        self.directory = directory
        self.path = path

    def add(self, pid: int) -> None:
        """Move process ``pid`` into it."""
        (self.directory / "cgroup.procs").write_text(str(pid))

    def child(self, name: str) -> ScratchCgroup:
        """A cgroup below it, removed with it."""
        (self.directory / name).mkdir()
        return ScratchCgroup(self.directory / name, f"{self.path}/{name}")

    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.directory / "cgroup.procs").read_text().split()]


@pytest.fixture
def scratch_cgroup() -> Iterator[ScratchCgroup]:
    """A new cgroup v2; at the end every process left in it (or below) is killed and
    it is removed. Skips where there is no cgroup v2 hierarchy to write to."""
    hierarchy = host_hierarchy()
    if os.getuid() != 0 or hierarchy is None or hierarchy.root != "/":
        pytest.skip("needs root and a cgroup v2 hierarchy mounted at its root")
    name = f"watchdogd-test-{os.getpid()}-{os.urandom(4).hex()}"
    directory = Path(hierarchy.mount) / name
    directory.mkdir()
    try:
        yield ScratchCgroup(directory, f"/{name}")
    finally:
        _remove_cgroup(directory)


def _remove_cgroup(directory: Path) -> None:
    with contextlib.suppress(OSError):
        (directory / "cgroup.kill").write_text("1")
    for below in sorted(directory.rglob("cgroup.procs"), key=lambda p: -len(p.parts)):
        for pid in below.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    # Killed processes leave their cgroup as they exit; until then rmdir says EBUSY.
    for cgroup in sorted({p.parent for p in directory.rglob("cgroup.procs")}, key=str)[::-1]:
        wait_until(lambda cgroup=cgroup: _removed(cgroup), what=f"{cgroup} to be removable")


def _removed(cgroup: Path) -> bool:
    try:
        cgroup.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


@pytest.fixture
def cgroup(scratch_cgroup: ScratchCgroup) -> Path:
    """The directory of a scratch cgroup (`scratch_cgroup`) with pressure (PSI)
    files; skips on a kernel whose cgroups have none."""
    if not (scratch_cgroup.directory / "cpu.pressure").exists():
        pytest.skip("this kernel's cgroups have no pressure (PSI) files")
    return scratch_cgroup.directory


#: A rank of job ``argv[1]``: rank ``argv[2]`` arms a timer of ``argv[3]`` seconds
#: under policy ``rank`` and waits in a function named after its rank, as a rank
#: waits in a collective.
RANK = """
    import sys, time
    from watchdogd_client import expires
    job, rank, after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

    def waiting_in_rank_{rank}():
        time.sleep(300)

    with expires(after=after, scope="step", policy="rank", job=job, rank=rank):
        print("ready", flush=True)
        waiting_in_rank_{rank}()
"""


def start_rank(socket: Path, job: str, rank: int, after: float) -> subprocess.Popen[str]:
    """A `RANK` worker on the daemon at ``socket``, once it is ready."""
    worker = python_worker(RANK.replace("{rank}", str(rank)), job, str(rank), str(after),
                           socket=socket)  # fmt: skip
    wait_ready(worker)
    return worker


def incidents(socket: Path) -> list[IncidentInfo]:
    """``watchdogctl incidents --json``, read back."""
    shown = ctl(socket, "incidents", "--json")
    assert shown.returncode == 0, shown.stderr
    return msgspec.json.decode(shown.stdout, type=list[IncidentInfo])


def whole(socket: Path, incident: str) -> IncidentInfo:
    """``watchdogctl incident ID --json``, read back."""
    shown = ctl(socket, "incident", incident, "--json")
    assert shown.returncode == 0, shown.stderr
    return msgspec.json.decode(shown.stdout, type=IncidentInfo)
