"""Acting as other users from a root test: uid 65534 (nobody), and uid 4321, an
ordinary user with no entry in /etc/passwd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from watchdogd.cli.watchdogctl import main as ctl_main
from watchdogd_client import Client, RequestRefused

from helpers.processes import forked

#: The uid and gid of nobody, a user with no rights over root's processes.
NOBODY = 65534
#: The uid and gid of a second ordinary user, neither root nor nobody.
OTHER = 4321


def become(uid: int) -> None:
    """Make this process (forked from a root test) run as ``uid`` and the group of
    that number, with no other groups."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def run_as(uid: int, action: Callable[[], Any]) -> Any:
    """What ``action`` returns (JSON) when run by ``uid`` in a fork of this process
    (see `helpers.processes.forked`)."""

    def as_user() -> Any:
        become(uid)
        return action()

    return forked(as_user)


def ctl_as(uid: int, socket: Path, *args: str) -> tuple[int, str, str]:
    """``watchdogctl --socket SOCKET ARGS`` run by ``uid`` in a fork of this process
    (which has the interpreter loaded, that ``uid`` may not read from where it
    lives): its exit status, stdout and stderr."""

    def run() -> list[Any]:
        result = CliRunner().invoke(ctl_main, ["--socket", str(socket), *args])
        return [result.exit_code, result.stdout, result.stderr]

    status, out, err = run_as(uid, run)
    return int(status), str(out), str(err)


def as_nobody(action: Callable[[Client], Any], socket: Path) -> dict[str, Any]:
    """Run ``action`` with a client in a child running as uid/gid 65534; returns
    ``{"ok": result}``, ``{"refused": code}`` or ``{"error": text}``."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        try:
            os.close(read_end)
            become(NOBODY)
            with Client(socket) as client:
                outcome: dict[str, Any] = {"ok": action(client)}
        except RequestRefused as exc:
            outcome = {"refused": exc.code, "message": exc.message}
        except BaseException as exc:
            outcome = {"error": repr(exc)}
        os.write(write_end, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        outcome = json.loads(pipe.read())
    os.waitpid(child, 0)
    return outcome


def nobody_sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], user=NOBODY, group=NOBODY, extra_groups=[])


# A parent that drops to uid 65534 after forking a child that stays root, both in a
# session of their own: the tree and the group of a process of uid 65534 that
# contain a root process (as a setuid program would). It prints the child's pid.
_MIXED_FAMILY = textwrap.dedent(
    """
    import os, sys, time
    kid = os.fork()
    if kid == 0:
        time.sleep(300)
        os._exit(0)
    os.setgid(65534)
    os.setuid(65534)
    print(kid, flush=True)
    time.sleep(300)
    """
)


def mixed_family() -> tuple[subprocess.Popen[str], int]:
    """A process of uid 65534 whose group and tree hold a root process, and that
    root process's pid (started as root, it dropped to 65534 after forking)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _MIXED_FAMILY],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())
