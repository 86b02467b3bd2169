"""Exceptions of the daemon; all derive from `DaemonError`.

None of them ever escapes a request or an expiry: a refused request becomes an error
reply, a failed action becomes a recorded outcome. Only start-up errors stop the
daemon, with a message that says what to fix.
"""

from __future__ import annotations


class DaemonError(Exception):
    """Base class of every exception raised by the daemon package."""


class ConfigError(DaemonError):
    """Raised at start (or reload) when the config file cannot be read or is invalid;
    the message names the file, the key and what was expected."""


class ListenError(DaemonError):
    """Raised at start when the socket path cannot be used: another daemon answers
    on it, or something that is not a socket is in the way."""


class Refusal(DaemonError):
    """Raised inside request handling to refuse a request; becomes an error reply
    with ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
