"""What every client offers, and the clients that do nothing: `BaseClient`, the
`Timer` handle of an ``expires()`` block, `NullClient` and `NoOpTimer`.

The blocking `watchdogd_client.client.Client` and the trio client build on these; a
block's handle arms and releases through its client's `BaseClient._arm_block` and
`BaseClient._release_block`, which a client that can release without waiting
(`Client`) overrides.
"""

from __future__ import annotations

import abc
import logging
import math
from types import TracebackType
from typing import Any, Final, Unpack

import msgspec

from watchdogd_protocol import DaemonInfo, TimerInfo

from . import blocks
from .arming import (
    Acquiring,
    After,
    Arming,
    Handle,
    arming_timeout,
    check_acquiring,
    check_names,
    check_scope,
)
from .errors import WatchdogdError
from .fastpath import FastPath
from .scope import caller_scope

__all__ = ["BaseClient", "DaemonStatus", "NoOpTimer", "NullClient", "Timer"]

_INF: Final = math.inf

log = logging.getLogger("watchdogd_client")


class DaemonStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What `BaseClient.status` returns: the daemon's summary and every timer the
    caller may see, soonest deadline first."""

    daemon: DaemonInfo
    timers: list[TimerInfo]


class BaseClient(abc.ABC):
    """What every client offers: arm, release, inspect, and the `expires` block."""

    @abc.abstractmethod
    def acquire(self, scope: str, timeout: After, **acquiring: Unpack[Acquiring]) -> float:
        """Arm (or re-arm) the timer ``(pid, scope)``: if it is still armed in
        ``timeout`` seconds, the daemon carries out the ``policy`` on the process.

        ``pid`` defaults to the calling process. Returns the seconds left on the timer.

        ``progress`` is a counter that the protected work itself advances (steps
        done, bytes written): under a policy with a ``stall`` time, re-arming keeps
        the timer alive only while it grows, so a thread that re-arms in a loop
        cannot keep a stuck one alive. A ``timeout`` of ``"auto"`` arms the timeout
        the daemon learned from earlier releases of the scope. With
        ``exit_releases``, the process's exit releases the timer quietly (no
        ``exited`` event): for a command expected to end, as `watchdogctl run`
        arms. ``**acquiring``: those, the policy, the bounds of ``"auto"`` and the
        job, as `Acquiring` describes them.
        """

    @abc.abstractmethod
    def release(self, scope: str, *, pid: int | None = None) -> bool:
        """Disarm the timer ``(pid, scope)``. Returns whether one was armed."""

    @abc.abstractmethod
    def status(self) -> DaemonStatus:
        """The daemon's summary and the timers this caller may see."""

    @abc.abstractmethod
    def ping(self) -> float:
        """Check the daemon answers; returns the round trip in seconds."""

    def expires(self, after: After, scope: str | None = None, **arming: Unpack[Arming]) -> Timer:
        """A context manager that arms a timer of ``after`` seconds on entry and
        releases it on exit, also when an exception leaves the block.

        ``scope`` defaults to the caller's ``file:line`` (with ``@thread-name`` outside
        the main thread). The block gets a `Timer` to release early or renew.
        ``**arming``: the policy, ``floor`` and ``ceiling`` for ``after="auto"``, the
        job (see `Arming`). Every argument is checked here, before anything is
        sent (TypeError, ValueError).
        """
        if scope is None:
            scope = caller_scope()
        else:
            check_scope(scope)
        return self._block(after, scope, arming)

    def _block(self, after: After, scope: str, arming: Arming) -> Timer:
        """The handle of a block of ``scope``, once ``after`` and ``arming`` are
        checked (the common case, a number of seconds and nothing else, checked
        inline: this runs at every block). A timeout over the daemon's maximum is
        refused by the daemon, or by the fast path, which knows it."""
        if (
            arming
            or (type(after) is not float and type(after) is not int)
            or not 0 < after < self._limit
        ):
            arming_timeout(after, arming, name="after", maximum=self._maximum())
        return Timer(self, after, scope, arming)

    #: The longest timeout the daemon arms, once this client knows it (infinity
    #: until then): a longer one is refused before it is sent.
    _limit: float = _INF

    def _maximum(self) -> float:
        """`_limit`, 0 while it is not known."""
        return 0.0 if self._limit == _INF else self._limit

    #: The fast path of this client's process (`watchdogd_client.fastpath`): a
    #: block's handle arms and releases by stores through it where it can, and
    #: through `_arm_block` and `_release_block` otherwise.
    _fast: FastPath | None = None

    def _arm_scope(self, scope: str, after: After, arming: Arming) -> int:
        """Arm a block of ``scope``: by a store where its slot takes it, else over
        the socket; the number of the arming (0 for a store, or where the daemon
        keeps none), for `_release_scope` to name. Every block of every client
        arms here: a handle's, the torch adapter's."""
        fast = self._fast
        if fast is not None and fast.arm(scope, after, arming):
            return 0
        return self._arm_block(scope, after, None, arming)

    def _release_scope(self, scope: str, arm: int) -> None:
        """Release a block of ``scope`` armed as ``arm``: by a store where its slot
        takes it, else over the socket (as a stored block's, when its slot closed
        meanwhile)."""
        fast = self._fast
        stored = None if fast is None else fast.release(scope)
        if stored is None or stored == "closed":
            self._release_block(scope, arm, stored=stored == "closed")

    def _arm_block(self, scope: str, after: After, progress: int | None, arming: Arming) -> int:
        """Arm the timer of an ``expires()`` block over the socket; the number of
        the arming, when the daemon keeps one (0 otherwise), for `_release_block`
        to name."""
        self.acquire(scope, after, progress=progress, **arming)
        return 0

    def _release_block(self, scope: str, arm: int, *, stored: bool = False) -> None:
        """Release the timer of an ``expires()`` block, armed as ``arm``, over the
        socket; ``stored``: it was armed by a store into a slot that closed since
        (`Release.stored`)."""
        self.release(scope)


class Timer(Handle["BaseClient"]):
    """The handle of an ``expires()`` block.

    `release` disarms early (the rest of the block runs unprotected; calling it again
    does nothing). `renew` re-arms with the same or a new timeout, also after
    `release`, and the block's exit then releases again; it may carry the work's
    progress counter (see `BaseClient.acquire`). While the block is open, it is
    what `watchdogd_client.release` releases in its thread, unless a block entered
    inside it is open.
    """

    __slots__ = ()

    def release(self) -> None:
        """Disarm now; idempotent. The worker goes on at once: a registered scope's
        release is a store, another's is sent without waiting when the process's
        responder can carry it (see `Client`)."""
        if self._armed:
            self._armed = False
            self.client._release_scope(self.scope, self._arm)

    def renew(self, after: After | None = None, *, progress: int | None = None) -> None:
        """Re-arm: the timer now expires ``after`` (default: the last timeout) from
        now; ``progress``, the work's counter, must have grown for a policy with a
        ``stall`` time to count it as alive."""
        if after is not None:
            arming_timeout(after, self.arming, name="after", maximum=self.client._maximum())
            self.after = after
        if progress is None:
            self._arm = self.client._arm_scope(self.scope, self.after, self.arming)
        else:
            self._arm = self.client._arm_block(self.scope, self.after, progress, self.arming)
        self._armed = True

    def __enter__(self) -> Timer:
        self._arm = self.client._arm_scope(self.scope, self.after, self.arming)
        self._armed = True
        blocks.entered(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        blocks.left(self)
        if not self._armed:
            return
        if exc_type is None:
            self.release()
            return
        # The block's own exception is what the caller needs to see; a failed
        # release must not replace it.
        try:
            self.release()
        except WatchdogdError as release_error:
            log.warning("could not release timer %r: %s", self.scope, release_error)


class NullClient(BaseClient):
    """A client that accepts everything and does nothing (tests, ``WATCHDOGD_DISABLE=1``)."""

    def acquire(self, scope: str, timeout: After, **acquiring: Unpack[Acquiring]) -> float:
        return check_acquiring(scope, timeout, acquiring)[0]

    def release(self, scope: str, *, pid: int | None = None) -> bool:
        return False

    def status(self) -> DaemonStatus:
        info = DaemonInfo(
            version="disabled",
            pid=0,
            uptime=0.0,
            timers=0,
            processes=0,
            connections=0,
            requests=0,
            expired=0,
            exited=0,
        )
        return DaemonStatus(daemon=info, timers=[])

    def ping(self) -> float:
        return 0.0


class NoOpTimer(NullClient):
    """A timer that does nothing, wherever a timer block or a client is expected.

    ``with NoOpTimer():`` is a block that arms nothing and yields a `Timer` whose
    `Timer.release` and `Timer.renew` do nothing (it is never `Timer.armed`); so
    does ``with NoOpTimer().expires(after=...):``. `acquire` and `release` take a
    scope and a timeout as a ``TimerClient``'s do, and do nothing;
    ``configure(NoOpTimer())`` makes the module-level `watchdogd_client.expires` arm
    nothing. It is a `NullClient`: it never connects to the daemon. Its blocks are
    blocks of their thread all the same, so `watchdogd_client.release` inside one
    finds that one (and releases nothing, returning False), never a block open
    around it.
    """

    def expires(self, after: After, scope: str | None = None, **arming: Unpack[Arming]) -> Timer:
        """A block that arms nothing: no value is checked, only the names of the
        keywords, as Python checks them."""
        return self._block(after, caller_scope() if scope is None else scope, arming)

    def _block(self, after: After, scope: str, arming: Arming) -> Timer:
        check_names(arming)
        return _NoOpBlock(self, after, scope, arming)

    def acquire(self, scope: str, timeout: After, **acquiring: Unpack[Acquiring]) -> float:
        """Nothing, whatever it is given: the timeout back when it is a number."""
        return timeout if isinstance(timeout, int | float) else 0.0

    def __enter__(self) -> Timer:
        return self.expires(math.inf, caller_scope()).__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        block = blocks.innermost(self)
        if block is not None:
            block.__exit__(*exc_info)


class _NoOpBlock(Timer):
    """The handle of a `NoOpTimer` block: never armed, whatever is asked of it."""

    __slots__ = ()

    def release(self) -> None:
        pass

    def renew(self, after: After | None = None, *, progress: int | None = None) -> None:
        pass

    def __enter__(self) -> Timer:
        blocks.entered(self)
        return self
