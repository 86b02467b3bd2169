"""One connection's protocol state, without the socket.

A `Session` turns each received frame body into reply frames appended to an output
buffer, and says when the connection must close. Invariants:

- Until a `Hello` with a supported version has been answered, any other frame is
  answered with ``handshake_required`` and the connection closes.
- After the handshake, a frame that fails to decode or validate gets an error reply
  carrying its id (when readable) and the connection stays usable.
- No exception leaves `Session.receive`: a bug while handling a valid request is
  logged and answered with ``internal``.
"""

from __future__ import annotations

from typing import Any

from watchdogd_client.errors import ProtocolError
from watchdogd_client.protocol import (
    Error,
    ErrorCode,
    Hello,
    ReplyMessage,
    decode_request,
    encode_frame_into,
)

from .errors import Refusal
from .logs import log
from .service import Caller, Service


class Session:
    """The protocol state of one connection from ``caller``."""

    __slots__ = ("caller", "greeted", "service")

    def __init__(self, service: Service[Any], caller: Caller[Any]) -> None:
        self.service = service
        self.caller = caller
        self.greeted = False

    def receive(self, frame: bytes, now: float, out: bytearray) -> bool:
        """Handle one frame body, appending the reply to ``out``. Returns False when
        the connection must close after ``out`` is sent."""
        try:
            request = decode_request(frame)
        except ProtocolError as exc:
            if self.greeted:
                error = Error(id=exc.request_id, code=exc.code, message=exc.message)
            else:
                message = f"the first request on a connection must be hello ({exc.message})"
                error = Error(id=exc.request_id, code=ErrorCode.HANDSHAKE_REQUIRED, message=message)
            encode_frame_into(error, out)
            return self.greeted
        reply: ReplyMessage
        if not self.greeted:
            if isinstance(request, Hello):
                try:
                    reply = self.service.welcome(request)
                    self.greeted = True
                except Refusal as refusal:
                    reply = Error(id=request.id, code=refusal.code, message=refusal.message)
            else:
                message = "the first request on a connection must be hello"
                reply = Error(id=request.id, code=ErrorCode.HANDSHAKE_REQUIRED, message=message)
            encode_frame_into(reply, out)
            return self.greeted
        try:
            reply = self.service.handle(request, self.caller, now)
        except Refusal as refusal:
            reply = Error(id=request.id, code=refusal.code, message=refusal.message)
        except Exception:
            log.exception("internal error handling %r from pid %d", request, self.caller.peer.pid)
            reply = Error(
                id=request.id,
                code=ErrorCode.INTERNAL,
                message="the daemon failed on this request; see its log",
            )
        encode_frame_into(reply, out)
        return True
