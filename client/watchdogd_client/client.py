"""The blocking client: `Client`, `NullClient`, `NoOpTimer` and the `Timer` handle of
``expires()``.

`Client` keeps one connection to the daemon, opened on first use. Requests are
serialised by a lock, so any number of threads may share one client. A child process
created by ``fork()`` never uses its parent's connection: it opens its own on first
use, and its requests are about its own pid. Every request is idempotent (acquire
re-arms, release of an absent timer succeeds), so one whose connection broke after
the handshake (the daemon restarted) is sent again once on a new connection.

The protocol (ids, the handshake, matching and checking replies, what each error
means, whether to send again) is the engine's, `watchdogd_client.engine`; `Client`
carries its bytes over a blocking socket with kernel-side timeouts.
"""

from __future__ import annotations

import abc
import logging
import math
import os
import socket
import struct
import threading
import time
import weakref
from types import TracebackType
from typing import Any, Final, TypeVar, Unpack

import msgspec

from . import blocks
from ._version import __version__ as _version
from .arming import After, Arming, Handle, acquire_request, arming_timeout
from .engine import Answer, Connection, Engine
from .errors import DaemonUnavailable, WatchdogdError
from .outage import OnUnavailable, Outage
from .paths import client_socket_path
from .protocol import (
    MAX_REPLY_BYTES,
    MAX_REPLY_FRAME,
    Acquired,
    DaemonInfo,
    Events,
    EventsReply,
    Incident,
    IncidentInfo,
    IncidentReply,
    Incidents,
    IncidentsReply,
    Metrics,
    MetricsReply,
    Ping,
    Policies,
    PoliciesReply,
    Pong,
    Release,
    Released,
    ReplyMessage,
    Request,
    Status,
    StatusReply,
    Suggest,
    SuggestionInfo,
    SuggestReply,
    TimerInfo,
    Welcome,
    Why,
    WhyReply,
)
from .responder import settle_responder
from .scope import caller_scope

__all__ = [
    "BaseClient",
    "Client",
    "DaemonStatus",
    "NoOpTimer",
    "NullClient",
    "OnUnavailable",
    "Timer",
]

log = logging.getLogger("watchdogd_client")

_R = TypeVar("_R", bound=ReplyMessage)

_DEFAULT_TIMEOUT: Final = 10.0
#: Kept at 64 KiB: a larger recv buffer makes CPython map and unmap memory per call.
_RECV_SIZE: Final = 64 * 1024
_STATUS_PAGE: Final = 1000
#: How long a client whose connection broke waits for the daemon to come back.
_RECONNECT_TIMEOUT: Final = 5.0


class DaemonStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What `BaseClient.status` returns: the daemon's summary and every timer the
    caller may see, soonest deadline first."""

    daemon: DaemonInfo
    timers: list[TimerInfo]


class BaseClient(abc.ABC):
    """What every client offers: arm, release, inspect, and the `expires` block."""

    @abc.abstractmethod
    def acquire(
        self,
        scope: str,
        timeout: After,
        *,
        pid: int | None = None,
        progress: int | None = None,
        **arming: Unpack[Arming],
    ) -> float:
        """Arm (or re-arm) the timer ``(pid, scope)``: if it is still armed in
        ``timeout`` seconds, the daemon carries out the ``policy`` on the process.

        ``pid`` defaults to the calling process. Returns the seconds left on the timer.

        ``progress`` is a counter that the protected work itself advances (steps
        done, bytes written): under a policy with a ``stall`` time, re-arming keeps
        the timer alive only while it grows, so a thread that re-arms in a loop
        cannot keep a stuck one alive. A ``timeout`` of ``"auto"`` arms the timeout
        the daemon learned from earlier releases of the scope. ``**arming``: the
        policy, the bounds of ``"auto"`` and the job, as `Arming` describes them.
        """

    @abc.abstractmethod
    def release(self, scope: str, *, pid: int | None = None) -> bool:
        """Disarm the timer ``(pid, scope)``. Returns whether one was armed."""

    @abc.abstractmethod
    def status(self) -> DaemonStatus:
        """The daemon's summary and the timers this caller may see."""

    @abc.abstractmethod
    def ping(self) -> float:
        """Check the daemon answers; returns the round trip in seconds."""

    def expires(self, after: After, scope: str | None = None, **arming: Unpack[Arming]) -> Timer:
        """A context manager that arms a timer of ``after`` seconds on entry and
        releases it on exit, also when an exception leaves the block.

        ``scope`` defaults to the caller's ``file:line`` (with ``@thread-name`` outside
        the main thread). The block gets a `Timer` to release early or renew.
        ``**arming``: the policy, ``floor`` and ``ceiling`` for ``after="auto"``, the
        job (see `Arming`).
        """
        arming_timeout(after, arming)
        return self._handle(after, caller_scope() if scope is None else scope, arming)

    def _handle(self, after: After, scope: str, arming: Arming) -> Timer:
        """The handle of an ``expires()`` block of this client's."""
        return Timer(self, after, scope, arming)


class Timer(Handle["BaseClient"]):
    """The handle of an ``expires()`` block.

    `release` disarms early (the rest of the block runs unprotected; calling it again
    does nothing). `renew` re-arms with the same or a new timeout, also after
    `release`, and the block's exit then releases again; it may carry the work's
    progress counter (see `BaseClient.acquire`). While the block is open, it is
    what `watchdogd_client.release` releases in its thread, unless a block entered
    inside it is open.
    """

    __slots__ = ()

    def release(self) -> None:
        """Disarm now; idempotent."""
        if self._armed:
            self._armed = False
            self.client.release(self.scope)

    def renew(self, after: After | None = None, *, progress: int | None = None) -> None:
        """Re-arm: the timer now expires ``after`` (default: the last timeout) from
        now; ``progress``, the work's counter, must have grown for a policy with a
        ``stall`` time to count it as alive."""
        if after is not None:
            self.after = after
        self.client.acquire(self.scope, self.after, progress=progress, **self.arming)
        self._armed = True

    def __enter__(self) -> Timer:
        self.renew()
        blocks.entered(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        blocks.left(self)
        if not self._armed:
            return
        if exc_type is None:
            self.release()
            return
        # The block's own exception is what the caller needs to see; a failed
        # release must not replace it.
        try:
            self.release()
        except WatchdogdError as release_error:
            log.warning("could not release timer %r: %s", self.scope, release_error)


class NullClient(BaseClient):
    """A client that accepts everything and does nothing (tests, ``WATCHDOGD_DISABLE=1``)."""

    def acquire(
        self,
        scope: str,
        timeout: After,
        *,
        pid: int | None = None,
        progress: int | None = None,
        **arming: Unpack[Arming],
    ) -> float:
        return arming_timeout(timeout, arming)

    def release(self, scope: str, *, pid: int | None = None) -> bool:
        return False

    def status(self) -> DaemonStatus:
        info = DaemonInfo(
            version="disabled",
            pid=0,
            uptime=0.0,
            timers=0,
            processes=0,
            connections=0,
            requests=0,
            expired=0,
            exited=0,
        )
        return DaemonStatus(daemon=info, timers=[])

    def ping(self) -> float:
        return 0.0


class NoOpTimer(NullClient):
    """A timer that does nothing, wherever a timer block or a client is expected.

    ``with NoOpTimer():`` is a block that arms nothing and yields a `Timer` whose
    `Timer.release` and `Timer.renew` do nothing (it is never `Timer.armed`); so
    does ``with NoOpTimer().expires(after=...):``. `acquire` and `release` take a
    scope and a timeout as a ``TimerClient``'s do, and do nothing;
    ``configure(NoOpTimer())`` makes the module-level `watchdogd_client.expires` arm
    nothing. It is a `NullClient`: it never connects to the daemon. Its blocks are
    blocks of their thread all the same, so `watchdogd_client.release` inside one
    finds that one (and releases nothing, returning False), never a block open
    around it.
    """

    def _handle(self, after: After, scope: str, arming: Arming) -> Timer:
        return _NoOpBlock(self, after, scope, arming)

    def __enter__(self) -> Timer:
        return self.expires(math.inf, caller_scope()).__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        block = blocks.innermost(self)
        if block is not None:
            block.__exit__(*exc_info)


class _NoOpBlock(Timer):
    """The handle of a `NoOpTimer` block: never armed, whatever is asked of it."""

    __slots__ = ()

    def release(self) -> None:
        pass

    def renew(self, after: After | None = None, *, progress: int | None = None) -> None:
        pass


class Client(BaseClient):
    """A blocking, thread-safe, fork-safe connection to the daemon.

    ``socket_path`` defaults as `watchdogd_client.paths.client_socket_path` says.
    ``timeout`` bounds each request (connect, send and reply), in seconds.
    ``max_reply`` bounds a reply frame; it may not be below `protocol.MAX_REPLY_BYTES`,
    the most a daemon sends.
    ``on_unavailable="warn"`` makes `acquire` and `release` carry on unprotected when
    the daemon cannot be reached, instead of raising `DaemonUnavailable`, with one
    warning per outage (see `Outage`); other refusals always raise `RequestRefused`.
    When an established connection breaks (the daemon restarted), the client keeps
    trying to reconnect for up to ``reconnect_timeout`` seconds, or as long as the
    daemon said a restart of it may take if that is longer, before it gives up.
    The first timer it arms on its own process starts the process's responder
    (`watchdogd_client.responder`), which answers the daemon's evidence requests;
    with ``responder=False`` its timers decline it: the process then has none.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float = _DEFAULT_TIMEOUT,
        on_unavailable: OnUnavailable = "raise",
        max_reply: int = MAX_REPLY_FRAME,
        reconnect_timeout: float = _RECONNECT_TIMEOUT,
        responder: bool = True,
    ) -> None:
        self._outage = Outage(on_unavailable)
        if max_reply < MAX_REPLY_BYTES:
            # A reply the daemon may send would then be unreadable.
            raise ValueError(f"max_reply must be at least {MAX_REPLY_BYTES}, not {max_reply!r}")
        if not (math.isfinite(timeout) and timeout >= 0.001):
            raise ValueError(f"timeout must be finite and at least 0.001 s, not {timeout!r}")
        self.on_unavailable: OnUnavailable = on_unavailable
        self.socket_path = client_socket_path(socket_path)
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.responder = responder
        self._engine = Engine(
            self.socket_path,
            client=f"python/{_version}",
            reconnect_timeout=reconnect_timeout,
            max_reply=max_reply,
        )
        self._lock = threading.Lock()
        #: The socket and its protocol: both or neither.
        self._sock: socket.socket | None = None
        self._connection: Connection | None = None
        self._owner_pid = 0
        _live_clients.add(self)

    def __repr__(self) -> str:
        return f"Client({self.socket_path!r})"

    def __getstate__(self) -> dict[str, object]:
        # A client sent to another process (multiprocessing's spawn pickles its
        # arguments) arrives unconnected and connects there on first use.
        return {
            "socket_path": self.socket_path,
            "timeout": self.timeout,
            "on_unavailable": self.on_unavailable,
            "max_reply": self._engine.max_reply,
            "reconnect_timeout": self.reconnect_timeout,
            "responder": self.responder,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection; the next request opens a new one."""
        with self._lock:
            self._disconnect()

    def acquire(
        self,
        scope: str,
        timeout: After,
        *,
        pid: int | None = None,
        progress: int | None = None,
        exit_releases: bool = False,
        **arming: Unpack[Arming],
    ) -> float:
        """See `BaseClient.acquire`. With ``exit_releases``, the process's exit
        releases the timer quietly (no ``exited`` event): for a command expected
        to end, as `watchdogctl run` arms."""
        request = acquire_request(
            self._engine.next_id(),
            scope,
            timeout,
            pid=pid,
            progress=progress,
            exit_releases=exit_releases,
            **arming,
        )
        if pid is None or pid == os.getpid():
            # Before the request: the responder connects on its own thread meanwhile.
            settle_responder(self.responder, self.socket_path, request)
        try:
            return self._call(request, Acquired).remaining
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return request.timeout

    def release(self, scope: str, *, pid: int | None = None) -> bool:
        try:
            return self._call(
                Release(id=self._engine.next_id(), scope=scope, pid=pid), Released
            ).found
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return False

    def status(self) -> DaemonStatus:
        timers: list[TimerInfo] = []
        cursor: str | None = None
        while True:
            page = self.status_page(limit=_STATUS_PAGE, cursor=cursor)
            timers.extend(page.timers_with_commands())
            cursor = page.cursor
            if cursor is None:
                return DaemonStatus(daemon=page.daemon, timers=timers)

    def status_page(self, *, limit: int = _STATUS_PAGE, cursor: str | None = None) -> StatusReply:
        """One page of `status`, as the daemon sent it (command lines in
        ``commands``, see `StatusReply.timers_with_commands`); pass the reply's
        ``cursor`` to get the next."""
        return self._call(
            Status(id=self._engine.next_id(), limit=limit, cursor=cursor), StatusReply
        )

    def ping(self) -> float:
        started = time.perf_counter()
        self._call(Ping(id=self._engine.next_id()), Pong)
        return time.perf_counter() - started

    def events(
        self, *, after: int | None = None, limit: int = 100, wait: float = 0.0
    ) -> EventsReply:
        """Recorded events, oldest first: the latest ``limit``, or those after the
        number ``after``. With ``wait``, the daemon holds the reply up to that many
        seconds for a new event (pass the reply's ``last`` as the next ``after``)."""
        request = Events(id=self._engine.next_id(), after=after, limit=limit, wait=wait)
        return self._call(request, EventsReply, wait=wait)

    def policies(self) -> PoliciesReply:
        """The daemon's policies and its default policy."""
        return self._call(Policies(id=self._engine.next_id()), PoliciesReply)

    def metrics(self) -> str:
        """The daemon's metrics in the Prometheus text exposition format."""
        return self._call(Metrics(id=self._engine.next_id()), MetricsReply).text

    def suggest(self) -> list[SuggestionInfo]:
        """What the daemon learned of how long your scopes (root: everyone's) are
        held before their release, and the timeout it suggests for each."""
        rows: list[SuggestionInfo] = []
        cursor: int | None = 0
        while cursor is not None:
            page = self._call(Suggest(id=self._engine.next_id(), cursor=cursor), SuggestReply)
            rows += page.suggestions
            cursor = page.cursor
        return rows

    def incidents(self, *, limit: int = 100) -> list[IncidentInfo]:
        """The latest incidents of your jobs (root: all), newest last, without
        their stacks."""
        return self._call(
            Incidents(id=self._engine.next_id(), limit=limit), IncidentsReply
        ).incidents

    def incident(self, incident: str) -> IncidentInfo:
        """One incident with every rank's stack you may see."""
        return self._call(
            Incident(id=self._engine.next_id(), incident=incident), IncidentReply
        ).incident

    def why(self, pid: int, *, limit: int = 100) -> WhyReply:
        """Everything the daemon knows about why process ``pid`` was, or would be,
        acted on (what you may see of it)."""
        return self._call(Why(id=self._engine.next_id(), pid=pid, limit=limit), WhyReply)

    def _call(self, request: Request, expected: type[_R], *, wait: float = 0.0) -> _R:
        with self._lock:
            answer = self._attempt(request, expected, wait)
            if answer.retry:
                # The connection broke under the request: the daemon may have
                # restarted. Every request is idempotent, so it goes once more.
                self._reconnect()
                answer = self._attempt(request, expected, wait, resent=True)
        reply = answer.result(expected)
        self._outage.answered(self.socket_path)
        return reply

    def _attempt(
        self, request: Request, expected: type[_R], wait: float, *, resent: bool = False
    ) -> Answer:
        if self._sock is not None and self._owner_pid != os.getpid():
            self._disconnect()
        if self._sock is None:
            self._connect()
        sock, connection = self._sock, self._connection
        assert sock is not None
        assert connection is not None
        frame = connection.send(request, expected, resent=resent)
        if wait:
            self._set_timeouts(self.timeout + wait)
        try:
            answer = self._exchange(sock, connection, request.id, frame)
        finally:
            if wait and self._sock is not None:
                self._set_timeouts(self.timeout)
        if connection.state != "open":
            self._disconnect()
        return answer

    def _exchange(
        self, sock: socket.socket, connection: Connection, request_id: int, frame: bytes
    ) -> Answer:
        """Send ``frame`` and read until the answer to ``request_id``."""
        closed = "the daemon closed it"
        try:
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError) as exc:
                # The daemon may have answered and closed before reading this (a
                # refusal at a connection limit, or a frame over its bound): what
                # it sent is still readable, and a refusal must read as one.
                connection.send_failed()
                closed = exc.strerror or closed
            while True:
                try:
                    data = sock.recv(_RECV_SIZE)
                except (BrokenPipeError, ConnectionResetError) as exc:
                    answers = connection.connection_lost(exc.strerror)
                else:
                    answers = (
                        connection.receive_data(data)
                        if data
                        else connection.connection_lost(closed)
                    )
                for answer in answers:
                    if answer.id == request_id:
                        return answer
                assert connection.state != "closed", "a request left unanswered"
        except BlockingIOError:
            # SO_RCVTIMEO / SO_SNDTIMEO ran out.
            self._disconnect()
            raise self._engine.unavailable(f"no reply within {self.timeout:g} s") from None
        except BaseException:
            # Anything else (a KeyboardInterrupt mid-recv) leaves a reply unread: the
            # connection is out of step, so it goes.
            self._disconnect()
            raise

    def _connect(self) -> None:
        try:
            self._open()
        except BaseException:
            # Half a connection (interrupted, or refused at the handshake) is none.
            self._disconnect()
            raise

    def _open(self) -> None:
        answer = self._greet()
        if answer.retry:
            # A daemon older than this client refused its version and closed: the
            # engine greets it in the oldest version now.
            self._disconnect()
            answer = self._greet()
        answer.result(Welcome)

    def _greet(self) -> Answer:
        """A new connection, and the answer to its hello."""
        sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._set_timeouts(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BlockingIOError:
            raise self._engine.unavailable(
                f"its backlog stayed full for {self.timeout:g} s"
            ) from None
        except OSError as exc:
            raise self._engine.connect_failed(exc) from None
        self._owner_pid = os.getpid()
        connection = self._connection = self._engine.connect()
        return self._exchange(sock, connection, connection.hello_id, connection.hello)

    def _reconnect(self) -> None:
        """Connect again, waiting out a daemon restart as the engine says."""
        backoff = self._engine.reconnecting(time.monotonic())
        while True:
            try:
                self._connect()
            except DaemonUnavailable:
                pause = backoff.pause(time.monotonic())
                if pause is None:
                    raise
            else:
                return
            time.sleep(pause)

    def _set_timeouts(self, seconds: float) -> None:
        # Kernel-side timeouts: settimeout() would add a poll() before every recv.
        assert self._sock is not None
        whole = int(seconds)
        timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._connection = None

    def _after_fork_in_child(self) -> None:
        # The parent's connection belongs to the parent: drop our copy of the fd
        # (closing a copy sends nothing on the socket). A lock another thread held
        # at fork time would stay held forever in the child.
        self._lock = threading.Lock()
        self._disconnect()


_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


def _reset_clients_in_child() -> None:
    for client in list(_live_clients):
        client._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_clients_in_child)
