"""Real processes for tests: victims, Python workers, forks of the test process, and
what /proc says of them."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from helpers.launcher import ForkedPython, forking, start_python
from helpers.waiting import PATIENCE, wait_until

if TYPE_CHECKING:
    from helpers.daemon import RunningDaemon


def python_worker(
    source: str,
    *args: str,
    socket: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
    stderr: int = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Start a Python process running ``source`` with WATCHDOGD_SOCKET set.

    The worker prints "ready" on stdout once its set-up is done; its stdin, stdout
    and stderr are pipes (its stderr ``stderr`` if that is a descriptor).
    """
    full_env = {**os.environ, "WATCHDOGD_SOCKET": str(socket), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        env=full_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=new_session,
    )


#: A worker process as the tests use it: a `subprocess.Popen` in text mode, or a
#: torch worker forked from the launcher that has imported torch.
Worker = subprocess.Popen[str] | ForkedPython


def torch_worker(
    source: str,
    *args: str,
    socket: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
    stderr: int = subprocess.PIPE,
) -> Worker:
    """As `python_worker`, for a ``source`` that imports torch: forked from a process
    that has imported it already (`helpers.launcher.start_python`), unless the suite
    runs every command with exec."""
    if not forking():
        return python_worker(
            source, *args, socket=socket, env=env, new_session=new_session, stderr=stderr
        )
    full_env = {**os.environ, "WATCHDOGD_SOCKET": str(socket), **(env or {})}
    return start_python(
        textwrap.dedent(source), args, env=full_env, new_session=new_session, stderr=stderr
    )


def forked(action: Callable[[], Any]) -> Any:
    """Run ``action`` in a forked child of this process and return what it returned
    (through JSON); an exception there is raised here as an AssertionError that
    carries the child's traceback. The child has the interpreter loaded, so it may
    drop to a user who could not read the interpreter from where it lives."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        try:
            os.close(read_end)
            try:
                outcome = {"ok": action()}
            except BaseException:
                outcome = {"error": traceback.format_exc()}
            with os.fdopen(write_end, "w") as pipe:
                json.dump(outcome, pipe)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    os.waitpid(child, 0)
    outcome = json.loads(text)
    if "error" in outcome:
        raise AssertionError(f"in the forked child:\n{outcome['error']}")
    return outcome["ok"]


def wait_ready(worker: Worker) -> None:
    """Block until the worker printed its "ready" line."""
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if line.strip() != "ready":
        _, err = worker.communicate(timeout=PATIENCE)
        raise AssertionError(f"worker failed before ready: {line!r}\n{err}")


_SYS_CLONE3: Final = 435
_CLONE_PARENT: Final = 0x8000


class PidHolder:
    """A child of the test process that holds a pid chosen for it (`fork_at_pid`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def wait(self, timeout: float = PATIENCE) -> int:
        """Its exit status, as `subprocess.Popen.returncode` says it, once it exits."""
        if self.returncode is None:
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            assert poller.poll(timeout * 1000), f"pid {self.pid} is still running"
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def close(self) -> None:
        """Kill it (if need be) and reap it."""
        if self.returncode is None:
            signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            self.wait()
        os.close(self.fd)


def fork_at_pid(pid: int, work: Callable[[], object], *, uid: int = 0) -> PidHolder:
    """A child of the test process that holds exactly ``pid`` (free: its last holder
    reaped) and runs ``work`` as ``uid``, then exits. How a recycled pid reaches a
    new process at once, rather than after the kernel has cycled through every other.

    clone3(2) with ``set_tid`` (Linux >= 5.5, CAP_SYS_ADMIN) gives the new process
    exactly that pid, or fails with EEXIST while another holds it; CLONE_PARENT
    makes it a child of the test process, which reaps it. The system call is made
    from a child forked for it, whose one thread is the only one the new process
    copies: a raw clone runs none of the at-fork hooks that a copy of a threaded
    process needs. The work goes on in this interpreter rather than exec a new one,
    which other uids could not (it lives under /root)."""
    said, say = os.pipe()
    helper = os.fork()
    if helper == 0:  # pragma: no cover - reports through the pipe
        os.close(said)
        wanted = (ctypes.c_int * 1)(pid)
        # struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal (none
        # with CLONE_PARENT: the new parent's is taken), stack, stack_size, tls,
        # set_tid, set_tid_size, cgroup.
        args = struct.pack(
            "11Q", _CLONE_PARENT, 0, 0, 0, 0, 0, 0, 0, ctypes.addressof(wanted), 1, 0
        )
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        got = libc.syscall(_SYS_CLONE3, ctypes.c_char_p(args), ctypes.c_size_t(len(args)))
        if got == 0:
            os.close(say)
            status = 1
            try:
                if uid:
                    become(uid)
                work()
                status = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        os.write(say, (str(got) if got > 0 else os.strerror(ctypes.get_errno())).encode())
        os._exit(0)
    os.close(say)
    os.waitpid(helper, 0)
    with os.fdopen(said) as pipe:
        got = pipe.read()
    assert got == str(pid), f"pid {pid} could not be taken: {got}"
    return PidHolder(pid)


def become(uid: int) -> None:
    """Become ``uid`` (gid ``uid``, no other groups), and dumpable again, as a
    process exec'd as ``uid`` would be (a change of credentials leaves one not)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


_PR_SET_DUMPABLE: Final = 4


#: The priority the shipped unit runs the daemon at (systemd/watchdogd.service).
UNIT_NICE = -10


@contextlib.contextmanager
def at_timing_priority() -> Iterator[None]:
    """This thread, and the processes it starts meanwhile, at real-time priority
    (`at_timing_priority_now`): what times a canary, and the canary itself."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    at_timing_priority_now()
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, param)


def at_timing_priority_now() -> None:
    """This thread from now on at SCHED_FIFO's lowest priority (on Linux, 0 names
    the calling thread). A killed canary at it exits, and a thread at it sees
    that, the moment the daemon's signal reaches it, whatever else runs: CPU hogs,
    and other tests' daemons at the unit's priority, busy under their attacks (at
    the unit's priority, one died 95 ms after the daemon signalled it on time).
    The lateness measured is the daemon's."""
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))


def at_units_priority_all(pid: int) -> None:
    """Every thread of ``pid`` at `UNIT_NICE` (a priority is a thread's): a daemon
    as the shipped unit runs it, or a worker whose death is timed as a canary's."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(thread), UNIT_NICE)


def sleeper() -> subprocess.Popen[bytes]:
    """A victim that sleeps and dies by whatever signal reaches it. Returned once
    its command line shows in /proc: Popen returns when exec began, and the kernel
    fills in the new program's arguments a moment later."""
    process = subprocess.Popen(["sleep", "300"])
    wait_until(lambda: _has_arguments(process.pid), what="the sleeper's command line")
    return process


def death_time(
    process: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = PATIENCE
) -> float:
    """When ``process`` exited, on CLOCK_MONOTONIC, seen through a pidfd (the
    moment its readiness is polled, not a polling wait)."""
    fd = os.pidfd_open(process.pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        assert poller.poll(timeout * 1000), f"pid {process.pid} did not die"
        return time.monotonic()
    finally:
        os.close(fd)


def _has_arguments(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return bool(cmdline.read(1))


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: it will never run again)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` still running (zombies left out)."""
    return [pid for pid, fields in _running() if int(fields[3]) == sid]


def _running() -> Iterator[tuple[int, list[str]]]:
    """Each process still running (zombies left out), with its `_stat_fields`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(int(entry))
        except (OSError, IndexError):
            continue
        if fields[0] not in "ZX":
            yield int(entry), fields


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


class Death:
    """When a child exits, as its pidfd says (no polling, no wait that would reap
    it), watched by a thread from the moment this is made: for timing victims
    while the test goes on doing something else."""

    def __init__(self, process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
        self._pidfd = os.pidfd_open(process.pid)
        #: On CLOCK_MONOTONIC, once it exited.
        self.at: float | None = None
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        poller.poll()
        self.at = time.monotonic()
        os.close(self._pidfd)

    def wait(self, timeout: float = PATIENCE) -> float:
        """When it exited; AssertionError if it is still running after ``timeout``."""
        self._watcher.join(timeout)
        assert self.at is not None, "it did not exit"
        return self.at


def reap(process: subprocess.Popen[bytes] | Worker) -> None:
    """Kill (if need be) and reap a child, and close its pipes."""
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


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


def rss_mib(pid: int) -> float:
    """The resident memory of ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def left_behind(orphans_too: bool = True) -> list[tuple[int, str]]:
    """What the tests forgot to end: the processes still running that descend from
    this one, or (``orphans_too``) that were orphaned (their parent gone, now
    init's) in its process group after it started; (pid, command line) each. One
    of them that runs on into its parent's code after a fork would call kill(0) on
    the whole group. (A worker of pytest-xdist looks at its descendants alone: the
    group is shared with the other workers, whose tests still run.)"""
    mine = _stat_fields(os.getpid())
    group, started = int(mine[2]), int(mine[19])
    parents: dict[int, int] = {}
    orphans: set[int] = set()
    for pid, fields in _running():
        parents[pid] = int(fields[1])
        if (
            orphans_too
            and int(fields[1]) == 1
            and int(fields[2]) == group
            and int(fields[19]) >= started
        ):
            orphans.add(pid)
    found = []
    for pid, parent in parents.items():
        ancestor = parent
        while ancestor not in (0, 1, os.getpid()):
            ancestor = parents.get(ancestor, 0)
        if ancestor == os.getpid() or pid in orphans:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            shown = " ".join(command.decode(errors="replace").split())
            if not any(helper in shown for helper in _OWN_HELPERS):
                found.append((pid, shown))
    return found


#: Helpers of the test process itself, which end with it: multiprocessing's (torch
#: starts its resource tracker in the test process), and pytest-xdist's workers
#: (execnet's bootstrap), which may still be exiting when the run ends.
_OWN_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "import sys;exec(eval(sys.stdin.readline()))",
)


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state first."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def released_while_frozen(daemon: RunningDaemon, source: str, figures: int) -> list[float]:
    """Run ``source``, a worker that prints "ready" inside an ``expires()`` block,
    ends the block on a line of its stdin and then prints ``figures`` numbers: the
    daemon is frozen (SIGSTOP) from before the block ends until they are printed,
    and its release must land once the daemon runs again. The numbers, as read."""
    worker = python_worker(source, socket=daemon.socket_path)
    try:
        assert worker.stdin is not None
        assert worker.stdout is not None
        wait_ready(worker)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            worker.stdin.write("go\n")
            worker.stdin.flush()
            read = [float(worker.stdout.readline()) for _ in range(figures)]
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        with daemon.client() as client:
            wait_until(
                lambda: not [t for t in client.status().timers if t.pid == worker.pid],
                what="the release, landed",
            )
        assert worker.poll() is None, worker.communicate()
        return read
    finally:
        reap(worker)
