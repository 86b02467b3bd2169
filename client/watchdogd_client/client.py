"""The blocking client, `Client`.

`Client` keeps one connection to the daemon, opened on first use. Requests are
serialised by a lock, so any number of threads may share one client. A child process
created by ``fork()`` never uses its parent's connection: it opens its own on first
use, and its requests are about its own pid. Every request is idempotent (acquire
re-arms, release of an absent timer succeeds), so one whose connection broke after
the handshake (the daemon restarted) is sent again once on a new connection.

The protocol (ids, the handshake, matching and checking replies, what each error
means, whether to send again, when and how long to wait for the daemon) is the
engine's, `watchdogd_client.engine`, and each method's request is
`watchdogd_client.queries`'s: `Client` takes the steps of their plans over a
blocking socket with kernel-side timeouts, one plan at a time under its lock.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import socket
import struct
import threading
import time
import weakref
from typing import Any, Final, TypeVar, Unpack

from watchdogd_protocol import (
    MAX_REPLY_BYTES,
    MAX_REPLY_FRAME,
    Acquire,
    Acquired,
    EventsReply,
    HangsReply,
    IncidentInfo,
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
from ._version import __version__ as _version
from .arming import (
    Acquiring,
    After,
    Arming,
    acquire_request,
    check_acquiring,
    socket_arm,
)
from .base import BaseClient, DaemonStatus, NoOpTimer, NullClient, Timer
from .engine import (
    Answer,
    Clock,
    Close,
    Connected,
    Connection,
    Engine,
    Exchange,
    Open,
    Pause,
    Plan,
    Step,
    drive,
)
from .errors import DaemonUnavailable
from .fastpath import fast_path, map_page
from .outage import OnUnavailable, Outage
from .paths import Place, find_socket, what_is_there
from .responder import EXIT_WAIT, release_carrier, settle_responder
from .trust import vet

__all__ = [
    "BaseClient",
    "Client",
    "DaemonStatus",
    "NoOpTimer",
    "NullClient",
    "OnUnavailable",
    "Timer",
]

_R = TypeVar("_R", bound=ReplyMessage)
_T = TypeVar("_T")

_DEFAULT_TIMEOUT: Final = 10.0
#: Kept at 64 KiB: a larger recv buffer makes CPython map and unmap memory per call.
_RECV_SIZE: Final = 64 * 1024
#: How long a client whose connection broke waits for the daemon to come back.
_RECONNECT_TIMEOUT: Final = 5.0


class Client(BaseClient):
    """A blocking, thread-safe, fork-safe connection to the daemon.

    ``socket_path`` defaults as `watchdogd_client.paths.find_socket` says. Each
    connection first judges the socket by where its path came from
    (`watchdogd_client.trust`): one it has no reason to trust gets nothing, not even
    a hello, and requests raise `UntrustedSocket` (a `DaemonUnavailable`).
    ``timeout`` bounds each request (connect, send and reply), in seconds.
    ``max_reply`` bounds a reply frame; it may not be below `watchdogd_protocol.MAX_REPLY_BYTES`,
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
    After a scope's first acknowledged arm, its blocks arm and release by stores
    (`watchdogd_client.fastpath`), unless ``fast=False`` or ``WATCHDOGD_FAST=0``.

    A block's release that goes over the socket is sent, and the worker goes on:
    its answer is read with the next request's (at the latest at exit) and checked.
    That needs a daemon that keeps armings' numbers (`Acquired.arm`) and the
    process's responder, which sends a release again if its connection broke
    before an answer was read (`watchdogd_client.releases`); a refused release is
    logged then, and raised by the next request. Otherwise it waits for its answer.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | Place | None = None,
        *,
        timeout: float = _DEFAULT_TIMEOUT,
        on_unavailable: OnUnavailable = "raise",
        max_reply: int = MAX_REPLY_FRAME,
        reconnect_timeout: float = _RECONNECT_TIMEOUT,
        responder: bool = True,
        fast: bool = True,
    ) -> None:
        self._outage = Outage(on_unavailable)
        if max_reply < MAX_REPLY_BYTES:
            # A reply the daemon may send would then be unreadable.
            raise ValueError(f"max_reply must be at least {MAX_REPLY_BYTES}, not {max_reply!r}")
        if not (math.isfinite(timeout) and timeout >= 0.001):
            raise ValueError(f"timeout must be finite and at least 0.001 s, not {timeout!r}")
        self.on_unavailable: OnUnavailable = on_unavailable
        self.place = find_socket(socket_path)
        self.socket_path = self.place.path
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.responder = responder
        self.fast = fast
        self._fast = fast_path(self.socket_path, fast)
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
        #: The releases of its blocks sent without waiting for their answers.
        self._releases = releases.Releasing()
        #: Its connection broke under a request or a release: the next request
        #: waits for the daemon to come back (`_connected`), as a retry does.
        self._broken = False
        _live_clients.add(self)

    def __repr__(self) -> str:
        return f"Client({self.socket_path!r})"

    def __getstate__(self) -> dict[str, object]:
        # A client sent to another process (multiprocessing's spawn pickles its
        # arguments) arrives unconnected and connects there on first use.
        return {
            # Its place, not its path: a path found by itself is judged as such there.
            "socket_path": self.place,
            "timeout": self.timeout,
            "on_unavailable": self.on_unavailable,
            "max_reply": self._engine.max_reply,
            "reconnect_timeout": self.reconnect_timeout,
            "responder": self.responder,
            "fast": self.fast,
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

    def acquire(self, scope: str, timeout: After, **acquiring: Unpack[Acquiring]) -> float:
        """See `BaseClient.acquire`."""
        _, arming = check_acquiring(scope, timeout, acquiring, maximum=self._maximum())
        fast = self._fast
        if fast is not None and socket_arm(acquiring):
            stored = fast.arm(scope, timeout, arming)
            if stored is not None:
                return stored
        request = acquire_request(
            self._engine.next_id(), scope, timeout, slot=fast is not None, **acquiring
        )
        reply = self._acquire(request, arming)
        return request.timeout if reply is None else reply.remaining

    def _acquire(self, request: Acquire, arming: Arming) -> Acquired | None:
        """Send ``request``, armed with ``arming`` (`queries.acquire`); its reply,
        or None when the daemon could not be reached and the client carries on
        unprotected (``on_unavailable="warn"``)."""
        if request.pid is None or request.pid == os.getpid():
            # Before the request: the responder connects on its own thread meanwhile.
            settle_responder(self.responder, self.place, request)
        plan = queries.acquire(self._engine, request, arming, fast=self._fast is not None)
        try:
            return self._run(plan)
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return None

    def _arm_block(self, scope: str, after: After, progress: int | None, arming: Arming) -> int:
        request = acquire_request(
            self._engine.next_id(),
            scope,
            after,
            progress=progress,
            slot=self._fast is not None,
            **arming,
        )
        reply = self._acquire(request, arming)
        return 0 if reply is None else reply.arm

    def _release_block(self, scope: str, arm: int, *, stored: bool = False) -> None:
        if stored:
            self._released(scope, None, stored=True)
            return
        responder = release_carrier(self.socket_path, arm)
        if responder is not None:
            with self._lock:
                connection, sock = self._connection, self._sock
                if (
                    connection is not None
                    and sock is not None
                    and connection.state == "open"
                    and self._owner_pid == os.getpid()
                ):
                    request = Release(id=self._engine.next_id(), scope=scope, arm=arm)
                    self._releases.sent(request, connection)
                    try:
                        sock.sendall(connection.send(request, Released))
                    except OSError:
                        # The daemon went: the responder sends it again once it is
                        # back, and so does the next request.
                        self._disconnect()
                        self._broken = True
                        responder.resend()
                    return
        self._released(scope, None)

    def release(self, scope: str, *, pid: int | None = None) -> bool:
        stored = None if pid is not None or self._fast is None else self._fast.release(scope)
        if stored is None or stored == "closed":
            return self._released(scope, pid, stored=stored == "closed")
        return stored

    def _released(self, scope: str, pid: int | None, *, stored: bool = False) -> bool:
        try:
            return self._run(queries.release(self._engine, scope, pid, stored=stored))
        except DaemonUnavailable as exc:
            self._outage.failed(exc)
            return False

    def status(self) -> DaemonStatus:
        return self._run(queries.status(self._engine))

    def status_page(
        self, *, limit: int = queries.STATUS_PAGE, cursor: str | None = None
    ) -> StatusReply:
        """One page of `status`, as the daemon sent it (command lines in
        ``commands``, see `StatusReply.timers_with_commands`); pass the reply's
        ``cursor`` to get the next."""
        return self._run(queries.status_page(self._engine, limit=limit, cursor=cursor))

    def ping(self) -> float:
        return self._run(queries.ping(self._engine))

    def events(
        self, *, after: int | None = None, limit: int = 100, wait: float = 0.0
    ) -> EventsReply:
        """Recorded events, oldest first: the latest ``limit``, or those after the
        number ``after``. With ``wait``, the daemon holds the reply up to that many
        seconds for a new event (pass the reply's ``last`` as the next ``after``)."""
        return self._run(queries.events(self._engine, after=after, limit=limit, wait=wait))

    def policies(self) -> PoliciesReply:
        """The daemon's policies and its default policy."""
        return self._run(queries.policies(self._engine))

    def metrics(self) -> str:
        """The daemon's metrics in the Prometheus text exposition format."""
        return self._run(queries.metrics(self._engine))

    def suggest(self) -> list[SuggestionInfo]:
        """What the daemon learned of how long your scopes (root: everyone's) are
        held before their release, and the timeout it suggests for each."""
        return self._run(queries.suggest(self._engine))

    def incidents(self, *, limit: int = 100) -> list[IncidentInfo]:
        """The latest incidents of your jobs (root: all), newest last, without
        their stacks."""
        return self._run(queries.incidents(self._engine, limit=limit))

    def incident(self, incident: str) -> IncidentInfo:
        """One incident with every rank's stack you may see."""
        return self._run(queries.incident(self._engine, incident))

    def hangs(self, job: str, *, uid: int | None = None, reset: bool = False) -> HangsReply:
        """The hangs of your job ``job`` (root: of the user ``uid``) and whether it
        may be restarted; with ``reset``, after its repeating mark is cleared."""
        return self._run(queries.hangs(self._engine, job, uid=uid, reset=reset))

    def why(self, pid: int, *, limit: int = 100) -> WhyReply:
        """Everything the daemon knows about why process ``pid`` was, or would be,
        acted on (what you may see of it)."""
        return self._run(queries.why(self._engine, pid, limit=limit))

    def _call(self, request: Request, expected: type[_R]) -> _R:
        return self._run(self._engine.call(request, expected))

    def _run(self, plan: Plan[_T]) -> _T:
        """Carry ``plan`` out under the lock, as the engine decides."""
        # A release of a block that ended was refused: its timer may still be
        # armed, which the worker must hear before it goes on.
        self._releases.raise_refused()
        with self._lock:
            result = drive(plan, self._take)
        self._outage.answered(self.socket_path)
        return result

    def _take(self, step: Step) -> Any:
        """Take one step of a plan (see `watchdogd_client.engine`)."""
        if isinstance(step, Exchange):
            return self._exchange_step(step)
        if isinstance(step, Connected):
            return self._connected(again=step.again)
        if isinstance(step, Open):
            return self._open()
        if isinstance(step, Pause):
            time.sleep(step.seconds)
        elif isinstance(step, Clock):
            return time.monotonic()
        elif isinstance(step, Close):
            self._disconnect()
        elif isinstance(step, queries.Grant) and self._fast is not None:
            mapper = functools.partial(map_page, self.place, timeout=self.timeout)
            return self._fast.answered(step.request, step.arming, step.reply, mapper)
        else:
            raise TypeError(f"a plan asked for {step!r}")
        return None

    def _exchange_step(self, step: Exchange) -> Answer:
        """Send the step's frame, the releases still unsettled first on a new
        connection; the answer it gets."""
        sock, connection = self._sock, step.connection
        assert sock is not None
        assert connection is self._connection
        frame = step.frame
        if connection.state == "open":
            frame = self._releases.again(connection, self._engine) + frame
        wait = step.wait
        if wait:
            _set_timeouts(sock, self.timeout + wait)
        try:
            answer = self._exchange(sock, connection, step.request_id, frame)
        finally:
            if wait and self._sock is not None:
                _set_timeouts(self._sock, self.timeout)
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
                found = None
                for answer in answers:
                    if answer.id == request_id:
                        found = answer
                    elif self._releases.in_flight:
                        self._releases.settle(answer)
                if found is not None:
                    return found
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

    def _connected(self, *, again: bool) -> Connection:
        """The open connection of this process, or a new one: dialled as the engine
        says, waiting out a daemon restart when ``again`` or when the last one
        broke under a request or a release."""
        if self._sock is not None and self._owner_pid != os.getpid():
            self._disconnect()
        connection = self._connection
        if self._sock is not None and connection is not None:
            return connection
        broke, self._broken = again or self._broken, False
        try:
            connection = drive(self._engine.dial(broke=broke), self._take)
        except BaseException:
            # Half a connection (interrupted, or refused at the handshake) is none.
            self._disconnect()
            raise
        self._limit = self._engine.max_timeout or math.inf
        return connection

    def _open(self) -> Connection:
        """A new socket, judged before anything is sent on it, and its protocol."""
        self._disconnect()  # what an attempt before it left
        sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        _set_timeouts(sock, self.timeout)
        with vet(self.place) as vetted:
            try:
                sock.connect(vetted.address)
            except BlockingIOError:
                raise self._engine.unavailable(
                    f"its backlog stayed full for {self.timeout:g} s"
                ) from None
            except OSError as exc:
                raise self._engine.connect_failed(exc, what_is_there(self.socket_path)) from None
            vetted.admit(sock)
        self._owner_pid = os.getpid()
        connection = self._connection = self._engine.connect()
        return connection

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._connection = None
        self._releases.disconnected()

    def _after_fork_in_child(self) -> None:
        # The parent's connection belongs to the parent: drop our copy of the fd
        # (closing a copy sends nothing on the socket). A lock another thread held
        # at fork time would stay held forever in the child.
        self._lock = threading.Lock()
        self._disconnect()
        self._releases.forget()


def _set_timeouts(sock: socket.socket | None, seconds: float) -> None:
    # Kernel-side timeouts: settimeout() would add a poll() before every recv.
    assert sock is not None
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _settle_releases(client: Client, timeout: float) -> None:
    """Read the answers of ``client``'s releases sent without waiting, for up to
    ``timeout`` seconds: at exit, so that the daemon takes each before it sees the
    process end."""
    if not client._lock.acquire(timeout=timeout):
        return
    try:
        sock, connection = client._sock, client._connection
        if sock is None or connection is None or not client._releases.in_flight:
            return
        _set_timeouts(sock, timeout)
        with contextlib.suppress(OSError):
            while client._releases.in_flight and connection.state != "closed":
                data = sock.recv(_RECV_SIZE)
                answers = connection.receive_data(data) if data else connection.connection_lost()
                for answer in answers:
                    client._releases.settle(answer)
        client._disconnect()
    finally:
        client._lock.release()


_live_clients: weakref.WeakSet[Client] = weakref.WeakSet()


@atexit.register
def _settle_at_exit() -> None:
    for client in list(_live_clients):
        _settle_releases(client, EXIT_WAIT)


def _reset_clients_in_child() -> None:
    for client in list(_live_clients):
        client._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_clients_in_child)
