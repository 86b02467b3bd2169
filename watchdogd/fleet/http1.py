"""HTTP/1.1 client connections over trio streams, bounded in every size.

Only what etcd's JSON gateway needs: a request is a ``POST`` with a
``Content-Length`` body; a response body comes with ``Content-Length``, with
``Transfer-Encoding: chunked`` (the gateway's streams), or without either and runs
to the end of the connection.

Invariants:

- Nothing the peer sends is held past a bound (`Limits`): a response head (status
  line, headers, and a chunked body's trailers) is at most ``max_head`` bytes in at
  most ``max_headers`` lines, a body read whole at most ``max_body`` bytes, a line of
  a streamed body at most ``max_line`` bytes. A declared ``Content-Length`` over the
  bound is refused before anything of the body is read.
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

import select
import socket
import ssl
import urllib.parse
from collections.abc import AsyncGenerator
from typing import Annotated, Final, Literal

import msgspec
import trio

#: Bytes asked of the stream at a time.
_RECEIVE: Final = 65536
#: A chunk-size line ("1f4;ext=1") is short; anything longer is not HTTP.
_MAX_CHUNK_LINE: Final = 1024
#: TCP keepalive on every connection: an idle connection (a watch with nothing to
#: report) to a host that vanished without closing it, in a partition or a power
#: loss, fails after about 5 + 3 x 2 = 11 s instead of the kernel's two hours.
_KEEPALIVE: Final = (
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
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
        self._buffer = bytearray()
        #: "idle" (ready for a request), "sent" (its head not read yet), "body" (the
        #: body is being read), "broken" (never used again).
        self._state = "idle"
        self._keep_alive = True
        self._framing: Literal["chunked", "length", "eof"] = "eof"
        self._left = 0  # bytes left of the body or of the current chunk
        self._chunk_crlf = False  # the CRLF after a chunk's data is still to be read
        self._done = False
        #: Requests sent on this connection, for a caller to tell a fresh one.
        self.requests = 0

    @property
    def reusable(self) -> bool:
        return self._state == "idle" and self._keep_alive and not self._buffer

    def closed_by_peer(self) -> bool:
        """Whether the idle connection has something to read: its peer closed it (or
        sent what no request asked for), so a request must not go out on it. A
        server that restarted leaves every pooled connection in this state."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0)) or bool(self._buffer)

    async def aclose(self) -> None:
        self._state = "broken"
        await trio.aclose_forcefully(self._stream)

    async def send(self, path: str, body: bytes) -> None:
        """Send ``POST path`` with the JSON ``body``."""
        assert self._state == "idle", f"a request on a connection that is {self._state}"
        self._state = "broken"  # until the request went out whole
        head = (
            f"POST {path} HTTP/1.1\r\n"
            f"Host: {self.endpoint.authority}\r\n"
            "Content-Type: application/json\r\n"
            "Accept: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("ascii")
        try:
            await self._stream.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionBroken(f"sending to {self.endpoint} failed: {_cause(exc)}") from exc
        self.requests += 1
        self._state = "sent"

    async def receive_head(self) -> Head:
        """The response's head, once it has come whole; its body is read next."""
        assert self._state == "sent", f"a response head on a connection that is {self._state}"
        self._state = "broken"  # until the head is read and understood
        head = await self._read_head()
        while 100 <= head.status < 200:  # interim answers precede the real one
            head = await self._read_head()
        connection = head.headers.get("connection", "").lower()
        if "close" in connection:
            self._keep_alive = False
        encoding = head.headers.get("transfer-encoding")
        length = head.headers.get("content-length")
        if encoding is not None:
            if encoding.lower().rsplit(",", 1)[-1].strip() != "chunked":
                raise self._broken(f"a transfer encoding this client does not read: {encoding}")
            self._framing, self._left, self._chunk_crlf = "chunked", 0, False
        elif length is not None:
            if not length.isdigit():
                raise self._broken(f"a Content-Length that is not a number: {length!r}")
            self._left = int(length)
            if self._left > self._limits.max_body:
                raise self._broken(
                    f"a body of {self._left} bytes, over the bound of {self._limits.max_body}",
                    TooLarge,
                )
            self._framing = "length"
        else:
            self._framing, self._keep_alive = "eof", False
        self._done = False
        self._state = "body"
        return head

    async def read_body(self) -> bytes:
        """The rest of the response's body, at most ``max_body`` bytes."""
        body = bytearray()
        while data := await self._read_some():
            body += data
            if len(body) > self._limits.max_body:
                raise self._broken(
                    f"a body over the bound of {self._limits.max_body} bytes", TooLarge
                )
        return bytes(body)

    async def read_lines(self) -> AsyncGenerator[bytes, None]:
        """The rest of the body, a line at a time (without its line end), each line
        as soon as it has come whole: the gateway writes one JSON message a line."""
        line = bytearray()
        while data := await self._read_some():
            line += data
            *whole, rest = line.split(b"\n")
            for one in [*whole, rest]:
                if len(one) > self._limits.max_line:
                    raise self._broken(
                        f"a line over the bound of {self._limits.max_line} bytes", TooLarge
                    )
            for one in whole:
                yield bytes(one.rstrip(b"\r"))
            line = bytearray(rest)
        if line:
            yield bytes(line)

    async def _read_head(self) -> Head:
        end = self._buffer.find(b"\r\n\r\n")
        while end < 0:
            if len(self._buffer) > self._limits.max_head:
                raise self._broken(f"a response head over {self._limits.max_head} bytes")
            await self._fill("a response head")
            end = self._buffer.find(b"\r\n\r\n")
        if end > self._limits.max_head:
            raise self._broken(f"a response head over {self._limits.max_head} bytes")
        status_line, *lines = bytes(self._buffer[:end]).split(b"\r\n")
        del self._buffer[: end + 4]
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise self._broken(f"not an HTTP/1.1 response: {status_line[:80]!r}")
        if version == b"HTTP/1.0":
            self._keep_alive = False
        return Head(int(code), self._headers(lines))

    def _headers(self, lines: list[bytes]) -> dict[str, str]:
        if len(lines) > self._limits.max_headers:
            raise self._broken(f"more than {self._limits.max_headers} header lines")
        headers: dict[str, str] = {}
        for line in lines:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise self._broken(f"a malformed header line: {line[:80]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        return headers

    async def _read_some(self) -> bytes:
        """The next piece of the body; b"" once it has ended, when the connection is
        idle again (or, for a body that ran to the end of the stream, spent)."""
        assert self._state == "body", f"a body read on a connection that is {self._state}"
        if self._done:
            return b""
        if self._framing == "chunked":
            data = await self._read_chunked()
        elif self._framing == "length":
            data = await self._read_length()
        else:
            data = await self._read_to_eof()
        if self._done:
            self._state = "idle" if self._framing != "eof" else "broken"
        return data

    async def _read_length(self) -> bytes:
        if self._left == 0:
            self._done = True
            return b""
        if not self._buffer:
            await self._fill("a body")
        return self._take(self._left)

    async def _read_to_eof(self) -> bytes:
        if not self._buffer and not await self._receive_into_buffer():
            self._done = True
            return b""
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def _read_chunked(self) -> bytes:
        if self._chunk_crlf:
            while len(self._buffer) < 2:
                await self._fill("a chunk's end")
            if self._buffer[:2] != b"\r\n":
                raise self._broken("a chunk not followed by CRLF")
            del self._buffer[:2]
            self._chunk_crlf = False
        if self._left == 0:
            line = await self._read_line(_MAX_CHUNK_LINE, "a chunk size")
            size = line.split(b";", 1)[0].strip()
            try:
                self._left = int(size, 16)
            except ValueError:
                raise self._broken(f"a chunk size that is not a number: {size[:20]!r}") from None
            if self._left == 0:
                await self._read_trailers()
                self._done = True
                return b""
        if not self._buffer:
            await self._fill("a chunk")
        data = self._take(self._left)
        self._chunk_crlf = self._left == 0
        return data

    async def _read_trailers(self) -> None:
        size = count = 0
        while line := await self._read_line(self._limits.max_head, "a trailer"):
            size += len(line) + 2
            count += 1
            if size > self._limits.max_head or count > self._limits.max_headers:
                raise self._broken("trailers over the bounds of a response head")

    async def _read_line(self, limit: int, what: str) -> bytes:
        end = self._buffer.find(b"\r\n")
        while end < 0:
            if len(self._buffer) > limit:
                raise self._broken(f"{what} over {limit} bytes")
            await self._fill(what)
            end = self._buffer.find(b"\r\n")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _take(self, most: int) -> bytes:
        data = bytes(self._buffer[:most])
        del self._buffer[:most]
        self._left -= len(data)
        return data

    async def _fill(self, what: str) -> None:
        if not await self._receive_into_buffer():
            raise self._broken(f"the connection closed in {what}")

    async def _receive_into_buffer(self) -> bool:
        try:
            data = await self._stream.receive_some(_RECEIVE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._broken(f"receiving failed: {_cause(exc)}") from exc
        self._buffer += data
        return bool(data)

    def _broken(
        self, what: str, kind: type[ConnectionBroken] = ConnectionBroken
    ) -> ConnectionBroken:
        self._state = "broken"
        return kind(f"{self.endpoint}: {what}")


def _cause(exc: BaseException) -> str:
    """What went wrong: trio raises the real error (an ssl.SSLError, the refusal of
    each address tried) as the cause of one that says little."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        cause = cause.exceptions[-1]
    inner = exc if cause is None else cause
    return str(inner) or type(inner).__name__
