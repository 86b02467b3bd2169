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
  included, and at most ``max_connections`` (default 8) connections are open, those
  of watches included (`watchdogd.fleet.transport`).
- A reply is at most ``Limits.max_body`` bytes, a watch message at most
  ``Limits.max_line``, a response head ``Limits.max_head`` in ``max_headers`` lines;
  past a bound a call raises `EtcdTooLarge`. So that any number of keys can be read
  whatever their size, a range is read in pages (`EtcdClient.range_pages`: at most
  `MAX_PAGE` keys, fewer when their values are large), and a watch asks etcd to
  split large responses into fragments.
- A watch waits for events without a timeout, since waiting is what it is for
  (`watchdogd.fleet.watch`).

Failures:

- A call raises only `EtcdFailure` (or the cancellation of its caller's scope):
  `EtcdUnavailable` when no endpoint answered in time, with the last error;
  `EtcdError` when etcd answered with an error, with its gRPC code and message. A
  caller catches the one class, reports it and goes on.
- Endpoints are tried in turn, from the current one; a call goes on to the next
  when its request cannot have been applied or applying it twice changes nothing
  (range, keepalive, revoke), otherwise it raises `EtcdUnavailable` saying that the
  request may have been applied (`watchdogd.fleet.transport`).
- A watch never ends quietly: `WatchBroken` when its stream ends or breaks,
  `EtcdCompacted` when etcd no longer has its start revision
  (`watchdogd.fleet.watch` says what the caller does then).
- The client heals on its own: each call dials again what it needs. It never
  sleeps between tries; a caller that retries waits with `Backoff`.

What the gateway takes and answers, and the errors above, are
`watchdogd.fleet.gateway`'s.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Final

import msgspec
import trio

from .gateway import (
    OUT_OF_RANGE,
    UNKNOWN,
    Compare,
    DeleteRangeReply,
    EtcdCompacted,
    EtcdError,
    EtcdTooLarge,
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
    WatchCreate,
    WatchRequest,
)
from .http1 import Limits
from .transport import Transport
from .watch import EtcdWatch

__all__ = ["MAX_PAGE", "Backoff", "Data", "EtcdClient", "Limits", "Range", "prefix_end"]

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


class EtcdClient:
    """A client of one etcd cluster through ``endpoints`` (``http://host:port`` or
    ``https://host:port`` URLs). ``ca``, ``cert`` and ``key`` are paths of PEM files
    for https endpoints (`watchdogd.fleet.transport.tls_context`). Raises
    `ConfigError` for an endpoint or a file it cannot use. Use it in ``async with``
    (or call `aclose`) to close its idle connections at the end."""

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
        self._transport = Transport(
            endpoints,
            timeout=timeout,
            connect_timeout=connect_timeout,
            ca=ca,
            cert=cert,
            key=key,
            max_connections=max_connections,
            limits=limits or Limits(),
        )

    @property
    def endpoint(self) -> str:
        """The endpoint the next call tries first."""
        return self._transport.endpoint

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the idle connections (a later call opens new ones)."""
        await self._transport.aclose()

    async def grant(self, ttl: int) -> int:
        """A new lease that lives ``ttl`` seconds unless kept alive; its id."""
        reply = await self._transport.call(
            "/v3/lease/grant", LeaseGrantRequest(ttl), LeaseReply, repeatable=False
        )
        if reply.ID == 0 or reply.TTL <= 0:
            raise EtcdError(UNKNOWN, f"a lease grant answered without a lease: {reply}")
        return reply.ID

    async def keepalive_once(self, lease: int) -> int:
        """Renew ``lease`` once; the seconds it now has left, 0 when it is gone
        (expired or revoked: its keys are deleted)."""
        message = await self._transport.call(
            "/v3/lease/keepalive", LeaseRequest(lease), Message[LeaseReply], repeatable=True
        )
        if message.error is not None:
            raise EtcdError(message.error.grpc_code, message.error.message)
        return 0 if message.result is None else max(message.result.TTL, 0)

    async def revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys. A lease already gone is no error."""
        with contextlib.suppress(LeaseNotFound):
            await self._transport.call(
                "/v3/lease/revoke", LeaseRequest(lease), Reply, repeatable=True
            )

    async def put(self, key: Data, value: Data, *, lease: int | None = None) -> int:
        """Set ``key`` to ``value``, attached to ``lease`` if given; the revision of
        the change. Raises `LeaseNotFound` for a lease that is gone."""
        request = PutRequest(_bytes(key), _bytes(value), lease or 0)
        reply = await self._transport.call("/v3/kv/put", request, Reply, repeatable=False)
        return reply.header.revision

    async def put_if_absent(self, key: Data, value: Data, *, lease: int | None = None) -> bool:
        """Create ``key`` with ``value`` unless it exists; whether it was created.
        (A call that ends in `EtcdUnavailable` may have created it.)"""
        raw = _bytes(key)
        request = TxnRequest(
            compare=[Compare(raw)],
            success=[RequestOp(PutRequest(raw, _bytes(value), lease or 0))],
        )
        reply = await self._transport.call("/v3/kv/txn", request, TxnReply, repeatable=False)
        return reply.succeeded

    async def get(self, key: Data) -> KeyValue | None:
        """``key`` as etcd holds it, or None when it does not exist."""
        reply = await self._transport.call(
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
                reply = await self._transport.call(
                    "/v3/kv/range", request, RangeReply, repeatable=True
                )
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
        reply = await self._transport.call(
            "/v3/kv/deleterange", request, DeleteRangeReply, repeatable=False
        )
        return reply.deleted

    @contextlib.asynccontextmanager
    async def open_watch(
        self,
        prefix: Data,
        *,
        through: Data | None = None,
        start_revision: int = 0,
        max_value: int | None = None,
    ) -> AsyncIterator[EtcdWatch]:
        """Watch every key that starts with ``prefix`` (with ``through``, as
        `range`), from ``start_revision`` (0: from now on); iterate the `EtcdWatch` for
        its events. A value over ``max_value`` bytes is left undecoded
        (`Event.oversize`). Opening it is bounded by the call timeout
        (`EtcdUnavailable`); it ends with `WatchBroken`, `EtcdCompacted` or another
        `EtcdError`, never quietly."""
        raw = _bytes(prefix)
        end = prefix_end(_bytes(raw if through is None else through))
        request = WatchRequest(WatchCreate(raw, end, max(start_revision, 0)))
        async with self._transport.open_watch(request, start_revision, max_value) as watch:
            yield watch
