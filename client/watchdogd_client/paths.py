"""Where the daemon's socket is.

The daemon listens on, in order: its ``--socket`` option, ``$WATCHDOGD_SOCKET``, the
``socket`` key of its config file, else the default for its uid: `SYSTEM_SOCKET` for
root, ``$XDG_RUNTIME_DIR/watchdogd.sock`` for another user, or, without
XDG_RUNTIME_DIR, ``/tmp/watchdogd-<uid>/watchdogd.sock`` (a directory only that user
may enter).

A client uses its explicit path, else ``$WATCHDOGD_SOCKET``, else the per-user default
when a socket exists there (a user running a daemon of their own), else `SYSTEM_SOCKET`:
a worker running as an unprivileged user finds the host's daemon without configuration.
Where its path came from (`Place.origin`) decides what the client asks of the socket
before it sends anything (`watchdogd_client.trust`).
"""

from __future__ import annotations

import os
import stat
from typing import Final, Literal, NamedTuple

ENV_SOCKET: Final = "WATCHDOGD_SOCKET"
SYSTEM_SOCKET: Final = "/run/watchdogd/watchdogd.sock"
SOCKET_NAME: Final = "watchdogd.sock"

#: Where a client's socket path came from: ``"named"``, by the caller (``--socket``,
#: an argument, ``$WATCHDOGD_SOCKET``); ``"user"``, the user's own default, found by
#: the client; ``"host"``, `SYSTEM_SOCKET`, found by the client.
Origin = Literal["named", "user", "host"]


class Place(NamedTuple):
    """A socket ``path`` and where it came from (its ``origin``)."""

    path: str
    origin: Origin


def user_socket_path(uid: int | None = None) -> str:
    """The default socket of a daemon run by ``uid`` (the current user by default)."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return SYSTEM_SOCKET
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, SOCKET_NAME)
    return os.path.join(f"/tmp/watchdogd-{uid}", SOCKET_NAME)


def find_socket(explicit: str | os.PathLike[str] | Place | None = None) -> Place:
    """The socket a client connects to, and where its path came from (see the module
    docstring for the order). A `Place` found earlier is kept as it is."""
    if isinstance(explicit, Place):
        return explicit
    if explicit is not None:
        return Place(os.fspath(explicit), "named")
    from_env = os.environ.get(ENV_SOCKET)
    if from_env:
        return Place(from_env, "named")
    own = user_socket_path()
    if own != SYSTEM_SOCKET and _is_socket(own):
        return Place(own, "user")
    return Place(SYSTEM_SOCKET, "host")


def client_socket_path(explicit: str | os.PathLike[str] | None = None) -> str:
    """The socket a client connects to (`find_socket`'s path)."""
    return find_socket(explicit).path


#: What a path may be besides a socket, in words.
_KINDS: Final = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def what_is_there(path: str) -> str:
    """What ``path`` is when it is there and no socket ("a directory"), else ""."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    return next((kind for test, kind in _KINDS if test(mode)), "")


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
