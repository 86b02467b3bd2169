"""Who is calling: the credentials the kernel reported for a connection."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel reported it when
    it connected (SO_PEERCRED). ``pidfd`` is None on kernels without SO_PEERPIDFD."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None = None
