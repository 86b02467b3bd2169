"""Where daemon and client look for the socket."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from watchdogd_client import Client, DaemonUnavailable
from watchdogd_client.paths import (
    SYSTEM_SOCKET,
    Place,
    client_socket_path,
    find_socket,
    user_socket_path,
    what_is_there,
)


def test_root_uses_the_system_socket() -> None:
    assert user_socket_path(0) == SYSTEM_SOCKET == "/run/watchdogd/watchdogd.sock"


def test_other_users_use_their_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert user_socket_path(1000) == "/run/user/1000/watchdogd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert user_socket_path(1000) == "/tmp/watchdogd-1000/watchdogd.sock"


def test_client_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WATCHDOGD_SOCKET", "/from/env.sock")
    assert client_socket_path("/explicit.sock") == "/explicit.sock"
    assert client_socket_path(tmp_path / "p.sock") == str(tmp_path / "p.sock")
    assert client_socket_path() == "/from/env.sock"
    monkeypatch.delenv("WATCHDOGD_SOCKET")
    monkeypatch.setattr("os.getuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    # No daemon of the user's own: the host's daemon.
    assert client_socket_path() == SYSTEM_SOCKET
    own = socket.socket(socket.AF_UNIX)
    own.bind(str(tmp_path / "watchdogd.sock"))
    try:
        assert client_socket_path() == str(tmp_path / "watchdogd.sock")
    finally:
        own.close()


def test_the_client_knows_where_its_path_came_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # What the client asks of the socket depends on it (watchdogd_client.trust).
    monkeypatch.setenv("WATCHDOGD_SOCKET", "/from/env.sock")
    assert find_socket("/explicit.sock") == Place("/explicit.sock", "named")
    assert find_socket() == Place("/from/env.sock", "named")
    monkeypatch.delenv("WATCHDOGD_SOCKET")
    monkeypatch.setattr("os.getuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert find_socket() == Place(SYSTEM_SOCKET, "host")
    own = socket.socket(socket.AF_UNIX)
    own.bind(str(tmp_path / "watchdogd.sock"))
    try:
        found = find_socket()
        assert found == Place(str(tmp_path / "watchdogd.sock"), "user")
        assert find_socket(found) is found  # kept as found, e.g. by a pickled client
    finally:
        own.close()


def test_what_is_at_a_socket_path_that_is_no_socket(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").touch()
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(tmp_path / "sock"))
    try:
        assert what_is_there(str(tmp_path)) == "a directory"
        assert what_is_there(str(tmp_path / "file")) == "a regular file"
        assert what_is_there(str(tmp_path / "fifo")) == "a FIFO"
        assert what_is_there("/dev/null") == "a character device"
        assert what_is_there(str(tmp_path / "sock")) == ""
        assert what_is_there(str(tmp_path / "absent")) == ""
    finally:
        listening.close()


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "not a socket but a directory"),
        ("file", "not a socket but a regular file"),
        ("sock", "nothing is listening on it"),
        ("absent", "no socket there"),
    ],
)
def test_a_client_says_what_is_at_its_path_when_no_daemon_is(
    tmp_path: Path, name: str, reason: str
) -> None:
    (tmp_path / "file").touch()
    with socket.socket(socket.AF_UNIX) as bound:  # its file stays; nobody listens
        bound.bind(str(tmp_path / "sock"))
    path = tmp_path / name if name else tmp_path
    with pytest.raises(DaemonUnavailable) as caught, Client(path, reconnect_timeout=0) as client:
        client.ping()
    assert f"watchdogd is not reachable at {path}: {reason}. " in str(caught.value)
