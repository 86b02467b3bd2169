"""HTTP/1.1 client connections over trio streams, bounded in every size.

h11 speaks the protocol (the request's bytes, the response's framing: a
``Content-Length`` body, ``Transfer-Encoding: chunked`` as the gateway's streams
are, or a body that runs to the end of the connection, and whether the connection
may carry another request); this module moves its bytes over a trio stream, holds
what the peer sends to our bounds, and says what went wrong in this project's words.
Only what etcd's JSON gateway needs: a request is a ``POST`` with a JSON body.

Why h11 and not httpx: the etcd client keeps its own pool of idle connections under
its own limit of connections (watches included), and checks a pooled connection
for a peer that closed it before each use. httpx would bring anyio and a second
pool that holds connections outside that count, and it bounds neither a body nor a
streamed line, so ours would be counted around it all the same; h11 is the
protocol layer that httpx's own HTTP/1.1 stands on, without any of that.

Invariants:

- Nothing the peer sends is held past a bound (`Limits`): a response head (status
  line and headers) is at most ``max_head`` bytes in at most ``max_headers`` lines,
  and so are a chunked body's trailers; a chunk-size line is refused once
  ``max_head`` bytes of it wait for their end; a body read whole is at most
  ``max_body`` bytes, a line of a streamed body at most ``max_line`` bytes. A
  declared ``Content-Length`` over the bound is refused before anything of the body
  is read; a growing body or line is refused before it is copied past its bound.
  What is received at a time is at most 64 KiB, and no more than what is left of
  the bound while a head is read.
- Every way a connection can fail (an OSError, a TLS error, the end of the stream
  before the response did, an answer that is not HTTP/1.1, a bound exceeded) is
  raised as `ConnectionBroken`, or `ConnectFailed` while it is being opened, when
  the request cannot have reached the server. A broken connection is never used
  again; its owner closes it.
- A connection is `Connection.reusable` only after a response was read to its end,
  neither side asked to close, and nothing more arrived.
- Nothing here waits on a clock: callers bound each call with a trio cancel scope.
  A connection interrupted by a cancellation is in an unknown state and is closed.
"""

from __future__ import annotations

import functools
import select
import socket
import ssl
import urllib.parse
from collections.abc import AsyncGenerator, Iterable
from typing import Annotated, Final, Literal

import h11
import msgspec
import trio

#: Bytes asked of the stream at a time.
_RECEIVE: Final = 65536
#: Request heads kept made (`_request`): a few paths, a few body lengths each.
_REQUESTS: Final = 512
#: Bytes of a refused head quoted in the error, so that it shows what answered.
_QUOTED: Final = 80
#: TCP keepalive on every connection: an idle connection (a watch with nothing to
#: report) to a host that vanished without closing it, in a partition or a power
#: loss, fails after about 5 + 3 x 2 = 11 s instead of the kernel's two hours.
_KEEPALIVE: Final = (
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
)
#: h11's reasons for refusing what the peer sent, by how they begin, in the words
#: of this module's errors; h11's own text follows in parentheses, and a reason not
#: listed is given as h11 words it.
_REASONS: Final = (
    ("illegal status line", "not an HTTP/1.1 response"),
    # h11's name for a status line that starts with a control byte (TLS, say).
    ("illegal request line", "not an HTTP/1.1 response"),
    ("no response line", "not an HTTP/1.1 response"),
    ("illegal header line", "a malformed header line"),
    ("continuation line at start", "a malformed header line"),
    ("bad Content-Length", "a Content-Length that is not a number"),
    ("conflicting Content-Length", "a Content-Length that is not one number"),
    ("Only Transfer-Encoding", "a transfer encoding this client does not read"),
    ("multiple Transfer-Encoding", "a transfer encoding this client does not read"),
    ("illegal chunk header", "a chunk size that is not a number"),
    ("malformed chunk footer", "a chunk not followed by CRLF"),
    # max_incomplete_event_size: past a head, only a chunk-size line or trailers wait.
    ("Receive buffer too long", "a chunk size or trailers over the bound of a head"),
)


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The most a connection accepts from its peer."""

    max_head: Annotated[int, msgspec.Meta(ge=256)] = 16 * 1024
    max_headers: Annotated[int, msgspec.Meta(ge=8)] = 64
    max_body: Annotated[int, msgspec.Meta(ge=1024)] = 4 * 1024 * 1024
    max_line: Annotated[int, msgspec.Meta(ge=1024)] = 4 * 1024 * 1024


class ConnectionBroken(Exception):
    """The connection failed or its peer broke the protocol or a bound; the
    message says which. The connection must not be used again."""


class TooLarge(ConnectionBroken):
    """A body or a line of the response was over its bound (`Limits`): the peer
    answered, with more than this connection takes."""


class ConnectFailed(ConnectionBroken):
    """The connection could not be opened (refused, unreachable, no such host, a TLS
    handshake that failed): no request went out on it."""


class Endpoint(msgspec.Struct, frozen=True):
    """Where a server listens: ``http://host:port`` or ``https://host:port``."""

    scheme: Literal["http", "https"]
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """The endpoint of ``url``; ValueError, saying what is wrong, when it is not
        a scheme, a host and a port with nothing after them."""
        parts = urllib.parse.urlsplit(url)
        scheme: Literal["http", "https"] = "https" if parts.scheme == "https" else "http"
        if parts.scheme != scheme:
            raise ValueError(f"{url!r}: the scheme must be http or https")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or not parts.hostname.isascii() or port is None:
            raise ValueError(f"{url!r}: name a host and a port, as in http://127.0.0.1:2379")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise ValueError(f"{url!r}: only a scheme, a host and a port are allowed")
        return cls(scheme, parts.hostname, port)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}"

    @property
    def authority(self) -> str:
        """``host:port`` as a ``Host`` header writes it (an IPv6 address in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class Head(msgspec.Struct, frozen=True):
    """A response's status code and headers (names in lower case; a repeated header's
    values joined by ", ")."""

    status: int
    headers: dict[str, str]


async def open_connection(
    endpoint: Endpoint, ssl_context: ssl.SSLContext | None, limits: Limits
) -> Connection:
    """A new connection to ``endpoint``, through TLS for ``https``. Raises
    `ConnectFailed`."""
    try:
        tcp = await trio.open_tcp_stream(endpoint.host, endpoint.port)
    except OSError as exc:
        raise ConnectFailed(f"cannot connect to {endpoint}: {_cause(exc)}") from exc
    try:
        for level, option, value in _KEEPALIVE:
            tcp.setsockopt(level, option, value)
        if endpoint.scheme == "http":
            return Connection(tcp, tcp, endpoint, limits)
        assert ssl_context is not None, "an https endpoint needs a TLS context"
        tls = trio.SSLStream(tcp, ssl_context, server_hostname=endpoint.host, https_compatible=True)
        await tls.do_handshake()
    except BaseException as exc:
        await trio.aclose_forcefully(tcp)
        if isinstance(exc, trio.BrokenResourceError | OSError):
            raise ConnectFailed(f"cannot connect to {endpoint}: {_cause(exc)}") from exc
        raise
    return Connection(tls, tcp, endpoint, limits)


class Connection:
    """One HTTP/1.1 connection: a request, its response head, then its body read
    whole (`read_body`) or line by line (`read_lines`), and again while
    `reusable`."""

    def __init__(
        self, stream: trio.abc.Stream, tcp: trio.SocketStream, endpoint: Endpoint, limits: Limits
    ) -> None:
        self.endpoint = endpoint
        self._stream = stream
        self._fd = tcp.socket.fileno()
        self._limits = limits
        self._host = endpoint.authority.encode("ascii")
        # h11 refuses an incomplete event past this; a head cannot get there (its
        # reads stop at the bound, `_receive`), so it bounds chunk-size lines and
        # trailers.
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=limits.max_head)
        #: "idle" (ready for a request), "sent" (its head not read yet), "body" (the
        #: body is being read), "broken" (never used again).
        self._state = "idle"
        #: Bytes received of the response head being read, and its first bytes.
        self._head_bytes = 0
        self._head_start = b""
        #: Whether the peer ended the stream: what h11 refuses next is that end.
        self._ended = False
        #: Requests sent on this connection, for a caller to tell a fresh one.
        self.requests = 0

    @property
    def reusable(self) -> bool:
        return (
            self._state == "idle"
            and self._h11.our_state is h11.IDLE
            and not self._h11.trailing_data[0]
        )

    def closed_by_peer(self) -> bool:
        """Whether the idle connection has something to read: its peer closed it (or
        sent what no request asked for), so a request must not go out on it. A
        server that restarted leaves every pooled connection in this state."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0)) or bool(self._h11.trailing_data[0])

    async def aclose(self) -> None:
        self._state = "broken"
        await trio.aclose_forcefully(self._stream)

    async def send(self, path: str, body: bytes) -> None:
        """Send ``POST path`` with the JSON ``body``."""
        assert self._state == "idle", f"a request on a connection that is {self._state}"
        self._state = "broken"  # until the request went out whole
        request = _request(self._host, path, len(body))
        data = self._h11.send(request) + self._h11.send(h11.Data(data=body))
        data += self._h11.send(h11.EndOfMessage())
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionBroken(f"sending to {self.endpoint} failed: {_cause(exc)}") from exc
        self.requests += 1
        self._state = "sent"

    async def receive_head(self) -> Head:
        """The response's head, once it has come whole; its body is read next."""
        assert self._state == "sent", f"a response head on a connection that is {self._state}"
        self._state = "broken"  # until the head is read and understood
        self._head_bytes, self._head_start = 0, b""
        event = await self._next_event("a response head", head=True)
        while isinstance(event, h11.InformationalResponse):  # interim answers: skipped
            # What came after it is the next head's, and counts against its bound.
            self._head_bytes = len(self._h11.trailing_data[0])
            event = await self._next_event("a response head", head=True)
        assert isinstance(event, h11.Response), event
        if len(event.headers) > self._limits.max_headers:
            raise self._broken(f"more than {self._limits.max_headers} header lines")
        head = Head(event.status_code, _joined(event.headers))
        # h11 checked that it is a number of at most 20 digits; a chunked body
        # would ignore it.
        declared = int(head.headers.get("content-length", "0"))
        if declared > self._limits.max_body and "transfer-encoding" not in head.headers:
            bound = self._limits.max_body
            raise self._broken(f"a body of {declared} bytes, over the bound of {bound}", TooLarge)
        self._state = "body"
        return head

    async def read_body(self) -> bytes:
        """The rest of the response's body, at most ``max_body`` bytes."""
        body = bytearray()
        while data := await self._read_some():
            if len(body) + len(data) > self._limits.max_body:
                raise self._broken(
                    f"a body over the bound of {self._limits.max_body} bytes", TooLarge
                )
            body += data
        return bytes(body)

    async def read_lines(self) -> AsyncGenerator[bytes, None]:
        """The rest of the body, a line at a time (without its line end), each line
        as soon as it has come whole: the gateway writes one JSON message a line."""
        bound = self._limits.max_line
        line = bytearray()
        while data := await self._read_some():
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                if len(line) + end - start > bound:
                    raise self._broken(f"a line over the bound of {bound} bytes", TooLarge)
                line += data[start:end]
                yield bytes(line.rstrip(b"\r"))
                line.clear()
                start = end + 1
            if len(line) + len(data) - start > bound:
                raise self._broken(f"a line over the bound of {bound} bytes", TooLarge)
            line += data[start:]
        if line:
            yield bytes(line)

    async def _read_some(self) -> bytes:
        """The next piece of the body; b"" once it has ended, when the connection is
        idle again (or, when it cannot carry another request, spent)."""
        assert self._state == "body", f"a body read on a connection that is {self._state}"
        event = await self._next_event("a body", head=False)
        if isinstance(event, h11.Data):
            return event.data
        assert isinstance(event, h11.EndOfMessage), event
        trailers = event.headers
        size = sum(len(name) + len(value) + 4 for name, value in trailers)
        if size > self._limits.max_head or len(trailers) > self._limits.max_headers:
            raise self._broken("trailers over the bounds of a response head")
        # h11 ends a body that runs to the end of the stream as if the connection
        # could carry another; it cannot.
        done = self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE
        if done and not self._ended:
            self._h11.start_next_cycle()
            self._state = "idle"
        else:  # either side asked to close, or the stream has ended
            self._state = "broken"
        return b""

    async def _next_event(self, what: str, *, head: bool) -> h11.Event:
        """The next thing h11 makes of the response, receiving as it needs."""
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise self._refused(what, str(exc), head=head) from None
            if isinstance(event, h11.Event):
                return event
            # PAUSED comes only after the end of a response, which is never read past.
            assert event is h11.NEED_DATA, event
            await self._receive(what, head=head)

    async def _receive(self, what: str, *, head: bool) -> None:
        room = _RECEIVE
        if head:
            # Never more than the head's bound: h11 would parse a head that came
            # whole in one read, however long.
            room = self._limits.max_head - self._head_bytes
            if room <= 0:
                raise self._broken(f"a response head over {self._limits.max_head} bytes")
        try:
            # bytes() of bytes is the same object: a copy only of a bytearray.
            data = bytes(await self._stream.receive_some(room))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._broken(f"receiving failed: {_cause(exc)}") from exc
        if head:
            self._head_bytes += len(data)
            self._head_start = self._head_start or data[:_QUOTED]
        self._ended = not data
        self._h11.receive_data(data)

    def _refused(self, what: str, reason: str, *, head: bool) -> ConnectionBroken:
        """The error for what h11 refused of the response, read in ``what``."""
        # h11 had all the data before the end and wanted more, so the end is what
        # it refuses now.
        if self._ended:
            return self._broken(f"the connection closed in {what}")
        if len(reason) > _QUOTED * 2:  # h11 quotes a refused line whole
            reason = f"{reason[: _QUOTED * 2]}..."
        words = next((ours for theirs, ours in _REASONS if reason.startswith(theirs)), None)
        text = reason if words is None else f"{words} ({reason})"
        if head:
            text += f", in a head that began {self._head_start!r}"
        return self._broken(text)

    def _broken(
        self, what: str, kind: type[ConnectionBroken] = ConnectionBroken
    ) -> ConnectionBroken:
        self._state = "broken"
        return kind(f"{self.endpoint}: {what}")


@functools.lru_cache(maxsize=_REQUESTS)
def _request(host: bytes, path: str, length: int) -> h11.Request:
    """The head of a ``POST`` of a JSON body of ``length`` bytes to ``path``: one
    object for every request alike, since h11 checks every header of a new one."""
    headers = [
        (b"Host", host),
        (b"Content-Type", b"application/json"),
        (b"Accept", b"application/json"),
        (b"Content-Length", b"%d" % length),
    ]
    return h11.Request(method=b"POST", target=path.encode("ascii"), headers=headers)


def _joined(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Headers by their lower-case name (h11 writes names so), a repeated header's
    values joined by ", "."""
    joined: dict[str, str] = {}
    for raw_name, raw_value in headers:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        joined[name] = f"{joined[name]}, {value}" if name in joined else value
    return joined


def _cause(exc: BaseException) -> str:
    """What went wrong: trio raises the real error (an ssl.SSLError, the refusal of
    each address tried) as the cause of one that says little."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[-1]
    inner = exc if cause is None else cause
    return str(inner) or type(inner).__name__
