"""The Prometheus scrape endpoint: ``GET /metrics`` over HTTP/1.1, for
``--metrics-listen``.

It runs on the daemon's trio loop, like every other reader of its state: the page
is rendered there (`Service.metrics_text`), never by a thread behind the loop's
back. What a scrape costs is bounded whoever sends it: one page is rendered at
most once a `REUSE` interval and served to every scrape meanwhile; at most
`MAX_CONNECTIONS` connections are served at once (one more is closed unanswered),
and at most `MAX_ACCEPTS` are taken a second; a request head is at most `MAX_HEAD`
bytes and must come whole within `TIMEOUT` seconds; each connection answers one
request and closes. h11 speaks the protocol.

Anyone who can reach the address reads the page: it names no job and no uid unless
the operator turned those series on (``--metrics-jobs``), and the address is the
loopback one unless given.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

import h11
import trio

from ..errors import ConfigError
from ..logs import log, logfmt

MAX_CONNECTIONS: Final = 16
#: Connections accepted in a second, at most.
MAX_ACCEPTS: Final = 200
#: What accept(2) fails with for a while, not for good.
_ACCEPT_RETRY: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
MAX_HEAD: Final = 8192
TIMEOUT: Final = 10.0
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


async def open_listeners(address: str) -> list[trio.SocketListener]:
    """The listening sockets of ``address``; ConfigError when it cannot be bound."""
    host, port = parse_address(address)
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ConfigError(f"--metrics-listen {address}: cannot listen: {exc.strerror}") from None


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


async def serve(
    listeners: list[trio.SocketListener],
    page: Page,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer scrapes on ``listeners`` until cancelled."""
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            where = listener.socket.getsockname()
            log.info(logfmt("metrics_listening", address=f"{where[0]}:{where[1]}"))
            nursery.start_soon(_accept, listener, limiter, page, nursery)
        task_status.started()


async def _accept(
    listener: trio.SocketListener,
    limiter: trio.CapacityLimiter,
    page: Page,
    nursery: trio.Nursery,
) -> None:
    """Take connections, at most `MAX_ACCEPTS` a second: a flood of connections
    costs the loop that fires the timers a bounded share of its time."""
    second, accepted = trio.current_time(), 0
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _ACCEPT_RETRY:
                raise
            await trio.sleep(0.1)  # out of descriptors or memory: it passes
            continue
        nursery.start_soon(_connection, stream, limiter, page)
        accepted += 1
        if trio.current_time() - second >= 1:
            second, accepted = trio.current_time(), 0
        elif accepted >= MAX_ACCEPTS:
            await trio.sleep_until(second + 1)
            second, accepted = trio.current_time(), 0


async def _connection(stream: trio.SocketStream, limiter: trio.CapacityLimiter, page: Page) -> None:
    try:
        limiter.acquire_nowait()
    except trio.WouldBlock:
        await trio.aclose_forcefully(stream)
        return
    try:
        with trio.move_on_after(TIMEOUT):
            await _answer(stream, page)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the scraper went away
    finally:
        limiter.release()
        await trio.aclose_forcefully(stream)


async def _answer(stream: trio.SocketStream, page: Page) -> None:
    server = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    try:
        request = await _request(stream, server)
    except h11.RemoteProtocolError:
        # h11 lets a server answer a request it could not parse, once.
        with contextlib.suppress(h11.LocalProtocolError):
            await _respond(stream, server, 400, b"a malformed request\n")
        return
    if request is None:
        return
    path = request.target.split(b"?", 1)[0]
    if request.method not in (b"GET", b"HEAD"):
        await _respond(stream, server, 405, b"GET /metrics\n", [(b"Allow", b"GET, HEAD")])
    elif path == b"/metrics":
        body = page.body()
        await _respond(stream, server, 200, body, [], head_only=request.method == b"HEAD")
    else:
        await _respond(stream, server, 404, b"the metrics are at /metrics\n")


async def _request(stream: trio.SocketStream, server: h11.Connection) -> h11.Request | None:
    """The request's head, once it came whole; None when the peer closed first."""
    while True:
        event = server.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            server.receive_data(data)
            if not data and server.their_state is not h11.DONE:
                return None
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _respond(
    stream: trio.SocketStream,
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
    await stream.send_all(data + server.send(h11.EndOfMessage()))
