"""How a call of the etcd client (`watchdogd.fleet.etcd`) reaches etcd's JSON
gateway: its request encoded, the endpoints tried in turn, a connection taken from
the pool or opened (TLS included), etcd's answer decoded, all within the call's
deadline.

- Every call ends within ``timeout`` seconds (default 2), waiting for a connection
  included; opening a connection, its TLS handshake included, within
  ``connect_timeout`` (default 1), so an endpoint that drops packets leaves time to
  try the next.
- At most ``max_connections`` (default 8) connections are open, idle ones, those of
  calls in progress and those of watches together; a call that finds them all busy
  waits for one within its timeout.
- Endpoints are tried in turn, from the current one. An endpoint that fails (no
  connection, a connection that broke, no answer in time, or etcd answering that it
  is unavailable, as a member without a leader does) makes the next one current, for
  this call and those after it. A call goes on to the next endpoint when its request
  cannot have been applied (no connection was made) or applying it twice changes
  nothing (``repeatable``); otherwise it raises `EtcdUnavailable` saying that the
  request may have been applied.
- It heals on its own: a pooled connection that its server closed (etcd restarted,
  say) is dropped before use, and each call dials again what it needs. It never
  sleeps between tries.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Final, TypeVar

import msgspec
import trio

from ..errors import ConfigError
from .gateway import (
    UNKNOWN,
    Ambiguous,
    EtcdError,
    EtcdTooLarge,
    EtcdUnavailable,
    WatchBroken,
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
from .watch import EtcdWatch

__all__ = ["Transport", "tls_context"]

_encoder: Final = msgspec.json.Encoder()
_T = TypeVar("_T")
_R = TypeVar("_R", bound=msgspec.Struct)


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


class _Unreached(Exception):
    """An endpoint failed before the request could have been applied."""


class Transport:
    """The calls to one etcd cluster through ``endpoints`` (``http://host:port`` or
    ``https://host:port`` URLs), with the bounds above; ``ca``, ``cert`` and ``key``
    are paths of PEM files for https endpoints (`tls_context`). Raises `ConfigError`
    for an endpoint or a file it cannot use."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float,
        connect_timeout: float,
        ca: str | None,
        cert: str | None,
        key: str | None,
        max_connections: int,
        limits: Limits,
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
        self._limits = limits
        self._max_connections = max_connections
        self._limiter = trio.CapacityLimiter(max_connections)
        self._idle: list[Connection] = []
        self._current = 0

    @property
    def endpoint(self) -> str:
        """The endpoint the next call tries first."""
        return str(self._endpoints[self._current])

    async def aclose(self) -> None:
        """Close the idle connections (a later call opens new ones)."""
        idle, self._idle = self._idle, []
        # Shielded: in a cancelled scope (a member's tasks ending), the first close's
        # Cancelled would leave the others open. A forceful close never waits.
        with trio.CancelScope(shield=True):
            for connection in idle:
                await connection.aclose()

    async def call(
        self, path: str, request: msgspec.Struct, reply: type[_R], *, repeatable: bool
    ) -> _R:
        """Send ``request`` to ``path``; etcd's answer, as ``reply``. ``repeatable``:
        applying the request twice changes nothing."""
        body = _encoder.encode(request)

        async def exchange(endpoint: Endpoint) -> _R:
            return await self._exchange(endpoint, path, body, reply)

        deadline = trio.current_time() + self._timeout
        async with self._token(deadline):
            return await self._first_answer(deadline, exchange, repeatable=repeatable)

    @contextlib.asynccontextmanager
    async def open_watch(
        self, request: WatchRequest, start_revision: int, max_value: int | None = None
    ) -> AsyncIterator[EtcdWatch]:
        """The `EtcdWatch` that ``request`` (from ``start_revision``) begins, on a
        connection of its own while it is open; beginning it is bounded by the call
        timeout. ``max_value``: see `EtcdWatch`."""
        body = _encoder.encode(request)

        async def start(endpoint: Endpoint) -> EtcdWatch:
            return await self._start_watch(endpoint, body, start_revision, max_value)

        deadline = trio.current_time() + self._timeout
        async with self._token(deadline):
            watch = await self._first_answer(deadline, start, repeatable=True)
            try:
                yield watch
            finally:
                await watch.aclose()

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

    async def _start_watch(
        self, endpoint: Endpoint, body: bytes, start_revision: int, max_value: int | None
    ) -> EtcdWatch:
        watch = EtcdWatch(await self._checkout(endpoint), start_revision, max_value)
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
