"""A user's own default socket, as a worker finds it by itself: uid 4321 without
XDG_RUNTIME_DIR nor WATCHDOGD_SOCKET (cron, ``sudo -u``, a container) looks for
/tmp/watchdogd-4321/watchdogd.sock. Here are its workers, and its own real daemon
there. Use them in a mount namespace of the test's own (`helpers.namespaces`): the
path is the host's otherwise."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

from watchdogd.cli.watchdogd import main as watchdogd_main
from watchdogd_client import Client, DaemonUnavailable, UntrustedSocket

from helpers.users import OTHER, become
from helpers.waiting import wait_until

#: The hung block of the reproduction, ``with expires(after=AFTER): sleep(HUNG)``:
#: 2 s and 8 s at full size (``WATCHDOGD_SOAK=1``).
AFTER, HUNG = (2.0, 8.0) if os.environ.get("WATCHDOGD_SOAK", "") == "1" else (0.5, 2.0)
#: Where a daemon of uid 4321, and its workers, put and look for its socket.
PER_USER: Final = Path(f"/tmp/watchdogd-{OTHER}/watchdogd.sock")
#: What a worker of uid 4321 is told when uid 65534 made that directory first.
IMPOSTOR: Final = (
    f"watchdogd's socket {PER_USER}, owned by uid 65534 (nobody), is not trusted: its "
    f"directory {PER_USER.parent} belongs to uid 65534 (nobody), not to you (uid 4321). "
    "Nothing was sent to it."
)


def become_worker_of_other() -> None:
    """Make this forked process a worker of uid 4321 whose environment names no
    socket."""
    become(OTHER)
    for name in ("XDG_RUNTIME_DIR", "WATCHDOGD_SOCKET"):
        os.environ.pop(name, None)


class _Lines(logging.Handler):
    def __init__(self, out: Any) -> None:
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.write(json.dumps({"logged": record.getMessage()}) + "\n")


def worker_of_other(body: Callable[[], None]) -> dict[str, Any]:
    """Run ``body`` in a fork of this process, as a worker of uid 4321 found its
    socket by itself (`become_worker_of_other`). How it ended: ``status`` (its exit
    status, or -N when signal N killed it), ``seconds`` from its start, what it
    ``raised`` (an `UntrustedSocket`'s message, its ``owner``), what the client
    ``logged`` at warning level and above."""
    read_end, write_end = os.pipe()
    started = time.monotonic()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        code = 0
        report = os.fdopen(write_end, "w", buffering=1)
        try:
            os.close(read_end)
            become_worker_of_other()
            logging.getLogger("watchdogd_client").addHandler(_Lines(report))
            body()
        except BaseException as exc:
            untrusted = _untrusted(exc)
            if untrusted is None:
                report.write(json.dumps({"raised": traceback.format_exc()}) + "\n")
                code = 2
            else:
                line = {"raised": str(untrusted), "owner": untrusted.owner}
                report.write(json.dumps(line) + "\n")
                code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(child, 0)
    seconds = time.monotonic() - started
    with os.fdopen(read_end) as pipe:
        lines = [json.loads(line) for line in pipe.read().splitlines()]
    outcome: dict[str, Any] = {
        "status": os.waitstatus_to_exitcode(status),
        "seconds": seconds,
        "raised": None,
        "owner": None,
        "logged": [line["logged"] for line in lines if "logged" in line],
    }
    for line in lines:
        if "raised" in line:
            outcome.update(line)
    return outcome


def _untrusted(exc: BaseException) -> UntrustedSocket | None:
    """The `UntrustedSocket` that ``exc`` is, or holds alone (a trio nursery's
    group)."""
    if isinstance(exc, UntrustedSocket):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _untrusted(exc.exceptions[0])
    return None


@contextlib.contextmanager
def daemon_of_other() -> Iterator[None]:
    """The real ``watchdogd`` run by uid 4321 without XDG_RUNTIME_DIR: it makes
    /tmp/watchdogd-4321 itself and listens at `PER_USER`. Its log is in
    /tmp/daemon-4321.log. A fork of this process, which imported the daemon (uid
    4321 may not read the interpreter's library from where it lives)."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the daemon
        code = 1
        try:
            log = os.open("/tmp/daemon-4321.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            become_worker_of_other()
            os.dup2(log, 1)
            os.dup2(log, 2)
            watchdogd_main.main(args=[], prog_name="watchdogd")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        finally:
            os._exit(code)
    try:
        wait_until(_answers, what=f"the daemon of uid {OTHER} at {PER_USER}")
        yield
    finally:
        os.kill(child, signal.SIGTERM)
        os.waitpid(child, 0)


def _answers() -> bool:
    try:
        with Client(PER_USER, timeout=1.0) as client:
            client.ping()
    except DaemonUnavailable:
        return False
    return True
