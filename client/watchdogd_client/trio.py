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
from typing import Any, Final, TypeVar, Unpack

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
    EventsReply,
    HangsReply,
    IncidentInfo,
    PageMapped,
    PoliciesReply,
    Release,
    Released,
    ReplyMessage,
    Request,
    StatusReply,
    SuggestionInfo,
    WhyReply,
)

from . import queries, releases
from ._version import __version__
from .arming import (
    Acquiring,
    After,
    Arming,
    Handle,
    acquire_request,
    arming_timeout,
    check_acquiring,
    check_scope,
    socket_arm,
)
from .base import DaemonStatus, log
from .engine import (
    Answer,
    Clock,
    Close,
    Connected,
    Connection,
    Engine,
    Exchange,
    Finished,
    Open,
    Pause,
    Plan,
    Step,
    advance,
)
from .errors import DaemonUnavailable, WatchdogdError
from .fastpath import FastPath, fast_path, map_page
from .outage import OnUnavailable, Outage
from .paths import Place, find_socket, what_is_there
from .responder import release_carrier, settle_responder
from .scope import shorten
from .trust import vet

__all__ = ["AsyncClient", "AsyncTimer", "open_client"]

_R = TypeVar("_R", bound=ReplyMessage)
_T = TypeVar("_T")
_RECV_SIZE: Final = 64 * 1024
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

    async def acquire(self, scope: str, timeout: After, **acquiring: Unpack[Acquiring]) -> float:
        """Arm or re-arm ``(pid, scope)``; see `watchdogd_client.Client.acquire`."""
        maximum = self._engine.max_timeout
        _, arming = check_acquiring(scope, timeout, acquiring, maximum=maximum)
        fast = self._fast
        if fast is not None and socket_arm(acquiring):
            stored = fast.arm(scope, timeout, arming)
            if stored is not None:
                return stored
        request = acquire_request(
            self._engine.next_id(), scope, timeout, slot=fast is not None, **acquiring
        )
        reply = await self._acquire(request, arming)
        return request.timeout if reply is None else reply.remaining

    async def _acquire(self, request: Acquire, arming: Arming) -> Acquired | None:
        """The answer to ``request``, armed with ``arming`` (`queries.acquire`);
        None where the daemon is unavailable and the client carries on
        unprotected."""
        if request.pid is None or request.pid == os.getpid():
            # A thread starts, and connects on its own: the loop does not wait.
            settle_responder(self.responder, self.place, request)
        plan = queries.acquire(self._engine, request, arming, fast=self._fast is not None)
        try:
            return await self._run(plan)
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return None

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
        try:
            return await self._run(queries.release(self._engine, scope, pid, stored=stored))
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return False

    async def status(self) -> DaemonStatus:
        """The daemon's summary and every timer this caller may see."""
        return await self._run(queries.status(self._engine))

    async def status_page(
        self, *, limit: int = queries.STATUS_PAGE, cursor: str | None = None
    ) -> StatusReply:
        """One page of `status`; see `watchdogd_client.Client.status_page`."""
        return await self._run(queries.status_page(self._engine, limit=limit, cursor=cursor))

    async def ping(self) -> float:
        """Round trip to the daemon, in seconds."""
        return await self._run(queries.ping(self._engine))

    async def events(
        self, *, after: int | None = None, limit: int = 100, wait: float = 0.0
    ) -> EventsReply:
        """Recorded events; see `watchdogd_client.Client.events`."""
        return await self._run(queries.events(self._engine, after=after, limit=limit, wait=wait))

    async def policies(self) -> PoliciesReply:
        """The daemon's policies and its default policy."""
        return await self._run(queries.policies(self._engine))

    async def metrics(self) -> str:
        """The daemon's metrics in the Prometheus text exposition format."""
        return await self._run(queries.metrics(self._engine))

    async def suggest(self) -> list[SuggestionInfo]:
        """The timeouts the daemon suggests; see `watchdogd_client.Client.suggest`."""
        return await self._run(queries.suggest(self._engine))

    async def incidents(self, *, limit: int = 100) -> list[IncidentInfo]:
        """The latest incidents of your jobs (root: all), newest last, without
        their stacks."""
        return await self._run(queries.incidents(self._engine, limit=limit))

    async def incident(self, incident: str) -> IncidentInfo:
        """One incident with every rank's stack you may see."""
        return await self._run(queries.incident(self._engine, incident))

    async def hangs(self, job: str, *, uid: int | None = None, reset: bool = False) -> HangsReply:
        """The hangs of a job; see `watchdogd_client.Client.hangs`."""
        return await self._run(queries.hangs(self._engine, job, uid=uid, reset=reset))

    async def why(self, pid: int, *, limit: int = 100) -> WhyReply:
        """Why process ``pid`` was, or would be, acted on; see
        `watchdogd_client.Client.why`."""
        return await self._run(queries.why(self._engine, pid, limit=limit))

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
        return await self._run(self._engine.call(request, expected))

    async def _run(self, plan: Plan[_T]) -> _T:
        """Carry ``plan`` out, as the engine decides."""
        self._releases.raise_refused()
        result = await self._drive(plan)
        self._outage.answered(self.socket_path)
        return result

    async def _drive(self, plan: Plan[_T]) -> _T:
        """`watchdogd_client.engine.drive`, awaiting each step."""
        step = advance(plan, None, None)
        while not isinstance(step, Finished):
            try:
                sent = await self._take(step)
            except DaemonUnavailable as exc:
                step = advance(plan, None, exc)
            else:
                step = advance(plan, sent, None)
        return step.value

    async def _take(self, step: Step) -> Any:
        """Take one step of a plan (see `watchdogd_client.engine`)."""
        if isinstance(step, Exchange):
            return await self._exchange_step(step)
        if isinstance(step, Connected):
            return await self._connected(again=step.again)
        if isinstance(step, Open):
            return await self._open()
        if isinstance(step, Pause):
            await trio.sleep(step.seconds)
        elif isinstance(step, Clock):
            return trio.current_time()
        elif isinstance(step, Close):
            await _carrier(step.connection).stream.aclose()
        elif isinstance(step, queries.Grant) and self._fast is not None:
            return await self._answered(self._fast, step.request, step.arming, step.reply)
        else:
            raise TypeError(f"a plan asked for {step!r}")
        return None

    async def _exchange_step(self, step: Exchange) -> Answer:
        protocol = step.connection
        connection = _carrier(protocol)
        if protocol.state != "open":  # the hello: a connection refused goes whole
            try:
                return await self._exchange(connection, step.request_id, step.frame)
            except BaseException:
                await connection.stream.aclose()
                raise
        # A new connection first carries the releases the last one left unanswered.
        frame = self._releases.again(protocol, self._engine) + step.frame
        return await self._exchange(connection, step.request_id, frame, step.wait)

    async def _exchange(
        self, connection: _Connection, request_id: int, frame: bytes, wait: float = 0.0
    ) -> Answer:
        """Send ``frame``; the answer to ``request_id``, which the reader task hands
        over."""
        send, receive = trio.open_memory_channel[Answer](1)
        connection.waiting[request_id] = send
        try:
            with trio.fail_after(self.timeout + wait):
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

    async def _connected(self, *, again: bool) -> Connection:
        """The open connection, or a new one dialled as the engine says: waiting
        out a daemon restart when ``again`` (a request's second attempt) or when
        the last connection broke, as a retried request does (DESIGN §13)."""
        async with self._connect_lock:
            connection = self._connection
            if connection is not None and connection.protocol.state == "open":
                return connection.protocol
            broke = again or connection is not None
            protocol = await self._drive(self._engine.dial(broke=broke))
            self._connection = _carrier(protocol)
            return protocol

    async def _open(self) -> Connection:
        """A new stream, judged before anything is sent, its protocol, and the
        reader task that feeds it."""
        try:
            with trio.fail_after(self.timeout):
                stream = await self._open_stream()
        except trio.TooSlowError:
            raise self._engine.unavailable(f"no answer within {self.timeout:g} s") from None
        except DaemonUnavailable:
            raise  # the judgement's own: it says what it found
        except OSError as exc:
            raise self._engine.connect_failed(exc, what_is_there(self.socket_path)) from None
        protocol = self._engine.connect()
        protocol.carrier = _Connection(stream, protocol, self._unwaited)
        self._nursery.start_soon(protocol.carrier.read_replies)
        return protocol

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


def _carrier(protocol: Connection) -> _Connection:
    """The stream and reader of ``protocol``, which `AsyncClient._open` made."""
    carrier = protocol.carrier
    assert isinstance(carrier, _Connection)
    return carrier


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
