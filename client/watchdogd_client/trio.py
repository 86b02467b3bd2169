"""The async client for trio programs (``pip install './client[trio]'``).

::

    from watchdogd_client.trio import open_client

    async with open_client() as client:
        async with client.expires(after=30) as timer:
            await step()
            await timer.release()

`open_client` opens one connection (lazily, on the first request) that any number of
tasks share: requests are pipelined, each reply finds its request by id, so a slow
request never holds up another. Requests are idempotent; one that fails because an
established connection broke (the daemon restarted) is sent again on a new one, for
up to ``reconnect_timeout`` seconds. The default scope of ``expires()`` is the
caller's ``file:line@task#n``: two tasks running the same line never share a timer.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Final, TypeVar, Unpack

try:
    import trio
except ModuleNotFoundError as missing:  # pragma: no cover - tested in a subprocess
    if missing.name != "trio":
        raise
    raise ImportError(
        "watchdogd_client.trio needs trio, an optional dependency of watchdogd-client: "
        "install it with the client's trio extra, e.g. pip install './client[trio]' "
        "from a watchdogd checkout, or pip install 'watchdogd_client-VERSION-py3-none-any"
        ".whl[trio]' from a built wheel"
    ) from missing

from ._version import __version__
from .arming import After, Arming, acquire_request, arming_timeout
from .client import DaemonStatus, OnUnavailable, Outage, log
from .errors import DaemonUnavailable, ProtocolError, RequestRefused, WatchdogdError
from .paths import client_socket_path
from .protocol import (
    MAX_REPLY_FRAME,
    PROTOCOL_VERSION,
    Acquired,
    Error,
    ErrorCode,
    FrameReader,
    Hello,
    Ping,
    Pong,
    Release,
    Released,
    ReplyMessage,
    Request,
    Status,
    StatusReply,
    TimerInfo,
    Welcome,
    decode_reply,
    encode_frame,
)
from .scope import shorten

__all__ = ["AsyncClient", "AsyncTimer", "open_client"]

_R = TypeVar("_R", bound=ReplyMessage)
_RECV_SIZE: Final = 64 * 1024
_STATUS_PAGE: Final = 1000


@contextlib.asynccontextmanager
async def open_client(
    socket_path: str | None = None,
    *,
    timeout: float = 10.0,
    on_unavailable: OnUnavailable = "raise",
    reconnect_timeout: float = 5.0,
) -> AsyncIterator[AsyncClient]:
    """An `AsyncClient` for the block; its connection closes with it."""
    async with trio.open_nursery() as nursery:
        client = AsyncClient(
            nursery,
            socket_path,
            timeout=timeout,
            on_unavailable=on_unavailable,
            reconnect_timeout=reconnect_timeout,
        )
        try:
            yield client
        finally:
            await client.aclose()


class _Connection:
    """One connection and the replies its requests are waiting for."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.send_lock = trio.Lock()
        self.waiting: dict[int, trio.MemorySendChannel[ReplyMessage | None]] = {}
        self.broken = False
        #: The reader task has ended: nothing more will be delivered.
        self.ended = False

    async def read_replies(self) -> None:
        reader = FrameReader(MAX_REPLY_FRAME)
        try:
            while data := await self.stream.receive_some(_RECV_SIZE):
                for frame in reader.feed(data):
                    reply = decode_reply(frame)
                    request_id = reply.id
                    if request_id is None:
                        # An error about no request in particular (a refused
                        # connection, a frame over the bound): it answers every
                        # request, and ends the connection (closing this side
                        # lets the daemon close its own).
                        for every in self.waiting.values():
                            every.send_nowait(reply)
                        self.waiting.clear()
                        return
                    channel = self.waiting.pop(request_id, None)
                    if channel is not None:
                        channel.send_nowait(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
            pass
        finally:
            self.broken = self.ended = True
            for channel in self.waiting.values():
                channel.send_nowait(None)  # the request's answer is lost
            self.waiting.clear()
            with trio.CancelScope(shield=True):
                await self.stream.aclose()


class AsyncClient:
    """The async counterpart of `watchdogd_client.Client`; get one from
    `open_client`. ``socket_path``, ``timeout``, ``on_unavailable`` and
    ``reconnect_timeout`` mean what they mean there."""

    def __init__(
        self,
        nursery: trio.Nursery,
        socket_path: str | None = None,
        *,
        timeout: float = 10.0,
        on_unavailable: OnUnavailable = "raise",
        reconnect_timeout: float = 5.0,
    ) -> None:
        self.socket_path = client_socket_path(socket_path)
        self.timeout = timeout
        self.on_unavailable: OnUnavailable = on_unavailable
        self._outage = Outage()
        self.reconnect_timeout = reconnect_timeout
        #: How long the daemon said a restart of it may take (its Welcome).
        self._restart = 0.0
        self._nursery = nursery
        self._connection: _Connection | None = None
        self._connect_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._task_numbers: weakref.WeakKeyDictionary[trio.lowlevel.Task, int] = (
            weakref.WeakKeyDictionary()
        )
        self._next_task_number = itertools.count(1)

    async def acquire(
        self,
        scope: str,
        timeout: After,
        *,
        pid: int | None = None,
        progress: int | None = None,
        **arming: Unpack[Arming],
    ) -> float:
        """Arm or re-arm ``(pid, scope)``; see `watchdogd_client.Client.acquire`."""
        request = acquire_request(
            next(self._ids), scope, timeout, pid=pid, progress=progress, **arming
        )
        try:
            return (await self._call(request, Acquired)).remaining
        except DaemonUnavailable as exc:
            self._unavailable(exc)
            return request.timeout

    async def release(self, scope: str, *, pid: int | None = None) -> bool:
        """Disarm ``(pid, scope)``; returns whether a timer was armed."""
        try:
            return (
                await self._call(Release(id=next(self._ids), scope=scope, pid=pid), Released)
            ).found
        except DaemonUnavailable as exc:
            self._unavailable(exc)
            return False

    async def status(self) -> DaemonStatus:
        """The daemon's summary and every timer this caller may see."""
        timers: list[TimerInfo] = []
        cursor: str | None = None
        while True:
            request = Status(id=next(self._ids), limit=_STATUS_PAGE, cursor=cursor)
            page = await self._call(request, StatusReply)
            timers.extend(page.timers_with_commands())
            cursor = page.cursor
            if cursor is None:
                return DaemonStatus(daemon=page.daemon, timers=timers)

    async def ping(self) -> float:
        """Round trip to the daemon, in seconds."""
        started = trio.current_time()
        await self._call(Ping(id=next(self._ids)), Pong)
        return trio.current_time() - started

    def expires(
        self, after: After, scope: str | None = None, **arming: Unpack[Arming]
    ) -> AsyncTimer:
        """``async with client.expires(after) as timer:`` arms on entry and releases
        on exit, also when an exception leaves the block (which propagates).
        ``**arming``: the policy, ``floor`` and ``ceiling`` for ``after="auto"``, the
        job (see `watchdogd_client.arming.Arming`)."""
        arming_timeout(after, arming)
        chosen = self._caller_scope() if scope is None else scope
        return AsyncTimer(self, after, chosen, arming)

    async def aclose(self) -> None:
        """Close the connection (the nursery's reader task ends with it)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.stream.aclose()

    def _caller_scope(self) -> str:
        frame = sys._getframe(2)
        task = trio.lowlevel.current_task()
        number = self._task_numbers.get(task)
        if number is None:
            number = self._task_numbers[task] = next(self._next_task_number)
        return shorten(f"{frame.f_code.co_filename}:{frame.f_lineno}@{task.name}#{number}")

    def _unavailable(self, exc: DaemonUnavailable) -> None:
        if self.on_unavailable == "raise":
            raise exc
        self._outage.failed(exc)

    async def _call(self, request: Request, expected: type[_R]) -> _R:
        reply = await self._call_once(request, expected)
        self._outage.answered(self.socket_path)
        return reply

    async def _call_once(self, request: Request, expected: type[_R]) -> _R:
        connection = await self._connected(reconnect=False)
        reply = await self._exchange(connection, request)
        if reply is None:
            # The connection broke under the request: the daemon may have restarted.
            # Every request is idempotent, so send it once more on a new connection.
            connection = await self._connected(reconnect=True)
            reply = await self._exchange(connection, request)
            if reply is None:
                raise self._error("the connection closed")
        if isinstance(reply, Error):
            raise RequestRefused(reply.code, reply.message)
        if not isinstance(reply, expected):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"expected a {expected.__name__} reply, got {type(reply).__name__}",
            )
        return reply

    async def _exchange(self, connection: _Connection, request: Request) -> ReplyMessage | None:
        """Send ``request``; its reply, or None if the connection broke first."""
        send, receive = trio.open_memory_channel[ReplyMessage | None](1)
        if connection.ended:
            return None
        connection.waiting[request.id] = send
        try:
            with trio.fail_after(self.timeout):
                try:
                    async with connection.send_lock:
                        await connection.stream.send_all(encode_frame(request))
                except trio.BrokenResourceError:
                    # The daemon may have answered and closed before reading this
                    # (a refusal at a connection limit): the reader task still
                    # delivers what it sent, or None once the stream ends.
                    connection.broken = True
                except trio.ClosedResourceError:
                    # The reader closed the stream under this send: it delivered
                    # the daemon's answer first, if there was one.
                    connection.broken = True
                    try:
                        return receive.receive_nowait()
                    except trio.WouldBlock:
                        return None
                except BaseException:
                    # A send cut short (cancelled) may have written part of a frame:
                    # nothing after it on this connection could be understood.
                    connection.broken = True
                    connection.stream.socket.close()
                    raise
                return await receive.receive()
        except trio.TooSlowError:
            raise self._error(f"no reply within {self.timeout:g} s") from None
        finally:
            connection.waiting.pop(request.id, None)

    async def _connected(self, *, reconnect: bool) -> _Connection:
        async with self._connect_lock:
            connection = self._connection
            if connection is not None and not connection.broken:
                return connection
            window = max(self.reconnect_timeout, self._restart)
            deadline = trio.current_time() + (window if reconnect else 0)
            pause = 0.01
            while True:
                try:
                    connection = await self._connect()
                except DaemonUnavailable:
                    if trio.current_time() + pause > deadline:
                        raise
                else:
                    self._connection = connection
                    return connection
                await trio.sleep(pause)
                pause = min(pause * 2, 0.25)

    async def _connect(self) -> _Connection:
        try:
            with trio.fail_after(self.timeout):
                stream = await trio.open_unix_socket(self.socket_path)
        except FileNotFoundError:
            raise self._error("no socket there") from None
        except ConnectionRefusedError:
            raise self._error("nothing is listening on it") from None
        except trio.TooSlowError:
            raise self._error(f"no answer within {self.timeout:g} s") from None
        except OSError as exc:
            raise self._error(exc.strerror or str(exc)) from None
        connection = _Connection(stream)
        self._nursery.start_soon(connection.read_replies)
        hello = Hello(
            id=next(self._ids), version=PROTOCOL_VERSION, client=f"python-trio/{__version__}"
        )
        try:
            reply = await self._exchange(connection, hello)
        except BaseException:
            await stream.aclose()
            raise
        if isinstance(reply, Welcome):
            self._restart = reply.restart
            return connection
        await stream.aclose()
        if reply is None:
            raise self._error("the connection closed during the handshake")
        if isinstance(reply, Error):
            raise RequestRefused(reply.code, reply.message)
        raise ProtocolError(ErrorCode.MALFORMED, f"expected welcome, got {reply!r}")

    def _error(self, reason: str) -> DaemonUnavailable:
        return DaemonUnavailable.at(self.socket_path, reason)


class AsyncTimer:
    """The handle of an ``async with client.expires(...)`` block; `release` and
    `renew` behave as `watchdogd_client.Timer`'s do."""

    __slots__ = ("_armed", "after", "arming", "client", "scope")

    def __init__(self, client: AsyncClient, after: After, scope: str, arming: Arming) -> None:
        self.client = client
        self.after = after
        self.scope = scope
        self.arming = arming
        self._armed = False

    @property
    def armed(self) -> bool:
        return self._armed

    async def release(self) -> None:
        """Disarm now; idempotent."""
        if self._armed:
            self._armed = False
            await self.client.release(self.scope)

    async def renew(self, after: After | None = None, *, progress: int | None = None) -> None:
        """Re-arm: expire ``after`` (default: the last timeout) seconds from now;
        ``progress`` as for `watchdogd_client.Timer.renew`."""
        if after is not None:
            self.after = after
        await self.client.acquire(self.scope, self.after, progress=progress, **self.arming)
        self._armed = True

    async def __aenter__(self) -> AsyncTimer:
        await self.renew()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._armed:
            return
        if exc_type is None:
            await self.release()
            return
        try:
            with trio.CancelScope(shield=True):  # release even when cancelled
                await self.release()
        except WatchdogdError as release_error:
            log.warning("could not release timer %r: %s", self.scope, release_error)
