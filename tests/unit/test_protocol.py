"""The wire protocol: golden bytes for every message, framing, validation."""

from __future__ import annotations

import math
import struct

import msgspec
import pytest

from watchdogd_client.errors import FrameTooLarge, ProtocolError
from watchdogd_protocol import (
    MAX_EVIDENCE_BYTES,
    MAX_REQUEST_FRAME,
    Acquire,
    Acquired,
    Collective,
    DaemonInfo,
    Error,
    ErrorCode,
    EventInfo,
    Events,
    EventsReply,
    Evidence,
    EvidenceWanted,
    FlightRecord,
    Frame,
    FrameReader,
    GroupState,
    Hello,
    Metrics,
    MetricsReply,
    Ping,
    Policies,
    PoliciesReply,
    PolicyInfo,
    Pong,
    Release,
    Released,
    Reply,
    Request,
    Respond,
    Responding,
    Status,
    StatusReply,
    StepResult,
    ThreadStack,
    TimerInfo,
    Unblocked,
    UnblockWanted,
    Wanted,
    Welcome,
    decode_for_responder,
    decode_reply,
    decode_request,
    encode_frame,
)
from watchdogd_protocol.responding import MAX_ENTRIES, MAX_FRAMES, MAX_NAME, MAX_THREADS

INFO = DaemonInfo(
    version="0.1.0",
    pid=99,
    uptime=1.0,
    timers=1,
    processes=1,
    connections=1,
    requests=5,
    expired=0,
    exited=0,
)
TIMER = TimerInfo(pid=4242, scope="step", remaining=1.5, policy="kill", uid=0, command="python")
EVENT = EventInfo(
    seq=6,
    kind="expired",
    time=1700000000.0,
    pid=4242,
    uid=0,
    scope="step",
    policy="term",
    late=0.0005,
    outcome="exited",
    steps=[StepResult(step="SIGTERM", result="sent SIGTERM")],
)
POLICY = PolicyInfo(name="kill", target="process", steps=["SIGKILL"], root_only=False, builtin=True)
COLLECTIVE = Collective(
    group="0",
    seq=58,
    op="gloo:all_reduce",
    state="scheduled",
    input_sizes=[[3, 4]],
    input_dtypes=["Float"],
)
EVIDENCE = Evidence(
    id=14,
    ask=7,
    threads=[
        ThreadStack(
            name="MainThread", ident=140, main=True, frames=[Frame("loader.py", 42, "read_shard")]
        )
    ],
    flight=FlightRecord(
        rank=3,
        groups=[
            GroupState(
                group="0",
                desc="default_pg",
                ranks=[0, 1, 2, 3],
                size=4,
                entered=COLLECTIVE,
                completed=57,
            )
        ],
        entries=[COLLECTIVE],
    ),
    note="cut",
)

#: The number the daemon gives an arming made 12,345.5 s after boot (`Timer.arm`).
ARMING = 4668012624728817664

GOLDEN = [
    pytest.param(
        Hello(id=1, version=1, client="python/0.1.0"),
        (
            "0000002d84a474797065a568656c6c6fa2696401a776657273696f6e01a6636c"
            "69656e74ac707974686f6e2f302e312e30"
        ),
        id="Hello-0",
    ),
    pytest.param(
        Acquire(id=2, scope="train.py:10", timeout=30.0),
        (
            "0000003584a474797065a761637175697265a2696402a573636f7065ab747261"
            "696e2e70793a3130a774696d656f7574cb403e000000000000"
        ),
        id="Acquire-1",
    ),
    pytest.param(
        Acquire(id=3, scope="step", timeout=1.5, policy="term", pid=4242),
        (
            "0000004186a474797065a761637175697265a2696403a573636f7065a4737465"
            "70a774696d656f7574cb3ff8000000000000a6706f6c696379a47465726da370"
            "6964cd1092"
        ),
        id="Acquire-2",
    ),
    pytest.param(
        Release(id=4, scope="step"),
        ("0000001d83a474797065a772656c65617365a2696404a573636f7065a473746570"),
        id="Release-3",
    ),
    pytest.param(
        Release(id=5, scope="step", pid=4242),
        ("0000002484a474797065a772656c65617365a2696405a573636f7065a473746570a3706964cd1092"),
        id="Release-4",
    ),
    pytest.param(
        Status(id=6),
        ("0000001182a474797065a6737461747573a2696406"),
        id="Status-5",
    ),
    pytest.param(
        Status(id=7, limit=10, cursor="12.5/3"),
        ("0000002684a474797065a6737461747573a2696407a56c696d69740aa6637572736f72a631322e352f33"),
        id="Status-6",
    ),
    pytest.param(
        Ping(id=8),
        ("0000000f82a474797065a470696e67a2696408"),
        id="Ping-7",
    ),
    pytest.param(
        Welcome(id=1, version=1, server="watchdogd/0.1.0", pid=99),
        (
            "0000003785a474797065a777656c636f6d65a2696401a776657273696f6e01a6"
            "736572766572af7761746368646f67642f302e312e30a370696463"
        ),
        id="Welcome-8",
    ),
    pytest.param(
        Acquired(id=2, remaining=30.0, rearmed=False),
        (
            "0000002f84a474797065a86163717569726564a2696402a972656d61696e696e"
            "67cb403e000000000000a7726561726d6564c2"
        ),
        id="Acquired-9",
    ),
    pytest.param(
        Acquired(id=2, remaining=30.0, rearmed=False, arm=ARMING),
        (
            "0000003c85a474797065a86163717569726564a2696402a972656d61696e696e"
            "67cb403e000000000000a7726561726d6564c2a361726dcf40c81cc000000000"
        ),
        id="Acquired-numbered",
    ),
    pytest.param(
        Release(id=4, scope="step", arm=ARMING),
        (
            "0000002a84a474797065a772656c65617365a2696404a573636f7065a4737465"
            "70a361726dcf40c81cc000000000"
        ),
        id="Release-numbered",
    ),
    pytest.param(
        Released(id=4, found=True),
        ("0000001a83a474797065a872656c6561736564a2696404a5666f756e64c3"),
        id="Released-10",
    ),
    pytest.param(
        StatusReply(id=6, daemon=INFO, timers=[TIMER]),
        (
            "000000d084a474797065a6737461747573a2696406a66461656d6f6e89a77665"
            "7273696f6ea5302e312e30a370696463a6757074696d65cb3ff0000000000000"
            "a674696d65727301a970726f63657373657301ab636f6e6e656374696f6e7301"
            "a8726571756573747305a76578706972656400a665786974656400a674696d65"
            "72739188a3706964cd1092a573636f7065a473746570a972656d61696e696e67"
            "cb3ff8000000000000a6706f6c696379a46b696c6ca375696400a7636f6d6d61"
            "6e64a6707974686f6ea36a6f62a0a472616e6bc0"
        ),
        id="StatusReply-11",
    ),
    pytest.param(
        Pong(id=8),
        ("0000000f82a474797065a4706f6e67a2696408"),
        id="Pong-12",
    ),
    pytest.param(
        Error(id=9, code="unknown_policy", message="no policy 'x'"),
        (
            "0000003a84a474797065a56572726f72a2696409a4636f6465ae756e6b6e6f77"
            "6e5f706f6c696379a76d657373616765ad6e6f20706f6c69637920277827"
        ),
        id="Error-13",
    ),
    pytest.param(
        Error(code="frame_too_large", message="too big"),
        (
            "0000003183a474797065a56572726f72a4636f6465af6672616d655f746f6f5f"
            "6c61726765a76d657373616765a7746f6f20626967"
        ),
        id="Error-14",
    ),
    pytest.param(
        Events(id=10, after=5, limit=50, wait=30.0),
        (
            "0000002d85a474797065a66576656e7473a269640aa5616674657205a56c696d"
            "697432a477616974cb403e000000000000"
        ),
        id="Events",
    ),
    pytest.param(
        Policies(id=11),
        ("0000001382a474797065a8706f6c6963696573a269640b"),
        id="Policies",
    ),
    pytest.param(
        Metrics(id=12),
        ("0000001282a474797065a76d657472696373a269640c"),
        id="Metrics",
    ),
    pytest.param(
        EventsReply(id=10, events=[EVENT], last=6),
        (
            "0000013284a474797065a66576656e7473a269640aa66576656e747391de0019"
            "a373657106a46b696e64a765787069726564a474696d65cb41d954fc40000000"
            "a3706964cd1092a375696400a573636f7065a473746570a6706f6c696379a474"
            "65726da7636f6d6d616e64a0a861726d65645f6174c0a8646561646c696e65c0"
            "a866697265645f6174c0a46c617465cb3f40624dd2f1a9fca76f7574636f6d65"
            "a6657869746564a573746570739183a473746570a75349475445524da6726573"
            "756c74ac73656e74205349475445524da66f7574707574a0a674696d657273c0"
            "a46e6f7465a0a57374617465a0a5776368616ea0a6726561736f6ea0a774696d"
            "656f7574c0ac74696d656f75745f66726f6da0a36a6f62a0a472616e6bc0a869"
            "6e636964656e74a0a673636f70657390a46c61737406"
        ),
        id="EventsReply",
    ),
    pytest.param(
        PoliciesReply(id=11, policies=[POLICY], default="kill"),
        (
            "0000007d84a474797065a8706f6c6963696573a269640ba8706f6c6963696573"
            "9187a46e616d65a46b696c6ca6746172676574a770726f63657373a573746570"
            "7391a75349474b494c4ca9726f6f745f6f6e6c79c2a76275696c74696ec3a573"
            "74616c6ccb0000000000000000a57065657273a0a764656661756c74a46b696c"
            "6c"
        ),
        id="PoliciesReply",
    ),
    pytest.param(
        MetricsReply(id=12, text="watchdogd_up 1\n"),
        ("0000002783a474797065a76d657472696373a269640ca474657874af7761746368646f67645f757020310a"),
        id="MetricsReply",
    ),
    pytest.param(
        Respond(id=13, job="run-7", rank=3, local_rank=1, group_rank=0),
        (
            "0000003a86a474797065a7726573706f6e64a269640da36a6f62a572756e2d37"
            "a472616e6b03aa6c6f63616c5f72616e6b01aa67726f75705f72616e6b00"
        ),
        id="Respond",
    ),
    pytest.param(
        Responding(id=14),
        ("0000001582a474797065aa726573706f6e64696e67a269640e"),
        id="Responding",
    ),
    pytest.param(
        EvidenceWanted(ask=7, incident="gpu7-3fa2-1"),
        (
            "0000003083a474797065af65766964656e63655f77616e746564a361736b07a8"
            "696e636964656e74ab677075372d336661322d31"
        ),
        id="EvidenceWanted",
    ),
    pytest.param(
        EVIDENCE,
        (
            "0000016e86a474797065a865766964656e6365a269640ea361736b07a7746872"
            "656164739184a46e616d65aa4d61696e546872656164a56964656e74cc8ca46d"
            "61696ec3a66672616d65739193a96c6f616465722e70792aaa726561645f7368"
            "617264a6666c6967687483a472616e6b03a667726f7570739186a567726f7570"
            "a130a464657363aa64656661756c745f7067a572616e6b739400010203a47369"
            "7a6504a7656e746572656486a567726f7570a130a37365713aa26f70af676c6f"
            "6f3a616c6c5f726564756365a57374617465a97363686564756c6564ab696e70"
            "75745f73697a657391920304ac696e7075745f64747970657391a5466c6f6174"
            "a9636f6d706c6574656439a7656e74726965739186a567726f7570a130a37365"
            "713aa26f70af676c6f6f3a616c6c5f726564756365a57374617465a973636865"
            "64756c6564ab696e7075745f73697a657391920304ac696e7075745f64747970"
            "657391a5466c6f6174a46e6f7465a3637574"
        ),
        id="Evidence",
    ),
    pytest.param(
        Respond(id=16, job="run-7", rank=3, unblock=True),
        (
            "0000002b85a474797065a7726573706f6e64a2696410a36a6f62a572756e2d37"
            "a472616e6b03a7756e626c6f636bc3"
        ),
        id="Respond-unblock",
    ),
    pytest.param(
        UnblockWanted(
            ask=8,
            waited=10.0,
            group="0",
            seq=57,
            entered_before=12.5,
            incident="gpu7-3fa2-2",
            reason="host gpu8 left the fleet",
        ),
        (
            "0000008488a474797065ae756e626c6f636b5f77616e746564a361736b08a677"
            "6169746564cb4024000000000000a567726f7570a130a373657139ae656e7465"
            "7265645f6265666f7265cb4029000000000000a8696e636964656e74ab677075"
            "372d336661322d32a6726561736f6eb8686f73742067707538206c6566742074"
            "686520666c656574"
        ),
        id="UnblockWanted",
    ),
    pytest.param(
        Unblocked(
            id=15,
            ask=8,
            outcome="unblocked",
            collective=Collective(group="0", seq=57, op="gloo:all_reduce", state="scheduled"),
            waited=12.5,
            cut=3,
        ),
        (
            "0000007c87a474797065a9756e626c6f636b6564a269640fa361736b08a76f75"
            "74636f6d65a9756e626c6f636b6564aa636f6c6c65637469766584a567726f75"
            "70a130a373657139a26f70af676c6f6f3a616c6c5f726564756365a573746174"
            "65a97363686564756c6564a6776169746564cb4029000000000000a363757403"
        ),
        id="Unblocked",
    ),
]


@pytest.mark.parametrize(("message", "golden"), GOLDEN)
def test_encoding_is_pinned(message: Request | Reply | Wanted, golden: str) -> None:
    assert encode_frame(message).hex() == golden


@pytest.mark.parametrize(("message", "golden"), GOLDEN)
def test_golden_bytes_decode_to_the_message(message: Request | Reply | Wanted, golden: str) -> None:
    body = bytes.fromhex(golden)[4:]
    decoded: object
    if isinstance(message, Request):
        decoded = decode_request(body)
    elif isinstance(message, EvidenceWanted | UnblockWanted):
        decoded = decode_for_responder(body)
    else:
        decoded = decode_reply(body)
    assert decoded == message


def test_an_older_clients_own_arming_number_is_ignored() -> None:
    """An older client sent a number of its own with each acquire (``arm``); the
    daemon numbers armings itself now, and reads the rest of the request as ever."""
    older = msgspec.msgpack.encode(
        {"type": "acquire", "id": 2, "scope": "train.py:10", "timeout": 30.0, "arm": 1}
    )
    assert decode_request(older) == Acquire(id=2, scope="train.py:10", timeout=30.0)


def test_a_responders_connection_reads_replies_and_the_daemons_asks() -> None:
    assert decode_for_responder(encode_frame(Responding(id=3))[4:]) == Responding(id=3)
    wanted = encode_frame(EvidenceWanted(ask=9))[4:]
    assert decode_for_responder(wanted) == EvidenceWanted(ask=9)
    with pytest.raises(ProtocolError):
        decode_reply(wanted)  # any other connection refuses it
    unblock = encode_frame(UnblockWanted(ask=9, waited=10))[4:]
    assert decode_for_responder(unblock) == UnblockWanted(ask=9, waited=10)
    with pytest.raises(ProtocolError):
        decode_reply(unblock)


def test_a_responder_of_before_says_nothing_of_unblocking_and_is_taken_as_not_doing_it() -> None:
    older = msgspec.msgpack.encode({"type": "respond", "id": 3, "job": "run-7"})
    assert decode_request(older) == Respond(id=3, job="run-7", unblock=False)


@pytest.mark.parametrize("waited", [-1.0, math.nan, math.inf, 86_401.0])
def test_an_unblock_is_bounded_in_time(waited: float) -> None:
    frame = msgspec.msgpack.encode({"type": "unblock_wanted", "ask": 1, "waited": waited})
    with pytest.raises(ProtocolError):
        decode_for_responder(frame)


def test_every_message_type_has_golden_bytes() -> None:
    pinned = {type(message) for message, _ in (param.values for param in GOLDEN)}
    assert pinned == {
        Hello, Acquire, Release, Status, Ping, Events, Policies, Metrics,
        Welcome, Acquired, Released, StatusReply, Pong, EventsReply, PoliciesReply, MetricsReply,
        Error, Respond, Responding, EvidenceWanted, Evidence, UnblockWanted, Unblocked,
    }  # fmt: skip


def test_frame_header_is_big_endian_length_of_body() -> None:
    frame = encode_frame(Ping(id=1))
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert msgspec.msgpack.decode(frame[4:]) == {"type": "ping", "id": 1}


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    body = msgspec.msgpack.encode({"type": "ping", "id": 3, "added_later": [1, 2]})
    assert decode_request(body) == Ping(id=3)


class TestValidation:
    def _error(self, fields: dict[str, object]) -> ProtocolError:
        with pytest.raises(ProtocolError) as caught:
            decode_request(msgspec.msgpack.encode(fields))
        return caught.value

    def test_unknown_op_names_the_known_ones(self) -> None:
        error = self._error({"type": "explode", "id": 7})
        assert error.code == ErrorCode.UNKNOWN_OP
        assert error.request_id == 7
        assert "'explode'" in error.message
        assert "acquire" in error.message

    def test_missing_type(self) -> None:
        error = self._error({"id": 7})
        assert error.code == ErrorCode.INVALID_REQUEST
        assert error.request_id == 7

    def test_wrong_type_keeps_the_id(self) -> None:
        error = self._error({"type": "acquire", "id": 8, "scope": "s", "timeout": "soon"})
        assert error.code == ErrorCode.INVALID_REQUEST
        assert error.request_id == 8
        assert "timeout" in error.message

    @pytest.mark.parametrize("timeout", [math.nan, -1.0, 0.0, -math.inf])
    def test_bad_timeouts_are_invalid(self, timeout: float) -> None:
        error = self._error({"type": "acquire", "id": 9, "scope": "s", "timeout": timeout})
        assert error.code == ErrorCode.INVALID_REQUEST
        assert error.request_id == 9

    def test_empty_scope_is_invalid(self) -> None:
        error = self._error({"type": "release", "id": 10, "scope": ""})
        assert error.code == ErrorCode.INVALID_REQUEST
        assert "scope" in error.message

    @pytest.mark.parametrize("pid", [0, -1, 2**31])
    def test_pids_that_mean_groups_or_nothing_are_invalid(self, pid: int) -> None:
        error = self._error({"type": "acquire", "id": 11, "scope": "s", "timeout": 1, "pid": pid})
        assert error.code == ErrorCode.INVALID_REQUEST

    @pytest.mark.parametrize(
        "fields",
        [
            {"type": "suggest", "cursor": 2**63},
            {"type": "suggest", "cursor": 2**64 - 1},
            {"type": "suggest", "cursor": -1},
            {"type": "events", "after": 2**63},
            {"type": "events", "after": -1},
            {"type": "status", "cursor": "1.0/" + "9" * 100},
        ],
    )
    def test_positions_past_63_bits_are_invalid(self, fields: dict[str, object]) -> None:
        error = self._error({**fields, "id": 12})
        assert error.code == ErrorCode.INVALID_REQUEST
        assert error.request_id == 12
        assert ("cursor" if "cursor" in fields else "after") in error.message

    def test_unreadable_id_is_none(self) -> None:
        error = self._error({"type": "acquire", "id": "eleven", "scope": "s", "timeout": 1})
        assert error.request_id is None

    @pytest.mark.parametrize(
        "body",
        [b"", b"\xc1", b"\x92", b"\x91" * 100_000 + b"\x00"],
        ids=["empty", "reserved-byte", "truncated", "deeply-nested"],
    )
    def test_garbage_is_malformed_not_a_crash(self, body: bytes) -> None:
        with pytest.raises(ProtocolError) as caught:
            decode_request(body)
        assert caught.value.code in (ErrorCode.MALFORMED, ErrorCode.INVALID_REQUEST)

    def test_not_a_map(self) -> None:
        with pytest.raises(ProtocolError) as caught:
            decode_request(msgspec.msgpack.encode([1, 2, 3]))
        assert caught.value.code == ErrorCode.INVALID_REQUEST

    def test_infinite_timeout_passes_the_schema_for_the_daemon_to_bound(self) -> None:
        # The maximum is configurable, so the daemon refuses it with its own limit.
        request = decode_request(
            msgspec.msgpack.encode({"type": "acquire", "id": 1, "scope": "s", "timeout": math.inf})
        )
        assert isinstance(request, Acquire)

    def test_an_unreadable_reply_is_a_protocol_error(self) -> None:
        with pytest.raises(ProtocolError):
            decode_reply(msgspec.msgpack.encode({"type": "welcome", "id": 1}))


class TestEvidenceBounds:
    """Every list and name of an `Evidence` is bounded where it is decoded."""

    def _refused(self, evidence: Evidence) -> ProtocolError:
        with pytest.raises(ProtocolError) as caught:
            decode_request(msgspec.msgpack.encode(evidence))
        assert caught.value.code == ErrorCode.INVALID_REQUEST
        assert caught.value.request_id == evidence.id
        return caught.value

    def test_at_the_bounds_it_decodes(self) -> None:
        frames = [Frame("f" * MAX_NAME, 1, "g")] * MAX_FRAMES
        threads = [ThreadStack(name=f"t{n}", frames=frames[:1]) for n in range(MAX_THREADS)]
        threads[0] = ThreadStack(name="MainThread", main=True, frames=frames)
        flight = FlightRecord(rank=0, entries=[COLLECTIVE] * MAX_ENTRIES)
        evidence = Evidence(id=1, ask=1, threads=threads, flight=flight)
        assert decode_request(msgspec.msgpack.encode(evidence)) == evidence

    def test_one_thread_too_many(self) -> None:
        threads = [ThreadStack(name="t")] * (MAX_THREADS + 1)
        assert "threads" in self._refused(Evidence(id=2, ask=1, threads=threads)).message

    def test_one_frame_too_many(self) -> None:
        stack = ThreadStack(name="t", frames=[Frame("f", 1, "g")] * (MAX_FRAMES + 1))
        assert "frames" in self._refused(Evidence(id=3, ask=1, threads=[stack])).message

    def test_one_entry_too_many(self) -> None:
        flight = FlightRecord(rank=0, entries=[COLLECTIVE] * (MAX_ENTRIES + 1))
        assert "entries" in self._refused(Evidence(id=4, ask=1, flight=flight)).message

    def test_a_name_too_long(self) -> None:
        stack = ThreadStack(name="t", frames=[Frame("f" * (MAX_NAME + 1), 1, "g")])
        self._refused(Evidence(id=5, ask=1, threads=[stack]))

    def test_a_whole_evidence_fits_in_a_request_frame(self) -> None:
        assert MAX_EVIDENCE_BYTES < MAX_REQUEST_FRAME


class TestFrameReader:
    def test_one_whole_frame(self) -> None:
        frame = encode_frame(Ping(id=1))
        assert FrameReader(MAX_REQUEST_FRAME).feed(frame) == [frame[4:]]

    def test_frames_split_anywhere_come_out_whole_and_in_order(self) -> None:
        stream = b"".join(encode_frame(Ping(id=i)) for i in range(20))
        for chunk_size in (1, 2, 3, 5, 7, 64):
            reader = FrameReader(MAX_REQUEST_FRAME)
            frames = []
            for start in range(0, len(stream), chunk_size):
                frames += reader.feed(stream[start : start + chunk_size])
            assert [decode_request(frame) for frame in frames] == [Ping(id=i) for i in range(20)]
            assert reader.buffered == 0

    def test_buffered_counts_a_partial_frame(self) -> None:
        reader = FrameReader(MAX_REQUEST_FRAME)
        frame = encode_frame(Ping(id=1))
        assert reader.feed(frame[:5]) == []
        assert reader.buffered == 5

    def test_declared_length_over_the_limit_is_refused_from_the_header_alone(self) -> None:
        reader = FrameReader(1024)
        with pytest.raises(FrameTooLarge) as caught:
            reader.feed(struct.pack(">I", 1025))
        assert caught.value.code == ErrorCode.FRAME_TOO_LARGE
        assert "1025" in caught.value.message
        assert reader.buffered == 0  # nothing of the announced size was kept

    def test_huge_declared_length_after_a_good_frame(self) -> None:
        reader = FrameReader(1024)
        good = encode_frame(Ping(id=1))
        with pytest.raises(FrameTooLarge):
            reader.feed(good + struct.pack(">I", 2**32 - 1))

    def test_frame_at_the_limit_is_accepted(self) -> None:
        reader = FrameReader(16)
        assert reader.feed(struct.pack(">I", 16) + b"x" * 16) == [b"x" * 16]
