"""The client engine alone: bytes in, answers and bytes out, no socket and no clock."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from watchdogd_client.engine import (
    Answer,
    Backoff,
    Clock,
    Close,
    Connected,
    Connection,
    Engine,
    Exchange,
    Open,
    Pause,
    Step,
    drive,
)
from watchdogd_client.errors import (
    DaemonUnavailable,
    FrameTooLarge,
    ProtocolError,
    RequestRefused,
    UntrustedSocket,
)
from watchdogd_protocol import (
    MAX_REPLY_BYTES,
    MAX_REPLY_FRAME,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Acquired,
    Error,
    ErrorCode,
    Hello,
    Ping,
    Pong,
    Release,
    Released,
    Reply,
    Welcome,
    decode_request,
    encode_frame,
)

SOCKET = "/run/test/watchdogd.sock"


def engine(max_reply: int = MAX_REPLY_FRAME) -> Engine:
    return Engine(SOCKET, client="test/1", reconnect_timeout=5.0, max_reply=max_reply)


def welcomed(source: Engine | None = None, restart: float = 0.0) -> Connection:
    connection = (source or engine()).connect()
    welcome = Welcome(id=connection.hello_id, version=1, server="0.1.0", pid=7, restart=restart)
    [answer] = connection.receive_data(encode_frame(welcome))
    assert answer.result(Welcome) == welcome
    return connection


def frame(reply: Reply) -> bytes:
    return encode_frame(reply)


def ping(connection: Connection, source: Engine) -> Ping:
    request = Ping(id=source.next_id())
    connection.send(request, Pong)
    return request


class TestHandshake:
    def test_the_hello_is_the_first_frame_and_states_the_version(self) -> None:
        connection = engine().connect()
        assert connection.state == "greeting"
        assert connection.hello[:4] == len(connection.hello[4:]).to_bytes(4, "big")
        hello = decode_request(connection.hello[4:])
        assert hello == Hello(id=connection.hello_id, version=PROTOCOL_VERSION, client="test/1")

    def test_a_welcome_opens_the_connection_and_says_how_long_a_restart_takes(self) -> None:
        source = engine()
        connection = welcomed(source, restart=7.5)
        assert connection.state == "open"
        assert source.restart == 7.5

    def test_a_welcome_in_pieces_is_read_when_whole(self) -> None:
        connection = engine().connect()
        data = frame(Welcome(id=connection.hello_id, version=1, server="s", pid=1))
        for byte in data[:-1]:
            assert connection.receive_data(bytes([byte])) == []
        [answer] = connection.receive_data(data[-1:])
        assert isinstance(answer.reply, Welcome)
        assert connection.state == "open"

    def test_no_request_goes_out_before_the_welcome(self) -> None:
        connection = engine().connect()
        with pytest.raises(RuntimeError, match="greeting"):
            connection.send(Ping(id=99), Pong)

    def test_a_refused_hello_raises_the_refusal_and_ends_the_connection(self) -> None:
        connection = engine().connect()
        refusal = Error(id=connection.hello_id, code=ErrorCode.LIMIT_EXCEEDED, message="too many")
        [answer] = connection.receive_data(frame(refusal))
        with pytest.raises(RequestRefused) as caught:
            answer.result(Welcome)
        assert caught.value.code == ErrorCode.LIMIT_EXCEEDED
        assert not answer.retry
        assert connection.state == "closed"

    def test_a_refusal_without_an_id_answers_the_hello_too(self) -> None:
        connection = engine().connect()
        [answer] = connection.receive_data(frame(Error(code="limit_exceeded", message="full")))
        assert answer.id == connection.hello_id
        with pytest.raises(RequestRefused, match="full"):
            answer.result(Welcome)

    def test_anything_but_a_welcome_is_a_protocol_error(self) -> None:
        connection = engine().connect()
        [answer] = connection.receive_data(frame(Pong(id=connection.hello_id)))
        with pytest.raises(ProtocolError, match="expected welcome, got Pong"):
            answer.result(Welcome)
        assert connection.state == "closed"

    def test_a_connection_lost_during_the_handshake_is_not_retried(self) -> None:
        connection = engine().connect()
        [answer] = connection.connection_lost("Connection reset by peer")
        assert not answer.retry
        with pytest.raises(DaemonUnavailable) as caught:
            answer.result(Welcome)
        assert "the connection closed during the handshake (Connection reset by peer)" in str(
            caught.value
        )
        assert caught.value.socket_path == SOCKET

    def test_a_welcome_after_the_hello_failed_to_send_opens_nothing(self) -> None:
        connection = engine().connect()
        connection.send_failed()
        welcome = Welcome(id=connection.hello_id, version=1, server="s", pid=1)
        [answer] = connection.receive_data(frame(welcome))
        with pytest.raises(DaemonUnavailable, match="during the handshake"):
            answer.result(Welcome)
        assert connection.state == "closed"


class TestRequests:
    def test_ids_are_unique_across_the_connections_of_one_client(self) -> None:
        source = engine()
        ids = [source.connect().hello_id, source.next_id(), source.connect().hello_id]
        assert ids == sorted(set(ids))

    def test_send_encodes_the_request_as_one_frame(self) -> None:
        source = engine()
        connection = welcomed(source)
        request = Release(id=source.next_id(), scope="step")
        assert connection.send(request, Released) == encode_frame(request)

    def test_pipelined_replies_answer_their_own_requests_in_arrival_order(self) -> None:
        source = engine()
        connection = welcomed(source)
        first, second = ping(connection, source), ping(connection, source)
        release = Release(id=source.next_id(), scope="s")
        connection.send(release, Released)
        data = b"".join(
            frame(reply)
            for reply in (
                Released(id=release.id, found=True),
                Pong(id=first.id),
                Pong(id=second.id),
            )
        )
        answers = connection.receive_data(data)
        assert [answer.id for answer in answers] == [release.id, first.id, second.id]
        assert answers[0].result(Released).found
        assert connection.state == "open"

    def test_a_refusal_of_one_request_leaves_the_connection_usable(self) -> None:
        source = engine()
        connection = welcomed(source)
        request = ping(connection, source)
        refusal = Error(id=request.id, code=ErrorCode.UNKNOWN_POLICY, message="no such policy")
        [answer] = connection.receive_data(frame(refusal))
        with pytest.raises(RequestRefused) as caught:
            answer.result(Pong)
        assert (caught.value.code, caught.value.message) == ("unknown_policy", "no such policy")
        assert not answer.retry
        assert connection.state == "open"

    def test_a_refusal_without_an_id_answers_every_request_and_ends_the_connection(self) -> None:
        source = engine()
        connection = welcomed(source)
        requests = [ping(connection, source) for _ in range(3)]
        over = Error(code=ErrorCode.FRAME_TOO_LARGE, message="frame declares 9 bytes")
        answers = connection.receive_data(frame(over))
        assert sorted(answer.id for answer in answers) == [request.id for request in requests]
        errors = [answer.error for answer in answers]
        assert all(isinstance(error, RequestRefused) for error in errors)
        assert len({id(error) for error in errors}) == 3  # one each: tracebacks apart
        assert connection.state == "closed"

    def test_a_reply_of_another_type_puts_the_connection_out_of_step(self) -> None:
        source = engine()
        connection = welcomed(source)
        asked, other = ping(connection, source), ping(connection, source)
        answers = connection.receive_data(frame(Released(id=asked.id, found=False)))
        assert [answer.id for answer in answers] == [asked.id, other.id]
        with pytest.raises(ProtocolError, match="expected a Pong reply, got Released"):
            answers[0].result(Pong)
        assert isinstance(answers[1].error, ProtocolError)
        assert connection.state == "closed"

    def test_a_reply_to_no_request_in_flight_puts_the_connection_out_of_step(self) -> None:
        source = engine()
        connection = welcomed(source)
        request = ping(connection, source)
        [answer] = connection.receive_data(frame(Pong(id=request.id + 100)))
        assert answer.id == request.id
        with pytest.raises(ProtocolError, match="answers no request in flight"):
            answer.result(Pong)
        assert connection.state == "closed"

    def test_an_unreadable_reply_answers_every_request_with_a_protocol_error(self) -> None:
        source = engine()
        connection = welcomed(source)
        request = ping(connection, source)
        garbage = msgspec.msgpack.encode({"type": "pong"})  # no id
        [answer] = connection.receive_data(len(garbage).to_bytes(4, "big") + garbage)
        assert answer.id == request.id
        with pytest.raises(ProtocolError, match="unreadable reply"):
            answer.result(Pong)
        assert connection.state == "closed"

    def test_a_reply_frame_over_the_bound_is_refused_from_its_header(self) -> None:
        source = engine(max_reply=MAX_REPLY_BYTES)
        connection = welcomed(source)
        request = ping(connection, source)
        [answer] = connection.receive_data((MAX_REPLY_BYTES + 1).to_bytes(4, "big"))
        assert answer.id == request.id
        with pytest.raises(FrameTooLarge):
            answer.result(Pong)

    def test_the_late_reply_of_an_abandoned_request_is_dropped(self) -> None:
        source = engine()
        connection = welcomed(source)
        gave_up, waiting = ping(connection, source), ping(connection, source)
        connection.abandon(gave_up.id)
        answers = connection.receive_data(frame(Pong(id=gave_up.id)) + frame(Pong(id=waiting.id)))
        assert [answer.id for answer in answers] == [waiting.id]
        assert connection.state == "open"

    def test_a_second_reply_to_an_answered_request_is_out_of_step(self) -> None:
        source = engine()
        connection = welcomed(source)
        request = ping(connection, source)
        assert len(connection.receive_data(frame(Pong(id=request.id)))) == 1
        connection.abandon(request.id)  # already answered: nothing to drop
        assert connection.receive_data(frame(Pong(id=request.id))) == []
        assert connection.state == "closed"


class TestRetry:
    def test_a_request_whose_connection_ended_goes_once_more(self) -> None:
        source = engine()
        connection = welcomed(source)
        request = ping(connection, source)
        [lost] = connection.connection_lost("the daemon closed it")
        assert (lost.id, lost.retry) == (request.id, True)
        assert connection.state == "closed"
        again = welcomed(source)
        again.send(request, Pong, resent=True)
        [gone] = again.connection_lost()
        assert not gone.retry
        with pytest.raises(DaemonUnavailable, match=r"not reachable at .*: the connection closed"):
            gone.result(Pong)

    def test_the_loss_says_how_the_connection_ended(self) -> None:
        answer = engine().lost(3, resent=True, reason="Broken pipe")
        assert "the connection closed (Broken pipe)" in str(answer.error)
        assert repr(answer).startswith("Answer(id=3, reply=None, error=DaemonUnavailable(")

    def test_a_refusal_sent_before_a_failed_send_still_answers(self) -> None:
        source = engine()
        connection = welcomed(source)
        request = ping(connection, source)
        connection.send_failed()
        assert connection.state == "closing"
        with pytest.raises(RuntimeError, match="closing"):
            ping(connection, source)
        over = Error(code=ErrorCode.FRAME_TOO_LARGE, message="over")
        [answer] = connection.receive_data(frame(over))
        assert answer.id == request.id
        assert isinstance(answer.error, RequestRefused)
        assert not answer.retry

    def test_every_request_in_flight_is_answered_once(self) -> None:
        source = engine()
        connection = welcomed(source)
        requests = [ping(connection, source) for _ in range(4)]
        answered = connection.receive_data(frame(Pong(id=requests[1].id)))
        answered += connection.connection_lost()
        answered += connection.connection_lost()
        assert sorted(answer.id for answer in answered) == [request.id for request in requests]

    def test_reconnecting_waits_at_least_as_long_as_the_daemon_said(self) -> None:
        source = engine()
        assert source.reconnecting(100.0).deadline == 105.0
        welcomed(source, restart=12.0)
        assert source.reconnecting(100.0).deadline == 112.0

    def test_the_pauses_double_up_to_a_quarter_second_until_the_deadline(self) -> None:
        backoff, now, pauses = Backoff(1.0), 0.0, []
        while (pause := backoff.pause(now)) is not None:
            pauses.append(pause)
            now += pause
        assert pauses[:6] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.25]
        assert set(pauses[5:]) == {0.25}
        assert now <= 1.0 < now + 0.25

    def test_a_first_connect_is_tried_once(self) -> None:
        assert Backoff(50.0).pause(50.0) is None


class Driver:
    """A driver of the engine's plans with no I/O: it records each step and takes
    it as the test scripts, the clock advancing by each pause."""

    def __init__(self, source: Engine, *, opens: list[Exception | None], welcome: bool = True):
        self.engine = source
        self.steps: list[str] = []
        self.opens = opens
        self.welcome = welcome
        self.now = 0.0
        self.connection: Connection | None = None
        #: What each request's exchange gets: True, its reply; False, the loss.
        self.replies: list[bool] = []

    def take(self, step: Step) -> object:
        self.steps.append(type(step).__name__)
        if isinstance(step, Clock):
            return self.now
        if isinstance(step, Pause):
            self.now += step.seconds
            return None
        if isinstance(step, Open):
            failure = self.opens.pop(0)
            if failure is not None:
                raise failure
            return self.engine.connect(responder=step.responder)
        if isinstance(step, Close):
            return step.connection.connection_lost()
        if isinstance(step, Connected):
            self.steps[-1] += "(again)" if step.again else ""
            if self.connection is None or self.connection.state != "open":
                self.connection = drive(self.engine.dial(broke=step.again), self.take)
            return self.connection
        assert isinstance(step, Exchange)
        return self.exchange(step)

    def exchange(self, step: Exchange) -> Answer:
        connection = step.connection
        if step.request_id == connection.hello_id:
            hello = decode_request(step.frame[4:])
            assert isinstance(hello, Hello)
            self.steps[-1] += f"(hello {hello.version})"
            if self.welcome or hello.version == MIN_PROTOCOL_VERSION:
                reply: Reply = Welcome(id=hello.id, version=1, server="s", pid=1)
            else:
                reply = Error(id=hello.id, code=ErrorCode.UNSUPPORTED_VERSION, message="old")
            [answer] = connection.receive_data(frame(reply))
            return answer
        if self.replies.pop(0):
            [answer] = connection.receive_data(frame(Pong(id=step.request_id)))
            return answer
        [answer] = connection.connection_lost("reset")
        return answer


class TestPlans:
    def test_a_call_connects_then_exchanges_its_frame(self) -> None:
        source = engine()
        driver = Driver(source, opens=[None])
        driver.replies = [True]
        request = Ping(id=source.next_id())
        assert drive(source.call(request, Pong), driver.take) == Pong(id=request.id)
        # The socket is opened (and judged) before the hello, the hello before the call.
        assert driver.steps == [
            "Connected",
            "Open",
            f"Exchange(hello {PROTOCOL_VERSION})",
            "Exchange",
        ]

    def test_a_call_lost_once_is_sent_again_and_a_second_loss_is_unavailable(self) -> None:
        source = engine()
        driver = Driver(source, opens=[None, None, None])
        driver.replies = [False, True]
        request = Ping(id=source.next_id())
        assert drive(source.call(request, Pong), driver.take) == Pong(id=request.id)
        assert driver.steps[4:] == [
            "Connected(again)",
            "Clock",
            "Open",
            f"Exchange(hello {PROTOCOL_VERSION})",
            "Exchange",  # the same request, its id kept
        ]
        driver.replies = [False, False]
        with pytest.raises(DaemonUnavailable, match="the connection closed"):
            drive(source.call(Ping(id=source.next_id()), Pong), driver.take)

    def test_a_daemon_that_refuses_the_version_is_greeted_again_in_the_oldest(self) -> None:
        source = engine()
        driver = Driver(source, opens=[None, None], welcome=False)
        connection = drive(source.greet(), driver.take)
        assert connection.state == "open"
        assert driver.steps == [
            "Open",
            f"Exchange(hello {PROTOCOL_VERSION})",
            "Close",
            "Open",
            f"Exchange(hello {MIN_PROTOCOL_VERSION})",
        ]

    def test_a_responder_refused_its_version_does_not_greet_again(self) -> None:
        source = engine()
        driver = Driver(source, opens=[None, None], welcome=False)
        with pytest.raises(RequestRefused) as caught:
            drive(source.greet(responder=True), driver.take)
        assert caught.value.code == ErrorCode.UNSUPPORTED_VERSION
        assert driver.steps == ["Open", f"Exchange(hello {PROTOCOL_VERSION})"]

    def test_a_first_dial_tries_once(self) -> None:
        source = engine()
        driver = Driver(source, opens=[source.unavailable("no socket there")])
        with pytest.raises(DaemonUnavailable, match="no socket there"):
            drive(source.dial(broke=False), driver.take)
        assert driver.steps == ["Open"]

    def test_a_dial_after_a_break_waits_out_the_reconnect_timeout(self) -> None:
        source = engine()  # reconnect_timeout 5 s
        down: list[Exception | None] = [
            source.unavailable("nothing is listening") for _ in range(99)
        ]
        driver = Driver(source, opens=down)
        with pytest.raises(DaemonUnavailable, match="nothing is listening"):
            drive(source.dial(broke=True), driver.take)
        pauses = driver.steps.count("Pause")
        assert driver.steps.count("Open") == pauses + 1
        assert 4.75 < driver.now <= 5.0

    def test_a_socket_not_to_be_trusted_is_not_tried_again(self) -> None:
        source = engine()
        driver = Driver(source, opens=[UntrustedSocket("owned by uid 4321", SOCKET, 4321), None])
        with pytest.raises(UntrustedSocket):
            drive(source.dial(broke=True), driver.take)
        assert driver.steps == ["Clock", "Open"]


def test_a_failed_connect_says_why() -> None:
    source = engine()
    assert "no socket there" in str(source.connect_failed(FileNotFoundError(2, "x")))
    assert "nothing is listening on it" in str(source.connect_failed(ConnectionRefusedError()))
    assert "Permission denied" in str(
        source.connect_failed(PermissionError(13, "Permission denied"))
    )


def test_an_answer_returns_its_reply() -> None:
    reply = Acquired(id=4, remaining=30.0, rearmed=False)
    assert Answer(4, reply).result(Acquired) is reply


def test_the_engine_imports_nothing_that_does_io() -> None:
    forbidden = ("socket", "select", "selectors", "trio", "asyncio", "ssl")
    code = (
        "import sys, watchdogd_client.engine\n"
        f"print(' '.join(sorted(set({forbidden!r}) & set(sys.modules))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
