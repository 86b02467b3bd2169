"""A slot page's descriptor comes beside the daemon's reply to `MapPage`, on a
connection of its own: whatever the read that follows it comes to, the client keeps
no descriptor it was not handed as its page."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from watchdogd_client.fastpath import map_page
from watchdogd_client.paths import Place
from watchdogd_protocol import (
    MAX_REQUEST_FRAME,
    PROTOCOL_VERSION,
    FrameReader,
    Hello,
    MapPage,
    Welcome,
    decode_request,
    encode_frame,
)

#: The name of the descriptor the daemon played here hands over.
PROBE = "watchdogd-handover-probe"


def _probes() -> int:
    """How many descriptors of this process name the probe's memfd."""
    held = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{PROBE}")
        except OSError:
            continue
    return held


def _serve_a_descriptor_then_stall(listener: socket.socket, done: threading.Event) -> None:
    """Welcome the hello; answer the `MapPage` with a descriptor and half a frame,
    then nothing until the test is over."""
    conn, _ = listener.accept()
    with conn:
        reader = FrameReader(MAX_REQUEST_FRAME)
        while True:
            for frame in reader.feed(conn.recv(65536)):
                request = decode_request(frame)
                if isinstance(request, Hello):
                    welcome = Welcome(
                        id=request.id, version=PROTOCOL_VERSION, server="test", pid=os.getpid()
                    )
                    conn.sendall(encode_frame(welcome))
                elif isinstance(request, MapPage):
                    page = os.memfd_create(PROBE)
                    try:
                        conn.sendmsg(
                            [b"\0\0"],
                            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, page.to_bytes(4, "little"))],
                        )
                    finally:
                        os.close(page)
                    done.wait(30)
                    return


def test_a_descriptor_before_a_reply_that_never_comes_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "watchdogd.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    done = threading.Event()
    server = threading.Thread(
        target=_serve_a_descriptor_then_stall, args=(listener, done), daemon=True
    )
    server.start()
    try:
        with pytest.raises(TimeoutError):
            map_page(Place(str(path), "named"), 1, timeout=0.5)
        assert _probes() == 0
    finally:
        done.set()
        server.join(5)
        listener.close()
