"""HTTP/1.1 client connections over trio streams, bounded in every size.

httptools (llhttp, the parser of Node.js, in C) reads the response's framing: a
``Content-Length`` body, ``Transfer-Encoding: chunked`` as the gateway's streams
are, or a body that runs to the end of the connection, and whether the connection
may carry another request. The request's head is written here: the only request is a
``POST`` of a JSON body to one of etcd's fixed paths, on an `Endpoint` whose host was
checked when it was parsed. This module moves the bytes over a trio stream, holds
what the peer sends to our bounds, and says what went wrong in this project's words.

Why httptools: h11, the sans-IO HTTP/1.1 of the trio ecosystem, was this module's
parser first; in pure Python it took about as much CPU as everything else of an etcd
call together, and its per-chunk work showed in every watch event a fleet of daemons
reads (docs/benchmarks.md, "The fleet's HTTP"). httpx would bring anyio and a second
pool that holds connections outside the etcd client's own count, and it bounds
neither a body nor a streamed line. h11 still serves the scrape endpoint
(`watchdogd.runtime.scrape`), where one request a second costs nothing.

Invariants:

- Nothing the peer sends is held past a bound (`Limits`): a response head (status
  line and headers) is at most ``max_head`` bytes in at most ``max_headers`` lines
  (each interim head has a bound of its own), and so are a chunked body's trailers;
  what is received in a body past a head without a byte of the body in it (a
  chunk-size line that never ends, trailers) is refused past ``max_head`` bytes; a
  body read whole is at most ``max_body`` bytes, a line of a streamed body at most
  ``max_line`` bytes. A declared ``Content-Length`` over the bound is refused before
  anything of the body is read; a growing body or line is refused before it is
  copied past its bound. What is received at a time is at most 64 KiB, and no more
  than what is left of the bound while a head is read.
- Every way a connection can fail (an OSError, a TLS error, the end of the stream
  before the response did, an answer that is not HTTP/1.x, a bound exceeded) is
  raised as `ConnectionBroken`, or `ConnectFailed` while it is being opened, when
  the request cannot have reached the server. A broken connection is never used
  again; its owner closes it.
- A connection is `Connection.reusable` only after a response was read to its end,
  neither side asked to close, and nothing more arrived.
- Nothing here waits on a clock: callers bound each call with a trio cancel scope.
  A connection interrupted by a cancellation is in an unknown state and is closed.
"""

from __future__ import annotations

import collections
import functools
import select
import socket
import ssl
import urllib.parse
from collections.abc import AsyncGenerator
from typing import Annotated, Final, Literal

import httptools
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
_NOT_HTTP: Final = "not an HTTP/1.1 response"
_BAD_HEADER: Final = "a malformed header line"
_BAD_LENGTH: Final = "a Content-Length that is not a number"
_BAD_CHUNK: Final = "a chunk size that is not a number"
#: llhttp's reasons for refusing what the peer sent, by how they begin, in the words
#: of this module's errors; llhttp's own text follows in parentheses, and a reason
#: not listed is given as llhttp words it.
_REASONS: Final = (
    ("Expected HTTP/", _NOT_HTTP),
    ("Invalid major version", _NOT_HTTP),
    ("Invalid minor version", _NOT_HTTP),
    ("Expected dot", _NOT_HTTP),
    ("Invalid status", _NOT_HTTP),
    ("Expected space after", _NOT_HTTP),
    ("Missing expected CR after response line", _NOT_HTTP),
    ("Missing expected LF after response line", _NOT_HTTP),
    ("Invalid header", _BAD_HEADER),
    ("Unexpected whitespace", _BAD_HEADER),
    ("Unexpected space", _BAD_HEADER),
    ("Missing expected CR after header", _BAD_HEADER),
    ("Missing expected LF after header", _BAD_HEADER),
    ("Invalid character in Content-Length", _BAD_LENGTH),
    ("Content-Length overflow", _BAD_LENGTH),
    ("Duplicate Content-Length", "a Content-Length that is not one number"),
    (
        "Content-Length can't be present with Transfer-Encoding",
        "a Content-Length and a transfer encoding",
    ),
    ("Invalid character in chunk size", _BAD_CHUNK),
    ("Chunk size overflow", _BAD_CHUNK),
    ("Expected LF after chunk", "a chunk not followed by CRLF"),
    ("Expected CR", "a chunk not followed by CRLF"),
    ("Invalid character in chunk ext", "a malformed chunk-size line"),
)
#: Characters an endpoint's host may not hold: it is written into each request's head.
_UNSAFE_HOST: Final = frozenset(" \t\r\n/\\@?#")


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
        host = parts.hostname or ""
        if not host.isascii() or not host.isprintable() or _UNSAFE_HOST & set(host):
            host = ""  # written into every request's head: plain characters only
        if not host or port is None:
            raise ValueError(f"{url!r}: name a host and a port, as in http://127.0.0.1:2379")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise ValueError(f"{url!r}: only a scheme, a host and a port are allowed")
        return cls(scheme, host, port)

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


class _Response:
    """What llhttp found so far of the response being read: httptools calls these
    methods from `httptools.HttpResponseParser.feed_data`, and `Connection` judges
    the result after each feed (a callback that raised would leave the parser's
    state unknown)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.expect()

    def expect(self) -> None:
        """A request went out: what comes next is its response."""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        #: Header lines of the head being read; lines and bytes of the trailers.
        self.lines = 0
        self.trailer_lines = 0
        self.trailer_bytes = 0
        #: Interim (1xx) heads skipped so far, and about their bytes (`head_size`).
        self.interims = 0
        self.skipped = 0
        self.body: collections.deque[bytes] = collections.deque()
        #: Whether a feed since the head brought a piece of the body, a chunk's
        #: size line or the end of the body.
        self.progress = False
        self.complete = False
        self.keep_alive = False
        #: Whether anything came after the response: the connection is spent.
        self.extra = False

    def on_message_begin(self) -> None:
        if self.complete:
            self.extra = True

    # What comes after the response (``extra``) is not read: it spends the connection.

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.extra:
            return
        if self.head_done:  # a trailer: its bounds are checked, its value dropped
            self.trailer_lines += 1
            self.trailer_bytes += len(name) + len(value) + 4
            return
        self.lines += 1
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        if self.extra:
            return
        self.status = self.parser.get_status_code()
        self.head_done = True
        self.progress = False

    def on_body(self, body: bytes) -> None:
        if self.extra:
            return
        self.body.append(body)
        self.progress = True

    def on_chunk_header(self) -> None:
        self.progress = True

    def on_message_complete(self) -> None:
        if self.extra:
            return
        if 100 <= self.status < 200:  # an interim answer: skipped, its head dropped
            self.interims += 1
            self.skipped += self.head_size()
            self.status, self.headers, self.head_done, self.lines = 0, {}, False, 0
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = self.progress = True

    def head_size(self) -> int:
        """About the bytes of the head read, as written plainly: its status line and
        its headers' lines."""
        return 17 + sum(len(name) + len(value) + 4 for name, value in self.headers.items()) + 2

    def runs_to_the_end(self) -> bool:
        """Whether the body, framed neither by a length nor by chunks, ends with the
        connection."""
        framed = "content-length" in self.headers or "transfer-encoding" in self.headers
        return self.head_done and not framed and self.status not in (204, 304)


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
        self._response = _Response()
        #: "idle" (ready for a request), "sent" (its head not read yet), "body" (the
        #: body is being read), "broken" (never used again).
        self._state = "idle"
        #: The first bytes of the response head being read, quoted when it is refused.
        self._head_start = b""
        #: Bytes received in the body since a feed last brought something of it.
        self._stalled = 0
        #: Requests sent on this connection, for a caller to tell a fresh one.
        self.requests = 0

    @property
    def reusable(self) -> bool:
        return self._state == "idle" and not self._response.extra

    def closed_by_peer(self) -> bool:
        """Whether the idle connection has something to read: its peer closed it (or
        sent what no request asked for), so a request must not go out on it. A
        server that restarted leaves every pooled connection in this state."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0)) or self._response.extra

    async def aclose(self) -> None:
        self._state = "broken"
        await trio.aclose_forcefully(self._stream)

    async def send(self, path: str, body: bytes) -> None:
        """Send ``POST path`` with the JSON ``body``."""
        assert self._state == "idle", f"a request on a connection that is {self._state}"
        self._state = "broken"  # until the request went out whole
        self._response.expect()
        try:
            await self._stream.send_all(_request(self._host, path, len(body)) + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionBroken(f"sending to {self.endpoint} failed: {_cause(exc)}") from exc
        self.requests += 1
        self._state = "sent"

    async def receive_head(self) -> Head:
        """The response's head, once it has come whole; its body is read next."""
        assert self._state == "sent", f"a response head on a connection that is {self._state}"
        self._state = "broken"  # until the head is read and understood
        response, limits = self._response, self._limits
        self._head_start, received = b"", 0
        while not response.head_done:
            # Never more than the head's bound: llhttp would parse a head that came
            # whole in one read, however long. Each interim head has its own.
            room = limits.max_head * (1 + response.interims) - received
            if room <= 0:
                raise self._broken(f"a response head over {limits.max_head} bytes")
            data = await self._receive(room, "a response head")
            self._head_start = self._head_start or data[:_QUOTED]
            received += len(data)
            self._feed(data, "a response head")
        # Counted once the head is whole, as its bytes bounded what it could hold.
        if response.lines > limits.max_headers:
            raise self._broken(f"more than {limits.max_headers} header lines")
        if self._response.parser.get_http_version() not in ("1.0", "1.1"):
            raise self._broken(f"{_NOT_HTTP}, in a head that began {self._head_start!r}")
        head = Head(response.status, response.headers)
        encoding = head.headers.get("transfer-encoding")
        if encoding is not None and encoding.lower() != "chunked":
            raise self._broken(f"a transfer encoding this client does not read ({encoding})")
        # llhttp checked that it is a number, and a chunked body comes without one.
        declared = int(head.headers.get("content-length", "0"))
        if declared > limits.max_body:
            bound = limits.max_body
            raise self._broken(f"a body of {declared} bytes, over the bound of {bound}", TooLarge)
        # What came after the head with it, before any of the body, waits as long.
        after = received - response.skipped - response.head_size()
        self._stalled = 0 if response.progress else max(0, after)
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
        # A long line comes in many pieces: they are joined once it has ended (a
        # buffer grown piece by piece would be copied over and over).
        pieces: list[bytes] = []
        size = 0
        while data := await self._read_some():
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                if size + end - start > bound:
                    raise self._broken(f"a line over the bound of {bound} bytes", TooLarge)
                pieces.append(data[start:end])
                yield b"".join(pieces).rstrip(b"\r")
                pieces.clear()
                size = 0
                start = end + 1
            size += len(data) - start
            if size > bound:
                raise self._broken(f"a line over the bound of {bound} bytes", TooLarge)
            if start < len(data):
                pieces.append(data[start:])
        if pieces:
            yield b"".join(pieces)

    async def _read_some(self) -> bytes:
        """The next piece of the body; b"" once it has ended, when the connection is
        idle again (or, when it cannot carry another request, spent)."""
        assert self._state == "body", f"a body read on a connection that is {self._state}"
        response, limits = self._response, self._limits
        while not response.body:
            if response.complete:
                self._check_trailers()
                if response.keep_alive and not response.extra:
                    self._state = "idle"
                else:  # either side asked to close
                    self._state = "broken"
                return b""
            data = await self._receive(_RECEIVE, "a body")
            if not data:  # the end of the stream ends only a body framed by it
                self._state = "broken"
                return b""
            response.progress = False
            self._feed(data, "a body")
            self._stalled = 0 if response.progress else self._stalled + len(data)
            if self._stalled > limits.max_head:
                raise self._broken("a chunk size or trailers over the bound of a head")
            self._check_trailers()
        return response.body.popleft()

    def _check_trailers(self) -> None:
        response, limits = self._response, self._limits
        if response.trailer_lines > limits.max_headers or response.trailer_bytes > limits.max_head:
            raise self._broken("trailers over the bounds of a response head")

    async def _receive(self, room: int, what: str) -> bytes:
        """At most ``room`` bytes of what the peer sent; b"" where the stream ended
        and the response in ``what`` may end with it (a body framed by the end)."""
        try:
            # bytes() of bytes is the same object: a copy only of a bytearray.
            data = bytes(await self._stream.receive_some(room))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._broken(f"receiving failed: {_cause(exc)}") from exc
        if not data and not self._response.runs_to_the_end():
            raise self._broken(f"the connection closed in {what}")
        if not data:
            self._response.complete = True
        return data

    def _feed(self, data: bytes, what: str) -> None:
        try:
            self._response.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise self._broken(f"a protocol upgrade no request asked for, in {what}") from None
        except httptools.HttpParserError as exc:
            reason = str(exc)
            if len(reason) > _QUOTED * 2:
                reason = f"{reason[: _QUOTED * 2]}..."
            words = next((ours for theirs, ours in _REASONS if reason.startswith(theirs)), None)
            text = reason if words is None else f"{words} ({reason})"
            if not self._response.head_done:
                text += f", in a head that began {self._head_start!r}"
            raise self._broken(text) from None

    def _broken(
        self, what: str, kind: type[ConnectionBroken] = ConnectionBroken
    ) -> ConnectionBroken:
        self._state = "broken"
        return kind(f"{self.endpoint}: {what}")


@functools.lru_cache(maxsize=_REQUESTS)
def _request(host: bytes, path: str, length: int) -> bytes:
    """The head of a ``POST`` of a JSON body of ``length`` bytes to ``path`` (one of
    the gateway's fixed paths) on ``host`` (an `Endpoint`'s checked authority)."""
    assert path.isascii(), path
    assert path.isprintable(), path
    assert " " not in path, path
    return b"".join(
        (
            b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (path.encode("ascii"), host),
            b"Content-Type: application/json\r\nAccept: application/json\r\n",
            b"Content-Length: %d\r\n\r\n" % length,
        )
    )


def _cause(exc: BaseException) -> str:
    """What went wrong: trio raises the real error (an ssl.SSLError, the refusal of
    each address tried) as the cause of one that says little."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[-1]
    inner = exc if cause is None else cause
    return str(inner) or type(inner).__name__
