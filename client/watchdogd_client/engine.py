"""The client's side of the protocol, with no I/O: one engine that the blocking
`Client` and the trio `AsyncClient` both drive.

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
"""

from __future__ import annotations

import itertools
from typing import Final, Literal, TypeVar

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

from .errors import DaemonUnavailable, ProtocolError, RequestRefused, WatchdogdError

__all__ = ["Answer", "Backoff", "Connection", "Engine", "State"]

_R = TypeVar("_R", bound=ReplyMessage)

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
