"""Daemons, ``watchdogctl`` runs and torch ranks forked from a process that has
imported them already.

A ``python -m watchdogd`` spends most of its start in Python's own start and in the
imports (trio, msgspec, click, the daemon's modules), and the suite starts some
hundreds of daemons and runs some hundreds of ``watchdogctl``: a third of its CPU,
which beside a busy machine is a third of its time. So each test process keeps one
launcher: a child that imports both commands once, then forks a process for each
start it is asked for. The forked process takes the test's argument list,
environment, working directory, umask and standard streams, then runs the command's
``main`` as its entry point would, and ends as an interpreter does (its threads
joined, its ``atexit`` hooks run, its streams flushed); so what a test sees is the
command's own behaviour. What differs: its parent is the launcher, its command
line in /proc is the launcher's, and the teardown of its modules after all that is
skipped (`_end`). Where the command line itself is what is tested,
the tests run the real command (the README's, the CLI's, systemd's tests).

Torch ranks (`start_python`) come from a second launcher, one that has imported
torch: its import is seconds of CPU, paid again by every rank a plain ``python -c``
starts, while a forked one runs its script at once, as torch's own
``start_processes(start_method="fork")`` and its data loaders' workers do. The
script runs as ``python -c`` runs it: in a ``__main__`` module of its own, with
``sys.argv[0]`` ``-c``.

``WATCHDOGD_TESTS_EXEC=1`` starts every command with exec instead.

The launcher and its test process speak over a SOCK_SEQPACKET pair: a start is one
message (JSON, the standard streams passed along with it); the launcher answers with
the new pid, and with each exit status as its child ends (it holds a pidfd of each).
It ends when its test process closes the pair.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib
import json
import locale
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

#: The commands the launcher runs, and the modules of their ``main``.
_ENTRY_POINTS: Final = {
    "watchdogd": "watchdogd.cli.watchdogd",
    "watchdogctl": "watchdogd.cli.watchdogctl",
}
#: What each launcher imports before it forks: the commands, or what a torch rank does.
_PRELOADS: Final = {
    "commands": tuple(_ENTRY_POINTS.values()),
    "torch": (
        "torch",
        "torch.distributed",
        "torch.distributed.elastic.timer",
        "watchdogd_client",
        "watchdogd_client.torch",
    ),
}
_MESSAGE: Final = 1 << 20
#: The longest a wait holds the launcher's lock at a time.
_SLICE: Final = 0.05
_TESTS: Final = str(Path(__file__).resolve().parent.parent)


def forking() -> bool:
    """Whether commands are forked from the launcher (not ``WATCHDOGD_TESTS_EXEC=1``)."""
    return os.environ.get("WATCHDOGD_TESTS_EXEC") != "1"


class Forked:
    """A process the launcher forked, with what the suite uses of `subprocess.Popen`.

    Its signals go through a pidfd the launcher opened before the process could
    end: the launcher reaps it at once when it does, so its pid may be another
    process's by the time a test signals it (a `Popen`'s child stays a zombie
    until waited for)."""

    def __init__(self, launcher: Launcher, pid: int, pidfd: int) -> None:
        self._launcher = launcher
        self._pidfd: int | None = pidfd
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self._launcher.status(self.pid, 0.0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._ended(self._launcher.status(self.pid, timeout))
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            # Ended, and not yet said so by the launcher: as kill(2) on a zombie.
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, status: int | None) -> None:
        if status is not None:
            self.returncode = status
            self.close()

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        self.close()


class ForkedPython(Forked):
    """A ``python -c`` the torch launcher forked, with its standard streams as pipes
    in text mode, as `subprocess.Popen` gives them."""

    def __init__(
        self, forked: Forked, stdin: IO[str], stdout: IO[str], stderr: IO[str] | None
    ) -> None:
        assert forked._pidfd is not None  # a start's answer carries it
        super().__init__(forked._launcher, forked.pid, forked._pidfd)
        forked._pidfd = None  # now this one's
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = stderr

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """What it writes on stdout and stderr to its end, stdin closed first."""
        if self.stdin is not None:
            self.stdin.close()
        read: dict[str, str] = {}

        def drain(name: str, stream: IO[str]) -> None:
            with stream:  # as `subprocess.Popen.communicate`, which closes it
                read[name] = stream.read()

        readers = [
            threading.Thread(target=drain, args=(name, stream), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return read.get("out", ""), read.get("err", "")


class Launcher:
    """A launcher of this test process, started on first use (`launcher`):
    ``preload`` says what it imports (`_PRELOADS`)."""

    def __init__(self, preload: str = "commands") -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        self._lock = threading.Lock()
        self._exited: dict[int, int] = {}
        code = (
            f"import sys; sys.path.insert(0, {_TESTS!r}); "
            f"from helpers.launcher import serve; serve(int(sys.argv[1]), {preload!r})()"
        )
        self._process = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd="/",
        )
        theirs.close()
        self.owner = os.getpid()

    def start(
        self,
        command: str,
        args: Sequence[str],
        *,
        stdin: int,
        stdout: int,
        stderr: int,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
    ) -> Forked:
        """Fork ``command`` (``watchdogd`` or ``watchdogctl``; ``python`` from the
        torch launcher, ``args`` then starting with ``-c`` and its source) with
        ``args``, this process's working directory and umask, and ``env`` (this
        process's environment if None), in a session of its own if ``new_session``."""
        umask = os.umask(0o022)
        os.umask(umask)
        request = {
            "command": command,
            "args": list(args),
            "env": dict(os.environ if env is None else env),
            "cwd": os.getcwd(),
            "umask": umask,
            "session": new_session,
        }
        with self._lock:
            socket.send_fds(self._socket, [json.dumps(request).encode()], [stdin, stdout, stderr])
            while True:
                reply, fds = self._receive(None)
                assert reply is not None
                if "pid" in reply:
                    # An exit read before this answer was an earlier process's that
                    # had the same pid: the launcher reaps a process, and says so,
                    # before its pid can be given again.
                    self._exited.pop(reply["pid"], None)
                    return Forked(self, reply["pid"], fds[0])

    def status(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it ended, waiting up to ``timeout`` seconds
        (None: as long as it takes); None if it still runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # The lock is let go now and then: another thread may start a process
            # or wait for its own meanwhile.
            with self._lock:
                if pid in self._exited:
                    return self._exited.pop(pid)
                left = _SLICE if deadline is None else deadline - time.monotonic()
                # Out of time, what has come meanwhile is still read (a poll).
                message, fds = self._receive(max(0.0, min(left, _SLICE)))
                for fd in fds:  # only a start's answer carries one
                    os.close(fd)
                if message is None and left <= 0:
                    return None

    def _receive(self, timeout: float | None) -> tuple[dict[str, Any] | None, list[int]]:
        """One message and the descriptors sent with it (exit statuses are kept as
        they come); None after ``timeout``."""
        self._socket.settimeout(timeout)
        try:
            data, fds, _, _ = socket.recv_fds(self._socket, _MESSAGE, 1)
        except (TimeoutError, BlockingIOError):
            return None, []
        finally:
            self._socket.settimeout(None)
        if not data:
            raise OSError("the launcher exited")
        message: dict[str, Any] = json.loads(data)
        if "exited" in message:
            self._exited[message["exited"]] = message["status"]
        return message, fds

    def close(self) -> None:
        self._socket.close()
        self._process.wait(timeout=10)


#: This test process's launchers, by what they preload (one each per test process).
_launchers: dict[str, Launcher] = {}
_started = threading.Lock()


def launcher(preload: str = "commands") -> Launcher:
    """This process's launcher that imported ``preload``, started on first use
    (again in a child of a fork)."""
    with _started:
        found = _launchers.get(preload)
        if found is None or found.owner != os.getpid():
            found = _launchers[preload] = Launcher(preload)
        return found


def close_launcher() -> None:
    """End this process's launchers, if it has any (the end of the test session)."""
    with _started:
        for started in _launchers.values():
            if started.owner == os.getpid():
                started.close()
        _launchers.clear()


def start_python(
    source: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    new_session: bool = False,
    stderr: int = subprocess.PIPE,
) -> ForkedPython:
    """``python -c source *args`` with pipes for its standard streams (its stderr
    ``stderr`` if that is a descriptor), forked from the launcher that has
    imported torch."""
    piped = stderr == subprocess.PIPE
    pipes = [os.pipe() for _ in range(3 if piped else 2)]
    theirs = [pipes[0][0], *(write for _, write in pipes[1:])]
    ours = [pipes[0][1], *(read for read, _ in pipes[1:])]
    try:
        forked = launcher("torch").start(
            "python",
            ["-c", source, *args],
            stdin=theirs[0],
            stdout=theirs[1],
            stderr=theirs[2] if piped else stderr,
            env=env,
            new_session=new_session,
        )
    except BaseException:
        for end in ours:
            os.close(end)
        raise
    finally:
        for end in theirs:
            os.close(end)
    encoding = locale.getpreferredencoding(False)
    return ForkedPython(
        forked,
        open(ours[0], "w", encoding=encoding),
        open(ours[1], encoding=encoding),
        open(ours[2], encoding=encoding) if piped else None,
    )


# The launcher's side.


def serve(control_fd: int, preload: str) -> Callable[[], None]:
    """Import what ``preload`` names, then fork a process for each start asked on
    ``control_fd`` until it closes. Returns only in a forked child: what to run
    there, at the top level of the interpreter, so that it ends as any does."""
    # What every start would import; not the package's __main__, which runs the daemon.
    for module in _PRELOADS[preload]:
        importlib.import_module(module)

    # What is imported now is never garbage: kept out of the collector's reach, a
    # forked child's collections and exit do not write to (and so copy) every page
    # of it; a third of a forked command's CPU otherwise.
    gc.freeze()
    control = socket.socket(fileno=control_fd)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    children: dict[int, int] = {}
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                message, fds, _, _ = socket.recv_fds(control, _MESSAGE, 3)
                if not message:
                    sys.exit(0)
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    return _child(control, request, fds)
                for fd in fds:
                    os.close(fd)
                # Opened before the child is reaped, so it is this child's: the
                # test process signals through a copy of it.
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                selector.register(pidfd, selectors.EVENT_READ)
                socket.send_fds(control, [json.dumps({"pid": pid}).encode()], [pidfd])
            else:
                assert isinstance(key.fileobj, int)
                selector.unregister(key.fileobj)
                os.close(key.fileobj)
                pid = children.pop(key.fileobj)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                control.send(json.dumps({"exited": pid, "status": code}).encode())


def _child(control: socket.socket, request: dict[str, Any], fds: list[int]) -> Callable[[], None]:
    """Become the process a start asked for; what its entry point runs."""
    control.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    # As exec with close_fds: nothing of the launcher's (the pidfds of the other
    # processes it started, the streams passed to it) stays open here.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path.remove(_TESTS)
    command, args = request["command"], request["args"]
    if command == "python":
        return _python_c(args)
    if command == "watchdogd":
        # As ``python -m watchdogd``: its path first, then the working directory.
        package = Path(sys.modules["watchdogd"].__file__ or "").parent
        sys.argv = [str(package / "__main__.py"), *args]
        sys.path[0] = request["cwd"]
    else:
        # As the console script: its path first, its directory on the path.
        script = Path(sys.executable).parent / command
        sys.argv = [str(script), *args]
        sys.path[0] = str(script.parent)
    main = sys.modules[_ENTRY_POINTS[command]].main

    def run() -> None:
        try:
            main()
        except SystemExit as exc:
            _end(exc.code)
        _end(0)

    return run


def _end(code: object) -> None:
    """End as the interpreter ends a process that exits with ``code``: its threads
    joined, its ``atexit`` hooks run, its standard streams flushed, the status a
    ``SystemExit`` of ``code`` gives. What it does then, the teardown of every
    module, is left out: it writes to (and so copies) each page the launcher had
    imported, half a forked daemon's CPU, and nothing of it reaches a test."""
    getattr(threading, "_shutdown")()  # noqa: B009 (what the interpreter calls first)
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status & 0xFF)


def _python_c(args: list[str]) -> Callable[[], None]:
    """What ``python -c args[1] *args[2:]`` runs: the source in a ``__main__`` of its
    own, ``sys.argv`` ``['-c', *args[2:]]``, the working directory first on the path
    (the launcher's own path is already so)."""
    code = compile(args[1], "<string>", "exec")
    sys.argv = ["-c", *args[2:]]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main

    def run() -> None:
        exec(code, main.__dict__)

    return run


def run_captured(
    command: str, args: Sequence[str], *, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end as ``subprocess.run(..., capture_output=True,
    text=True, timeout=timeout)`` does, forked from the launcher."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        with open(os.devnull, "rb") as devnull:
            process = launcher().start(
                command, args, stdin=devnull.fileno(), stdout=out_write, stderr=err_write
            )
    finally:
        os.close(out_write)
        os.close(err_write)
    deadline = time.monotonic() + timeout
    captured = {out_read: bytearray(), err_read: bytearray()}
    with selectors.DefaultSelector() as selector:
        for fd in captured:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    process.kill()
                    process.wait()
                    raise subprocess.TimeoutExpired([command, *args], timeout)
                for key, _ in selector.select(left):
                    assert isinstance(key.fileobj, int)
                    if data := os.read(key.fileobj, 65536):
                        captured[key.fileobj] += data
                    else:
                        selector.unregister(key.fileobj)
        finally:
            os.close(out_read)
            os.close(err_read)
    code = process.wait(max(0.0, deadline - time.monotonic()))
    stdout, stderr = (_text(captured[fd]) for fd in (out_read, err_read))
    return subprocess.CompletedProcess([command, *args], code, stdout, stderr)


def _text(data: bytes | bytearray) -> str:
    """``data`` as ``text=True`` reads it: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")
