"""What each uid's connections hold in replies: built and not yet taken by the
kernel (`ReplyBudget`), so that many connections of one user asking for large pages
cannot drive the daemon's memory up (`watchdogd.runtime.server` checks it before
each request)."""

from __future__ import annotations

import trio

from ..core import ROOT


class ReplyBudget:
    """Bytes of replies that connections hold in the daemon, per uid: built and not
    yet taken by the kernel.

    A connection of a non-root uid over ``per_uid``, or while all non-root uids
    together are over ``total``, waits before it reads another request; the rest of
    the daemon goes on. Invariant: a connection checks before each request and a
    reply is at most `MAX_REPLY_BYTES`, and nothing awaits between the check and
    `hold`, so a uid never holds more than ``per_uid`` plus one reply (and all of
    them more than ``total`` plus one). What is held is released once sent, or
    once its connection gives up on an unread client (``send_timeout``), so the
    wait ends. Root is counted apart and never waits: its limits are the global
    caps.
    """

    __slots__ = ("_held", "_lot", "_others")

    def __init__(self) -> None:
        # A plain dict: a Counter's missing keys and deletions run in Python, and
        # each request holds and releases.
        self._held: dict[int, int] = {}
        self._others = 0
        self._lot = trio.lowlevel.ParkingLot()

    def held(self, uid: int) -> int:
        """Bytes held now for ``uid``'s connections."""
        return self._held.get(uid, 0)

    def over(self, uid: int, per_uid: int, total: int) -> bool:
        """Whether a connection of ``uid`` must wait before building more replies."""
        return uid != ROOT and (self._held.get(uid, 0) >= per_uid or self._others >= total)

    async def wait_for_room(self, uid: int, per_uid: int, total: int) -> None:
        """Return once ``uid`` is within its budget."""
        while self.over(uid, per_uid, total):
            await self._lot.park()

    def hold(self, uid: int, size: int) -> None:
        self._held[uid] = self._held.get(uid, 0) + size
        if uid != ROOT:
            self._others += size

    def release(self, uid: int, size: int) -> None:
        if not size:
            return
        if left := self._held[uid] - size:
            self._held[uid] = left
        else:
            del self._held[uid]
        if uid != ROOT:
            self._others -= size
        if self._lot:
            self._lot.unpark_all()
