"""Who is calling: the credentials the kernel reported for a connection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: The superuser's uid: kill(2) lets it signal any process, and every per-uid limit
#: and view of the daemon leaves it out.
ROOT: Final = 0


@dataclass(slots=True, frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel reported it when
    it connected (SO_PEERCRED). ``pidfd`` is None on kernels without SO_PEERPIDFD."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None = None
