"""systemd integration without libsystemd: notifications and socket activation.

- `Notifier` sends ``READY=1``, ``STATUS=...``, ``STOPPING=1`` and ``WATCHDOG=1`` as
  datagrams to ``$NOTIFY_SOCKET`` (a path, or an abstract name starting with ``@``).
  Without the variable every call does nothing. A failed send is ignored: systemd
  going away must not take the daemon with it.
- `watchdog_interval` turns ``$WATCHDOG_USEC`` into the ping interval (half of it),
  when ``$WATCHDOG_PID`` is unset or names this process.
- `inherited_listener` takes the listening socket systemd passed (``$LISTEN_FDS`` /
  ``$LISTEN_PID``, the first descriptor, 3), when it was passed to this process.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import Final

#: The first descriptor systemd passes (SD_LISTEN_FDS_START).
LISTEN_FDS_START: Final = 3


class Notifier:
    """Talks to the service manager, if there is one."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        environ = dict(os.environ) if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        if self._address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.setblocking(False)

    def send(self, *fields: str) -> bool:
        """Send ``KEY=value`` fields in one message; returns whether it was sent."""
        if self._socket is None:
            return False
        try:
            self._socket.sendto("\n".join(fields).encode(), self._address)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def watchdog_interval(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec=``), or None."""
    environ = dict(os.environ) if environ is None else environ
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None


def inherited_listener() -> socket.socket | None:
    """The listening socket systemd passed to this process, or None.

    The variables are removed so that programs the daemon starts (hooks) do not
    believe they were passed a socket too."""
    pid = os.environ.pop("LISTEN_PID", "")
    count = os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid != str(os.getpid()) or not count.isdigit() or int(count) < 1:
        return None
    if not stat.S_ISSOCK(os.fstat(LISTEN_FDS_START).st_mode):
        return None
    sock = socket.socket(fileno=LISTEN_FDS_START)
    os.set_inheritable(LISTEN_FDS_START, False)
    sock.setblocking(False)
    return sock
