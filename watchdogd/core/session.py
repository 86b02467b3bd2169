"""One connection's protocol state, without the socket.

A `Session` turns each received frame body into reply frames appended to an output
buffer, and says when the connection must close. Invariants:

- Until a `Hello` with a supported version has been answered, any other frame is
  answered with ``handshake_required`` and the connection closes.
- After the handshake, a frame that fails to decode or validate gets an error reply
  carrying its id (when readable) and the connection stays usable.
- No exception leaves `Session.receive`: a bug while handling a valid request is
  handed to the log (rate-limited per uid) and answered with ``internal``. Nothing a request can
  cause other than a bug is logged with a traceback.
- Every refusal (a frame that does not decode, a handshake refused, a request
  refused) is a debug line, rate-limited per (uid, ``refused``), saying who, the op,
  the code and why; at the info level it costs one attribute read.
- Every request is counted once, by op and result, when it is answered.
- ``shown`` is the highest event number a reply of the connection carried (its
  runtime sends the reply once that event is written: `watchdogd.runtime.server`);
  a `HangsReply` carries the number of its job's latest mark or reset.
- A connection whose `Respond` was taken is a responder's (``responder``): each
  `Respond` taken, and each `Evidence` or `Unblocked` it sends, is answered and
  handed back to the connection, which binds its asks to the process
  (`watchdogd.runtime.server`) and gives the answer to whoever asked on it
  (`watchdogd.runtime.asks`).
- A `MapPage` that was answered is handed back too: its reply must leave with the
  page's descriptor (`watchdogd.runtime.server`).
"""

from __future__ import annotations

from typing import Any, Final

from watchdogd_protocol import (
    Error,
    ErrorCode,
    Events,
    EventsReply,
    Evidence,
    HangsReply,
    Hello,
    MapPage,
    PageMapped,
    ProtocolError,
    ReplyMessage,
    RequestMessage,
    Respond,
    Responding,
    Unblocked,
    WhyReply,
    decode_request,
    encode_frame_into,
)

from ..errors import Refusal
from .logline import Level, logfmt
from .service import Caller, Service


class Session:
    """The protocol state of one connection from ``caller``."""

    __slots__ = ("caller", "greeted", "responder", "service", "shown")

    def __init__(self, service: Service[Any], caller: Caller[Any]) -> None:
        self.service = service
        self.caller = caller
        self.greeted = False
        #: Its `Respond` was taken: the process answers evidence requests on it.
        self.responder = False
        #: The highest event number its replies showed: the connection sends them
        #: once that event is kept beside the state, so that a number a client saw
        #: is never given to another event after a crash.
        self.shown = 0

    def receive(
        self, frame: bytes, now: float, out: bytearray, *, may_wait: bool = True
    ) -> bool | Events | Respond | Evidence | Unblocked | MapPage:
        """Handle one frame body, appending the reply to ``out``. Returns False when
        the connection must close after ``out`` is sent, (when ``may_wait``) the
        `Events` request to answer with `answer` once an event happens or its wait
        runs out, the `Respond` taken or the `Evidence` or `Unblocked` a responder
        sent, answered already, or the `MapPage` whose reply (the last in ``out``)
        goes with a descriptor."""
        try:
            request = decode_request(frame)
        except ProtocolError as exc:
            self.service.metrics.count_request("invalid", exc.code)
            if self.greeted:
                error = Error(id=exc.request_id, code=exc.code, message=exc.message)
            else:
                message = f"the first request on a connection must be hello ({exc.message})"
                error = Error(id=exc.request_id, code=ErrorCode.HANDSHAKE_REQUIRED, message=message)
            if self.service.log.debugging:
                self._refused("?", error)
            encode_frame_into(error, out)
            return self.greeted
        if not self.greeted:
            reply: ReplyMessage
            result = "ok"
            if isinstance(request, Hello):
                try:
                    reply = self.service.arming.welcome(request)
                    self.greeted = True
                except Refusal as refusal:
                    result = refusal.code
                    reply = Error(id=request.id, code=refusal.code, message=refusal.message)
            else:
                result = ErrorCode.HANDSHAKE_REQUIRED
                message = "the first request on a connection must be hello"
                reply = Error(id=request.id, code=result, message=message)
            self.service.metrics.count_request(_OPS[type(request)], result)
            if isinstance(reply, Error) and self.service.log.debugging:
                self._refused(_OPS[type(request)], reply)
            encode_frame_into(reply, out)
            return self.greeted
        return self.answer(request, now, out, may_wait=may_wait)

    def answer(
        self, request: RequestMessage, now: float, out: bytearray, *, may_wait: bool = False
    ) -> bool | Events | Respond | Evidence | Unblocked | MapPage:
        """Handle a decoded request, appending its reply to ``out``."""
        result = "ok"
        reply: ReplyMessage
        try:
            reply = self.service.handle(request, self.caller, now)
        except Refusal as refusal:
            result = refusal.code
            reply = Error(id=request.id, code=refusal.code, message=refusal.message)
            if self.service.log.debugging:
                self._refused(_OPS[type(request)], reply)
        except Exception as exc:
            # A bug, logged with its traceback; rate-limited per uid all the same,
            # since whoever found it can repeat the request at will.
            peer = self.caller.peer
            self.service.log.log(
                (peer.uid, "internal"),
                Level.ERROR,
                f"internal error handling {request!r} from pid {peer.pid} uid {peer.uid}",
                error=exc,
            )
            result = ErrorCode.INTERNAL
            reply = Error(
                id=request.id,
                code=ErrorCode.INTERNAL,
                message="the daemon failed on this request; see its log",
            )
        if (
            may_wait
            and isinstance(request, Events)
            and isinstance(reply, EventsReply)
            and request.after is not None
            and request.wait > 0
            and not reply.events
        ):
            return request
        self.service.metrics.count_request(_OPS[type(request)], result)
        encode_frame_into(reply, out)
        if isinstance(reply, EventsReply | WhyReply | HangsReply):
            self.shown = max(self.shown, _shown(reply))
        if isinstance(reply, Responding) and isinstance(request, Respond | Evidence | Unblocked):
            if isinstance(request, Respond):
                self.responder = True
            return request
        if isinstance(reply, PageMapped) and isinstance(request, MapPage):
            return request
        return True

    def _refused(self, op: str, error: Error) -> None:
        """The debug line of a refusal: who asked, what, and why it was refused."""
        peer = self.caller.peer
        line = logfmt(
            "refused", op=op, pid=peer.pid, uid=peer.uid, code=error.code, reason=error.message
        )
        self.service.log.log((peer.uid, "refused"), Level.DEBUG, line)


def _shown(reply: EventsReply | WhyReply | HangsReply) -> int:
    """The highest event number ``reply`` shows."""
    if isinstance(reply, HangsReply):
        return reply.event
    last = reply.last if isinstance(reply, EventsReply) else 0
    return max(last, reply.events[-1].seq) if reply.events else last


_OPS: Final[dict[type[RequestMessage], str]] = {
    kind: str(kind.__struct_config__.tag) for kind in RequestMessage.__args__
}
