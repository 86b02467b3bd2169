"""The client's side of the protocol, with no I/O: one engine that the blocking
`Client`, the trio `AsyncClient` and the process's responder all drive.

As in h11, the engine is handed the bytes that arrived and says what they mean, and
hands back the bytes to send; it never touches a socket, a clock or a thread. A
driver opens a socket, makes a `Connection` of it with `Engine.connect`, sends its
`Connection.hello`, then what `Connection.send` returns for each request, feeds
whatever it receives to `Connection.receive_data` (and the end of the stream to
`Connection.connection_lost`), and acts on the `Answer` each request gets.

Invariants:

- Request ids are unique per `Engine`, that is per client, across its connections:
  a request sent again on a new connection keeps its id.
- A connection carries requests only once its `Welcome` came (``"open"``).
- Every request sent on a connection gets exactly one `Answer`: its reply, the
  refusal or fault that ended the connection, or its loss when the stream ended
  first. A request the driver gave up on (`Connection.abandon`) gets none, and its
  late reply is dropped.
- A reply that cannot be read, that answers no request in flight, or that is of
  another type than its request expects means the two ends are out of step: every
  request in flight gets the `ProtocolError`, and the connection is done.
- The retry decision: every request is idempotent (acquire re-arms, release of an
  absent timer succeeds), so one whose connection ended after the welcome and
  before its reply (the daemon restarted) is sent once more on a new connection,
  which the driver keeps trying to open for as long as `Engine.reconnecting` says;
  a second loss is `DaemonUnavailable`.
- The version: a hello states the newest protocol version the engine speaks. A
  daemon older than the client refuses it (``unsupported_version``); the hello's
  answer then says to connect again (``retry``), and from then on the engine greets
  in the oldest version it speaks, which any daemon of this protocol welcomes.

Every frame the daemon sends answers a request, except `EvidenceWanted` and
`UnblockWanted`, which it sends unasked, and only on a responder's connection
(`Engine.connect` with ``responder``): `receive_data` keeps each in
`Connection.wanted`, in arrival order, for the driver to take.

The driver is written once, here, as plans: `Engine.dial`, `Engine.greet` and
`Engine.call` are generators that yield the `Step` to take next (`Open` a socket,
`Exchange` a frame for an answer, `Close`, `Pause`, read the `Clock`, get the
`Connected` connection) and are sent what it gave, or thrown the
`DaemonUnavailable` it raised. They decide when to reconnect and how long to
pause, that a second loss is `DaemonUnavailable`, that a refused version is
greeted again in the oldest, and that the socket is judged (`Open`, which
`watchdogd_client.trust` does) before anything is sent on it. A shell carries the
steps out: `drive` and the blocking client's sockets and threads, the trio
client's streams and reader tasks, the responder's thread. `watchdogd_client.queries`
builds each request of the clients' methods on `Engine.call`.

Why sans-IO, and not httpcore's way (async written once, the sync code generated
from it and checked to stay in step): the engine existed already, bytes in and
answers out, and what the three drivers shared beyond it were decisions, not
I/O. The rest differs by more than ``await``: the blocking client reads its
answers inline under a lock, the trio client pipelines many tasks' requests and
reads them in one reader task, and the responder answers frames the daemon sends
unasked; a fast-path arm whose slot page could not be mapped is armed again
without a slot, a decision that either client makes with a mapping of its own (in
a worker thread on trio). Generated code would have to hide each of those
differences behind a generated name; a plan names each step, and both shells are
short enough to read whole. A step costs a generator resume, well under the
microseconds a round trip over the socket takes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator
from typing import Any, Final, Generic, Literal, TypeVar

import msgspec

from watchdogd_protocol import (
    MAX_REPLY_FRAME,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    RECONNECT_PAUSE,
    Error,
    ErrorCode,
    EvidenceWanted,
    FrameReader,
    Hello,
    Reply,
    ReplyMessage,
    Request,
    UnblockWanted,
    Wanted,
    Welcome,
    decode_for_responder,
    decode_reply,
    encode_frame,
)

from .errors import (
    DaemonUnavailable,
    ProtocolError,
    RequestRefused,
    UntrustedSocket,
    WatchdogdError,
)

__all__ = [
    "CLOCK",
    "Answer",
    "Backoff",
    "Clock",
    "Close",
    "Connected",
    "Connection",
    "Engine",
    "Exchange",
    "Finished",
    "Open",
    "Pause",
    "Plan",
    "State",
    "Step",
    "advance",
    "drive",
]

_R = TypeVar("_R", bound=ReplyMessage)
_T = TypeVar("_T")

#: The first pause between attempts to reconnect (the longest is the protocol's
#: `RECONNECT_PAUSE`): a daemon that restarts is back within tens of milliseconds.
_FIRST_PAUSE: Final = 0.01


#: Where a `Connection` is: ``"greeting"``, the hello is sent and its welcome
#: awaited (requests wait for it); ``"open"``, welcomed, requests may be sent;
#: ``"closing"``, a send failed, so no more requests go out, but what the daemon sent
#: before it closed (a refusal) is still read and answers its request; ``"closed"``,
#: ended, every request sent on it has its answer. Strings rather than an Enum: the
#: state is checked on every send and every read, and a member's lookup would cost
#: more than the check.
State = Literal["greeting", "open", "closing", "closed"]


class Answer(msgspec.Struct, frozen=True):
    """What became of request ``id``: its ``reply``, checked against the type it
    expects, or the ``error`` it maps to (`RequestRefused`, `ProtocolError`,
    `DaemonUnavailable`).

    ``retry`` is set when the connection ended before the reply and the request may
    go once more on a new connection, and on a hello whose version the daemon
    refused: a new connection greets in the older one; ``error`` then says what to
    raise instead.
    (A Struct: one is made per reply, and a Struct is quicker to make than an
    instance of a plain class.)
    """

    id: int
    reply: ReplyMessage | None
    error: WatchdogdError | None = None
    retry: bool = False

    def result(self, expected: type[_R]) -> _R:
        """The reply, of the type the request was sent expecting; raises ``error``."""
        if self.error is not None:
            raise self.error
        # Checked against the type its request expects when it arrived.
        return self.reply  # type: ignore[return-value]


class Backoff:
    """The pauses between attempts to connect while the daemon restarts: from 10 ms,
    doubling to ``longest`` (`RECONNECT_PAUSE` unless given), for as long as the next attempt
    would start before ``deadline`` (on the driver's monotonic clock)."""

    __slots__ = ("_longest", "_pause", "deadline")

    def __init__(self, deadline: float, *, longest: float = RECONNECT_PAUSE) -> None:
        self.deadline = deadline
        self._longest = longest
        self._pause = _FIRST_PAUSE

    def pause(self, now: float) -> float | None:
        """Seconds to wait before the next attempt, or None: give up."""
        pause = self._pause
        if now + pause > self.deadline:
            return None
        self._pause = min(pause * 2, self._longest)
        return pause


class Step:
    """What a plan asks its driver to do next (see the module docstring)."""

    __slots__ = ()


class Open(Step):
    """Open a socket to the daemon, judge it (`watchdogd_client.trust`) before
    anything is sent on it, and send back `Engine.connect`'s `Connection` for it
    (``responder``: a responder's); raise `DaemonUnavailable` when it cannot be
    had (`UntrustedSocket` for one not to be trusted)."""

    __slots__ = ("responder",)

    def __init__(self, *, responder: bool) -> None:
        self.responder = responder


class Exchange(Step):
    """Send ``frame`` on ``connection``, behind whatever the driver owes an open
    connection first (releases to send again), and send back the `Answer` to
    ``request_id``; raise `DaemonUnavailable` when no answer comes in time.
    ``wait``: how much longer than the driver's timeout the daemon may hold the
    reply (a request that asks it to)."""

    __slots__ = ("connection", "frame", "request_id", "wait")

    def __init__(
        self, connection: Connection, request_id: int, frame: bytes, wait: float = 0.0
    ) -> None:
        self.connection = connection
        self.request_id = request_id
        self.frame = frame
        self.wait = wait


class Close(Step):
    """Close the socket of ``connection``, which the daemon refused."""

    __slots__ = ("connection",)

    def __init__(self, connection: Connection) -> None:
        self.connection = connection


class Pause(Step):
    """Wait ``seconds`` before the next attempt to connect."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Clock(Step):
    """Send back the driver's monotonic clock, in seconds."""

    __slots__ = ()


class Connected(Step):
    """Send back the driver's open connection, or one it opened with `Engine.dial`
    (waiting for the daemon as `Engine.reconnecting` says when ``again``, a
    request's second attempt, or when the driver's last connection broke)."""

    __slots__ = ("again",)

    def __init__(self, *, again: bool) -> None:
        self.again = again


#: The one `Clock` step: every plan that reads the time yields it.
CLOCK: Final = Clock()
_FIRST: Final = Connected(again=False)
_AGAIN: Final = Connected(again=True)

#: A plan: the steps it yields, what each is sent back, and what it ends with.
Plan = Generator[Step, Any, _T]


class Finished(Generic[_T]):
    """A plan that ended: what it ended with."""

    __slots__ = ("value",)

    def __init__(self, value: _T) -> None:
        self.value = value


def advance(plan: Plan[_T], sent: Any, failed: DaemonUnavailable | None) -> Step | Finished[_T]:
    """The next step of ``plan``, sent what the last one gave (``sent``) or
    thrown how it failed (``failed``); `Finished` once the plan ends. The one
    turn of every shell's loop (`drive`, the trio client's)."""
    try:
        return plan.send(sent) if failed is None else plan.throw(failed)
    except StopIteration as done:
        return Finished(done.value)


def drive(plan: Plan[_T], take: Callable[[Step], Any]) -> _T:
    """Carry ``plan`` out with blocking I/O: ``take(step)`` takes each step and
    returns what the plan is sent back; a `DaemonUnavailable` it raises is thrown
    into the plan, which decides what it means. What the plan ends with."""
    step = advance(plan, None, None)
    while not isinstance(step, Finished):
        try:
            sent = take(step)
        except DaemonUnavailable as exc:
            step = advance(plan, None, exc)
        else:
            step = advance(plan, sent, None)
    return step.value


class Engine:
    """What a client keeps from one connection to the next: its request ids, how long
    the daemon said a restart of it may take, and how the errors it meets read.

    ``socket_path`` names the daemon in errors; ``client`` is what the hello says
    the client is; ``max_reply`` bounds a reply frame; ``reconnect_timeout`` is how
    long a client whose connection broke waits for the daemon at the least.
    ``version`` is the protocol version its hellos state: `PROTOCOL_VERSION` until a
    daemon refuses it.
    """

    __slots__ = (
        "_ids",
        "client",
        "max_reply",
        "max_timeout",
        "reconnect_timeout",
        "restart",
        "socket_path",
        "version",
    )

    def __init__(
        self,
        socket_path: str,
        *,
        client: str,
        reconnect_timeout: float,
        max_reply: int = MAX_REPLY_FRAME,
    ) -> None:
        self.socket_path = socket_path
        self.client = client
        self.reconnect_timeout = reconnect_timeout
        self.max_reply = max_reply
        #: How long the daemon said a restart of it may take (its latest Welcome).
        self.restart = 0.0
        #: The longest timeout the daemon arms, as its latest Welcome said (0: not
        #: known yet): `watchdogd_client.arming.arming_timeout` refuses a longer one.
        self.max_timeout = 0.0
        self.version = PROTOCOL_VERSION
        # next() on a count is atomic under the GIL: the blocking client's threads
        # take their ids without a lock.
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        """A request id no other request of this client has."""
        return next(self._ids)

    def connect(self, *, responder: bool = False) -> Connection:
        """The protocol of a socket just connected to the daemon; a ``responder``'s
        connection also takes the daemon's `EvidenceWanted` and `UnblockWanted`."""
        return Connection(self, responder=responder)

    def reconnecting(self, now: float) -> Backoff:
        """How to wait for the daemon after a connection broke: for
        ``reconnect_timeout``, or as long as the daemon said its restart may take,
        if longer."""
        return Backoff(now + max(self.reconnect_timeout, self.restart))

    def dial(self, *, broke: bool) -> Plan[Connection]:
        """Open a connection and greet the daemon on it: once, or, when a
        connection ``broke`` (the daemon may be restarting), again after each
        failure for as long as `reconnecting` says. A socket not to be trusted is
        not tried again: its owner stays who it is, however long the wait."""
        backoff = self.reconnecting((yield CLOCK)) if broke else None
        while True:
            try:
                connection: Connection = yield from self.greet()
            except UntrustedSocket:
                raise
            except DaemonUnavailable:
                pause = None if backoff is None else backoff.pause((yield CLOCK))
                if pause is None:
                    raise
            else:
                return connection
            yield Pause(pause)

    def greet(self, *, responder: bool = False) -> Plan[Connection]:
        """Open a socket, judged before anything is sent, and greet the daemon: the
        connection, once welcomed. A daemon older than the client refuses its
        version and closes; it is greeted again in the oldest version, except by a
        ``responder`` (a daemon that old has no responders): that refusal is raised."""
        connection: Connection = yield Open(responder=responder)
        answer: Answer = yield Exchange(connection, connection.hello_id, connection.hello)
        if answer.retry and not responder:
            yield Close(connection)
            connection = yield Open(responder=responder)
            answer = yield Exchange(connection, connection.hello_id, connection.hello)
        answer.result(Welcome)
        return connection

    def call(self, request: Request, expected: type[_R], *, wait: float = 0.0) -> Plan[_R]:
        """Send ``request`` on the driver's connection and return its reply, an
        ``expected``, or raise what it was refused. Every request is idempotent:
        one whose connection ended before its reply (the daemon restarted) goes
        once more on a new connection; a second loss is `DaemonUnavailable`.
        ``wait``: as `Exchange` says."""
        connection: Connection = yield _FIRST
        frame = connection.send(request, expected)
        answer: Answer = yield Exchange(connection, request.id, frame, wait)
        if answer.retry:
            connection = yield _AGAIN
            frame = connection.send(request, expected, resent=True)
            answer = yield Exchange(connection, request.id, frame, wait)
        return answer.result(expected)

    def unavailable(self, reason: str) -> DaemonUnavailable:
        """The error for a daemon that did not answer, saying why."""
        return DaemonUnavailable.at(self.socket_path, reason)

    def connect_failed(self, exc: OSError, there: str = "") -> DaemonUnavailable:
        """What a failed connect(2) tells the caller; ``there``: what the path is
        when it is no socket (`paths.what_is_there`), which Linux also refuses
        with ECONNREFUSED."""
        if isinstance(exc, FileNotFoundError):
            return self.unavailable("no socket there")
        if isinstance(exc, ConnectionRefusedError):
            return self.unavailable(
                f"not a socket but {there}" if there else "nothing is listening on it"
            )
        return self.unavailable(exc.strerror or str(exc))

    def lost(self, request_id: int, *, resent: bool, reason: str | None = None) -> Answer:
        """The answer of a request whose connection ended before its reply: sent
        once more, unless it was already ``resent``. ``reason``: how it ended."""
        closed = f"the connection closed ({reason})" if reason else "the connection closed"
        return Answer(request_id, None, self.unavailable(closed), retry=not resent)


class Connection:
    """The protocol of one connection, from its hello to its end.

    ``hello`` is the frame to send first, and ``hello_id`` the id its answer
    carries: a `Welcome` opens the connection, anything else ends it. See the module
    docstring for what every request is owed. On a ``responder``'s connection,
    ``wanted`` holds the daemon's asks received and not yet taken by the driver.
    """

    __slots__ = (
        "_abandoned",
        "_decode",
        "_engine",
        "_pending",
        "_reader",
        "carrier",
        "hello",
        "hello_id",
        "state",
        "wanted",
    )

    def __init__(self, engine: Engine, *, responder: bool = False) -> None:
        self._engine = engine
        self._reader = FrameReader(engine.max_reply)
        # Any other connection refuses the daemon's asks as it refuses any unknown frame.
        self._decode = decode_for_responder if responder else decode_reply
        self.wanted: list[Wanted] = []
        #: What the driver carries this connection's bytes with: the engine never
        #: looks at it.
        self.carrier: object = None
        self.state: State = "greeting"
        self.hello_id = engine.next_id()
        self.hello = encode_frame(
            Hello(id=self.hello_id, version=engine.version, client=engine.client)
        )
        #: Requests in flight: the reply type each expects, and whether it was resent.
        self._pending: dict[int, tuple[type[Reply], bool]] = {
            self.hello_id: (Welcome, True)  # never sent again: a failed hello is a failed connect
        }
        #: Requests given up on: a reply to one is late, not out of step.
        self._abandoned: set[int] = set()

    def send(self, request: Request, expected: type[Reply], *, resent: bool = False) -> bytes:
        """The frame that carries ``request``, whose reply must be an ``expected``;
        ``resent`` when it goes again after its first connection ended."""
        if self.state != "open":
            raise RuntimeError(f"a request sent on a connection that is {self.state}")
        self._pending[request.id] = (expected, resent)
        return encode_frame(request)

    def receive_data(self, data: bytes) -> list[Answer]:
        """The answers that the received bytes ``data`` complete, in order."""
        answers: list[Answer] = []
        try:
            frames = self._reader.feed(data)
        except ProtocolError as exc:  # FrameTooLarge: the stream is out of step
            self._end(answers, exc)
            return answers
        pending = self._pending
        for frame in frames:
            try:
                reply = self._decode(frame)
            except ProtocolError as exc:
                self._end(answers, exc)
                break
            if isinstance(reply, EvidenceWanted | UnblockWanted):
                self.wanted.append(reply)
                continue
            request_id = reply.id
            waiting = None if request_id is None else pending.pop(request_id, None)
            if (
                waiting is not None
                and request_id is not None
                and request_id != self.hello_id
                and isinstance(reply, waiting[0])
            ):
                answers.append(Answer(request_id, reply))  # what nearly every frame is
                continue
            self._received(reply, waiting, answers)
            if self.state == "closed":
                break
        return answers

    def connection_lost(self, reason: str | None = None) -> list[Answer]:
        """The stream ended (``reason``: how): the answers of every request that was
        still waiting for its reply."""
        self.state = "closed"
        pending, self._pending = self._pending, {}
        self._abandoned.clear()
        answers = []
        for request_id, (_, resent) in pending.items():
            if request_id == self.hello_id:
                closed = "the connection closed during the handshake"
                error = self._engine.unavailable(f"{closed} ({reason})" if reason else closed)
                answers.append(Answer(request_id, None, error))
            else:
                answers.append(self._engine.lost(request_id, resent=resent, reason=reason))
        return answers

    def send_failed(self) -> None:
        """A send on this connection failed: no request goes out on it any more."""
        if self.state != "closed":
            self.state = "closing"

    def abandon(self, request_id: int) -> None:
        """The driver gave up waiting for ``request_id`` (a timeout, a cancellation):
        its reply, should it come, is dropped."""
        if self._pending.pop(request_id, None) is not None:
            self._abandoned.add(request_id)

    def _received(
        self,
        reply: ReplyMessage,
        waiting: tuple[type[Reply], bool] | None,
        answers: list[Answer],
    ) -> None:
        """Answer with a reply that is not simply the one its request expects;
        ``waiting``: what its request was waiting for, if its id named one."""
        request_id = reply.id
        if request_id is None:
            # An error about no request in particular (a refused connection, a frame
            # over the bound): it answers every request, and the daemon closes.
            assert isinstance(reply, Error)
            self._end(answers, RequestRefused(reply.code, reply.message))
        elif waiting is None:
            if request_id in self._abandoned:
                self._abandoned.discard(request_id)
                return
            late = f"reply id {request_id} answers no request in flight"
            self._end(answers, ProtocolError(ErrorCode.MALFORMED, late))
        elif request_id == self.hello_id:
            answers.append(self._greeted(reply))
        elif isinstance(reply, Error):
            answers.append(Answer(request_id, None, RequestRefused(reply.code, reply.message)))
        else:
            wrong = f"expected a {waiting[0].__name__} reply, got {type(reply).__name__}"
            error = ProtocolError(ErrorCode.MALFORMED, wrong)
            answers.append(Answer(request_id, None, error))
            self._end(answers, error)

    def _greeted(self, reply: ReplyMessage) -> Answer:
        """The answer to the hello: a welcome opens the connection, anything else
        ends it (the daemon closes a connection it refused)."""
        if isinstance(reply, Welcome) and self.state == "greeting":
            self.state = "open"
            self._engine.restart = reply.restart
            self._engine.max_timeout = reply.max_timeout
            return Answer(self.hello_id, reply)
        self.state = "closed"
        error: WatchdogdError
        if isinstance(reply, Error):
            error = RequestRefused(reply.code, reply.message)
            engine = self._engine
            if (
                reply.code == ErrorCode.UNSUPPORTED_VERSION
                and engine.version > MIN_PROTOCOL_VERSION
            ):
                # A daemon older than this client: it speaks the oldest version at
                # least, and the daemon closes a connection it refused.
                engine.version = MIN_PROTOCOL_VERSION
                return Answer(self.hello_id, None, error, retry=True)
        elif isinstance(reply, Welcome):  # but the hello's send failed: nothing can follow
            error = self._engine.unavailable("the connection closed during the handshake")
        else:
            error = ProtocolError(ErrorCode.MALFORMED, f"expected welcome, got {reply!r}")
        return Answer(self.hello_id, None, error)

    def _end(self, answers: list[Answer], error: RequestRefused | ProtocolError) -> None:
        """End the connection, answering every request in flight with an ``error``
        of its own (one exception raised in several tasks would tangle their
        tracebacks)."""
        self.state = "closed"
        code, message = error.code, error.message
        answers += [Answer(id_, None, type(error)(code, message)) for id_ in self._pending]
        self._pending.clear()
        self._abandoned.clear()
