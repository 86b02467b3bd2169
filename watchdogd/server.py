"""The Unix socket: the listener and one task per connection.

Connections use plain non-blocking sockets and trio's ``wait_readable`` /
``wait_writable``: a request that is already in the kernel buffer is read, handled and
answered without a pass through the scheduler. A connection that never blocks yields
every few requests, so one busy client cannot starve the others.

Bounds kept here: a frame that declares more than ``max_frame_bytes`` gets an error
frame and the connection closes; a frame still incomplete ``partial_frame_timeout``
after it began closes the connection (an idle connection between frames stays); a
client that leaves its replies unread for ``send_timeout`` is disconnected, so
nothing is buffered for it without bound.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Callable
from typing import Any, Final

import trio

from watchdogd_client.errors import FrameTooLarge
from watchdogd_client.protocol import Error, Events, FrameReader, encode_frame_into

from .errors import ListenError, Refusal
from .logs import log, logfmt
from .process import peer_of
from .service import Service
from .session import Session

#: Kept at 64 KiB: a larger recv buffer makes CPython map and unmap memory per call.
_RECV_SIZE: Final = 64 * 1024
#: Requests served back to back from one connection before it yields to the others.
_BURST: Final = 16
_BACKLOG: Final = 1024


class Listener:
    """A listening socket and the path it is bound to.

    ``inode`` is the path's inode right after bind, so `close` unlinks the path only
    while it is still this socket (a second daemon may have replaced it); None for a
    socket this process did not bind (inherited from systemd), which is never unlinked.
    """

    def __init__(self, sock: socket.socket, path: str, inode: int | None) -> None:
        self.socket = sock
        self.path = path
        self.inode = inode

    def close(self) -> None:
        try:
            if self.inode is not None and os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except OSError:
            pass
        self.socket.close()


def open_listener(path: str, mode: int) -> Listener:
    """Bind and listen on ``path``.

    A socket file already there is replaced only when connecting to it is refused
    (its daemon is gone); a daemon that answers, or a path that is not a socket, is
    an error and nothing is removed.
    """
    _prepare_directory(os.path.dirname(path) or ".")
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(path)
        inode = os.lstat(path).st_ino
        os.chmod(path, mode)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {path}: {exc.strerror}") from None
    sock.setblocking(False)
    return Listener(sock, path, inode)


def _prepare_directory(directory: str) -> None:
    private = directory.startswith("/tmp/")
    try:
        os.makedirs(directory, mode=0o700 if private else 0o755, exist_ok=True)
        info = os.stat(directory)
    except OSError as exc:
        raise ListenError(
            f"cannot create the socket directory {directory}: {exc.strerror}"
        ) from None
    if private and (info.st_uid != os.getuid() or info.st_mode & 0o022):
        # Anyone may create directories in /tmp: one made by another user, or one
        # others may write to, could be used to hijack the socket.
        raise ListenError(
            f"{directory} is not a private directory of uid {os.getuid()}; "
            "remove it or choose another socket with --socket"
        )


def _remove_stale_socket(path: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ListenError(f"{path} exists and is not a socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        log.info(logfmt("stale_socket_removed", socket=path))
        return
    except BlockingIOError:
        pass  # its backlog is full: something is listening
    finally:
        probe.close()
    raise ListenError(f"another daemon is listening on {path}; stop it or use --socket")


async def serve(
    listener: Listener,
    service: Service[Any],
    *,
    clock: Callable[[], float],
    news: trio.lowlevel.ParkingLot,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections forever, each served by its own task. ``news`` is unparked
    whenever an event is recorded (for followers of ``events``)."""
    async with trio.open_nursery() as nursery:
        task_status.started()
        sock = listener.socket
        while True:
            await trio.lowlevel.wait_readable(sock)
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        raise
                    # Out of descriptors: the pending connection stays queued; try
                    # again shortly rather than spin on it.
                    log.error(logfmt("accept_failed", error=exc.strerror))
                    await trio.sleep(0.1)
                    break
                nursery.start_soon(_connection, conn, service, clock, news)


async def _connection(
    conn: socket.socket,
    service: Service[Any],
    clock: Callable[[], float],
    news: trio.lowlevel.ParkingLot,
) -> None:
    peer = None
    try:
        conn.setblocking(False)
        peer = peer_of(conn)
        try:
            caller = service.open_connection(peer)
        except Refusal as refusal:
            out = bytearray()
            encode_frame_into(Error(code=refusal.code, message=refusal.message), out)
            with contextlib.suppress(OSError):
                conn.send(out)
            return
        try:
            await _converse(conn, Session(service, caller), clock, news)
        finally:
            service.close_connection(caller)
    except (ConnectionResetError, BrokenPipeError):
        pass
    except Exception:
        # A bug must cost one connection, never the daemon and its timers.
        log.exception("connection from pid %s failed", "?" if peer is None else peer.pid)
    finally:
        conn.close()
        if peer is not None and peer.pidfd is not None:
            os.close(peer.pidfd)


async def _converse(
    conn: socket.socket,
    session: Session,
    clock: Callable[[], float],
    news: trio.lowlevel.ParkingLot,
) -> None:
    service = session.service
    reader = FrameReader(service.config.max_frame_bytes)
    partial_deadline: float | None = None
    burst = 0
    while True:
        try:
            data = conn.recv(_RECV_SIZE)
            burst += 1
            if burst >= _BURST:
                burst = 0
                await trio.lowlevel.checkpoint()
        except BlockingIOError:
            burst = 0
            if partial_deadline is None:
                await trio.lowlevel.wait_readable(conn)
                continue
            with trio.move_on_at(partial_deadline):
                await trio.lowlevel.wait_readable(conn)
                continue
            log.info(logfmt("partial_frame_timeout", pid=session.caller.peer.pid))
            return
        if not data:
            return
        try:
            frames = reader.feed(data)
        except FrameTooLarge as exc:
            out = bytearray()
            encode_frame_into(Error(code=exc.code, message=exc.message), out)
            await _flush(conn, session, out)
            return
        if not await _answer(conn, session, frames, clock, news):
            return
        if not reader.buffered:
            partial_deadline = None
        elif partial_deadline is None or frames:
            partial_deadline = trio.current_time() + service.config.partial_frame_timeout


async def _answer(
    conn: socket.socket,
    session: Session,
    frames: list[bytes],
    clock: Callable[[], float],
    news: trio.lowlevel.ParkingLot,
) -> bool:
    """Answer ``frames``, sending the replies together; False to close."""
    out = bytearray()
    for frame in frames:
        outcome = session.receive(frame, clock(), out)
        if outcome is False:
            await _flush(conn, session, out)
            return False
        if outcome is not True:
            # A follower waiting for news: answer what came before it first.
            if not await _flush(conn, session, out):
                return False
            out = bytearray()
            await _wait_for_news(conn, session, outcome, news)
            session.answer(outcome, clock(), out)
    return await _flush(conn, session, out)


async def _flush(conn: socket.socket, session: Session, out: bytearray) -> bool:
    """Send ``out``; False (logged) when the client left its replies unread."""
    if not out or await _send_all(conn, out, session.service.config.send_timeout):
        return True
    log.info(logfmt("unread_replies", pid=session.caller.peer.pid, uid=session.caller.peer.uid))
    return False


async def _wait_for_news(
    conn: socket.socket, session: Session, request: Events, news: trio.lowlevel.ParkingLot
) -> None:
    """Hold an events request until an event it may see is recorded, its wait runs
    out, or the client sends more (or hangs up)."""
    caller = session.caller.peer.uid
    events = session.service.events
    with trio.move_on_after(request.wait):
        async with trio.open_nursery() as nursery:

            async def until_client_speaks() -> None:
                await trio.lowlevel.wait_readable(conn)
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_client_speaks)
            while not events.page(request.after, 1, lambda event: caller in (0, event.uid)):
                await news.park()
            nursery.cancel_scope.cancel()


async def _send_all(conn: socket.socket, data: bytearray, timeout: float) -> bool:
    """Send everything; False if the peer left it unread for ``timeout`` seconds."""
    try:
        sent = conn.send(data)
    except BlockingIOError:
        sent = 0
    if sent == len(data):
        return True  # the common case: the replies fit in the socket buffer
    view = memoryview(data)[sent:]
    deadline: float | None = None
    while view:
        try:
            view = view[conn.send(view) :]
            continue
        except BlockingIOError:
            pass
        if deadline is None:
            deadline = trio.current_time() + timeout
        with trio.move_on_at(deadline):
            await trio.lowlevel.wait_writable(conn)
            continue
        return False
    return True
