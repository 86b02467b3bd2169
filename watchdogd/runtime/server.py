"""The Unix socket: the listener and one task per connection.

Connections use plain non-blocking sockets and trio's ``wait_readable`` /
``wait_writable``: a request that is already in the kernel buffer is read, handled and
answered without a pass through the scheduler. A connection that never blocks yields
every few requests, so one busy client cannot starve the others.

Bounds kept here: a frame that declares more than ``max_frame_bytes`` gets an error
frame and the connection closes; a frame still incomplete ``partial_frame_timeout``
after it began closes the connection (an idle connection between frames stays); a
client that leaves its replies unread for ``send_timeout`` is disconnected, so
nothing is buffered for it without bound. Replies waiting to be sent count against
their uid's `ReplyBudget`: a connection of a uid over it waits, so many connections
of one user asking for large pages cannot drive the daemon's memory up.

Against a flood of connections: the listener takes at most `ACCEPTS_PER_TURN`
before the loop runs its other tasks, so connects queued as fast as they are taken
never hold the timers up. The core counts each uid's connections
(``max_connections_per_uid``, ``max_connections``); one refused at a limit is given
`_REFUSAL_WAIT` to send its hello, but only `REFUSALS_WAITING` of a uid's at once,
so a uid connecting past its limit holds no more of the daemon's descriptors and
tasks than that.

A reply is an acknowledgement: it is sent only once the changes made before it are
committed to the state file (see `watchdogd.storage.store`), and a reply that shows
an event's number once that event is written beside it
(`watchdogd.storage.record_file`).

A connection whose `Respond` was taken answers the asks about the process that
opened it (`watchdogd.runtime.asks`) until the connection closes or that
process exits, whichever comes first: the exit is watched on the process's pidfd
by a task of the listener's nursery, which ends before the connection lets the
pidfd go.
"""

from __future__ import annotations

import array
import contextlib
import grp
import logging
import os
import socket
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec
import trio

from watchdogd_protocol import (
    Acquired,
    Error,
    Events,
    Evidence,
    FrameReader,
    FrameTooLarge,
    MapPage,
    ProtocolError,
    Released,
    Respond,
    Unblocked,
    decode_reply,
    decode_request,
    encode_frame_into,
)

from ..core import Journal, RateLimitedLog, Service, Session
from ..errors import ListenError, Refusal
from ..host.process import Process, peer_of
from ..logs import log, logfmt
from .asks import Asks
from .reply_budget import ReplyBudget

if TYPE_CHECKING:
    from ..storage.record_file import RecordFile

#: Kept at 64 KiB: a larger recv buffer makes CPython map and unmap memory per call.
_RECV_SIZE: Final = 64 * 1024
#: Reads served back to back from one connection before it yields to the others.
_BURST: Final = 16
#: Frames of one read answered before the task yields: a pipelined flood shares
#: the loop with everyone else a few requests at a time.
_FRAMES_PER_TURN: Final = 8
#: Replies are sent once this many bytes are pending, so a pipelined burst of large
#: replies is never held in memory at once.
_FLUSH_AT: Final = 256 * 1024
_BACKLOG: Final = 1024
#: Connections accepted before the loop's other tasks get a turn: a flood of
#: connects that the kernel queues as fast as they are taken must not keep the
#: timers from firing.
ACCEPTS_PER_TURN: Final = 16
#: How long a refused connection is given to send its hello before the refusal.
_REFUSAL_WAIT: Final = 1.0
#: Refused connections of one uid given `_REFUSAL_WAIT` at once; past them a
#: refusal is sent without waiting. A uid connecting past its limit as fast as it
#: can would otherwise hold a descriptor and a task of the daemon's for each
#: connection it opened within the last second, without bound.
REFUSALS_WAITING: Final = 16
#: The most of an oversized frame read and dropped after refusing it.
_DRAIN_BYTES: Final = 16 * 1024 * 1024


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


def open_listener(path: str, mode: int, group: str | int | None = None) -> Listener:
    """Bind and listen on ``path`` with permission bits ``mode`` and owning ``group``.

    A socket file already there is replaced only when connecting to it is refused
    (its daemon is gone); a daemon that answers, or a path that is not a socket, is
    an error and nothing is removed.
    """
    gid = _group_id(group)
    _prepare_directory(os.path.dirname(path) or ".")
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(path)
        inode = os.lstat(path).st_ino
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {path}: {exc.strerror}") from None
    sock.setblocking(False)
    return Listener(sock, path, inode)


def _group_id(group: str | int | None) -> int | None:
    if group is None or isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ListenError(f"socket_group: no group named {group!r}") from None


def _prepare_directory(directory: str) -> None:
    private = directory.startswith("/tmp/")
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(directory) and not os.path.isdir(parent):
        # One directory is made (/run/watchdogd), never a tree: a mistyped path must
        # not leave directories behind, made as root.
        raise ListenError(
            f"cannot create the socket directory {directory}: {parent} does not exist"
        )
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, mode=0o700 if private else 0o755)
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


@dataclass(frozen=True, slots=True)
class Context:
    """What every connection shares besides the service."""

    #: The clock deadlines are on.
    clock: Callable[[], float]
    #: Unparked whenever an event is recorded (for followers of ``events``).
    news: trio.lowlevel.ParkingLot
    #: Fires the timers due at a given time (`Scheduler.poll`).
    tick: Callable[[float], None]
    #: Where the service's changes go, committed before a reply acknowledges them.
    journal: Journal
    #: The lines connections cause, rate-limited per (uid, kind).
    log: RateLimitedLog
    #: What each uid's connections hold in replies.
    replies: ReplyBudget = field(default_factory=ReplyBudget)
    #: The responders' connections, and the asks waiting on them.
    asks: Asks = field(default_factory=Asks)
    #: Where events are kept beside the state (None: no state).
    record: RecordFile | None = None
    #: Refused connections waiting for their hello, per uid.
    refusals: Counter[int] = field(default_factory=Counter)


async def serve(
    listener: Listener,
    service: Service[Any],
    context: Context,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections forever, each served by its own task."""
    async with trio.open_nursery() as nursery:
        task_status.started()
        sock = listener.socket
        while True:
            await trio.lowlevel.wait_readable(sock)
            for _ in range(ACCEPTS_PER_TURN):
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    # Out of descriptors (or refused by a security module): the
                    # pending connection stays queued; try again shortly rather
                    # than spin on it, and never let it stop the daemon.
                    log.error(logfmt("accept_failed", error=exc.strerror or str(exc)))
                    await trio.sleep(0.1)
                    break
                nursery.start_soon(_connection, conn, service, context, nursery)


async def _connection(
    conn: socket.socket, service: Service[Any], context: Context, nursery: trio.Nursery
) -> None:
    """Serve one connection; ``nursery`` (the listener's) runs the watch of its
    responder's process, if it becomes one (`_Connection.respond`)."""
    peer = None
    try:
        conn.setblocking(False)
        peer = peer_of(conn)
        try:
            caller = service.arming.open_connection(peer)
        except Refusal as refusal:
            _debug(
                context,
                peer.uid,
                "refused",
                pid=peer.pid,
                code=refusal.code,
                reason=refusal.message,
            )
            await _refuse(conn, refusal, service.rules.daemon.max_frame_bytes, context, peer.uid)
            return
        _debug(context, peer.uid, "connected", pid=peer.pid)
        connection = _Connection(conn, Session(service, caller), context, nursery)
        try:
            await connection.converse()
        finally:
            # The watch ends first: it waits on the pidfd that closing the
            # connection's caller may close.
            connection.watching.cancel()
            connection.stop_responding()
            service.arming.close_connection(caller)
            _debug(context, peer.uid, "disconnected", pid=peer.pid)
    except (ConnectionResetError, BrokenPipeError):
        pass
    except Exception as exc:
        # A bug must cost one connection, never the daemon and its timers.
        context.log.log(
            ("?" if peer is None else peer.uid, "connection_failed"),
            logging.ERROR,
            f"connection from pid {'?' if peer is None else peer.pid} failed",
            error=exc,
        )
    finally:
        conn.close()
        if peer is not None and peer.pidfd is not None:
            os.close(peer.pidfd)


def _debug(context: Context, uid: int, event: str, **fields: object) -> None:
    """A debug line about a connection of ``uid``, rate-limited per (uid, event)."""
    if context.log.debugging:
        line = logfmt(event, uid=uid, **fields)
        context.log.log((uid, event), logging.DEBUG, line)


async def _refuse(
    conn: socket.socket, refusal: Refusal, max_frame: int, context: Context, uid: int
) -> None:
    """Answer a connection refused at a limit, then close it.

    The client's hello is read first (within `_REFUSAL_WAIT`, and within the frame
    bound): closing with it unread would make the client's write fail (EPIPE) or its
    read fail (ECONNRESET) before it saw the refusal, and it would report the daemon
    as down. The refusal carries the hello's id when it could be read. Past
    `REFUSALS_WAITING` of ``uid``'s, the refusal goes at once: a flooding uid's
    client may then see the connection reset."""
    request_id = None
    if context.refusals[uid] < REFUSALS_WAITING:
        context.refusals[uid] += 1
        try:
            request_id = await _read_hello(conn, max_frame)
        finally:
            context.refusals[uid] -= 1
            if not context.refusals[uid]:
                del context.refusals[uid]
    out = bytearray()
    encode_frame_into(Error(id=request_id, code=refusal.code, message=refusal.message), out)
    with contextlib.suppress(OSError):
        conn.send(out)


async def _read_hello(conn: socket.socket, max_frame: int) -> int | None:
    """The id of the first frame, read within `_REFUSAL_WAIT`; None if none came."""
    reader = FrameReader(max_frame)
    with trio.move_on_after(_REFUSAL_WAIT), contextlib.suppress(OSError, FrameTooLarge):
        while True:
            try:
                data = conn.recv(_RECV_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(conn)
                continue
            if not data:
                return None
            if frames := reader.feed(data):
                with contextlib.suppress(ProtocolError):
                    return decode_request(frames[0]).id
                return None
    return None


async def _drain(conn: socket.socket) -> None:
    """Read and drop what the client is still sending (the rest of a frame over
    the bound) until it closes its side, for at most `_REFUSAL_WAIT` and
    `_DRAIN_BYTES`: closing with it unread resets the connection, and the client
    could see the reset before the refusal already sent."""
    left = _DRAIN_BYTES
    with trio.move_on_after(_REFUSAL_WAIT), contextlib.suppress(OSError):
        while left > 0:
            try:
                data = conn.recv(min(_RECV_SIZE, left))
            except BlockingIOError:
                await trio.lowlevel.wait_readable(conn)
                continue
            if not data:
                break
            left -= len(data)


class _Connection:
    """Reads frames, answers them, and enforces the per-connection bounds."""

    def __init__(
        self, conn: socket.socket, session: Session, context: Context, nursery: trio.Nursery
    ) -> None:
        self.conn = conn
        self.session = session
        self.context = context
        self.nursery = nursery
        self.config = session.service.rules.daemon
        self.journal = context.journal
        self.durable = self.journal.generation
        self.uid = session.caller.peer.uid
        #: Bytes of this connection's replies counted in ``context.replies``.
        self.held = 0
        #: A send is under way: nothing else may write to the socket until it ends.
        self.sending = False
        #: The watch of its responder's process (`respond`), ended with the connection.
        self.watching = trio.CancelScope()
        self.watched = False

    async def converse(self) -> None:
        try:
            await self._converse()
        finally:
            self.context.replies.release(self.uid, self.held)
            self.held = 0

    async def _converse(self) -> None:
        conn = self.conn
        reader = FrameReader(self.config.max_frame_bytes)
        partial_deadline: float | None = None
        burst = 0
        while True:
            self.config = self.session.service.rules.daemon  # a reload may have changed it
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
                peer = self.session.caller.peer
                self.context.log.log(
                    (peer.uid, "partial_frame_timeout"),
                    logging.INFO,
                    logfmt("partial_frame_timeout", pid=peer.pid, uid=peer.uid),
                )
                return
            if not data:
                return
            try:
                frames = reader.feed(data)
            except FrameTooLarge as exc:
                out = bytearray()
                encode_frame_into(Error(code=exc.code, message=exc.message), out)
                await self.flush(out)
                await _drain(conn)
                return
            if not await self.answer(frames, more=reader.buffered > 0):
                return
            if not reader.buffered:
                partial_deadline = None
            elif partial_deadline is None or frames:
                partial_deadline = trio.current_time() + self.config.partial_frame_timeout

    async def answer(self, frames: list[bytes], *, more: bool) -> bool:
        """Answer ``frames`` (``more``: part of another frame follows them); False to
        close. Replies go out together, or in parts of about `_FLUSH_AT` bytes; every
        `_FRAMES_PER_TURN` frames the task fires what is due and lets the others run.
        An events request waits for news only when nothing follows it: a request
        pipelined behind it is never held up."""
        clock, tick = self.context.clock, self.context.tick
        out = bytearray()
        last = len(frames)
        replies = self.context.replies
        for count, frame in enumerate(frames, 1):
            limits = (self.config.reply_bytes_per_uid, self.config.reply_bytes)
            if replies.over(self.uid, *limits):
                # Send what this connection holds first: waiting on it would
                # keep the budget full for everyone of this uid.
                if not await self.flush(out):
                    return False
                out = bytearray()
                await replies.wait_for_room(self.uid, *limits)
            now = clock()
            tick(now)
            may_wait = count == last and not more
            before = len(out)
            outcome = self.session.receive(frame, now, out, may_wait=may_wait)
            self._hold(len(out) - before)
            if outcome is False:
                await self.flush(out)
                return False
            if isinstance(outcome, Evidence | Unblocked):
                self.context.asks.answered(self, outcome)
            elif isinstance(outcome, Respond):
                self.respond()
            elif isinstance(outcome, MapPage):
                # The reply, last in ``out``, leaves with the page's descriptor.
                if not await self.flush(out[:before]) or not await self._send_page(
                    out[before:], outcome, clock()
                ):
                    return False
                out = bytearray()
            elif outcome is not True:
                # A follower waiting for news: answer what came before it first.
                if not await self.flush(out):
                    return False
                out = bytearray()
                await self.wait_for_news(outcome)
                self.session.answer(outcome, clock(), out)
                self._hold(len(out))
            if len(out) >= _FLUSH_AT or count % _FRAMES_PER_TURN == 0:
                if not await self.flush(out):
                    return False
                out = bytearray()
                await trio.lowlevel.checkpoint()
        return await self.flush(out)

    async def flush(self, out: bytearray) -> bool:
        """Send ``out`` once every change made so far is in the store (a reply is an
        acknowledgement); False (logged) when the client left its replies unread."""
        if not out:
            return True
        try:
            record = self.context.record
            if record is not None and self.session.shown > record.written:
                await record.through(self.session.shown)
            if self.journal.generation != self.durable:
                # Committed at once: one write(2) per reply costs less than a turn
                # of the loop spent gathering other connections' changes into it
                # (the frames of one connection's batch share their commit anyway).
                changed = self.journal.generation
                if self.journal.commit(changed):
                    self.durable = changed
                else:
                    out = _not_durable(out)
            # The common case, with no coroutine of its own: the replies fit in
            # the socket buffer.
            sent = _send_some(self.conn, out)
            return sent == len(out) or await self._send_rest(memoryview(out)[sent:])
        finally:
            # Sent, or given up on: either way no longer the daemon's to hold.
            self.context.replies.release(self.uid, self.held)
            self.held = 0

    async def _send_page(self, reply: bytearray, request: MapPage, now: float) -> bool:
        """Send ``reply`` to ``request`` with the page's descriptor (SCM_RIGHTS);
        False (logged) when the client leaves it unread."""
        service = self.session.service
        try:
            page = service.page_for(request, self.session.caller, now)
        except Refusal:
            return True  # the process went meanwhile: it needs no page
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [page.fd]))]
        while True:
            try:
                sent = self.conn.sendmsg([reply], ancillary)
                break
            except BlockingIOError:
                with trio.move_on_after(self.config.send_timeout) as waited:
                    await trio.lowlevel.wait_writable(self.conn)
                if waited.cancelled_caught:
                    return False
        return sent == len(reply) or await self._send_rest(memoryview(reply)[sent:])

    def _hold(self, size: int) -> None:
        self.context.replies.hold(self.uid, size)
        self.held += size

    async def _send_rest(self, rest: memoryview) -> bool:
        """Send ``rest`` of the replies as the client reads them; False (logged)
        once it left them unread for ``send_timeout``."""
        self.sending = True
        try:
            sent = await _send_all(self.conn, rest, self.config.send_timeout)
        finally:
            self.sending = False
        if sent:
            return True
        peer = self.session.caller.peer
        self.context.log.log(
            (peer.uid, "unread_replies"),
            logging.INFO,
            logfmt("unread_replies", pid=peer.pid, uid=peer.uid),
        )
        return False

    def respond(self) -> None:
        """Its `Respond` was taken, bound to the process that opened the connection
        (`Service.handle`): the connection answers the asks about that process,
        until the connection closes or the process exits. The exit is watched on
        the process's pidfd, so a responder whose process is gone (a child of a
        fork kept the socket) is dropped at once, not at the next ask."""
        process = self.session.caller.process
        assert process is not None  # bound when its Respond was taken
        self.context.asks.attach(process, self)
        if not self.watched:
            self.watched = True
            self.nursery.start_soon(self._until_exit, process)

    async def _until_exit(self, process: Process) -> None:
        if self.watching.cancel_called:
            return  # the connection ended before this task ran: the pidfd may be closed
        with self.watching:
            try:
                await trio.lowlevel.wait_readable(process.fd)
                self.stop_responding()
            except Exception as exc:
                # In the listener's nursery: a bug must cost this watch, never
                # the listener.
                self.context.log.log(
                    (process.uid, "responder_watch_failed"),
                    logging.ERROR,
                    f"watching the responder of pid {process.pid} failed",
                    error=exc,
                )

    def stop_responding(self) -> None:
        """The connection answers for its process no longer: it closed, or the
        process exited. Undoes only its own registration: the process may
        respond on another connection now."""
        process = self.session.caller.process
        if self.session.responder and process is not None:
            self.context.asks.detach(process, self)
            self.session.service.arming.stop_responding(process)

    def send_now(self, frame: bytes) -> bool:
        """Send ``frame`` (a message of the daemon's own to a responder) whole, now,
        or not at all: never into the middle of a reply being sent, and never
        waiting on a responder that does not read."""
        if self.sending:
            return False
        try:
            sent = self.conn.send(frame)
        except OSError:
            return False
        if sent == len(frame):
            return True
        # A part went: the stream is out of step with its frames, and the
        # responder's side reads garbage from here on. Close it.
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)
        return False

    async def wait_for_news(self, request: Events) -> None:
        """Hold an events request until an event it may see is recorded, its wait
        runs out, or the client sends more (or hangs up)."""
        caller = self.session.caller.peer.uid
        events = self.session.service.events
        with trio.move_on_after(request.wait):
            async with trio.open_nursery() as nursery:

                async def until_client_speaks() -> None:
                    await trio.lowlevel.wait_readable(self.conn)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_client_speaks)
                while not events.page(request.after, 1, caller):
                    await self.context.news.park()
                nursery.cancel_scope.cancel()


def _not_durable(out: bytearray) -> bytearray:
    """``out`` with every acknowledgement of a change marked not durable (the state
    could not be written). Only on a failing disk, so it may take its time."""
    marked = bytearray()
    for frame in FrameReader(len(out)).feed(bytes(out)):
        reply = decode_reply(frame)
        if isinstance(reply, Acquired | Released):
            reply = msgspec.structs.replace(reply, durable=False)
        encode_frame_into(reply, marked)
    return marked


def _send_some(conn: socket.socket, data: bytearray) -> int:
    """What the socket buffer takes of ``data`` now."""
    try:
        return conn.send(data)
    except BlockingIOError:
        return 0


async def _send_all(conn: socket.socket, view: memoryview, timeout: float) -> bool:
    """Send everything; False if the peer left it unread for ``timeout`` seconds."""
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
