"""Who is calling, and whom it may signal.

The credentials the kernel reported for a connection (`Peer`), the uid of root
(`ROOT`), and kill(2)'s rule for a sender (`may_signal`): the one rule by which a
request may name a target and by which a timer's owner is checked again before
its policy signals (`watchdogd.host.process.Process.signallable_by`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: The superuser's uid: kill(2) lets it signal any process, and every per-uid limit
#: and view of the daemon leaves it out.
ROOT: Final = 0


@dataclass(slots=True, frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel reported it when
    it connected (SO_PEERCRED). ``pidfd`` is None on kernels without SO_PEERPIDFD,
    and when the kernel has it but gave none (``gone``)."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None = None
    #: The kernel has SO_PEERPIDFD and gave no pidfd: the process that connected
    #: had exited and been reaped (kernels before 6.9 give none for such a one),
    #: so its pid may be another process's already, and is never opened.
    gone: bool = False


def may_signal(sender: int, real_uid: int, saved_uid: int) -> bool:
    """Whether uid ``sender`` may signal a process of ``real_uid`` and ``saved_uid``
    (as they are now), as kill(2) judges it: root always, anyone else while it is
    still the process's real or saved uid. The one rule every signal of the daemon
    follows; it judges ``sender``, not the daemon, so a timer armed by a user acts
    only where that user could, though the daemon itself may hold CAP_KILL."""
    return sender == ROOT or sender in (real_uid, saved_uid)
