"""Exceptions raised by the watchdogd client; all derive from `WatchdogdError`.

`WatchdogdError`, `ProtocolError` and `FrameTooLarge` are the protocol's own
(`watchdogd_protocol.errors`), re-exported here: one class under either name.
"""

from __future__ import annotations

from watchdogd_protocol.errors import FrameTooLarge, ProtocolError, WatchdogdError

__all__ = [
    "DaemonUnavailable",
    "FrameTooLarge",
    "ProtocolError",
    "RequestRefused",
    "UntrustedSocket",
    "WatchdogdError",
]


class DaemonUnavailable(WatchdogdError, ConnectionError):
    """Raised when the daemon cannot be reached or stops answering.

    The message names the socket that was tried and says how to start the daemon. It
    means only that no daemon answered (a refusal is `RequestRefused`), and it is a
    `ConnectionError`, so code that handles ``OSError`` for its other connections
    handles this one too. ``errno`` is None: the reason is in the message.
    """

    def __init__(self, message: str, socket_path: str) -> None:
        super().__init__(message)
        self.socket_path = socket_path

    @classmethod
    def at(cls, socket_path: str, reason: str) -> DaemonUnavailable:
        """The error for ``socket_path``, saying why and how to start the daemon."""
        return cls(
            f"watchdogd is not reachable at {socket_path}: {reason}. "
            "Start it with `watchdogd` (or `systemctl start watchdogd.socket`), "
            "or point WATCHDOGD_SOCKET at the socket it listens on.",
            socket_path,
        )


class UntrustedSocket(DaemonUnavailable):
    """Raised, before anything is sent, when the client has no reason to trust what
    listens at its socket (`watchdogd_client.trust` says what it asks of each path).

    The message names the socket, its owner and why it is not trusted. It is a
    `DaemonUnavailable`: no daemon the client may talk to answered, so a client made
    with ``on_unavailable="warn"`` carries on unprotected with a warning. It is not
    waited out as a restarting daemon is: who owns a directory does not change by
    itself. ``owner`` is the uid that owns the socket file, None when there is none.
    """

    def __init__(self, message: str, socket_path: str, owner: int | None) -> None:
        super().__init__(message, socket_path)
        self.owner = owner


class RequestRefused(WatchdogdError):
    """Raised when the daemon answers a request with an error reply.

    `code` is machine-readable (one of `watchdogd_protocol.ErrorCode`, or a code added by a newer
    daemon); the message is the daemon's own explanation.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message
