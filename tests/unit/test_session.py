"""Per-connection protocol state: handshake first, errors keep the connection."""

from __future__ import annotations

import logging

import msgspec
import pytest

from watchdogd.core.logline import RateLimitedLog, Throttle
from watchdogd.core.session import Session
from watchdogd.logs import LoggingSink
from watchdogd_protocol import (
    Acquire,
    Acquired,
    Error,
    ErrorCode,
    FrameReader,
    Hello,
    Ping,
    Pong,
    ReplyMessage,
    Welcome,
    decode_reply,
    encode_frame,
)

from helpers.fakes import ALICE, make_service


def exchange(session: Session, message: object) -> tuple[ReplyMessage, bool]:
    body = message if isinstance(message, bytes) else encode_frame(message)[4:]  # type: ignore[arg-type]
    out = bytearray()
    keep_open = session.receive(body, 1.0, out)
    assert isinstance(keep_open, bool)
    [frame] = FrameReader(1 << 20).feed(bytes(out))
    return decode_reply(frame), keep_open


def new_session() -> Session:
    service, _, _ = make_service()
    return Session(service, service.arming.open_connection(ALICE))


def test_handshake_then_requests() -> None:
    session = new_session()
    reply, keep_open = exchange(session, Hello(id=1, version=1))
    assert isinstance(reply, Welcome)
    assert keep_open
    reply, keep_open = exchange(session, Acquire(id=2, scope="s", timeout=5))
    assert isinstance(reply, Acquired)
    assert (reply.id, reply.remaining, reply.rearmed) == (2, 5, False)


def test_anything_before_the_handshake_closes() -> None:
    session = new_session()
    reply, keep_open = exchange(session, Ping(id=1))
    assert isinstance(reply, Error)
    assert (reply.id, reply.code, keep_open) == (1, ErrorCode.HANDSHAKE_REQUIRED, False)
    reply, keep_open = exchange(new_session(), b"\xc1")
    assert isinstance(reply, Error)
    assert (reply.code, keep_open) == (ErrorCode.HANDSHAKE_REQUIRED, False)


def test_unsupported_version_closes() -> None:
    reply, keep_open = exchange(new_session(), Hello(id=1, version=99))
    assert isinstance(reply, Error)
    assert (reply.code, keep_open) == (ErrorCode.UNSUPPORTED_VERSION, False)
    assert "99" in reply.message


def test_bad_requests_get_errors_and_the_connection_stays_usable() -> None:
    session = new_session()
    exchange(session, Hello(id=1, version=1))
    bad = [
        msgspec.msgpack.encode({"type": "nope", "id": 2}),
        msgspec.msgpack.encode({"type": "acquire", "id": 3, "scope": "", "timeout": 1}),
        msgspec.msgpack.encode({"type": "acquire", "id": 4, "scope": "s", "timeout": float("nan")}),
        b"\xc1",
    ]
    codes = []
    for body in bad:
        reply, keep_open = exchange(session, body)
        assert isinstance(reply, Error)
        assert keep_open
        codes.append((reply.id, reply.code))
    assert codes == [
        (2, ErrorCode.UNKNOWN_OP),
        (3, ErrorCode.INVALID_REQUEST),
        (4, ErrorCode.INVALID_REQUEST),
        (None, ErrorCode.MALFORMED),
    ]
    assert exchange(session, Ping(id=5)) == (Pong(id=5), True)


def test_a_bug_becomes_an_internal_error_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    service, _, _ = make_service()
    session = Session(service, service.arming.open_connection(ALICE))
    exchange(session, Hello(id=1, version=1))

    def broken(*args: object) -> object:
        raise RuntimeError("bug")

    monkeypatch.setattr(service.pages, "status", broken)
    reply, keep_open = exchange(session, msgspec.msgpack.encode({"type": "status", "id": 2}))
    assert isinstance(reply, Error)
    assert (reply.id, reply.code, keep_open) == (2, ErrorCode.INTERNAL, True)
    assert exchange(session, Ping(id=3)) == (Pong(id=3), True)


def test_internal_errors_are_logged_at_a_bounded_rate(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    service, _, _ = make_service()
    service.log = RateLimitedLog(
        Throttle(burst=3, per_second=0.0, clock=lambda: 0.0), LoggingSink()
    )
    session = Session(service, service.arming.open_connection(ALICE))
    exchange(session, Hello(id=1, version=1))

    def broken(*args: object) -> object:
        raise RuntimeError("bug")

    monkeypatch.setattr(service.pages, "status", broken)
    with caplog.at_level(logging.ERROR, logger="watchdogd"):
        for request_id in range(2, 102):
            reply, _ = exchange(
                session, msgspec.msgpack.encode({"type": "status", "id": request_id})
            )
            assert isinstance(reply, Error)
            assert reply.code == ErrorCode.INTERNAL
    assert len(caplog.records) == 3  # each with its traceback
    assert all(record.exc_info for record in caplog.records)
