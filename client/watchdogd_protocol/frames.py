"""Frames: how messages travel, and the bounds on their size.

A frame is a 4-byte big-endian unsigned length followed by one msgpack message of
exactly that length. One typed decoder per direction validates what arrives; a frame
that declares more bytes than the receiver's bound is refused before any buffer of
that size exists (`FrameReader` raises `FrameTooLarge`).
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec
from msgspec import Struct

from .errors import FrameTooLarge, ProtocolError
from .replies import ErrorCode, Reply, ReplyMessage
from .requests import Request, RequestId, RequestMessage
from .responding import EvidenceWanted, UnblockWanted

#: Default bound on a frame the daemon accepts (requests are small).
MAX_REQUEST_FRAME: Final = 64 * 1024
#: The daemon never sends a reply frame longer than this: status and events pages
#: are cut by encoded size as well as by count.
MAX_REPLY_BYTES: Final = 1024 * 1024
#: Default bound on a frame the client accepts; at least `MAX_REPLY_BYTES`, with room
#: for a future daemon that sends more.
MAX_REPLY_FRAME: Final = 16 * 1024 * 1024

_HEADER: Final = struct.Struct(">I")
HEADER_SIZE: Final = _HEADER.size

_REQUEST_TAGS: Final = tuple(sorted(str(t.__struct_config__.tag) for t in RequestMessage.__args__))


class _Envelope(Struct):
    """The two fields an error reply needs from a request that failed validation."""

    id: RequestId | None = None
    type: str | None = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RequestMessage)
_reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)
#: What a responder's connection receives: replies, and the daemon's messages of
#: its own (`EvidenceWanted`, `UnblockWanted`).
Wanted = EvidenceWanted | UnblockWanted
_responder_decoder: msgspec.msgpack.Decoder[ReplyMessage | Wanted] = msgspec.msgpack.Decoder(
    ReplyMessage | Wanted
)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode_frame(message: Request | Reply | Wanted) -> bytes:
    """Return one complete frame carrying ``message``."""
    # Encoding first and prepending the header is the quickest of the ways to make
    # one frame; `encode_frame_into` is for several frames in one buffer.
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


def encode_frame_into(message: Request | Reply | Wanted, out: bytearray) -> None:
    """Append one complete frame carrying ``message`` to ``out``.

    Several replies appended to one buffer go out in one send.
    """
    start = len(out)
    out += b"\0\0\0\0"
    _encoder.encode_into(message, out, start + HEADER_SIZE)
    _HEADER.pack_into(out, start, len(out) - start - HEADER_SIZE)


def decode_request(frame: bytes) -> RequestMessage:
    """Decode and validate one request frame body.

    Raises `ProtocolError` with the code to answer with and, when it could be read,
    the request's id.
    """
    try:
        return _request_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise _invalid_request(frame, exc) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"not a msgpack message: {exc}") from None


def _invalid_request(frame: bytes, exc: msgspec.ValidationError) -> ProtocolError:
    try:
        envelope = _envelope_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        envelope = _Envelope()
    if envelope.type is not None and envelope.type not in _REQUEST_TAGS:
        known = ", ".join(_REQUEST_TAGS)
        return ProtocolError(
            ErrorCode.UNKNOWN_OP,
            f"unknown request type {envelope.type!r}; known: {known}",
            envelope.id,
        )
    return ProtocolError(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}", envelope.id)


def decode_reply(frame: bytes) -> ReplyMessage:
    """Decode one reply frame body; raises `ProtocolError` if it is not a valid reply."""
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"unreadable reply from daemon: {exc}") from None


def decode_for_responder(frame: bytes) -> ReplyMessage | Wanted:
    """Decode one frame a responder's connection received: a reply, or the daemon's
    `EvidenceWanted` or `UnblockWanted`; raises `ProtocolError` if it is none."""
    try:
        return _responder_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"unreadable message from daemon: {exc}") from None


class FrameReader:
    """Splits a byte stream into frame bodies.

    Bytes are buffered only up to the end of the current frame; a header that declares
    more than ``max_frame`` bytes raises `FrameTooLarge` before anything is allocated
    for it. After `FrameTooLarge` the stream is out of sync and must be closed.
    """

    __slots__ = ("_buffer", "_max_frame", "buffered")

    def __init__(self, max_frame: int) -> None:
        self._max_frame = max_frame
        self._buffer = bytearray()
        #: Bytes received of a frame not yet complete (0 between frames). An
        #: attribute, kept by `feed`: a reader asks after each read.
        self.buffered = 0

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return every frame body they complete, in order."""
        if not self._buffer:
            # Fast path: most reads hold exactly one whole request.
            if len(data) >= HEADER_SIZE:
                (length,) = _HEADER.unpack_from(data)
                self._check(length)
                if len(data) == HEADER_SIZE + length:
                    return [data[HEADER_SIZE:]]
            buffer = self._buffer = bytearray(data)
        else:
            buffer = self._buffer
            buffer += data
        frames: list[bytes] = []
        start = 0
        end = len(buffer)
        while end - start >= HEADER_SIZE:
            (length,) = _HEADER.unpack_from(buffer, start)
            self._check(length)
            stop = start + HEADER_SIZE + length
            if stop > end:
                break
            frames.append(bytes(buffer[start + HEADER_SIZE : stop]))
            start = stop
        del buffer[:start]
        self.buffered = len(buffer)
        return frames

    def _check(self, length: int) -> None:
        if length > self._max_frame:
            raise FrameTooLarge(
                ErrorCode.FRAME_TOO_LARGE,
                f"frame declares {length} bytes; the limit is {self._max_frame}",
            )
