"""The releases of this process's ``expires()`` blocks that went out without waiting
for their answer, until an answer is read: what a `watchdogd_client.Client` and the
process's responder share, so that none is lost when a connection breaks.

A block's release is sent on its client's own connection, behind the acquire before
it, so the daemon takes the two in order; the client reads its answer with the
answer to its next request. Each release here is known by a token: the client
that sent it, and the responder, send it again on a new connection (each with an
id of its own) while its answer has not been read, and the first answer read
settles it. It names the arming it releases (`Release.arm`), so sending it twice,
or late, never disarms a newer arming of its scope.

Invariants:

- A release is settled once: acknowledged (whether a timer was still armed or not)
  or refused. A refusal is logged when it is read and handed to the client that
  sent it, which raises it at its next request.
- A child made by ``fork()`` starts with none: the parent's releases are about the
  parent's timers.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import NamedTuple

from watchdogd_protocol import Release, Released

from .engine import Answer, Connection, Engine
from .errors import DaemonUnavailable, WatchdogdError

__all__ = ["InFlight", "Releasing", "add", "get", "pending", "settle", "waiting"]

log = logging.getLogger("watchdogd_client")


class InFlight(NamedTuple):
    """A release on its way: the ``scope`` and ``arm`` it releases, and the list
    its refusal goes to (its client's)."""

    scope: str
    arm: int
    refused: list[WatchdogdError]


class _Releases:
    # Every access is one dict operation, or a copy made in C, atomic under the
    # GIL: the worker's threads and the responder's share it without a lock.
    tokens = itertools.count(1)
    in_flight: dict[int, InFlight] = {}  # noqa: RUF012 (one per process, never replaced but at fork)


def add(scope: str, arm: int, refused: list[WatchdogdError]) -> int:
    """Keep the release of arming ``arm`` of ``scope`` until it is settled; its
    token."""
    token = next(_Releases.tokens)
    _Releases.in_flight[token] = InFlight(scope, arm, refused)
    return token


def get(token: int) -> InFlight | None:
    """The release of ``token``, if it is not settled yet."""
    return _Releases.in_flight.get(token)


def pending() -> list[tuple[int, InFlight]]:
    """Every release not settled yet, oldest first."""
    return list(_Releases.in_flight.items())


def waiting() -> bool:
    """Whether any release is not settled yet."""
    return bool(_Releases.in_flight)


def settle(token: int, error: WatchdogdError | None) -> None:
    """An answer to the release of ``token`` was read: ``error`` if the daemon
    refused it. The first answer settles it; later ones do nothing."""
    released = _Releases.in_flight.pop(token, None)
    if released is None or error is None:
        return
    log.error(
        "the daemon refused the release of %r, whose timer may still be armed: %s",
        released.scope,
        error,
    )
    released.refused.append(error)


class Releasing:
    """One client's releases sent without waiting: the tokens of those not settled
    yet, those of them sent on the current connection (by request id), and the
    refusals read, for its next request to raise."""

    __slots__ = ("_in_flight", "_mine", "_on", "refused")

    def __init__(self) -> None:
        #: Appended by whichever thread reads a refusal: this client's, or the
        #: responder's.
        self.refused: list[WatchdogdError] = []
        self._mine: set[int] = set()
        self._in_flight: dict[int, int] = {}
        #: The connection they were last sent on.
        self._on: Connection | None = None

    @property
    def in_flight(self) -> bool:
        """Whether the current connection carries some whose answer is unread."""
        return bool(self._in_flight)

    def sent(self, request: Release, connection: Connection) -> None:
        """``request`` went out on ``connection`` without waiting for its answer."""
        assert request.arm is not None
        token = add(request.scope, request.arm, self.refused)
        self._mine.add(token)
        self._in_flight[request.id] = token
        self._on = connection

    def again(self, connection: Connection, engine: Engine) -> bytes:
        """The frames that send again, first on a new ``connection``, the releases
        whose answers were not read (none on the connection they went on)."""
        if not self._mine or connection is self._on:
            return b""
        self._on = connection
        frames = bytearray()
        for token in list(self._mine):
            released = get(token)
            if released is None:  # the responder read an answer meanwhile
                self._mine.discard(token)
                continue
            request = Release(id=engine.next_id(), scope=released.scope, arm=released.arm)
            frames += connection.send(request, Released, resent=True)
            self._in_flight[request.id] = token
        return bytes(frames)

    def settle(self, answer: Answer) -> None:
        """Settle the release ``answer`` answers, if it answers one; one whose
        connection ended first goes again on the next."""
        token = self._in_flight.pop(answer.id, None)
        if token is None or isinstance(answer.error, DaemonUnavailable):
            return
        self._mine.discard(token)
        settle(token, answer.error)

    def disconnected(self) -> None:
        """The connection is gone: what it carried goes again on the next."""
        self._in_flight.clear()

    def forget(self) -> None:
        """After fork(), in the child: the releases are the parent's."""
        self._mine.clear()
        self._in_flight.clear()
        self.refused = []
        self._on = None

    def raise_refused(self) -> None:
        """Raise the oldest refusal read and not raised yet, if any."""
        if self.refused:
            raise self.refused.pop(0)


def _forget_in_child() -> None:
    _Releases.in_flight = {}


os.register_at_fork(after_in_child=_forget_in_child)
