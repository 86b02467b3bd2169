"""The socket server, in-process, over real Unix sockets: framing bounds, pipelining,
slow and hostile clients, responders and their processes, and the socket file's
life."""

from __future__ import annotations

import functools
import grp
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
import trio
import trio.testing

from watchdogd.core.config import Config, DaemonConfig
from watchdogd.core.service import Service
from watchdogd.errors import ListenError
from watchdogd.runtime.daemon import run
from watchdogd.runtime.reply_budget import ReplyBudget
from watchdogd.runtime.server import open_listener
from watchdogd_protocol import (
    Acquire,
    Acquired,
    Error,
    ErrorCode,
    Events,
    EventsReply,
    FrameReader,
    Hello,
    Ping,
    Pong,
    Release,
    Released,
    ReplyMessage,
    RequestMessage,
    Status,
    StatusReply,
    Suggest,
    SuggestReply,
    Welcome,
    decode_reply,
    encode_frame,
)

from helpers.processes import python_worker, reap, sleeper

StartDaemon = Callable[..., Awaitable[Service[Any]]]


@pytest.fixture
async def start_daemon(socket_path: Path, nursery: trio.Nursery) -> AsyncIterator[StartDaemon]:
    """Starts the daemon in-process; closes the test's connections at the end."""

    async def start(**settings: Any) -> Service[Any]:
        config = Config(daemon=DaemonConfig(**settings))
        service: Service[Any] = await nursery.start(
            functools.partial(run, config, str(socket_path), handle_signals=False)
        )
        return service

    yield start
    while Conn.opened:
        await Conn.opened.pop().stream.aclose()


class Conn:
    """A raw protocol connection, for saying exactly what a client may say.

    Every connection opened in a test is closed when the test ends."""

    opened: ClassVar[list[Conn]] = []

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.reader = FrameReader(1 << 24)
        self.frames: list[bytes] = []

    @classmethod
    async def open(cls, path: Path, *, greet: bool = True) -> Conn:
        conn = cls(await trio.open_unix_socket(str(path)))
        cls.opened.append(conn)
        if greet:
            assert isinstance(await conn.ask(Hello(id=0, version=1)), Welcome)
        return conn

    async def send(self, *messages: RequestMessage) -> None:
        await self.stream.send_all(b"".join(encode_frame(message) for message in messages))

    async def receive(self) -> ReplyMessage:
        while not self.frames:
            data = await self.stream.receive_some()
            if not data:
                raise EOFError
            self.frames += self.reader.feed(data)
        return decode_reply(self.frames.pop(0))

    async def ask(self, message: RequestMessage) -> ReplyMessage:
        await self.send(message)
        return await self.receive()

    async def closed_by_daemon(self) -> bool:
        """Whether the daemon closes the connection (within a generous bound)."""
        with trio.move_on_after(10):
            try:
                while await self.stream.receive_some():
                    pass
            except trio.BrokenResourceError:
                pass
            return True
        return False


async def test_pipelined_requests_are_answered_in_order_with_their_ids(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    await start_daemon()
    conn = await Conn.open(socket_path, greet=False)
    await conn.send(
        Hello(id=1, version=1),
        Acquire(id=2, scope="a", timeout=60),
        Acquire(id=3, scope="b", timeout=60),
        Acquire(id=4, scope="a", timeout=90),
        Release(id=5, scope="b"),
        Ping(id=6),
    )
    replies = [await conn.receive() for _ in range(6)]
    assert [reply.id for reply in replies] == [1, 2, 3, 4, 5, 6]
    # Each arming's number is the daemon's own (compared apart: its value is a time).
    armed = [reply for reply in replies if isinstance(reply, Acquired)]
    assert all(reply.arm for reply in armed)
    replies = [
        msgspec.structs.replace(reply, arm=0) if isinstance(reply, Acquired) else reply
        for reply in replies
    ]
    assert replies[1:] == [
        Acquired(id=2, remaining=60, rearmed=False),
        Acquired(id=3, remaining=60, rearmed=False),
        Acquired(id=4, remaining=90, rearmed=True),
        Released(id=5, found=True),
        Pong(id=6),
    ]


async def test_a_request_pipelined_behind_a_long_poll_is_not_held_up(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    await start_daemon()
    conn = await Conn.open(socket_path)
    await conn.send(Events(id=1, after=0, wait=30), Ping(id=2))
    with trio.fail_after(5):
        replies = [await conn.receive(), await conn.receive()]
    assert replies[1] == Pong(id=2)
    assert isinstance(replies[0], EventsReply)
    assert replies[0].events == []


async def test_oversized_frame_gets_an_error_then_the_connection_closes(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    service = await start_daemon()
    conn = await Conn.open(socket_path)
    await conn.stream.send_all(struct.pack(">I", 64 * 1024 + 1))
    reply = await conn.receive()
    assert isinstance(reply, Error)
    assert reply.code == ErrorCode.FRAME_TOO_LARGE
    assert await conn.closed_by_daemon()
    assert service.arming.connections == 0


async def test_bad_frames_leave_the_connection_and_others_usable(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    await start_daemon()
    bystander = await Conn.open(socket_path)
    conn = await Conn.open(socket_path)
    await conn.stream.send_all(struct.pack(">I", 1) + b"\xc1")
    reply = await conn.receive()
    assert isinstance(reply, Error)
    assert reply.code == ErrorCode.MALFORMED
    assert await conn.ask(Ping(id=7)) == Pong(id=7)
    assert await bystander.ask(Ping(id=8)) == Pong(id=8)


#: Cursors of every request that takes one, out of range or of the wrong shape.
#: msgpack has no integer past 2**64 - 1: 2**64 + 1 goes as the float and the text
#: a client could send instead.
_BAD_POSITIONS: list[dict[str, object]] = [
    {"type": op, field: value}
    for op, field in (("suggest", "cursor"), ("events", "after"))
    for value in (2**63, 2**64 - 1, float(2**64 + 1), str(2**64 + 1), -1, -(2**63), 1.5,
                  "9" * 60_000, [1], {"a": 1}, None if op == "suggest" else True)
]  # fmt: skip
_BAD_STATUS_CURSORS: list[dict[str, object]] = [
    {"type": "status", "cursor": cursor}
    for cursor in (f"1.0/{2**63}", f"1.0/{2**64 + 1}", "1.0/-1", "nan/1", "inf/3", "-inf/3",
                   "1e400/1", "1.0", "/1", "", "1.0/1/2", "1/ 2_0", "x" * 60_000, 2**63, -1, 1.0)
]  # fmt: skip
BAD_CURSORS = _BAD_POSITIONS + _BAD_STATUS_CURSORS


async def test_a_cursor_of_any_size_or_shape_is_an_invalid_request(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    service = await start_daemon()
    conn = await Conn.open(socket_path)
    for number in range(3):
        await conn.ask(Acquire(id=1, scope=f"s{number}", timeout=60))
    for request_id, fields in enumerate(BAD_CURSORS, 10):
        body = msgspec.msgpack.encode({**fields, "id": request_id})
        await conn.stream.send_all(struct.pack(">I", len(body)) + body)
        reply = await conn.receive()
        assert isinstance(reply, Error), fields
        assert (reply.id, reply.code) == (request_id, ErrorCode.INVALID_REQUEST), reply
        assert len(reply.message) < 1000
    # The connection stays usable; the daemon failed on nothing; good cursors work.
    assert await conn.ask(Ping(id=1)) == Pong(id=1)
    assert not [key for key in service.metrics.requests if key[1] == ErrorCode.INTERNAL]
    first = await conn.ask(Status(id=2, limit=2))
    assert isinstance(first, StatusReply)
    assert first.cursor is not None
    rest = await conn.ask(Status(id=3, limit=2, cursor=first.cursor))
    assert isinstance(rest, StatusReply)
    assert [t.scope for t in first.timers + rest.timers] == ["s0", "s1", "s2"]
    last = await conn.ask(Suggest(id=4, cursor=2**63 - 1))
    assert isinstance(last, SuggestReply)
    assert (last.suggestions, last.cursor) == ([], None)
    assert await conn.ask(Events(id=5, after=2**63 - 1)) == EventsReply(id=5, events=[], last=0)


async def test_first_frame_must_be_hello(start_daemon: StartDaemon, socket_path: Path) -> None:
    await start_daemon()
    conn = await Conn.open(socket_path, greet=False)
    reply = await conn.ask(Ping(id=1))
    assert isinstance(reply, Error)
    assert reply.code == ErrorCode.HANDSHAKE_REQUIRED
    assert await conn.closed_by_daemon()


async def test_half_sent_frame_times_out_but_idle_connection_stays(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    await start_daemon(partial_frame_timeout=0.3)
    idle = await Conn.open(socket_path)
    stalled = await Conn.open(socket_path)
    await stalled.stream.send_all(encode_frame(Ping(id=1))[:3])
    assert await stalled.closed_by_daemon()
    await trio.sleep(0.5)
    assert await idle.ask(Ping(id=2)) == Pong(id=2)


async def test_client_that_never_reads_is_disconnected(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    service = await start_daemon(send_timeout=0.3)
    greedy = await Conn.open(socket_path)
    burst = encode_frame(Status(id=1, limit=1)) * 2000
    with trio.move_on_after(20):
        try:
            while True:  # keep asking, never read: the daemon must let go
                await greedy.stream.send_all(burst)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    with trio.fail_after(10):
        while service.arming.connections:
            await trio.sleep(0.01)
    other = await Conn.open(socket_path)
    assert await other.ask(Ping(id=2)) == Pong(id=2)


async def test_timers_outlive_their_connection(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    service = await start_daemon()
    victim = sleeper()
    try:
        conn = await Conn.open(socket_path)
        assert isinstance(
            await conn.ask(Acquire(id=1, scope="s", timeout=0.2, pid=victim.pid)), Acquired
        )
        await conn.stream.aclose()
        with trio.fail_after(10):
            while victim.poll() is None:
                await trio.sleep(0.01)
        assert victim.returncode == -9
        with trio.fail_after(10):
            while service.metrics.expired < 1:
                await trio.sleep(0.01)
    finally:
        reap(victim)


async def test_exit_drops_timers_at_once(start_daemon: StartDaemon, socket_path: Path) -> None:
    service = await start_daemon()
    victim = sleeper()
    try:
        conn = await Conn.open(socket_path)
        for scope in ("a", "b"):
            await conn.ask(Acquire(id=1, scope=scope, timeout=600, pid=victim.pid))
        reply = await conn.ask(Status(id=2))
        assert isinstance(reply, StatusReply)
        assert {t.scope for t in reply.timers} == {"a", "b"}
        victim.kill()
        with trio.fail_after(10):
            while len(service.table):
                await trio.sleep(0.001)
        assert service.metrics.exited == 1
        assert service.table.process_count == 0
    finally:
        reap(victim)


async def test_unknown_process_is_refused(start_daemon: StartDaemon, socket_path: Path) -> None:
    await start_daemon()
    gone = subprocess.Popen(["true"])
    gone.wait()
    conn = await Conn.open(socket_path)
    reply = await conn.ask(Acquire(id=1, scope="s", timeout=5, pid=gone.pid))
    assert isinstance(reply, Error)
    assert reply.code == ErrorCode.NO_SUCH_PROCESS


async def test_socket_mode_is_applied(start_daemon: StartDaemon, socket_path: Path) -> None:
    await start_daemon()
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o666


class TestSocketFile:
    def test_stale_socket_is_replaced(self, socket_path: Path) -> None:
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(str(socket_path))
        dead.close()  # the file stays; nothing listens
        listener = open_listener(str(socket_path), 0o600)
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        listener.close()
        assert not socket_path.exists()

    def test_mode_and_group(self, socket_path: Path) -> None:
        listener = open_listener(str(socket_path), 0o660, "nogroup")
        try:
            info = os.stat(socket_path)
            assert stat.S_IMODE(info.st_mode) == 0o660
            assert info.st_gid == grp.getgrnam("nogroup").gr_gid
        finally:
            listener.close()
        with pytest.raises(ListenError, match="no group named 'no-such-group'"):
            open_listener(str(socket_path), 0o660, "no-such-group")

    def test_a_live_daemon_is_never_replaced(self, socket_path: Path) -> None:
        live = open_listener(str(socket_path), 0o666)
        try:
            with pytest.raises(ListenError, match="another daemon is listening"):
                open_listener(str(socket_path), 0o666)
            assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
        finally:
            live.close()

    def test_a_path_that_is_not_a_socket_is_never_removed(self, socket_path: Path) -> None:
        socket_path.write_text("precious")
        with pytest.raises(ListenError, match="is not a socket"):
            open_listener(str(socket_path), 0o666)
        assert socket_path.read_text() == "precious"

    def test_close_leaves_a_replaced_path_alone(self, socket_path: Path) -> None:
        listener = open_listener(str(socket_path), 0o666)
        socket_path.unlink()
        socket_path.write_text("someone else's")
        listener.close()
        assert socket_path.read_text() == "someone else's"

    @pytest.mark.parametrize(("base", "mode"), [("/var/tmp", 0o755), ("/tmp", 0o700)])
    def test_a_missing_directory_is_created_private_under_tmp(self, base: str, mode: int) -> None:
        top = Path(tempfile.mkdtemp(dir=base))
        umask = os.umask(0o022)
        try:
            directory = top / "run"
            open_listener(str(directory / "watchdogd.sock"), 0o666).close()
            assert stat.S_IMODE(directory.stat().st_mode) == mode
        finally:
            os.umask(umask)
            shutil.rmtree(top)

    def test_private_tmp_directory_must_be_ours(self, tmp_path: Path) -> None:
        shared = Path("/tmp") / f"wd-shared-{os.getpid()}"
        shared.mkdir(mode=0o777)
        os.chmod(shared, 0o777)
        try:
            with pytest.raises(ListenError, match="not a private directory"):
                open_listener(str(shared / "watchdogd.sock"), 0o666)
        finally:
            shared.rmdir()


async def test_a_uid_over_its_reply_budget_waits_and_root_never_does() -> None:
    budget = ReplyBudget()
    budget.hold(1000, 8)
    assert budget.over(1000, 8, 100)
    assert not budget.over(2000, 8, 100)
    budget.hold(0, 10_000)
    assert not budget.over(0, 8, 100)  # root waits for no one
    assert not budget.over(2000, 8, 100)  # root's bytes are not in the shared total
    woken: list[int] = []

    async def waiter(uid: int) -> None:
        await budget.wait_for_room(uid, 8, 100)
        woken.append(uid)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, 1000)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []
        budget.hold(2000, 95)
        budget.release(1000, 8)  # 1000 is within its own budget, and the total too
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [1000]
        budget.hold(3000, 5)  # the shared total reaches 100: everyone but root waits
        assert budget.over(1000, 8, 100)
        nursery.start_soon(waiter, 1000)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [1000]
        budget.release(2000, 95)
    assert woken == [1000, 1000]
    assert (budget.held(1000), budget.held(2000), budget.held(3000)) == (0, 0, 5)


#: A process that registers as a responder of job "j", then on a line of its stdin
#: forks and exits: its child keeps the connection and says its pid.
RESPONDS_AND_FORKS = """
    import os, socket, sys, time
    from watchdogd_protocol import (
        PROTOCOL_VERSION, FrameReader, Hello, Respond, decode_reply, encode_frame,
    )

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["WATCHDOGD_SOCKET"])
    reader = FrameReader(1 << 20)

    def call(request):
        sock.sendall(encode_frame(request))
        frames = []
        while not frames:
            frames = reader.feed(sock.recv(65536))
        return type(decode_reply(frames[0])).__name__

    print(call(Hello(id=0, version=PROTOCOL_VERSION)), call(Respond(id=1, job="j")), flush=True)
    sys.stdin.readline()
    child = os.fork()
    if child == 0:
        time.sleep(300)
        os._exit(0)
    print(child, flush=True)
"""


async def test_a_responder_is_dropped_the_moment_its_process_exits(
    start_daemon: StartDaemon, socket_path: Path
) -> None:
    service = await start_daemon()
    worker = python_worker(RESPONDS_AND_FORKS, socket=socket_path)
    child = None
    try:
        assert worker.stdin is not None
        assert worker.stdout is not None
        said = await trio.to_thread.run_sync(worker.stdout.readline)
        assert said.split() == ["Welcome", "Responding"]
        assert service.responders.jobs() == {(0, "j")}
        worker.stdin.write("fork\n")
        worker.stdin.flush()
        child = os.pidfd_open(int(await trio.to_thread.run_sync(worker.stdout.readline)))
        assert await trio.to_thread.run_sync(worker.wait) == 0
        # Dropped on its exit, with no ask, while the child keeps the connection.
        with trio.fail_after(10):
            while service.responders.jobs():
                await trio.sleep(0.001)
        assert len(service.responders) == 0
        assert service.arming.connections == 1
    finally:
        if child is not None:
            signal.pidfd_send_signal(child, signal.SIGKILL)
            os.close(child)
        reap(worker)
