"""The async client for trio programs (``pip install './client[trio]'``).

::

    from watchdogd_client.trio import open_client

    async with open_client() as client:
        async with client.expires(after=30) as timer:
            await step()
            await timer.release()

`open_client` opens one connection (lazily, on the first request) that any number of
tasks share: requests are pipelined, each reply finds its request by id, so a slow
request never holds up another. Requests are idempotent; one whose connection broke
after the handshake (the daemon restarted) is sent again on a new one, which the
client keeps trying to open for up to ``reconnect_timeout`` seconds. The default
scope of ``expires()`` is the caller's ``file:line@task#n``: two tasks running the
same line never share a timer.

The protocol is the same engine the blocking client drives
(`watchdogd_client.engine`): here a reader task per connection feeds it what arrives
and hands each answer to the task waiting for it.

A block's release does not wait for its answer, as the blocking client's does not
(`watchdogd_client.Client`): it is sent, the block ends, and the reader task settles
it when the answer comes (`watchdogd_client.releases`); a refusal is logged then and
raised by the client's next request. A broken connection's unsettled releases go
first on the next one, and the process's responder sends them too without waiting
for the program. `AsyncClient.aclose` waits up to 2 s for their answers, so the
daemon takes them before it sees the process end.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import weakref
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Final, TypeVar, Unpack

import msgspec

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

from watchdogd_protocol import (
    Acquire,
    Acquired,
    PageMapped,
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
)

from . import releases
from ._version import __version__
from .arming import (
    After,
    Arming,
    Handle,
    acquire_request,
    arming_timeout,
    check_acquire,
    check_scope,
)
from .base import DaemonStatus, log
from .engine import Answer, Backoff, Connection, Engine
from .errors import DaemonUnavailable, UntrustedSocket, WatchdogdError
from .fastpath import FastPath, fast_path, map_page
from .outage import OnUnavailable, Outage
from .paths import Place, find_socket, what_is_there
from .responder import release_carrier, settle_responder
from .scope import shorten
from .trust import vet

__all__ = ["AsyncClient", "AsyncTimer", "open_client"]

_R = TypeVar("_R", bound=ReplyMessage)
_RECV_SIZE: Final = 64 * 1024
_STATUS_PAGE: Final = 1000
#: How long `AsyncClient.aclose` waits for the answers of its releases.
_CLOSE_WAIT: Final = 2.0


@contextlib.asynccontextmanager
async def open_client(
    socket_path: str | Place | None = None,
    *,
    timeout: float = 10.0,
    on_unavailable: OnUnavailable = "raise",
    reconnect_timeout: float = 5.0,
    responder: bool = True,
    fast: bool = True,
) -> AsyncIterator[AsyncClient]:
    """An `AsyncClient` for the block; its connection closes with it."""
    async with trio.open_nursery() as nursery:
        client = AsyncClient(
            nursery,
            socket_path,
            timeout=timeout,
            on_unavailable=on_unavailable,
            reconnect_timeout=reconnect_timeout,
            responder=responder,
            fast=fast,
        )
        try:
            yield client
        finally:
            await client.aclose()


class _Connection:
    """One stream, its protocol, and the tasks waiting for answers on it."""

    def __init__(
        self,
        stream: trio.SocketStream,
        protocol: Connection,
        unwaited: Callable[[Answer], None],
    ) -> None:
        self.stream = stream
        self.protocol = protocol
        self.send_lock = trio.Lock()
        self.waiting: dict[int, trio.MemorySendChannel[Answer]] = {}
        #: Takes the answers no task waits for: those of releases sent without waiting.
        self._unwaited = unwaited

    async def read_replies(self) -> None:
        """Feed the protocol what arrives and hand each answer to its task, until the
        connection ends; then close the stream (closing this side lets the daemon
        close its own)."""
        protocol = self.protocol
        try:
            while protocol.state != "closed":
                try:
                    data = await self.stream.receive_some(_RECV_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                self._deliver(protocol.receive_data(data) if data else protocol.connection_lost())
        finally:
            self._deliver(protocol.connection_lost())  # nothing more will be read
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def _deliver(self, answers: list[Answer]) -> None:
        for answer in answers:
            channel = self.waiting.pop(answer.id, None)
            if channel is not None:
                channel.send_nowait(answer)
            else:
                self._unwaited(answer)


class AsyncClient:
    """The async counterpart of `watchdogd_client.Client`; get one from
    `open_client`. ``socket_path``, ``timeout``, ``on_unavailable``,
    ``reconnect_timeout``, ``responder`` and ``fast`` mean what they mean there: the
    process's responder is a thread of its own, whichever client starts it, and its
    slots are shared by all its clients (a store is no I/O, so no checkpoint)."""

    def __init__(
        self,
        nursery: trio.Nursery,
        socket_path: str | Place | None = None,
        *,
        timeout: float = 10.0,
        on_unavailable: OnUnavailable = "raise",
        reconnect_timeout: float = 5.0,
        responder: bool = True,
        fast: bool = True,
    ) -> None:
        self.responder = responder
        self.fast = fast
        self._outage = Outage(on_unavailable)
        self.on_unavailable: OnUnavailable = on_unavailable
        self.place = find_socket(socket_path)
        self.socket_path = self.place.path
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        #: The process's fast path, shared with its blocking clients
        #: (`watchdogd_client.fastpath`): a store is no I/O, so no await either.
        self._fast = fast_path(self.socket_path, fast)
        self._engine = Engine(
            self.socket_path,
            client=f"python-trio/{__version__}",
            reconnect_timeout=reconnect_timeout,
        )
        self._nursery = nursery
        self._connection: _Connection | None = None
        self._connect_lock = trio.Lock()
        self._task_numbers: weakref.WeakKeyDictionary[trio.lowlevel.Task, int] = (
            weakref.WeakKeyDictionary()
        )
        self._next_task_number = itertools.count(1)
        self._releases = releases.Releasing()
        #: Set once no release waits for its answer, while `aclose` waits for that.
        self._all_settled: trio.Event | None = None

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
        check_acquire(scope, pid, progress)
        arming_timeout(timeout, arming, maximum=self._engine.max_timeout)
        fast = self._fast
        if fast is not None and pid is None and progress is None:
            stored = fast.arm(scope, timeout, arming)
            if stored is not None:
                return stored
        request = acquire_request(
            self._engine.next_id(),
            scope,
            timeout,
            pid=pid,
            progress=progress,
            slot=fast is not None,
            **arming,
        )
        reply = await self._acquire(request, arming)
        return request.timeout if reply is None else reply.remaining

    async def _acquire(self, request: Acquire, arming: Arming) -> Acquired | None:
        """The answer to ``request``, armed with ``arming``; None where the daemon
        is unavailable and the client carries on unprotected. A slot it grants
        takes the scope's later blocks."""
        if request.pid is None or request.pid == os.getpid():
            # A thread starts, and connects on its own: the loop does not wait.
            settle_responder(self.responder, self.place, request)
        try:
            reply = await self._call(request, Acquired)
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return None
        fast = self._fast
        if fast is not None and await self._answered(fast, request, arming, reply):
            # Its page could not be had (the daemon went meanwhile): the block is
            # armed again without a slot, so it is protected wherever the page is.
            request = msgspec.structs.replace(request, id=self._engine.next_id(), slot=False)
            try:
                reply = await self._call(request, Acquired)
            except DaemonUnavailable as exc:
                self._outage.failed(exc)
                return None
        return reply

    async def _answered(
        self, fast: FastPath, request: Acquire, arming: Arming, reply: Acquired
    ) -> bool:
        """`FastPath.answered`, the page it needs fetched off the loop."""
        grant = reply.slot if request.slot and reply.durable else None
        if grant is None or fast.mapped(grant.page):
            return fast.answered(request, arming, reply, self._unmapped)
        try:
            got = await trio.to_thread.run_sync(self._map_page, grant.page)
        except (OSError, WatchdogdError) as exc:
            failed = exc

            def failing(page: int) -> tuple[int, PageMapped]:
                raise failed

            return fast.answered(request, arming, reply, failing)
        taken: list[int] = []

        def handed(page: int) -> tuple[int, PageMapped]:
            taken.append(page)
            return got

        lost = fast.answered(request, arming, reply, handed)
        if not taken:  # another task mapped it meanwhile
            os.close(got[0])
        return lost

    def _map_page(self, page: int) -> tuple[int, PageMapped]:
        return map_page(self.place, page, timeout=self.timeout)

    @staticmethod
    def _unmapped(page: int) -> tuple[int, PageMapped]:
        raise ConnectionError(f"slot page {page} was mapped meanwhile")

    async def _arm_block(
        self, scope: str, after: After, progress: int | None, arming: Arming
    ) -> int:
        """Arm a block's timer over the socket; the number of its arming (0 where
        the daemon keeps none), for `_release_block` to name."""
        request = acquire_request(
            self._engine.next_id(),
            scope,
            after,
            progress=progress,
            slot=self._fast is not None,
            **arming,
        )
        reply = await self._acquire(request, arming)
        return 0 if reply is None else reply.arm

    async def _release_block(self, scope: str, arm: int, *, stored: bool = False) -> None:
        """Release a block's timer, armed as ``arm``, over the socket: without
        waiting for the answer where the daemon numbered the arming and the
        process's responder would send it again after a break; otherwise as
        `release` does. ``stored``: armed by a store into a slot that closed since
        (`Release.stored`)."""
        if stored:
            await self._released(scope, None, stored=True)
            return
        responder = release_carrier(self.socket_path, arm)
        connection = self._connection
        if responder is None or connection is None or connection.protocol.state != "open":
            await self._released(scope, None)
            return
        request = Release(id=self._engine.next_id(), scope=scope, arm=arm)
        frame = connection.protocol.send(request, Released)
        self._releases.sent(request, connection.protocol)
        try:
            async with connection.send_lock:
                await connection.stream.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The daemon went: the responder sends it again once it is back, and so
            # does this client's next connection.
            connection.protocol.send_failed()
            responder.resend()
        except BaseException:
            # Cut short, perhaps mid-frame: nothing after it could be understood.
            connection.protocol.send_failed()
            connection.stream.socket.close()
            responder.resend()
            raise

    def _unwaited(self, answer: Answer) -> None:
        self._releases.settle(answer)
        if self._all_settled is not None and not self._releases.in_flight:
            self._all_settled.set()

    async def release(self, scope: str, *, pid: int | None = None) -> bool:
        """Disarm ``(pid, scope)``; returns whether a timer was armed."""
        stored = None if pid is not None or self._fast is None else self._fast.release(scope)
        if stored is None or stored == "closed":
            return await self._released(scope, pid, stored=stored == "closed")
        return stored

    async def _released(self, scope: str, pid: int | None, *, stored: bool = False) -> bool:
        request = Release(id=self._engine.next_id(), scope=scope, pid=pid, stored=stored)
        try:
            return (await self._call(request, Released)).found
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return False

    async def status(self) -> DaemonStatus:
        """The daemon's summary and every timer this caller may see."""
        timers: list[TimerInfo] = []
        cursor: str | None = None
        while True:
            request = Status(id=self._engine.next_id(), limit=_STATUS_PAGE, cursor=cursor)
            page = await self._call(request, StatusReply)
            timers.extend(page.timers_with_commands())
            cursor = page.cursor
            if cursor is None:
                return DaemonStatus(daemon=page.daemon, timers=timers)

    async def ping(self) -> float:
        """Round trip to the daemon, in seconds."""
        started = trio.current_time()
        await self._call(Ping(id=self._engine.next_id()), Pong)
        return trio.current_time() - started

    def expires(
        self, after: After, scope: str | None = None, **arming: Unpack[Arming]
    ) -> AsyncTimer:
        """``async with client.expires(after) as timer:`` arms on entry and releases
        on exit, also when an exception leaves the block (which propagates).
        ``**arming``: the policy, ``floor`` and ``ceiling`` for ``after="auto"``, the
        job (see `watchdogd_client.arming.Arming`)."""
        arming_timeout(after, arming, name="after", maximum=self._engine.max_timeout)
        if scope is None:
            scope = self._caller_scope()
        else:
            check_scope(scope)
        return AsyncTimer(self, after, scope, arming)

    async def aclose(self) -> None:
        """Close the connection (the nursery's reader task ends with it), once the
        answers of its releases are read, for at most 2 s."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._releases.in_flight and connection.protocol.state == "open":
            self._all_settled = trio.Event()
            with trio.move_on_after(_CLOSE_WAIT):
                await self._all_settled.wait()
            self._all_settled = None
        await connection.stream.aclose()

    def _caller_scope(self) -> str:
        frame = sys._getframe(2)
        task = trio.lowlevel.current_task()
        number = self._task_numbers.get(task)
        if number is None:
            number = self._task_numbers[task] = next(self._next_task_number)
        return shorten(f"{frame.f_code.co_filename}:{frame.f_lineno}@{task.name}#{number}")

    async def _call(self, request: Request, expected: type[_R]) -> _R:
        self._releases.raise_refused()
        answer = await self._attempt(request, expected)
        if answer.retry:
            # The connection broke under the request: the daemon may have restarted.
            # Every request is idempotent, so it goes once more on a new connection.
            answer = await self._attempt(request, expected, resent=True)
        reply = answer.result(expected)
        self._outage.answered(self.socket_path)
        return reply

    async def _attempt(
        self, request: Request, expected: type[_R], *, resent: bool = False
    ) -> Answer:
        connection = await self._connected(reconnect=resent)
        # A new connection first carries the releases the last one left unanswered.
        frame = self._releases.again(connection.protocol, self._engine)
        frame += connection.protocol.send(request, expected, resent=resent)
        return await self._exchange(connection, request.id, frame)

    async def _exchange(self, connection: _Connection, request_id: int, frame: bytes) -> Answer:
        """Send ``frame``; the answer to ``request_id``, which the reader task hands
        over."""
        send, receive = trio.open_memory_channel[Answer](1)
        connection.waiting[request_id] = send
        try:
            with trio.fail_after(self.timeout):
                try:
                    async with connection.send_lock:
                        await connection.stream.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # The daemon may have answered and closed before reading this (a
                    # refusal at a connection limit), or the reader closed the stream
                    # under this send: the reader hands over what the daemon sent, or
                    # the loss once the stream ends.
                    connection.protocol.send_failed()
                except BaseException:
                    # A send cut short (cancelled) may have written part of a frame:
                    # nothing after it on this connection could be understood.
                    connection.protocol.send_failed()
                    connection.stream.socket.close()
                    raise
                return await receive.receive()
        except trio.TooSlowError:
            raise self._engine.unavailable(f"no reply within {self.timeout:g} s") from None
        finally:
            connection.waiting.pop(request_id, None)
            connection.protocol.abandon(request_id)

    async def _connected(self, *, reconnect: bool) -> _Connection:
        async with self._connect_lock:
            connection = self._connection
            if connection is not None and connection.protocol.state == "open":
                return connection
            now = trio.current_time()
            # A connection that broke: the daemon may be restarting, wait for it
            # as a retried request does (DESIGN §13), not only on the retry.
            broke = reconnect or connection is not None
            backoff = self._engine.reconnecting(now) if broke else Backoff(now)
            while True:
                try:
                    connection = await self._connect()
                except UntrustedSocket:
                    raise  # its owner stays who it is, however long the wait
                except DaemonUnavailable:
                    pause = backoff.pause(trio.current_time())
                    if pause is None:
                        raise
                else:
                    self._connection = connection
                    return connection
                await trio.sleep(pause)

    async def _connect(self) -> _Connection:
        connection, answer = await self._greet()
        if answer.retry:
            # A daemon older than this client refused its version and closed: the
            # engine greets it in the oldest version now.
            await connection.stream.aclose()
            connection, answer = await self._greet()
        try:
            answer.result(Welcome)
        except BaseException:
            await connection.stream.aclose()
            raise
        return connection

    async def _greet(self) -> tuple[_Connection, Answer]:
        """A new connection, and the answer to its hello."""
        try:
            with trio.fail_after(self.timeout):
                stream = await self._open_stream()
        except trio.TooSlowError:
            raise self._engine.unavailable(f"no answer within {self.timeout:g} s") from None
        except DaemonUnavailable:
            raise  # the judgement's own: it says what it found
        except OSError as exc:
            raise self._engine.connect_failed(exc, what_is_there(self.socket_path)) from None
        connection = _Connection(stream, self._engine.connect(), self._unwaited)
        self._nursery.start_soon(connection.read_replies)
        protocol = connection.protocol
        try:
            answer = await self._exchange(connection, protocol.hello_id, protocol.hello)
        except BaseException:
            await stream.aclose()
            raise
        return connection, answer

    async def _open_stream(self) -> trio.SocketStream:
        """A stream to the daemon, judged before anything is sent on it (the
        judgement's few system calls run on the loop: they never wait on a disk)."""
        with vet(self.place) as vetted:
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                await sock.connect(vetted.address)
                vetted.admit(sock)
            except BaseException:
                sock.close()
                raise
        return trio.SocketStream(sock)


class AsyncTimer(Handle["AsyncClient"]):
    """The handle of an ``async with client.expires(...)`` block; `release` and
    `renew` behave as `watchdogd_client.Timer`'s do."""

    __slots__ = ()

    async def release(self) -> None:
        """Disarm now; idempotent. The task goes on at once: a registered scope's
        release is a store, another's is sent without waiting when the process's
        responder can carry it (see the module's docstring)."""
        if self._armed:
            self._armed = False
            fast = self.client._fast
            stored = None if fast is None else fast.release(self.scope)
            if stored is None or stored == "closed":
                await self.client._release_block(self.scope, self._arm, stored=stored == "closed")

    async def renew(self, after: After | None = None, *, progress: int | None = None) -> None:
        """Re-arm: expire ``after`` (default: the last timeout) seconds from now;
        ``progress`` as for `watchdogd_client.Timer.renew`."""
        if after is not None:
            arming_timeout(
                after, self.arming, name="after", maximum=self.client._engine.max_timeout
            )
            self.after = after
        fast = self.client._fast
        if progress is None and fast is not None and fast.arm(self.scope, self.after, self.arming):
            self._arm = 0
        else:
            self._arm = await self.client._arm_block(self.scope, self.after, progress, self.arming)
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
