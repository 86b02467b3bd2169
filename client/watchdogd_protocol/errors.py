"""The exceptions of the watchdogd-client distribution: `WatchdogdError`, the base of
every one it raises, and those the protocol itself raises on bytes that do not follow
it. The client (`watchdogd_client.errors`) re-exports them beside its own, so that
``watchdogd_client.ProtocolError`` is this very class and code that catches either
name catches what the framing raises."""

from __future__ import annotations

__all__ = ["FrameTooLarge", "ProtocolError", "WatchdogdError"]


class WatchdogdError(Exception):
    """Base class of every exception raised by `watchdogd_client` and
    `watchdogd_protocol`."""


class ProtocolError(WatchdogdError):
    """Raised when bytes on the wire do not follow the watchdogd protocol.

    The daemon turns it into an error reply carrying `code`; the client raises it when
    the daemon's reply cannot be understood. `request_id` is the id of the offending
    request when it could still be read.
    """

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


class FrameTooLarge(ProtocolError):
    """Raised by `FrameReader` when a frame declares a length over the reader's bound."""
