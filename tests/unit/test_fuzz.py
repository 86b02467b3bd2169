"""Hostile input, generated: the frame reader, request validation and request
handling never fail in any way but the documented one."""

from __future__ import annotations

import math
import struct
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from watchdogd.core.session import Session
from watchdogd.errors import Refusal
from watchdogd_client.errors import FrameTooLarge, ProtocolError
from watchdogd_protocol import (
    Acquire,
    Error,
    ErrorCode,
    FrameReader,
    Hello,
    Release,
    Reply,
    Status,
    decode_reply,
    decode_request,
    encode_frame,
)

from helpers.fakes import ALICE, DAEMON_PID, make_world

MAX = 1024
CODES = {code.value for code in ErrorCode}
OPS = ["hello", "acquire", "release", "status", "ping", "events", "policies", "metrics"]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any msgpack value, nested; floats include NaN and the infinities.
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)

# Maps shaped like requests: a real or made-up op, an id of any kind, and fields
# that are sometimes right and often not.
request_like = st.fixed_dictionaries(
    {"type": st.sampled_from(OPS) | st.text(max_size=12)},
    optional={
        "id": st.integers(min_value=-5, max_value=2**64 - 1) | values,
        "scope": st.text(max_size=300) | values,
        "timeout": st.floats(allow_nan=True, allow_infinity=True) | values,
        "pid": st.integers(min_value=-(2**40), max_value=2**40) | values,
        "policy": st.text(max_size=200) | values,
        "version": st.integers(min_value=-3, max_value=5),
        "limit": st.integers(min_value=-5, max_value=20_000),
        "cursor": st.text(max_size=30) | values,
        "after": st.integers(min_value=-5, max_value=100) | values,
        "wait": st.floats(allow_nan=True, allow_infinity=True),
    },
)


@FUZZ
@given(st.binary(max_size=4096), st.lists(st.integers(min_value=1, max_value=600), max_size=20))
def test_frame_reader_splits_any_stream_within_its_bound(data: bytes, cuts: list[int]) -> None:
    reader = FrameReader(MAX)
    position = 0
    for size in [*cuts, len(data)]:
        try:
            frames = reader.feed(data[position : position + size])
        except FrameTooLarge:
            return  # the documented failure: the connection is then closed
        assert all(len(frame) <= MAX for frame in frames)
        position += size
        assert reader.buffered <= MAX + 4


@FUZZ
@given(st.integers(min_value=MAX + 1, max_value=2**32 - 1), st.binary(max_size=64))
def test_huge_declared_lengths_are_refused_from_the_header(length: int, tail: bytes) -> None:
    with pytest.raises(FrameTooLarge, match=str(length)):
        FrameReader(MAX).feed(struct.pack(">I", length) + tail)


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_decode_or_fail_cleanly(body: bytes) -> None:
    _decode_or_protocol_error(body)


@FUZZ
@given(values)
def test_any_msgpack_value_decodes_or_fails_cleanly(value: Any) -> None:
    _decode_or_protocol_error(msgspec.msgpack.encode(value))


@FUZZ
@given(request_like)
def test_request_shaped_maps_decode_or_fail_with_their_id(fields: dict[str, Any]) -> None:
    body = msgspec.msgpack.encode(fields)
    request = _decode_or_protocol_error(body)
    if isinstance(request, Acquire):
        assert request.timeout > 0  # NaN, zero and negatives never get through
        assert request.scope
        assert request.pid is None or request.pid >= 1


def test_deep_nesting_and_truncation() -> None:
    for body in (
        b"\x91" * 200_000 + b"\x00",
        b"\x81" * 100_000,
        b"\xdc\xff\xff",
        b"\xdb\xff\xff\xff\xff",
    ):
        _decode_or_protocol_error(body)


def _decode_or_protocol_error(body: bytes) -> Any:
    """The request, or None after checking the ProtocolError, the one way to fail."""
    error: ProtocolError | None = None
    try:
        return decode_request(body)
    except ProtocolError as exc:
        error = exc
    assert error.code in CODES
    assert error.message
    return None


@FUZZ
@given(st.lists(request_like | st.binary(max_size=200).map(lambda b: {"raw": b}), max_size=25))
def test_a_session_answers_every_frame_and_never_raises(items: list[dict[str, Any]]) -> None:
    world = make_world(max_timers_per_uid=5)
    session = Session(world.service, world.service.arming.open_connection(ALICE))
    out = bytearray()
    session.receive(encode_frame(Hello(id=0, version=1))[4:], 0.0, out)
    for now, item in enumerate(items, 1):
        body = item["raw"] if set(item) == {"raw"} else msgspec.msgpack.encode(item)
        out = bytearray()
        keep_open = session.receive(body, float(now), out)
        if keep_open is not True and keep_open is not False:
            continue  # an events long poll: the server would answer it later
        [frame] = FrameReader(1 << 24).feed(bytes(out))
        reply = decode_reply(frame)
        assert isinstance(reply, Reply)
        if isinstance(reply, Error):
            assert reply.code in CODES
            assert reply.code != ErrorCode.INTERNAL, reply.message
        assert keep_open
    _check_table(world.service)


scopes = st.text(min_size=1, max_size=300)
timeouts = st.floats(min_value=1e-9, allow_nan=False, allow_infinity=True)
pids = st.sampled_from([None, 1, 100, 200, 201, 202, 300, DAEMON_PID, 4040])


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(["alice", "bob", "root"]), st.booleans(), scopes, timeouts, pids),
        max_size=40,
    )
)
def test_arbitrary_valid_requests_keep_the_table_consistent(
    steps: list[tuple[str, bool, str, float, int | None]],
) -> None:
    world = make_world(max_timers_per_uid=4, max_timers=10, max_scope_bytes=64)
    service = world.service
    for now, (who, arm, scope, timeout, pid) in enumerate(steps):
        caller = getattr(world, who)
        request = (
            Acquire(id=now, scope=scope, timeout=timeout, pid=pid)
            if arm
            else Release(id=now, scope=scope, pid=pid)
        )
        code = "ok"
        try:
            service.handle(request, caller, float(now))
        except Refusal as refusal:
            code = refusal.code
        assert code == "ok" or code in CODES
        service.handle(Status(id=now), world.root, float(now))
        _check_table(service)
    assert len(service.table) <= 10
    for timer in service.table.timers():
        assert math.isfinite(timer.deadline)
        assert len(timer.scope.encode()) <= 64
        assert timer.pid not in (1, DAEMON_PID)


def _check_table(service: Any) -> None:
    owners = Counter(timer.owner for timer in service.table.timers())
    for uid, count in owners.items():
        assert service.table.owned_by(uid) == count
        if uid != 0:
            assert count <= service.rules.daemon.max_timers_per_uid
