"""A responder is its process: a process of uid 65534 registers as a responder,
forks and exits, its child keeps the connection, and the pid goes to root's
process (or to a worker of uid 4321) through clone3's ``set_tid``
(`helpers.processes.fork_at_pid`). The child's connection answers for nobody:
the stack recorded for root's process is its own (py-spy's, or its responder's),
never the child's planted frame; a `Respond` from the connection of a process
that has gone is refused, so the worker's own responder stays its own. Through
each attack a root canary is signalled within 100 ms of its deadline.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import select
import signal
import socket as socket_module
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from watchdogd_client import Client
from watchdogd_client.arming import JobLabels
from watchdogd_client.responder import Responder
from watchdogd_protocol import (
    PROTOCOL_VERSION,
    Error,
    EventInfo,
    Evidence,
    EvidenceWanted,
    Frame,
    FrameReader,
    Hello,
    RequestMessage,
    Respond,
    ThreadStack,
    decode_for_responder,
    encode_frame,
)

from helpers.daemon import RunningDaemon, configured_daemon, expired_event
from helpers.processes import (
    PidHolder,
    at_timing_priority,
    at_timing_priority_now,
    at_units_priority_all,
    become,
    fork_at_pid,
    reap,
    sleeper,
)
from helpers.users import NOBODY
from helpers.waiting import PATIENCE

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as other uids")

CONFIG = """
[policies.dumpy]
root_only = true
steps = [ { dump = true, timeout = 30 }, { signal = "SIGKILL" } ]
"""

#: A uid of its own for the worker whose responder is attacked (no passwd entry).
WORKER_UID = 4321
#: How late a root canary may be signalled during an attack.
ON_TIME = 0.1
PLANTED = "planted_frame"
PLANTED_STACK = ThreadStack(
    name="MainThread", main=True, frames=[Frame(file="/srv/x.py", line=1, function=PLANTED)]
)


def forge(socket: str, respond_first: bool, commands: int, say: int) -> None:
    """As uid 65534: connect, say hello, send `Respond` first if ``respond_first``,
    fork, and exit; the child keeps the connection. It answers every ask with a
    planted frame, and takes from ``commands`` ``respond`` (send `Respond` on the
    connection its parent opened) and ``report`` (how many asks reached it),
    saying what happened as JSON lines on ``say``."""
    sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    sock.connect(socket)
    reader = FrameReader(1 << 24)
    received: list[bytes] = []
    ids = itertools.count(1)
    asked = 0

    def tell(message: dict[str, Any]) -> None:
        os.write(say, json.dumps(message).encode() + b"\n")

    def serve_one() -> object:
        nonlocal asked
        while not received:
            data = sock.recv(65536)
            if not data:
                os._exit(0)
            received.extend(reader.feed(data))
        message = decode_for_responder(received.pop(0))
        if isinstance(message, EvidenceWanted):
            asked += 1
            evidence = Evidence(id=next(ids), ask=message.ask, threads=[PLANTED_STACK])
            sock.sendall(encode_frame(evidence))
        return message

    def call(request: RequestMessage) -> str:
        sock.sendall(encode_frame(request))
        while True:
            reply = serve_one()
            if getattr(reply, "id", None) == request.id:
                return reply.code if isinstance(reply, Error) else type(reply).__name__.lower()

    call(Hello(id=0, version=PROTOCOL_VERSION))
    if respond_first:
        tell({"respond": call(Respond(id=next(ids), job="forged"))})
    child = os.fork()
    if child:
        tell({"child": child})
        return
    lines = os.fdopen(commands)
    while True:
        readable, _, _ = select.select([sock.fileno(), commands], [], [])
        if sock.fileno() in readable:
            serve_one()
        if commands in readable:
            command = lines.readline().strip()
            if command == "respond":
                tell({"respond": call(Respond(id=next(ids), job="forged"))})
            elif command == "report":
                tell({"asked": asked})
            else:
                return


def root_real_work(say: int) -> None:
    """Root's process that takes the forger's pid."""
    os.write(say, b"ready\n")
    time.sleep(300)


def worker_of_4321(socket: Path, say: int) -> None:
    """A worker of uid 4321 that takes the forger's pid: its responder (the client
    library's) registers before it says it is ready."""
    own = Responder(str(socket), JobLabels())
    own.start()
    deadline = time.monotonic() + PATIENCE
    while not own._registered and time.monotonic() < deadline:
        time.sleep(0.01)
    worker_real_work(say, registered=own._registered)


def worker_real_work(say: int, *, registered: bool) -> None:
    os.write(say, b"ready\n" if registered else b"unregistered\n")
    time.sleep(300)


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as running:
        yield running


class Forger:
    """The forging process of uid 65534 (`forge`) and, once it exited, its child."""

    def __init__(self, socket: Path, *, respond_first: bool) -> None:
        commands, self._commands = os.pipe()
        said, say = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the forger, which never returns
            try:
                os.close(self._commands)
                os.close(said)
                become(NOBODY)
                forge(str(socket), respond_first, commands, say)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(0)
        os.close(commands)
        os.close(say)
        self.pid = pid
        self._said = os.fdopen(said)
        if respond_first:
            assert self.said() == {"respond": "responding"}  # it is alive: its own
        child = int(self.said()["child"])
        self._child = os.pidfd_open(child)
        # Reaped: its pid is free for the next process to take.
        _, status = os.waitpid(pid, 0)
        assert status == 0

    def said(self) -> dict[str, Any]:
        line = self._said.readline()
        assert line, "the forger is gone"
        said: dict[str, Any] = json.loads(line)
        return said

    def tell(self, command: str) -> dict[str, Any]:
        os.write(self._commands, command.encode() + b"\n")
        return self.said()

    def close(self) -> None:
        signal.pidfd_send_signal(self._child, signal.SIGKILL)
        os.close(self._child)
        os.close(self._commands)
        self._said.close()


class Canary:
    """A root timer on a real ``sleep`` child; a thread notes, through a pidfd, when
    it died."""

    def __init__(self, client: Client, timeout: float) -> None:
        with at_timing_priority():
            self.victim = sleeper()
        self._fd = os.pidfd_open(self.victim.pid)
        remaining = client.acquire("canary", timeout, pid=self.victim.pid)
        # The latest it can be: a slow answer never makes a canary late.
        self.deadline = time.monotonic() + remaining
        self.died: float | None = None
        self._watcher = threading.Thread(target=self._wait, daemon=True)
        self._watcher.start()

    def _wait(self) -> None:
        at_timing_priority_now()
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if poller.poll(PATIENCE * 2000):
            self.died = time.monotonic()

    def assert_on_time(self) -> None:
        self._watcher.join(PATIENCE * 2)
        assert self.died is not None, "the canary was never signalled"
        late = self.died - self.deadline
        assert late < ON_TIME, f"the canary died {late * 1000:.1f} ms late"
        assert self.victim.wait(PATIENCE) == -signal.SIGKILL

    def close(self) -> None:
        reap(self.victim)
        os.close(self._fd)


def taken_by(pid: int, work: Callable[[int], object], *, uid: int = 0) -> PidHolder:
    """A process of ``uid`` that holds ``pid`` and runs ``work``, once ``work`` said
    it is ready on the pipe it is given."""
    said, say = os.pipe()
    holder = fork_at_pid(pid, lambda: work(say), uid=uid)
    os.close(say)
    try:
        with os.fdopen(said) as pipe:
            assert pipe.readline().strip() == "ready"
    except BaseException:
        holder.close()
        raise
    return holder


@contextlib.contextmanager
def root_canary(daemon: RunningDaemon, after: float) -> Iterator[Client]:
    """A root client, and a canary it arms due ``after`` seconds on, during what the
    block does: on time once the block is over."""
    at_units_priority_all(daemon.pid)  # as deployed, as the canary is timed
    with daemon.client() as client:
        canary = Canary(client, after)
        try:
            yield client
            canary.assert_on_time()
        finally:
            canary.close()


def dumped_and_killed(daemon: RunningDaemon, holder: PidHolder) -> EventInfo:
    """Root arms a dump-then-kill timer on ``holder``, and a canary due as the dump
    is taken; the expiry, once ``holder`` was killed."""
    with root_canary(daemon, 0.6) as client:
        client.acquire("root-dump", 0.5, pid=holder.pid, policy="dumpy")
        assert holder.wait(PATIENCE * 3) == -signal.SIGKILL
        return expired_event(client, holder.pid)


def test_a_dead_responders_child_never_answers_for_roots_process_on_its_pid(
    daemon: RunningDaemon,
) -> None:
    forger = Forger(daemon.socket_path, respond_first=True)
    try:
        root = taken_by(forger.pid, root_real_work)
        try:
            event = dumped_and_killed(daemon, root)
        finally:
            root.close()
        assert forger.tell("report") == {"asked": 0}  # it answers for nobody
    finally:
        forger.close()
    dump, kill = event.steps
    assert PLANTED not in dump.output
    # py-spy took the real stack from outside: root's process has no responder.
    assert dump.result == "exit 0", dump.output
    assert "root_real_work" in dump.output, dump.output
    assert kill.result == "sent SIGKILL"


def test_a_respond_from_the_connection_of_a_process_that_has_gone_is_refused(
    daemon: RunningDaemon,
) -> None:
    forger = Forger(daemon.socket_path, respond_first=False)
    try:
        with root_canary(daemon, 0.2):
            assert forger.tell("respond") == {"respond": "no_such_process"}
        assert forger.tell("report") == {"asked": 0}
    finally:
        forger.close()


def test_a_workers_responder_is_replaced_by_no_connection_but_its_own(
    daemon: RunningDaemon,
) -> None:
    forger = Forger(daemon.socket_path, respond_first=False)
    try:
        work = functools.partial(worker_of_4321, daemon.socket_path)
        worker = taken_by(forger.pid, work, uid=WORKER_UID)
        try:
            # The old connection's pid is the worker's now; the process is not.
            assert forger.tell("respond") == {"respond": "no_such_process"}
            event = dumped_and_killed(daemon, worker)
        finally:
            worker.close()
        assert forger.tell("report") == {"asked": 0}
    finally:
        forger.close()
    dump, _ = event.steps
    assert (dump.step, dump.result) == ("dump by the worker's responder", "ok"), dump.output
    assert "worker_real_work" in dump.output
    assert PLANTED not in dump.output
