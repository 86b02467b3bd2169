"""Whom a client talks to: the socket of every connection is judged before a byte
is sent on it, by where its path came from (`watchdogd_client.paths.Place`).

- **A per-user path the client found** (``$XDG_RUNTIME_DIR/watchdogd.sock``,
  ``/tmp/watchdogd-UID/watchdogd.sock``): its directory belongs to the user (the
  process's effective uid, the one the kernel and the daemon know it by) and no one
  else may write to it; the process listening runs as that user or as root.
- **The host's path** (`SYSTEM_SOCKET`): no one but its directory's owner may write
  to the directory, and that owner is root, or a user root gave the directory to:
  one whose directory sits in a directory only root may write, as systemd makes
  ``RuntimeDirectory=`` for a ``DynamicUser=`` service (``/run/watchdogd``, or
  ``/run/private/watchdogd`` behind a symbolic link once the directory is kept
  across restarts). The listener runs as root or as that owner. A socket made by
  systemd (``watchdogd.socket``) has root for its listener: the kernel reports the
  credentials of whoever called listen(2), never those of the daemon it passes the
  socket to.
- **A path named by the caller** (an argument, ``--socket``, ``$WATCHDOGD_SOCKET``):
  trusted as named, unless others than its owner may write to its directory and the
  directory lacks the sticky bit (as ssh's StrictModes judges): then anyone could
  have replaced the socket. Any listener will do.

A responder (``evidence``: it sends the process's stacks) asks more of a named path:
a listener that runs as root, as the process's own user, or, on the host's path, as
the user root gave its directory to.

Invariants:

- The directory judged is the one the connection goes through: it is opened
  (``O_PATH``), judged by that descriptor, and the connect goes through
  ``/proc/self/fd/N/``, so that no one can swap another directory in between. It
  holds the socket itself: a symbolic link in place of the socket is resolved
  first, and the links on the way to the directory are the kernel's to follow.
- The listener's uid is the kernel's (``SO_PEERCRED``), read after connect(2) and
  before anything is sent.
- Nothing is remembered from one connection to the next; a refusal is an
  `UntrustedSocket`, whose message names the socket, its owner and the reason.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from collections.abc import Callable
from functools import cache
from types import TracebackType
from typing import Final, Protocol

from .errors import DaemonUnavailable, UntrustedSocket
from .paths import SYSTEM_SOCKET, Place

__all__ = ["Vetted", "vet"]

#: struct ucred: pid, uid, gid.
_UCRED: Final = struct.Struct("3i")
#: sun_path holds 108 bytes with the terminating NUL.
_MAX_ADDRESS: Final = 107
#: Group and other write bits.
_OTHERS_WRITE: Final = stat.S_IWGRP | stat.S_IWOTH


class _Socket(Protocol):
    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


class Vetted:
    """A socket whose directory was judged fit for its place: connect to
    ``address``, then `admit` the listener before sending anything. A context
    manager; it holds the directory open until it ends."""

    __slots__ = ("_directory", "_fd", "_listeners", "_name", "address", "place")

    def __init__(
        self, place: Place, directory: str, fd: int, name: str, listeners: frozenset[int] | None
    ) -> None:
        self.place = place
        self._directory = directory
        self._fd = fd
        self._name = name
        #: The uids a listener may run as; None: any.
        self._listeners = listeners
        through = f"/proc/self/fd/{fd}/{name}"
        if _proc_fds() and len(os.fsencode(through)) <= _MAX_ADDRESS:
            self.address = through
        else:
            # Without /proc (a bare chroot), the judged path itself: the check and
            # the connect are then two lookups of it, as for any other client.
            self.address = os.path.join(directory, name)

    def __enter__(self) -> Vetted:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def admit(self, sock: _Socket) -> None:
        """Check the listener of ``sock``, connected to `address`; raises
        `UntrustedSocket`."""
        listeners = self._listeners
        if listeners is None:
            return
        _, uid, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid not in listeners:
            wanted = " nor ".join(self._describe(listener) for listener in sorted(listeners))
            reason = f"the process listening on it runs as {_who(uid)}, " + (
                f"neither {wanted}" if len(listeners) > 1 else f"not {wanted}"
            )
            raise _refusal(self.place, self._fd, self._name, reason)

    def _describe(self, uid: int) -> str:
        if uid == 0:
            return "root"
        if uid == os.geteuid():
            return f"you ({_who(uid)})"
        return f"{_who(uid)}, who owns {_where(self._fd, self._directory)}"


def vet(place: Place, *, evidence: bool = False) -> Vetted:
    """Judge the directory of ``place``'s socket (see the module docstring);
    ``evidence``: for a responder. Raises `UntrustedSocket`, or `DaemonUnavailable`
    when the directory cannot be opened."""
    fd, directory, name = _open_directory(place.path, place)
    try:
        if _is_link(fd, name):
            # A link in place of the socket: the directory judged is where it leads.
            os.close(fd)
            fd = -1
            fd, directory, name = _open_directory(os.path.realpath(place.path), place)
        listeners = _judge(place, directory, fd, name, evidence)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return Vetted(place, directory, fd, name, listeners)


def _open_directory(path: str, place: Place) -> tuple[int, str, str]:
    """The directory of ``path``, open (``O_PATH``: the kernel resolves the links on
    the way in one call), its name, and the socket's name in it."""
    directory, name = os.path.split(path)
    directory = directory or "."
    try:
        return os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), directory, name
    except FileNotFoundError:
        raise DaemonUnavailable.at(place.path, "no socket there") from None
    except OSError as exc:
        reason = f"its directory {directory}: {exc.strerror or exc}"
        raise DaemonUnavailable.at(place.path, reason) from None


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False  # nothing there: the connect says so


def _judge(
    place: Place, directory: str, fd: int, name: str, evidence: bool
) -> frozenset[int] | None:
    """The uids a listener may run as (None: any); raises `UntrustedSocket` for a
    directory unfit for ``place``."""
    info = os.fstat(fd)
    owner, me = info.st_uid, os.geteuid()
    fault = _fault(place, info, me, fd, lambda: _where(fd, directory))
    if fault is not None:
        raise _refusal(place, fd, name, fault)
    if place.origin == "user":
        return frozenset({0, me})
    if place.origin == "host":
        return frozenset({0, owner})
    if not evidence:
        return None
    # The host's path named: its service's user is trusted as the host rule trusts it.
    given = owner != 0 and not info.st_mode & _OTHERS_WRITE and _given_by_root(fd)
    if place.path == SYSTEM_SOCKET and given:
        return frozenset({0, me, owner})
    return frozenset({0, me})


def _fault(
    place: Place, info: os.stat_result, me: int, fd: int, here: Callable[[], str]
) -> str | None:
    """What makes the directory (``info``, open as ``fd``) unfit for ``place`` and
    the user ``me``, if anything; ``here`` says where it is, for the message."""
    owner = info.st_uid
    written = info.st_mode & _OTHERS_WRITE
    if place.origin == "user":
        if owner != me:
            return f"its directory {here()} belongs to {_who(owner)}, not to you ({_who(me)})"
        return _writable(info, here()) if written else None
    if place.origin == "host":
        if written:
            return _writable(info, here())
        if owner != 0 and not _given_by_root(fd):
            where = here()
            return (
                f"its directory {where} belongs to {_who(owner)}, and others than root may "
                f"write to {os.path.dirname(where)}, so root did not give it to them"
            )
        return None
    if written and not info.st_mode & stat.S_ISVTX:
        return f"{_writable(info, here())} and it has no sticky bit: anyone could replace it"
    return None


def _given_by_root(fd: int) -> bool:
    """Whether the directory open as ``fd`` sits in one that only root may write to:
    its owner is then whom root made it for."""
    parent = os.stat("..", dir_fd=fd)
    return parent.st_uid == 0 and not parent.st_mode & _OTHERS_WRITE


def _writable(info: os.stat_result, directory: str) -> str:
    mode = stat.S_IMODE(info.st_mode)
    return f"others than its owner may write to its directory {directory} (mode {mode:04o})"


def _where(fd: int, directory: str) -> str:
    """Where the directory open as ``fd`` really is (a link on the way resolved),
    for a refusal's message."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return directory


def _refusal(place: Place, fd: int, name: str, reason: str) -> UntrustedSocket:
    try:
        owner: int | None = os.stat(name, dir_fd=fd, follow_symlinks=False).st_uid
    except OSError:
        owner = None
    owned = "" if owner is None else f", owned by {_who(owner)},"
    return UntrustedSocket(
        f"watchdogd's socket {place.path}{owned} is not trusted: {reason}. Nothing was "
        "sent to it. Remove it if no daemon of yours made it, or name the socket of a "
        "daemon you trust with WATCHDOGD_SOCKET (or --socket).",
        place.path,
        owner,
    )


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


@cache
def _proc_fds() -> bool:
    return os.path.isdir("/proc/self/fd")
