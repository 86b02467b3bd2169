"""An etcd v3 client for trio, over etcd's JSON gateway.

Why this client and not a package: the ``etcd3`` gRPC package has had no release
since 2020 (and pins old grpcio and protobuf); the gateway, ``POST /v3/...`` with
JSON bodies on the client port, is etcd's own stable API, served by every etcd since
3.4 beside gRPC; speaking it needs no grpc dependency, only the small HTTP/1.1 client
in `watchdogd.fleet.http1`; and a client written for trio runs on the daemon's own
loop, where trio's cancellation reaches into every call.

It speaks what the fleet needs: put, range, delete, a put-if-absent transaction,
lease grant, keepalive and revoke, and watch. Keys and values are bytes (a str is
taken as its UTF-8) and travel base64, as the gateway requires; etcd's 64-bit
numbers travel as JSON strings and are read as ints.

Bounds:

- Every call ends within ``timeout`` seconds (default 2), waiting for a connection
  included; opening a connection, its TLS handshake included, within
  ``connect_timeout`` (default 1), so an endpoint that drops packets leaves time to
  try the next.
- At most ``max_connections`` (default 8) connections are open, idle ones, those of
  calls in progress and those of watches together; a call that finds them all busy
  waits for one within its timeout.
- A reply is at most ``Limits.max_body`` bytes, a watch message at most
  ``Limits.max_line``, a response head ``Limits.max_head`` in ``max_headers`` lines;
  past a bound a call raises `EtcdTooLarge`. So that any number of keys can be read
  whatever their size, a range is read in pages (`EtcdClient.range_pages`: at most
  `MAX_PAGE` keys, fewer when their values are large), and a watch asks etcd to
  split large responses into fragments.
- A watch waits for events without a timeout, since waiting is what it is for; its
  connection's TCP keepalive ends it about 11 s after its host vanished.

Failures:

- A call raises only `EtcdFailure` (or the cancellation of its caller's scope):
  `EtcdUnavailable` when no endpoint answered in time, with the last error;
  `EtcdError` when etcd answered with an error, with its gRPC code and message. A
  caller catches the one class, reports it and goes on.
- Endpoints are tried in turn, from the current one. An endpoint that fails (no
  connection, a connection that broke, no answer in time, or etcd answering that it
  is unavailable, as a member without a leader does) makes the next one current, for
  this call and those after it. A call goes on to the next endpoint when its request
  cannot have been applied (no connection was made) or applying it twice changes
  nothing (range, keepalive, revoke); otherwise it raises `EtcdUnavailable` saying
  that the request may have been applied.
- A watch never ends quietly: `WatchBroken` when its stream ends or breaks (the
  caller watches again from `Watch.revision` + 1), `EtcdCompacted` when etcd no
  longer has its start revision (the caller reads the range, and watches from that
  range's revision + 1).
- The client heals on its own: a pooled connection that its server closed (etcd
  restarted, say) is dropped before use, and each call dials again what it needs.
  The client never sleeps between tries; a caller that retries waits with `Backoff`.

What the gateway takes and answers, and the errors above, are
`watchdogd.fleet.gateway`'s; a watch's stream is `watchdogd.fleet.watch`'s.
"""

from __future__ import annotations

import contextlib
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Final, TypeVar

import msgspec
import trio

from ..errors import ConfigError
from .gateway import (
    OUT_OF_RANGE,
    UNKNOWN,
    Ambiguous,
    Compare,
    DeleteRangeReply,
    EtcdCompacted,
    EtcdError,
    EtcdTooLarge,
    EtcdUnavailable,
    KeyValue,
    LeaseGrantRequest,
    LeaseNotFound,
    LeaseReply,
    LeaseRequest,
    Message,
    PutRequest,
    RangeReply,
    RangeRequest,
    Reply,
    RequestOp,
    TxnReply,
    TxnRequest,
    WatchBroken,
    WatchCreate,
    WatchRequest,
    answered_error,
)
from .http1 import (
    ConnectFailed,
    Connection,
    ConnectionBroken,
    Endpoint,
    Limits,
    TooLarge,
    open_connection,
)
from .watch import Watch

__all__ = [
    "MAX_PAGE",
    "Backoff",
    "Data",
    "EtcdClient",
    "Limits",
    "Range",
    "prefix_end",
    "tls_context",
]

#: The most keys one page of a range read asks for.
MAX_PAGE: Final = 256

#: A key or a value: bytes, or a str that stands for its UTF-8.
Data = bytes | str


class Range(msgspec.Struct, frozen=True):
    """The keys under a prefix, sorted, and the store's ``revision`` when they were
    read: a watch from ``revision + 1`` sees every change after them."""

    revision: int
    kvs: list[KeyValue]


class Backoff:
    """How long to wait between tries of something that keeps failing: ``first``
    seconds, doubling to at most ``most``, each spread by a random ±``jitter`` share
    so that a fleet that lost etcd together does not come back in step.
    `reset` after a success."""

    def __init__(
        self,
        first: float = 0.1,
        most: float = 5.0,
        *,
        jitter: float = 0.2,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        assert 0 < first <= most
        assert 0 <= jitter < 1
        self._first, self._most, self._jitter, self._uniform = first, most, jitter, uniform
        self._next = first

    def delay(self) -> float:
        """The next wait, in seconds; each call doubles the one after."""
        base = self._next
        self._next = min(self._next * 2, self._most)
        return base * self._uniform(1 - self._jitter, 1 + self._jitter)

    async def wait(self) -> None:
        await trio.sleep(self.delay())

    def reset(self) -> None:
        self._next = self._first


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A TLS client context that trusts ``ca`` (the system's authorities without it)
    and, given ``cert``, presents it with ``key`` (a key inside the certificate file
    when None). Raises `ConfigError` naming the file that cannot be used."""
    if key is not None and cert is None:
        raise ConfigError("etcd TLS: a client key needs its certificate (cert)")
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"etcd TLS: cannot use the CA file {ca}: {exc}") from exc
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"etcd TLS: cannot use the client certificate {cert} and key {key}: {exc}"
            ) from exc
    return context


_encoder: Final = msgspec.json.Encoder()
_T = TypeVar("_T")
_R = TypeVar("_R", bound=msgspec.Struct)


def _bytes(data: Data) -> bytes:
    return data.encode() if isinstance(data, str) else data


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range of every key starting with ``prefix``:
    its last byte below 0xff plus one. (etcd reads ``b"\\0"`` as "every key", for a
    prefix that is empty or all 0xff bytes.)"""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


class _Unreached(Exception):
    """An endpoint failed before the request could have been applied."""


class EtcdClient:
    """A client of one etcd cluster through ``endpoints`` (``http://host:port`` or
    ``https://host:port`` URLs). ``ca``, ``cert`` and ``key`` are paths of PEM files
    for https endpoints (`tls_context`). Raises `ConfigError` for an endpoint or a
    file it cannot use. Use it in ``async with`` (or call `aclose`) to close its
    idle connections at the end."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 2.0,
        connect_timeout: float = 1.0,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        max_connections: int = 8,
        limits: Limits | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("etcd: name at least one endpoint")
        try:
            self._endpoints = [Endpoint.parse(url) for url in endpoints]
        except ValueError as exc:
            raise ConfigError(f"etcd endpoint {exc}") from exc
        assert timeout > 0
        assert connect_timeout > 0
        assert max_connections > 0
        needs_tls = any(e.scheme == "https" for e in self._endpoints)
        self._tls = tls_context(ca, cert, key) if needs_tls else None
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._limits = limits or Limits()
        self._max_connections = max_connections
        self._limiter = trio.CapacityLimiter(max_connections)
        self._idle: list[Connection] = []
        self._current = 0

    @property
    def endpoint(self) -> str:
        """The endpoint the next call tries first."""
        return str(self._endpoints[self._current])

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the idle connections (a later call opens new ones)."""
        idle, self._idle = self._idle, []
        # Shielded: in a cancelled scope (a member's tasks ending), the first close's
        # Cancelled would leave the others open. A forceful close never waits.
        with trio.CancelScope(shield=True):
            for connection in idle:
                await connection.aclose()

    async def grant(self, ttl: int) -> int:
        """A new lease that lives ``ttl`` seconds unless kept alive; its id."""
        reply = await self._call(
            "/v3/lease/grant", LeaseGrantRequest(ttl), LeaseReply, repeatable=False
        )
        if reply.ID == 0 or reply.TTL <= 0:
            raise EtcdError(UNKNOWN, f"a lease grant answered without a lease: {reply}")
        return reply.ID

    async def keepalive_once(self, lease: int) -> int:
        """Renew ``lease`` once; the seconds it now has left, 0 when it is gone
        (expired or revoked: its keys are deleted)."""
        message = await self._call(
            "/v3/lease/keepalive", LeaseRequest(lease), Message[LeaseReply], repeatable=True
        )
        if message.error is not None:
            raise EtcdError(message.error.grpc_code, message.error.message)
        return 0 if message.result is None else max(message.result.TTL, 0)

    async def revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys. A lease already gone is no error."""
        with contextlib.suppress(LeaseNotFound):
            await self._call("/v3/lease/revoke", LeaseRequest(lease), Reply, repeatable=True)

    async def put(self, key: Data, value: Data, *, lease: int | None = None) -> int:
        """Set ``key`` to ``value``, attached to ``lease`` if given; the revision of
        the change. Raises `LeaseNotFound` for a lease that is gone."""
        request = PutRequest(_bytes(key), _bytes(value), lease or 0)
        reply = await self._call("/v3/kv/put", request, Reply, repeatable=False)
        return reply.header.revision

    async def put_if_absent(self, key: Data, value: Data, *, lease: int | None = None) -> bool:
        """Create ``key`` with ``value`` unless it exists; whether it was created.
        (A call that ends in `EtcdUnavailable` may have created it.)"""
        raw = _bytes(key)
        request = TxnRequest(
            compare=[Compare(raw)],
            success=[RequestOp(PutRequest(raw, _bytes(value), lease or 0))],
        )
        reply = await self._call("/v3/kv/txn", request, TxnReply, repeatable=False)
        return reply.succeeded

    async def get(self, key: Data) -> KeyValue | None:
        """``key`` as etcd holds it, or None when it does not exist."""
        reply = await self._call(
            "/v3/kv/range", RangeRequest(_bytes(key)), RangeReply, repeatable=True
        )
        return reply.kvs[0] if reply.kvs else None

    async def range(
        self, prefix: Data, *, through: Data | None = None, page: int = MAX_PAGE
    ) -> Range:
        """Every key that starts with ``prefix`` (with ``through``: every key from
        ``prefix`` to the last that starts with ``through``), with the revision they
        were read at: `range_pages`, gathered."""
        revision, kvs = 0, []
        async for part in self.range_pages(prefix, through=through, page=page):
            revision = part.revision
            kvs += part.kvs
        return Range(revision, kvs)

    async def range_pages(
        self, prefix: Data, *, through: Data | None = None, page: int = MAX_PAGE
    ) -> AsyncIterator[Range]:
        """The keys of `range`, read a page at a time, all at the revision of the
        first page: at most ``page`` keys a page, and fewer when a page's values
        would be over the reply bound (each key alone is within it: etcd bounds a
        request). Raises `EtcdCompacted` when etcd compacted that revision away
        in between (read again)."""
        raw = _bytes(prefix)
        end = prefix_end(_bytes(raw if through is None else through))
        start, revision, size = raw, 0, page
        while True:
            request = RangeRequest(start, end, limit=size, revision=revision)
            try:
                reply = await self._call("/v3/kv/range", request, RangeReply, repeatable=True)
            except EtcdTooLarge:
                if size == 1:
                    raise
                size = max(1, size // 4)
                continue
            except EtcdError as exc:
                if exc.code == OUT_OF_RANGE and revision:
                    raise EtcdCompacted(revision) from None
                raise
            revision = revision or reply.header.revision
            yield Range(revision, reply.kvs)
            if not reply.more or not reply.kvs:
                return
            start = reply.kvs[-1].key + b"\0"
            size = min(page, size * 2)

    async def delete(self, key: Data, *, prefix: bool = False) -> int:
        """Delete ``key`` (every key that starts with it, with ``prefix``); how many
        keys were deleted."""
        raw = _bytes(key)
        request = RangeRequest(raw, prefix_end(raw) if prefix else b"")
        reply = await self._call("/v3/kv/deleterange", request, DeleteRangeReply, repeatable=False)
        return reply.deleted

    @contextlib.asynccontextmanager
    async def open_watch(
        self, prefix: Data, *, through: Data | None = None, start_revision: int = 0
    ) -> AsyncIterator[Watch]:
        """Watch every key that starts with ``prefix`` (with ``through``, as
        `range`), from ``start_revision`` (0: from now on); iterate the `Watch` for
        its events. Opening it is bounded by the call timeout (`EtcdUnavailable`); it
        ends with `WatchBroken`, `EtcdCompacted` or another `EtcdError`, never
        quietly."""
        raw = _bytes(prefix)
        end = prefix_end(_bytes(raw if through is None else through))
        body = _encoder.encode(WatchRequest(WatchCreate(raw, end, max(start_revision, 0))))

        async def start(endpoint: Endpoint) -> Watch:
            return await self._start_watch(endpoint, body, start_revision)

        deadline = trio.current_time() + self._timeout
        async with self._token(deadline):
            watch = await self._first_answer(deadline, start, repeatable=True)
            try:
                yield watch
            finally:
                await watch.aclose()

    async def _call(
        self, path: str, request: msgspec.Struct, reply: type[_R], *, repeatable: bool
    ) -> _R:
        """Send ``request`` to ``path``; etcd's answer."""
        body = _encoder.encode(request)

        async def exchange(endpoint: Endpoint) -> _R:
            return await self._exchange(endpoint, path, body, reply)

        deadline = trio.current_time() + self._timeout
        async with self._token(deadline):
            return await self._first_answer(deadline, exchange, repeatable=repeatable)

    @contextlib.asynccontextmanager
    async def _token(self, deadline: float) -> AsyncIterator[None]:
        """Hold one of the ``max_connections`` tokens, if one is free by ``deadline``."""
        # A borrower of its own: one task may hold a watch's token and call too.
        borrower = object()
        with trio.move_on_at(deadline) as scope:
            await self._limiter.acquire_on_behalf_of(borrower)
        if scope.cancelled_caught:
            raise EtcdUnavailable(f"no etcd connection was free within {self._timeout} s")
        try:
            yield
        finally:
            self._limiter.release_on_behalf_of(borrower)

    async def _first_answer(
        self, deadline: float, attempt: Callable[[Endpoint], Awaitable[_T]], *, repeatable: bool
    ) -> _T:
        """``attempt`` on the endpoints in turn, from the current one, until one
        answers or ``deadline`` passes."""
        failure = "no endpoint was tried"
        for endpoint in self._in_turn():
            with trio.move_on_at(deadline) as scope:
                try:
                    return await attempt(endpoint)
                except _Unreached as exc:
                    failure = str(exc)
                except Ambiguous as exc:
                    if not repeatable:
                        self._failed(endpoint)
                        raise EtcdUnavailable(
                            f"{exc} (the request may have been applied)"
                        ) from None
                    failure = str(exc)
            self._failed(endpoint)
            if scope.cancelled_caught:
                raise EtcdUnavailable(f"no answer from {endpoint} within {self._timeout} s")
        raise EtcdUnavailable(f"no etcd endpoint answered: {failure}")

    async def _exchange(self, endpoint: Endpoint, path: str, body: bytes, reply: type[_R]) -> _R:
        connection = await self._checkout(endpoint)
        try:
            await connection.send(path, body)
            head = await connection.receive_head()
            data = await connection.read_body()
        except TooLarge as exc:
            await connection.aclose()
            raise EtcdTooLarge(str(exc)) from None
        except ConnectionBroken as exc:
            await connection.aclose()
            raise Ambiguous(str(exc)) from None
        except BaseException:
            await connection.aclose()
            raise
        await self._checkin(connection)
        if head.status != 200:
            raise answered_error(endpoint, head.status, data)
        try:
            return msgspec.json.decode(data, type=reply, strict=False)
        except msgspec.DecodeError as exc:
            raise EtcdError(UNKNOWN, f"{endpoint} answered {path} with no reply: {exc}") from None

    async def _start_watch(self, endpoint: Endpoint, body: bytes, start_revision: int) -> Watch:
        watch = Watch(await self._checkout(endpoint), start_revision)
        try:
            await watch.begin(body)
        except (ConnectionBroken, WatchBroken) as exc:
            await watch.aclose()
            raise Ambiguous(str(exc)) from None
        except BaseException:
            await watch.aclose()
            raise
        return watch

    def _in_turn(self) -> list[Endpoint]:
        count = len(self._endpoints)
        return [self._endpoints[(self._current + i) % count] for i in range(count)]

    def _failed(self, endpoint: Endpoint) -> None:
        """``endpoint`` failed: the next one is tried first from now on (unless
        another call moved on already)."""
        if self._endpoints[self._current] == endpoint:
            self._current = (self._current + 1) % len(self._endpoints)

    async def _checkout(self, endpoint: Endpoint) -> Connection:
        """An idle connection to ``endpoint`` that its server has not closed, or a
        new one. The caller holds a token of the limiter."""
        for index in range(len(self._idle) - 1, -1, -1):
            connection = self._idle[index]
            if connection.endpoint != endpoint:
                continue
            del self._idle[index]
            if not connection.closed_by_peer():
                return connection
            await connection.aclose()
        # Every open connection is idle or held with a token, this call's among them.
        while (
            self._idle and len(self._idle) + self._limiter.borrowed_tokens > self._max_connections
        ):
            await self._idle.pop(0).aclose()
        opened: Connection | None = None
        with trio.move_on_after(self._connect_timeout):
            try:
                opened = await open_connection(endpoint, self._tls, self._limits)
            except ConnectFailed as exc:
                raise _Unreached(str(exc)) from None
        if opened is None:
            raise _Unreached(f"no connection to {endpoint} within {self._connect_timeout} s")
        return opened

    async def _checkin(self, connection: Connection) -> None:
        if connection.reusable:
            self._idle.append(connection)
        else:
            await connection.aclose()
