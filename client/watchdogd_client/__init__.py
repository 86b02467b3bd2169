"""Thin client for watchdogd, the per-host watchdog daemon for hung worker processes.

A worker tells the daemon "if I am still inside this block in T seconds, I am hung"::

    from watchdogd_client import expires

    with expires(after=30):
        train_step()

If the block is still running 30 seconds later, the daemon carries out the timer's
policy on the process (SIGKILL by default). The daemon, not the worker, keeps the time,
so a worker stuck in C code or a deadlock is caught all the same.

This package depends on msgspec only; it never imports trio or click. The blocking
client (and with it the socket module) loads on first use of one of its names, so
that a program that imports this package for its exceptions or its arming
parameters loads no socket module. The wire protocol, which the daemon's sans-IO
core imports, is a package of its own beside this one (`watchdogd_protocol`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Unpack

from watchdogd_protocol import ErrorCode

from . import blocks
from ._version import __version__
from .arming import After, Arming
from .errors import (
    DaemonUnavailable,
    FrameTooLarge,
    ProtocolError,
    RequestRefused,
    UntrustedSocket,
    WatchdogdError,
)
from .scope import caller_scope
from .switches import DISABLE, env_switch

if TYPE_CHECKING:
    from .client import (
        BaseClient,
        Client,
        DaemonStatus,
        NoOpTimer,
        NullClient,
        OnUnavailable,
        Timer,
    )

#: Names of the blocking client, loaded with it on first use.
_FROM_CLIENT = frozenset(
    {"BaseClient", "Client", "DaemonStatus", "NoOpTimer", "NullClient", "OnUnavailable", "Timer"}
)


def __getattr__(name: str) -> Any:
    if name not in _FROM_CLIENT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import client

    value = getattr(client, name)
    globals()[name] = value
    return value


__all__ = [
    "After",
    "Arming",
    "BaseClient",
    "Client",
    "DaemonStatus",
    "DaemonUnavailable",
    "ErrorCode",
    "FrameTooLarge",
    "NoOpTimer",
    "NullClient",
    "OnUnavailable",
    "ProtocolError",
    "RequestRefused",
    "Timer",
    "UntrustedSocket",
    "WatchdogdError",
    "__version__",
    "configure",
    "default_client",
    "expires",
    "release",
]


class _Default:
    """The module-level client of `configure` and `expires`; ``made`` says whether
    `default_client` made it (and so may close it)."""

    client: BaseClient | None = None
    made = False
    lock = threading.Lock()


def configure(client: BaseClient | None) -> None:
    """Make ``client`` the one module-level `expires` uses (None: back to the default).
    A default client made earlier by `default_client` is closed."""
    from .client import Client

    with _Default.lock:
        if _Default.made and isinstance(_Default.client, Client):
            _Default.client.close()
        _Default.client = client
        _Default.made = False


def default_client() -> BaseClient:
    """The configured client, else one made on first use: a `NullClient` when the
    ``WATCHDOGD_DISABLE`` switch is on (see `watchdogd_client.switches`), otherwise a
    `Client` on the default socket (``$WATCHDOGD_SOCKET`` or the host's daemon)."""
    client = _Default.client
    if client is not None:
        return client
    from .client import Client, NullClient

    with _Default.lock:
        if _Default.client is None:
            _Default.client = NullClient() if env_switch(DISABLE) else Client()
            _Default.made = True
        return _Default.client


def expires(
    after: After,
    scope: str | None = None,
    *,
    client: BaseClient | None = None,
    **arming: Unpack[Arming],
) -> Timer:
    """Arm a timer of ``after`` seconds (or ``"auto"``) for the block, with the
    policy and the rest that ``**arming`` gives (see `Arming`); see
    `BaseClient.expires`.

    Uses ``client``, else the one given to `configure`, else `default_client()`.
    """
    chosen = client or _Default.client or default_client()
    if scope is None:
        # Straight to the block: its scope is this caller's, made here, not given.
        return chosen._block(after, caller_scope(), arming)
    return chosen.expires(after, scope, **arming)


def release() -> bool:
    """Release the innermost ``expires()`` block still open in the calling thread,
    as its handle's `Timer.release` does: its timer is disarmed now, the rest of
    the block runs unprotected, and the block's exit releases nothing more.

    Returns whether it disarmed one. The innermost block is the one entered last
    among those open in this thread: after an inner block ended, the block around
    it. A block released already (by its handle or by this) is still the innermost
    until it ends, so releasing again does nothing and returns False, as does a
    call where no block of this thread is open. Another thread's blocks are never
    touched, nor a timer armed with `BaseClient.acquire`.
    """
    block = blocks.innermost()
    if block is None or not block.armed:
        return False
    block.release()
    return True
