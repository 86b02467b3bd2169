"""A daemon played by the test on a real Unix socket: it speaks the protocol as far
as a client and a responder need (hello, acquire, release, ping, respond, evidence,
unblocked), and lets the test do what the daemon decides: ask a responder for
evidence or to unblock its process, close
its connection, refuse a protocol version, or listen as another user (an impostor
in a directory of its own making among them)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from watchdogd_protocol import (
    MAX_REQUEST_FRAME,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    Error,
    ErrorCode,
    Evidence,
    EvidenceWanted,
    FrameReader,
    Hello,
    Ping,
    Pong,
    Release,
    Released,
    Reply,
    RequestMessage,
    Respond,
    Responding,
    Unblocked,
    UnblockWanted,
    Welcome,
    decode_request,
    encode_frame,
)

from helpers.users import NOBODY, become
from helpers.waiting import PATIENCE, wait_until

_UCRED = struct.Struct("3i")


class ResponderLine:
    """A responder's connection, as the fake daemon holds it once `Respond` came:
    the worker's ``hello`` and ``respond``, and its ``pid`` as the kernel says."""

    def __init__(self, conn: _Served, hello: Hello, respond: Respond) -> None:
        self._conn = conn
        self.hello = hello
        self.respond = respond
        self.pid = conn.pid
        self.evidence: queue.Queue[Evidence] = queue.Queue()
        self.unblocked: queue.Queue[Unblocked] = queue.Queue()
        #: Set when the connection ended, from either side.
        self.ended = threading.Event()

    def ask(self, ask: int, incident: str = "", timeout: float = PATIENCE) -> Evidence:
        """Send `EvidenceWanted` and wait for the `Evidence` that answers it."""
        self._conn.send(EvidenceWanted(ask=ask, incident=incident))
        evidence = self.evidence.get(timeout=timeout)
        assert evidence.ask == ask
        return evidence

    def unblock(self, wanted: UnblockWanted, timeout: float = PATIENCE) -> Unblocked:
        """Send ``wanted`` and wait for the `Unblocked` that answers it."""
        self._conn.send(wanted)
        answer = self.unblocked.get(timeout=timeout)
        assert answer.ask == wanted.ask
        return answer

    def close(self) -> None:
        """End the connection, as a daemon that stops does."""
        self._conn.close()


class _Served:
    """One accepted connection and its thread."""

    def __init__(self, daemon: FakeDaemon, sock: socket.socket) -> None:
        self.daemon = daemon
        self.sock = sock
        self.pid, self.uid, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        self.received = 0
        self.line: ResponderLine | None = None
        self._send_lock = threading.Lock()
        self._hello: Hello | None = None
        self.thread = threading.Thread(target=self.serve, daemon=True)

    def send(self, message: Reply | EvidenceWanted | UnblockWanted) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.sendall(encode_frame(message))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        reader = FrameReader(MAX_REQUEST_FRAME)
        try:
            while data := self.sock.recv(65536):
                self.received += len(data)
                for frame in reader.feed(data):
                    if not self.handle(decode_request(frame)):
                        return
        except OSError:
            pass
        finally:
            self.sock.close()
            self.daemon.ended(self)
            if self.line is not None:
                self.line.ended.set()

    def handle(self, request: RequestMessage) -> bool:
        """Answer ``request``; False: the connection is to close."""
        daemon = self.daemon
        match request:
            case Hello():
                daemon.hellos.append(request)
                low, high = daemon.versions
                if not low <= request.version <= high:
                    message = f"this daemon speaks {low} to {high}"
                    self.send(
                        Error(id=request.id, code=ErrorCode.UNSUPPORTED_VERSION, message=message)
                    )
                    return False
                if daemon.stall_responders and request.client.startswith("python-responder"):
                    return True  # never welcomed
                self._hello = request
                self.send(Welcome(id=request.id, version=high, server="fake", pid=os.getpid()))
            case Acquire():
                self.send(Acquired(id=request.id, remaining=request.timeout, rearmed=False))
                daemon.acquired += 1
            case Release():
                self.send(Released(id=request.id, found=True))
            case Ping():
                self.send(Pong(id=request.id))
            case Respond():
                assert self._hello is not None
                daemon.respond_count += 1
                self.send(Responding(id=request.id))
                self.line = ResponderLine(self, self._hello, request)
                daemon.responders.put(self.line)
            case Evidence():
                self.send(Responding(id=request.id))
                assert self.line is not None, "evidence from a connection that never sent Respond"
                self.line.evidence.put(request)
            case Unblocked():
                self.send(Responding(id=request.id))
                assert self.line is not None, "an answer from a connection that never sent Respond"
                self.line.unblocked.put(request)
            case _:
                self.send(Error(id=request.id, code=ErrorCode.UNKNOWN_OP, message="not here"))
        return True


class FakeDaemon:
    """The fake daemon on ``path``, speaking protocol ``versions`` (lowest,
    highest); ``stall_responders`` leaves a responder's hello unanswered. A context
    manager: it listens from entry to exit."""

    def __init__(
        self,
        path: Path,
        *,
        versions: tuple[int, int] = (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION),
        stall_responders: bool = False,
    ) -> None:
        self.path = path
        self.versions = versions
        self.stall_responders = stall_responders
        self.hellos: list[Hello] = []
        self.responders: queue.Queue[ResponderLine] = queue.Queue()
        #: Connections that ended before they sent a byte.
        self.silent = 0
        #: `Respond` requests received.
        self.respond_count = 0
        #: `Acquire` requests answered.
        self.acquired = 0
        self._served: list[_Served] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FakeDaemon:
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o666)  # any user may connect, as to the daemon's default
        self._listener.listen(64)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        self._thread.join(PATIENCE)
        with self._lock:
            served = list(self._served)
        for conn in served:
            conn.close()
            conn.thread.join(PATIENCE)

    def seen(self) -> dict[str, Any]:
        """What it saw so far (see `fake_daemon_as`)."""
        with self._lock:
            served = list(self._served)
        return {
            "connections": len(served),
            "received": sum(conn.received for conn in served),
            "silent": self.silent,
            "responds": self.respond_count,
            "acquired": self.acquired,
            "hellos": [hello.client for hello in self.hellos],
        }

    def next_responder(self, timeout: float = PATIENCE) -> ResponderLine:
        """The next responder whose `Respond` came."""
        return self.responders.get(timeout=timeout)

    def ended(self, conn: _Served) -> None:
        with self._lock:
            self.silent += conn.received == 0

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = _Served(self, sock)
            with self._lock:
                self._served.append(conn)
            conn.thread.start()


@contextlib.contextmanager
def fake_daemon_of_nobody(
    path: Path, until: Callable[[FakeDaemon], bool]
) -> Iterator[Callable[[], dict[str, Any]]]:
    """A `FakeDaemon` on ``path`` run by a forked child as uid 65534, in a directory
    given to that user (needs root): see `fake_daemon_as`, with ``until``."""
    os.chown(path.parent, NOBODY, NOBODY)
    with fake_daemon_as(NOBODY, path, until=until) as report:
        yield report


@contextlib.contextmanager
def fake_daemon_as(
    uid: int,
    path: Path,
    *,
    until: Callable[[FakeDaemon], bool] | None = None,
    directory_mode: int | None = None,
) -> Iterator[Callable[[], dict[str, Any]]]:
    """A `FakeDaemon` on ``path`` run by a forked child as ``uid`` and the group of
    that number (needs root); with ``directory_mode``, the child first makes the
    socket's directory itself, as an impostor would. Yields a function that returns
    what it saw: ``connections`` accepted, bytes ``received``, ``silent``
    connections (ended before a byte), ``responds``, ``acquired``, and the clients
    of its ``hellos``. It reports once ``until(daemon)`` holds in the child (or the
    patience ran out), or, without ``until``, as soon as it is asked."""
    ready_read, ready_write = os.pipe()
    report_read, report_write = os.pipe()
    stop_read, stop_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        try:
            for end in (ready_read, report_read, stop_write):
                os.close(end)
            become(uid)
            if directory_mode is not None:
                path.parent.mkdir(mode=directory_mode)
                os.chmod(path.parent, directory_mode)
            with FakeDaemon(path) as daemon:
                os.write(ready_write, b"ready")
                if until is None:
                    os.read(stop_read, 1)
                else:
                    with contextlib.suppress(AssertionError):
                        wait_until(lambda: until(daemon), what="the test's condition")
                seen = daemon.seen()
            os.write(report_write, json.dumps(seen).encode())
        finally:
            os._exit(0)
    for end in (ready_write, report_write, stop_read):
        os.close(end)
    try:
        assert os.read(ready_read, 5) == b"ready", f"the fake daemon of uid {uid} did not start"

        def report() -> dict[str, Any]:
            with contextlib.suppress(OSError):
                os.write(stop_write, b"x")
            with os.fdopen(os.dup(report_read)) as pipe:
                return dict(json.loads(pipe.read()))

        yield report
    finally:
        for end in (ready_read, report_read, stop_write):
            os.close(end)
        with contextlib.suppress(OSError):
            os.kill(child, 9)
        os.waitpid(child, 0)
