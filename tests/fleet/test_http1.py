"""The HTTP/1.1 client connection against a real TCP server in the test that answers
with exact bytes: framing, keep-alive, streamed lines, bounds, and broken peers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio

from watchdogd.fleet.http1 import (
    ConnectFailed,
    Connection,
    ConnectionBroken,
    Endpoint,
    Limits,
    open_connection,
)

from helpers.etcd import free_ports
from helpers.waiting import PATIENCE

#: What the server does for one request: write these bytes, or run this on the stream.
Answer = bytes | Callable[[trio.SocketStream], Awaitable[None]]


class Server:
    """Answers the requests of each connection with the next answers in turn, then
    closes the connection; keeps what it was sent."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.requests: list[bytes] = []
        self.endpoint = Endpoint("http", "127.0.0.1", 0)

    async def handle(self, stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while self.answers:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                self.requests.append(head + b"\r\n\r\n" + buffer[:length])
                buffer = buffer[length:]
                answer = self.answers.pop(0)
                if isinstance(answer, bytes):
                    await stream.send_all(answer)
                else:
                    await answer(stream)


@contextlib.asynccontextmanager
async def serving(*answers: Answer) -> AsyncIterator[Server]:
    server = Server(list(answers))
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        server.endpoint = Endpoint("http", "127.0.0.1", port)
        nursery.start_soon(trio.serve_listeners, server.handle, listeners)
        yield server
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def connected(server: Server, limits: Limits | None = None) -> AsyncIterator[Connection]:
    connection = await open_connection(server.endpoint, None, limits or Limits())
    try:
        yield connection
    finally:
        await connection.aclose()


def ok(body: bytes, *headers: str) -> bytes:
    lines = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\n{lines}Content-Length: {len(body)}\r\n\r\n".encode() + body


def chunked(*chunks: bytes, trailers: bytes = b"") -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + body + b"0\r\n" + trailers + b"\r\n"


async def post(connection: Connection, body: bytes = b"{}") -> tuple[int, bytes]:
    with trio.fail_after(PATIENCE):
        await connection.send("/v3/kv/range", body)
        head = await connection.receive_head()
        return head.status, await connection.read_body()


async def test_a_connection_is_kept_alive_for_the_next_request() -> None:
    async with serving(ok(b'{"a":1}'), ok(b"")) as server, connected(server) as connection:
        assert await post(connection, b'{"key":"eA=="}') == (200, b'{"a":1}')
        assert connection.reusable
        assert not connection.closed_by_peer()
        assert await post(connection) == (200, b"")
        assert connection.requests == 2
    port = server.endpoint.port
    assert server.requests[0] == (
        b"POST /v3/kv/range HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/json\r\nAccept: application/json\r\n"
        b'Content-Length: 14\r\n\r\n{"key":"eA=="}' % port
    )


async def test_a_connection_its_server_closed_says_so() -> None:
    async with serving(ok(b"")) as server, connected(server) as connection:
        await post(connection)
        with trio.fail_after(PATIENCE):
            while not connection.closed_by_peer():
                await trio.sleep(0.01)


async def test_chunked_body_read_whole_with_extensions_and_trailers() -> None:
    answer = chunked(b"ab", b"c" * 300, trailers=b"X-Trailer: 1\r\n").replace(
        b"\r\n2\r\n", b"\r\n2;name=value\r\n"
    )
    async with serving(answer, ok(b"next")) as server, connected(server) as connection:
        assert await post(connection) == (200, b"ab" + b"c" * 300)
        assert connection.reusable
        assert await post(connection) == (200, b"next")


async def test_streamed_lines_arrive_as_each_is_whole() -> None:
    seen = trio.Event()

    async def stream_lines(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await stream.send_all(b'8\r\n{"n":1}\n\r\n4\r\n{"n"\r\n')
        await seen.wait()  # the first line got through before any more was sent
        await stream.send_all(b'4\r\n:2}\n\r\n5\r\n{"n":\r\n3\r\n3}\n\r\n0\r\n\r\n')

    async with serving(stream_lines) as server, connected(server) as connection:
        lines = []
        with trio.fail_after(PATIENCE):
            await connection.send("/v3/watch", b"{}")
            await connection.receive_head()
            async for line in connection.read_lines():
                lines.append(line)
                seen.set()
        assert lines == [b'{"n":1}', b'{"n":2}', b'{"n":3}']
        assert connection.reusable


async def test_a_body_without_length_runs_to_the_end_of_the_connection() -> None:
    async with (
        serving(b"HTTP/1.1 200 OK\r\n\r\nto the end") as server,
        connected(server) as connection,
    ):
        assert await post(connection) == (200, b"to the end")
        assert not connection.reusable


async def test_interim_answers_are_skipped_and_close_is_honoured() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"x", "Connection: close")
    async with serving(answer) as server, connected(server) as connection:
        assert await post(connection) == (200, b"x")
        assert not connection.reusable


@pytest.mark.parametrize(
    ("answer", "limits", "message"),
    [
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 3000, Limits(), "head over 16384 bytes"),
        (ok(b"", *["X: y"] * 64), Limits(), "more than 64 header lines"),
        # Refused on its declared length: the body itself never comes.
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n", Limits(max_body=4096), "5000"),
        (chunked(b"x" * 3000, b"x" * 3000), Limits(max_body=4096), "over the bound"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", Limits(), "not an HTTP/1.1 response"),
        (b"HTTP/1.1 200 OK\r\nbad line\r\n\r\n", Limits(), "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", Limits(), "not a number"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", Limits(), "gzip"),
        (chunked(b"x").replace(b"1\r\n", b"z\r\n", 1), Limits(), "chunk size"),
        (chunked(b"xy").replace(b"xy\r\n", b"xyz"), Limits(), "not followed by CRLF"),
        (ok(b"0123456789")[:-4], Limits(), "closed in a body"),
        (b"HTTP/1.1 200 OK\r\nContent-", Limits(), "closed in a response head"),
        # Sent at once, blank line and all: refused on its size alone.
        (ok(b"", "X: " + "y" * 16400), Limits(), "head over 16384 bytes"),
        # Twenty digits at most: a longer number is refused, never converted.
        (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", Limits(), "number"),
        (chunked(b"x" * 4097), Limits(max_body=4096), "over the bound of 4096"),
        # A chunk-size line that never ends, held only to the head's bound.
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"e" * 20000,
            Limits(),
            "chunk size or trailers over",
        ),
        (chunked(b"x", trailers=b"X: y\r\n" * 65), Limits(), "trailers over"),
        (chunked(b"x", trailers=b"X: " + b"y" * 16400 + b"\r\n"), Limits(), "trailers over"),
        (chunked(b"x" * 100)[:-20], Limits(), "closed in a body"),
        # A TLS server's first bytes: refused at once, without waiting for a blank line.
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", Limits(), "not an HTTP/1.1 response"),
    ],
)
async def test_a_peer_that_breaks_the_protocol_or_a_bound_breaks_the_connection(
    answer: bytes, limits: Limits, message: str
) -> None:
    async def answer_and_hold(stream: trio.SocketStream) -> None:
        await stream.send_all(answer)
        if b"closed" not in message.encode():
            await trio.sleep_forever()  # what the client waits for, never comes

    async with serving(answer_and_hold) as server, connected(server, limits) as connection:
        with pytest.raises(ConnectionBroken, match=message) as raised:
            await post(connection)
        assert not connection.reusable
    assert len(str(raised.value)) < 400, "a refused line is quoted, not copied whole"


async def test_a_streamed_line_over_the_bound_breaks_the_connection() -> None:
    answer = chunked(b"x" * 1500, b"x" * 1500 + b"\n")
    async with serving(answer) as server, connected(server, Limits(max_line=2048)) as connection:
        await connection.send("/v3/watch", b"{}")
        await connection.receive_head()
        with pytest.raises(ConnectionBroken, match="line over the bound of 2048"):
            async for _ in connection.read_lines():
                pass


async def test_nothing_listening_is_a_failed_connect() -> None:
    endpoint = Endpoint("http", "127.0.0.1", free_ports(1)[0])
    with pytest.raises(ConnectFailed, match="Connection refused"):
        await open_connection(endpoint, None, Limits())


def test_endpoints_parse_from_urls() -> None:
    assert Endpoint.parse("http://127.0.0.1:2379") == Endpoint("http", "127.0.0.1", 2379)
    assert Endpoint.parse("https://etcd.example:2379/") == Endpoint("https", "etcd.example", 2379)
    ipv6 = Endpoint.parse("http://[::1]:2379")
    assert (ipv6.host, ipv6.authority, str(ipv6)) == ("::1", "[::1]:2379", "http://[::1]:2379")
    # A host goes into every request's head as written: plain characters only.
    bad = ("127.0.0.1:2379", "unix:///x", "http://h", "http://h:99999", "http://u@h:1")
    for url in (*bad, "http://a b:1", "http://h\x00:1", "http://h\x7f:1"):
        with pytest.raises(ValueError, match="http"):
            Endpoint.parse(url)


async def test_a_body_and_a_line_at_their_bound_are_taken() -> None:
    line = b"y" * 2048
    answers = (chunked(b"x" * 2000, b"x" * 2096), chunked(line[:1000], line[1000:] + b"\n"))
    limits = Limits(max_body=4096, max_line=2048)
    async with serving(*answers) as server, connected(server, limits) as connection:
        assert await post(connection) == (200, b"x" * 4096)
        with trio.fail_after(PATIENCE):
            await connection.send("/v3/watch", b"{}")
            await connection.receive_head()
            assert [one async for one in connection.read_lines()] == [line]
        assert connection.reusable


async def test_each_interim_head_has_a_bound_of_its_own() -> None:
    big = "X: " + "y" * 10000
    answer = f"HTTP/1.1 100 Continue\r\n{big}\r\n\r\n".encode() + ok(b"x", big)
    async with serving(answer, ok(b"next")) as server, connected(server) as connection:
        assert await post(connection) == (200, b"x")
        assert await post(connection) == (200, b"next")


async def test_interim_heads_do_not_count_against_a_chunk_size_line() -> None:
    big = "X: " + "y" * 10000
    interim = f"HTTP/1.1 100 Continue\r\n{big}\r\n\r\n".encode()
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def in_three_parts(stream: trio.SocketStream) -> None:
        # The heads, then a chunk-size line with a long extension, then the rest:
        # only the line's own bytes wait for its end.
        for part in (interim * 2 + head, b"1;" + b"e" * 6000, b"\r\nx\r\n0\r\n\r\n"):
            await stream.send_all(part)
            await trio.sleep(0.05)

    async with serving(in_three_parts) as server, connected(server) as connection:
        assert await post(connection) == (200, b"x")


async def test_a_stream_that_breaks_mid_line_breaks_the_connection() -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b'9\r\n{"n":1}\n{\r\n'
    async with serving(answer) as server, connected(server) as connection:
        lines = []

        async def follow() -> None:
            async for line in connection.read_lines():
                lines.append(line)

        with trio.fail_after(PATIENCE):
            await connection.send("/v3/watch", b"{}")
            await connection.receive_head()
            with pytest.raises(ConnectionBroken, match="closed in a body"):
                await follow()
        assert lines == [b'{"n":1}']
        assert not connection.reusable


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx",
        ok(b"x", "Connection: close"),
        ok(b"x", "Connection: keep-alive, close"),
    ],
)
async def test_a_response_that_closes_leaves_no_reusable_connection(answer: bytes) -> None:
    async with serving(answer, ok(b"never")) as server, connected(server) as connection:
        assert await post(connection) == (200, b"x")
        assert not connection.reusable


async def test_what_came_after_a_response_leaves_it_unusable() -> None:
    async with serving(ok(b"x") + ok(b"unasked")) as server, connected(server) as connection:
        assert await post(connection) == (200, b"x")
        assert not connection.reusable
        assert connection.closed_by_peer()
