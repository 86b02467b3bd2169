"""One user's evidence, as much as the protocol lets it give: real processes of
uid 65534, each a responder of the user's job on a raw connection that answers
every `EvidenceWanted` with as large an `Evidence` as a frame holds, and a timer
of the job that the user arms again and again, each expiry opening an incident
whose every rank gives that much.

The flood runs in a child of the test that becomes uid 65534 and forks the
responders (single-threaded after its fork: it only calls the kernel and
msgspec); the test waits for its rounds and reads what the daemon kept."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path

from watchdogd_protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    Evidence,
    EvidenceWanted,
    Frame,
    FrameReader,
    Hello,
    Respond,
    ThreadStack,
    decode_for_responder,
    decode_reply,
    encode_frame,
)

from helpers.users import NOBODY
from helpers.waiting import PATIENCE

#: The job the flood's timers and responders belong to (uid 65534's).
JOB = "evidence-flood"


def threads() -> list[ThreadStack]:
    """Threads whose stacks fill an `Evidence` to just under its bound."""
    frame = Frame(file="/flood/" + "f" * 480, line=1, function="g" * 480)
    frames = [frame] * 60  # 60 frames of about 0.95 KiB: 57 KiB
    return [ThreadStack(name="MainThread", ident=1, main=True, frames=frames)]


def _raw(path: str) -> tuple[socket.socket, FrameReader]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(PATIENCE * 4)
    sock.connect(path)
    reader = FrameReader(16 * 1024 * 1024)
    sock.sendall(encode_frame(Hello(id=0, version=PROTOCOL_VERSION)))
    _next(sock, reader)
    return sock, reader


def _next(sock: socket.socket, reader: FrameReader) -> list[bytes]:
    while True:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the daemon closed the connection")
        frames = reader.feed(data)
        if frames:
            return frames


def _respond(path: str, ready: int) -> None:
    """A responder of `JOB` answering every ask, until killed."""
    sock, reader = _raw(path)
    sock.sendall(encode_frame(Respond(id=1, job=JOB)))
    _next(sock, reader)
    os.write(ready, b"r")
    stacks, ids = threads(), count(2)
    sock.settimeout(None)
    while True:
        for frame in _next(sock, reader):
            wanted = decode_for_responder(frame)
            if isinstance(wanted, EvidenceWanted):
                evidence = Evidence(id=next(ids), ask=wanted.ask, threads=stacks)
                sock.sendall(encode_frame(evidence))


def _arm_rounds(path: str, rounds: int, pause: float, up: int) -> None:
    """Arm a timer of `JOB` (policy ``log``) that expires at once, ``rounds``
    times, ``pause`` seconds apart: an incident a round, once the window of the
    one before has closed. Says ``d`` on ``up`` after each."""
    sleeper = os.fork()
    if sleeper == 0:  # pragma: no cover - the timers' process
        time.sleep(3600)
        os._exit(0)
    try:
        sock, reader = _raw(path)
        for round_ in range(rounds):
            acquire = Acquire(id=round_ + 1, scope=f"round-{round_}", timeout=0.01, policy="log",
                              pid=sleeper, job=JOB, rank=0)  # fmt: skip
            sock.sendall(encode_frame(acquire))
            [reply] = _next(sock, reader)
            assert isinstance(decode_reply(reply), Acquired)
            time.sleep(pause)
            os.write(up, b"d")
    finally:
        os.kill(sleeper, signal.SIGKILL)
        os.waitpid(sleeper, 0)


def _lead(path: str, responders: int, rounds: tuple[int, float], up: int, down: int) -> None:
    """As the flood's user: fork the responders, and once the test says ``g`` on
    ``down``, arm the ``rounds`` (how many, how far apart); until ``down``
    closes."""
    children = []
    try:
        for _ in range(responders):
            child = os.fork()
            if child == 0:  # pragma: no cover - a responder
                try:
                    _respond(path, up)
                finally:
                    os._exit(0)
            children.append(child)
        if os.read(down, 1) == b"g":
            _arm_rounds(path, *rounds, up)
            os.read(down, 1)
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        for child in children:
            os.waitpid(child, 0)


class EvidenceFlood:
    """``responders`` processes of ``uid`` (65534 unless told) registered as
    responders of its job, and the rounds of expiries that make them answer:
    ``rounds`` incidents, ``pause`` seconds apart (more than the daemon's
    ``incident_window``)."""

    def __init__(
        self, socket_path: Path, responders: int, rounds: int, pause: float, uid: int = NOBODY
    ) -> None:
        self.rounds = rounds
        self._up, up = os.pipe()
        down, self._down = os.pipe()
        self.leader = os.fork()
        if self.leader == 0:  # pragma: no cover - the user, reporting through the pipes
            code = 1
            try:
                os.close(self._up)
                os.close(self._down)
                if uid != os.getuid():
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                _lead(str(socket_path), responders, (rounds, pause), up, down)
                code = 0
            finally:
                os._exit(code)
        os.close(up)
        os.close(down)
        self._read(responders, "the flood's responders to register")

    def start(self) -> None:
        """Begin the rounds."""
        os.write(self._down, b"g")

    def wait_round(self) -> None:
        """Return once the next round is armed and its pause over."""
        self._read(1, "a round of the flood")

    def run(self) -> None:
        """Every round, armed and over."""
        self.start()
        for _ in range(self.rounds):
            self.wait_round()

    def _read(self, wanted: int, what: str) -> None:
        got = 0
        while got < wanted:
            ready, _, _ = select.select([self._up], [], [], PATIENCE * 4)
            assert ready, f"waited too long for {what}"
            data = os.read(self._up, wanted - got)
            assert data, f"the flood ended before {what}"
            got += len(data)

    def close(self) -> None:
        """End the flood: its processes are killed, and reaped."""
        with contextlib.suppress(OSError):
            os.close(self._down)
        os.waitpid(self.leader, 0)
        os.close(self._up)


@contextlib.contextmanager
def evidence_flood(
    socket_path: Path, responders: int, rounds: int, pause: float, uid: int = NOBODY
) -> Iterator[EvidenceFlood]:
    """An `EvidenceFlood` on the daemon at ``socket_path``, ended after."""
    flood = EvidenceFlood(socket_path, responders, rounds, pause, uid)
    try:
        yield flood
    finally:
        flood.close()
