"""The daemon's configuration: a TOML file decoded with msgspec.

Unknown keys are errors, every number has a bound, and every error names the file,
the key and what was expected. Each setting has a default, so the daemon runs with no
file at all. Precedence for the socket: ``--socket``, then ``$WATCHDOGD_SOCKET``, then
the file's ``[daemon] socket``, then the default of `watchdogd_client.paths`.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta, Struct

from watchdogd_client.protocol import MAX_REQUEST_FRAME

from .errors import ConfigError

DAY: Final = 86_400.0

LogLevel = Literal["debug", "info", "warning", "error"]
Seconds = Annotated[float, Meta(gt=0, le=365 * DAY)]
Count = Annotated[int, Meta(ge=1, le=100_000_000)]


class DaemonConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[daemon]`` table."""

    #: Socket path; see the module docstring for precedence.
    socket: str | None = None
    #: Permission bits of the socket. Every request is authorized on its own, from
    #: the caller's kernel-reported credentials, so 0o666 is the default.
    socket_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o666
    log_level: LogLevel = "info"
    #: Largest request frame accepted; larger declared lengths close the connection.
    max_frame_bytes: Annotated[int, Meta(ge=1024, le=16 * 1024 * 1024)] = MAX_REQUEST_FRAME
    #: Longest scope, in UTF-8 bytes.
    max_scope_bytes: Annotated[int, Meta(ge=1, le=16 * 1024)] = 256
    #: Longest timeout a timer may be armed with.
    max_timeout: Seconds = 30 * DAY
    #: Timers armed by one non-root uid at once.
    max_timers_per_uid: Count = 10_000
    #: Timers armed at once in all (root included).
    max_timers: Count = 1_000_000
    #: Connections open from one non-root uid at once.
    max_connections_per_uid: Count = 256
    #: Connections open at once in all.
    max_connections: Count = 4096
    #: A client that leaves its replies unread this long is disconnected.
    send_timeout: Seconds = 10.0
    #: A frame still incomplete this long after its first byte closes its connection.
    partial_frame_timeout: Seconds = 10.0


class Config(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole config file."""

    daemon: DaemonConfig = DaemonConfig()


_AT_PATH: Final = re.compile(r" - at `\$\.?([^`]*)`$")


def parse_config(data: bytes | str, source: str) -> Config:
    """Decode a config document; ``source`` names it in error messages."""
    try:
        return msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None


def load_config(path: str) -> Config:
    """Read and decode the config file at ``path``."""
    try:
        with open(path, "rb") as config_file:
            data = config_file.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    return parse_config(data, path)


def _explain(message: str) -> str:
    # msgspec says "Expected `int` >= 1 - at `$.daemon.max_timers`"; name the key
    # the way the file spells it.
    match = _AT_PATH.search(message)
    if match is None:
        return message
    where = match.group(1) or "the top level"
    return f"{where}: {message[: match.start()]}"
