"""The Prometheus scrape endpoint: ``GET /metrics`` over HTTP/1.1, for
``--metrics-listen``.

It runs on the daemon's trio loop, like every other reader of its state: the page
is rendered there (`Service.metrics_text`), never by a thread behind the loop's
back. Each connection answers one request and closes; h11 speaks the protocol.

What it withstands: anyone who can reach the address may open connections, send
slowly or not at all, or open and close them as fast as they can, and every local
user is 127.0.0.1. Prometheus connects, sends its request at once and reads the
page; that is all a connection is given room for:

- a request head is at most `MAX_HEAD` bytes and must come whole within
  `HEAD_TIMEOUT` of the accept, however steadily it trickles in; the page must
  then be taken within `SEND_TIMEOUT`;
- each connection is a task of its own, answered as soon as its request is whole:
  no lock or turn is shared, and a connection already closed when it is taken
  (a flood's) is closed at once, without a task;
- at most `MAX_CONNECTIONS` are held, and a new one is always taken: room is made
  by dropping, from the address that holds the most, its connection that has
  waited longest for its request (one whose page is being sent only when none
  waits). A flood from one address never drops another address's connection; a
  scraper on the flooding address loses its own only if `MAX_CONNECTIONS` more
  arrive between its accept and its request;
- the listener takes at most `ACCEPTS_PER_TURN` connections before the loop runs
  its other tasks (the timers among them), and the kernel queues at most
  `BACKLOG`: a scrape behind a flood waits for no more than that many to be
  taken. An attacker who keeps more than `MAX_CONNECTIONS` plus `BACKLOG`
  connecting at once fills that queue, and every new connection, a scrape's too,
  then waits for its SYN to be sent again (a second later): past that it is the
  kernel's queue, shared by all, that is contended, and the daemon drains it as
  fast as its share of the CPU lets it;
- one page is rendered at most once a `REUSE` interval and served to every scrape
  meanwhile.

Anyone who can reach the address reads the page: it names no job and no uid unless
the operator turned those series on (``--metrics-jobs``), and the address is the
loopback one unless given.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

import h11
import trio

from ..errors import ConfigError
from ..logs import log, logfmt

#: Connections held at once: far more than the scrapers of one host need, so that
#: a flood's idle connections wait their `HEAD_TIMEOUT` out beside a scrape rather
#: than ahead of it in the kernel's queue. Each costs a task and a descriptor.
MAX_CONNECTIONS: Final = 1024
#: Seconds from the accept to the request's last head byte: Prometheus sends it at
#: once, so this is a round trip of a slow network and its client's turn.
HEAD_TIMEOUT: Final = 2.0
#: Seconds to take the page once the request came.
SEND_TIMEOUT: Final = 10.0
#: Connections accepted before the loop's other tasks get a turn.
ACCEPTS_PER_TURN: Final = 16
#: Connections the kernel queues for the accept: a scrape that arrives behind a
#: flood waits for at most this many to be taken first; a SYN that finds the queue
#: full is dropped and sent again a second later.
BACKLOG: Final = 1024
#: What accept(2) fails with for that connection alone (reset before it was
#: taken, refused by a security module), as trio's own listener ignores them.
_ONE_FAILED: Final = frozenset({errno.ECONNABORTED, errno.EPERM, errno.EPROTO})
MAX_HEAD: Final = 8192
_RECV_SIZE: Final = 4096
#: Seconds a rendered page is served again before it is rendered anew.
REUSE: Final = 1.0
#: Prometheus's text exposition format.
CONTENT_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (on 127.0.0.1) as (host, port);
    ConfigError, saying how to write it, otherwise."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536 or not host.isascii():
        raise ConfigError(
            f"--metrics-listen {address!r}: write HOST:PORT, [IPV6]:PORT or PORT "
            "(on 127.0.0.1), as in 127.0.0.1:9101"
        )
    return host, int(port)


async def open_listeners(address: str) -> list[socket.socket]:
    """The listening sockets of ``address`` (non-blocking); ConfigError when it
    cannot be bound."""
    host, port = parse_address(address)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=BACKLOG)
    except OSError as exc:
        raise ConfigError(f"--metrics-listen {address}: cannot listen: {exc.strerror}") from None
    # Plain sockets: the accept loop takes what the kernel queued without a pass
    # through the scheduler for each.
    sockets = []
    for listener in listeners:
        sock = socket.socket(fileno=listener.socket.detach())
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


class Page:
    """The metrics page, rendered at most once per `REUSE` seconds."""

    def __init__(self, render: Callable[[], str], clock: Callable[[], float]) -> None:
        self._render = render
        self._clock = clock
        self._body = b""
        self._at = -REUSE

    def body(self) -> bytes:
        now = self._clock()
        if now - self._at >= REUSE:
            self._body, self._at = self._render().encode(), now
        return self._body


class Held:
    """One connection of the `HeldConnections`: its socket, its peer's address, when it
    entered (a count), its deadline's scope, and whether its request came."""

    __slots__ = ("answering", "conn", "host", "scope", "seq")

    def __init__(self, conn: socket.socket, host: str, seq: int, deadline: float) -> None:
        self.conn = conn
        self.host = host
        self.seq = seq
        self.scope = trio.CancelScope(deadline=deadline)
        self.answering = False

    def drop(self) -> None:
        """Close the connection under its task, which wakes to find it closed: a
        cancelled scope would cost the loop more, and a flood drops one per
        connection it opens."""
        trio.lowlevel.notify_closing(self.conn)
        self.conn.close()


class HeldConnections:
    """The connections held, at most ``capacity``; a new one always enters.

    Invariant: every held connection is in exactly one address's dict, in the
    order it entered; the count of all of them is at most ``capacity``. Room is
    made by dropping, from the address holding the most (of those tied, the one
    whose oldest came first), its oldest connection still waiting for its
    request, else its oldest."""

    def __init__(self, capacity: int = MAX_CONNECTIONS) -> None:
        self._capacity = capacity
        self._hosts: dict[str, dict[Held, None]] = {}
        self._count = 0
        self._entered = 0

    def __len__(self) -> int:
        return self._count

    def enter(self, conn: socket.socket, host: str, deadline: float) -> Held:
        if self._count >= self._capacity:
            self._drop()
        self._entered += 1
        held = Held(conn, host, self._entered, deadline)
        self._hosts.setdefault(host, {})[held] = None
        self._count += 1
        return held

    def leave(self, held: Held) -> None:
        """Forget ``held`` (once; again does nothing)."""
        mine = self._hosts.get(held.host)
        if mine is None or held not in mine:
            return
        del mine[held]
        if not mine:
            del self._hosts[held.host]
        self._count -= 1

    def _drop(self) -> None:
        heaviest = max(self._hosts.values(), key=lambda m: (len(m), -next(iter(m)).seq))
        victim = next((h for h in heaviest if not h.answering), next(iter(heaviest)))
        self.leave(victim)
        victim.drop()


async def serve(
    listeners: list[socket.socket],
    page: Page,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer scrapes on ``listeners`` until cancelled."""
    room = HeldConnections()
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            where = listener.getsockname()
            log.info(logfmt("metrics_listening", address=f"{where[0]}:{where[1]}"))
            nursery.start_soon(_accept, listener, room, page, nursery)
        task_status.started()


async def _accept(
    listener: socket.socket, room: HeldConnections, page: Page, nursery: trio.Nursery
) -> None:
    """Take what the kernel queued, `ACCEPTS_PER_TURN` at a time: the timers run
    between turns, and nothing here waits on a connection."""
    while True:
        await trio.lowlevel.wait_readable(listener)
        for _ in range(ACCEPTS_PER_TURN):
            try:
                conn, address = listener.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _ONE_FAILED:
                    continue
                # Out of descriptors or memory: the connection stays queued; try
                # again shortly rather than spin on it, and never stop the daemon.
                log.error(logfmt("metrics_accept_failed", error=exc.strerror or str(exc)))
                await trio.sleep(0.1)
                break
            conn.setblocking(False)
            first = _first_read(conn)
            if first == b"":
                conn.close()  # gone already: a flood's connection costs no task
                continue
            held = room.enter(conn, address[0], trio.current_time() + HEAD_TIMEOUT)
            nursery.start_soon(_connection, first, held, room, page)


def _first_read(conn: socket.socket) -> bytes | None:
    """What the peer sent first: b"" when it is gone (closed or reset), None when
    nothing came yet."""
    try:
        return conn.recv(_RECV_SIZE)
    except BlockingIOError:
        return None
    except OSError:
        return b""


async def _connection(first: bytes | None, held: Held, room: HeldConnections, page: Page) -> None:
    try:
        with held.scope:
            if held.conn.fileno() != -1:  # else dropped before its task ran
                await _answer(held.conn, first, held, page)
    except (OSError, trio.ClosedResourceError):
        pass  # the scraper went away, or its connection was dropped for another
    finally:
        room.leave(held)
        held.conn.close()


async def _answer(conn: socket.socket, first: bytes | None, held: Held, page: Page) -> None:
    while first is None:
        # Nothing is parsed before a byte came: most of a flood's connections
        # never send one.
        await trio.lowlevel.wait_readable(conn)
        first = _first_read(conn)
    if not first:
        return
    server = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    server.receive_data(first)
    try:
        request = await _request(conn, server)
    except h11.RemoteProtocolError:
        # h11 lets a server answer a request it could not parse, once.
        with contextlib.suppress(h11.LocalProtocolError):
            await _respond(conn, server, 400, b"a malformed request\n")
        return
    if request is None:
        return
    held.answering = True
    held.scope.deadline = trio.current_time() + SEND_TIMEOUT
    path = request.target.split(b"?", 1)[0]
    if request.method not in (b"GET", b"HEAD"):
        await _respond(conn, server, 405, b"GET /metrics\n", [(b"Allow", b"GET, HEAD")])
    elif path == b"/metrics":
        body = page.body()
        await _respond(conn, server, 200, body, [], head_only=request.method == b"HEAD")
    else:
        await _respond(conn, server, 404, b"the metrics are at /metrics\n")


async def _request(conn: socket.socket, server: h11.Connection) -> h11.Request | None:
    """The request's head, once it came whole; None when the peer closed first."""
    while True:
        event = server.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            try:
                data = conn.recv(_RECV_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(conn)
                continue
            server.receive_data(data)
            if not data and server.their_state is not h11.DONE:
                return None
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _respond(
    conn: socket.socket,
    server: h11.Connection,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    head_only: bool = False,
) -> None:
    content_type = CONTENT_TYPE if status == 200 else b"text/plain; charset=utf-8"
    response = h11.Response(
        status_code=status,
        reason=HTTPStatus(status).phrase.encode(),
        headers=[
            (b"Content-Type", content_type),
            (b"Content-Length", b"%d" % len(body)),
            (b"Connection", b"close"),
            *(headers or []),
        ],
    )
    data = server.send(response)
    if not head_only:
        data += server.send(h11.Data(data=body))
    await _send_all(conn, data + server.send(h11.EndOfMessage()))


async def _send_all(conn: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[conn.send(view) :]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(conn)
