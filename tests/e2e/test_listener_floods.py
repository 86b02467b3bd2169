"""Slow and flooding clients of uid 65534 at every listener the daemon has: the
scrape endpoint (``--metrics-listen``) still answers Prometheus within 2 s, the
Unix socket still answers root, and a root canary is signalled within 100 ms of
its deadline meanwhile.

Scaled down here (seconds each); ``WATCHDOGD_SOAK=1`` runs each attack for 21.5 s,
at the size the bounds were made for (41 scrapes beside 64 slow connections)."""

from __future__ import annotations

import contextlib

# Imported before the attacker becomes uid 65534, which cannot read the
# interpreter's library under /root: a host name is encoded with it.
import encodings.idna  # noqa: F401
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from watchdogd.runtime.server import ACCEPTS_PER_TURN, REFUSALS_WAITING
from watchdogd_client import Client, DaemonUnavailable, RequestRefused
from watchdogd_protocol import (
    Error,
    ErrorCode,
    FrameReader,
    Hello,
    decode_reply,
    encode_frame,
)

from helpers.daemon import RunningDaemon, configured_daemon, expired_event
from helpers.etcd import free_ports
from helpers.processes import at_units_priority_all, death_time, reap, sleeper
from helpers.users import NOBODY
from helpers.waiting import PATIENCE

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as uid 65534")

SOAK = os.environ.get("WATCHDOGD_SOAK", "") == "1"
#: How long each attack lasts: root asks from a second after it began to half a
#: second before it ends.
ATTACK_SECONDS = 21.5 if SOAK else 4.0
#: What a scrape or a root request may take under attack.
ANSWERED_WITHIN = 2.0
#: How late a root canary may be signalled, and seen to die.
ON_TIME = 0.1
DIED_WITHIN = 1.0
#: Slow connections at once, each sending a byte every `DRIP` seconds.
SLOW_CONNECTIONS = 64
DRIP = 0.5
#: Connections the flood holds open and idle at once, and the processes that
#: open and close connections as fast as they can beside it.
IDLE_CONNECTIONS = 1500
CHURNERS = 2

HELLO = encode_frame(Hello(id=0, version=1))
SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: watchdogd\r\n\r\n"


# The attacker: uid 65534 in a child process of its own.


@contextlib.contextmanager
def attacking_as_nobody(attack: Callable[[], object]) -> Iterator[None]:
    """``attack`` run by uid 65534 in a forked child for the block's length; the
    child and whatever it forked (a process group of their own) are killed at
    its end."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the hostile user
        try:
            os.setpgid(0, 0)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            attack()
        finally:
            os._exit(0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpgid(child, child)  # whichever of the two runs first
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)
        os.waitpid(child, 0)


Connect = Callable[[], Awaitable[trio.SocketStream]]
Behaviour = Callable[[trio.SocketStream], Awaitable[None]]


async def _reconnecting(connect: Connect, behaviour: Behaviour) -> None:
    """One hostile connection, opened again whenever the daemon drops it."""
    while True:
        try:
            stream = await connect()
        except OSError:
            await trio.sleep(0.05)
            continue
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await behaviour(stream)


async def _drip(stream: trio.SocketStream, payload: bytes) -> None:
    """Send ``payload`` a byte every `DRIP` seconds: once the daemon closed the
    connection, a send fails."""
    for byte in payload * 1000:
        await stream.send_all(bytes([byte]))
        await trio.sleep(DRIP)


async def _idle(stream: trio.SocketStream) -> None:
    while await stream.receive_some(65536):
        pass


def slow_loris(connect: Connect, payload: bytes) -> Callable[[], object]:
    async def attack() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(SLOW_CONNECTIONS):
                nursery.start_soon(_reconnecting, connect, lambda s: _drip(s, payload))

    return lambda: trio.run(attack)


def idle_flood(connect: Connect) -> Callable[[], object]:
    async def attack() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(IDLE_CONNECTIONS):
                nursery.start_soon(_reconnecting, connect, _idle)

    return lambda: trio.run(attack)


def churn(family: socket.AddressFamily, address: str | tuple[str, int]) -> Callable[[], object]:
    """Connections opened and closed as fast as `CHURNERS` processes can."""

    def attack() -> None:
        for _ in range(CHURNERS - 1):
            if os.fork() == 0:
                break
        while True:
            with socket.socket(family, socket.SOCK_STREAM) as opened:
                opened.settimeout(5)
                with contextlib.suppress(OSError):
                    opened.connect(address)

    return attack


# Root: a canary timer and a client asking every half second.


class Canary:
    """A root timer on a real ``sleep`` child, due ``after`` seconds from now, and
    a thread that sees through a pidfd when the child dies."""

    def __init__(self, daemon: RunningDaemon, after: float) -> None:
        self.victim = sleeper()
        with daemon.client() as client:
            remaining = client.acquire("canary", after, pid=self.victim.pid)
        # The latest it can be: a slow answer never makes a canary late.
        self.deadline = time.monotonic() + remaining
        self._died: list[float] = []
        self._watcher = threading.Thread(target=self._watch, args=(after,), daemon=True)
        self._watcher.start()

    def _watch(self, after: float) -> None:
        self._died.append(death_time(self.victim, timeout=after + PATIENCE))

    def died(self) -> float:
        """How late after its deadline it was seen to die."""
        self._watcher.join()
        assert self._died, "the canary never died"
        assert self.victim.wait() == -signal.SIGKILL
        return self._died[0] - self.deadline


@dataclass
class Held:
    """What root saw during an attack: how long each ask took (None: it failed,
    or took over `PATIENCE`), how late the daemon signalled the canary, and how
    late it was seen to die."""

    took: list[float | None]
    signalled: float
    died: float

    def __str__(self) -> str:
        answered = [t for t in self.took if t is not None and t < ANSWERED_WITHIN]
        slowest = max((t for t in self.took if t is not None), default=float("nan"))
        return (
            f"{len(answered)} of {len(self.took)} answered within {ANSWERED_WITHIN} s "
            f"(slowest {slowest * 1000:.0f} ms); the canary signalled "
            f"{self.signalled * 1000:.1f} ms late, seen dead {self.died * 1000:.1f} ms late"
        )

    def check(self) -> None:
        print(self)  # the figures, shown with the output of a failure or with -s
        assert all(t is not None and t < ANSWERED_WITHIN for t in self.took), self
        assert self.signalled < ON_TIME, self
        # Its exit, once signalled, waits for a busy machine to run it and this
        # process to see it.
        assert self.died < DIED_WITHIN, self


def every_half_second(ask: Callable[[], object], seconds: float) -> list[float | None]:
    took: list[float | None] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        try:
            ask()
        except (OSError, DaemonUnavailable, RequestRefused, AssertionError):
            took.append(None)
        else:
            took.append(time.monotonic() - began)
        time.sleep(max(0.0, began + 0.5 - time.monotonic()))
    return took


def under_attack(
    daemon: RunningDaemon, attack: Callable[[], object], ask: Callable[[], object]
) -> Held:
    """``attack`` run by uid 65534 while root asks every half second, with a root
    canary due near the attack's end. The daemon runs at the shipped unit's priority,
    as deployed (every thread of it: priorities are a thread's)."""
    at_units_priority_all(daemon.pid)
    with attacking_as_nobody(attack):
        time.sleep(1.0)  # the attack builds up
        canary = Canary(daemon, ATTACK_SECONDS - 1.5)
        try:
            took = every_half_second(ask, ATTACK_SECONDS - 1.0)
            died = canary.died()
        finally:
            reap(canary.victim)
    with daemon.client() as client:
        signalled = expired_event(client, canary.victim.pid).late
    assert signalled is not None
    return Held(took, signalled, died)


# The scrape endpoint.


@contextlib.contextmanager
def scraped(socket_path: Path, tmp_path: Path) -> Iterator[tuple[RunningDaemon, int]]:
    [port] = free_ports(1)
    running = RunningDaemon(
        socket_path, tmp_path / "log", ["--no-state", "--metrics-listen", str(port)]
    )
    running.start()
    try:
        yield running, port
    finally:
        assert running.stop() == 0, running.log()


def scrape(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as conn:
        conn.sendall(SCRAPE)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:100]
    assert b"watchdogd_timers_armed" in reply


def tcp(port: int) -> Connect:
    return lambda: trio.open_tcp_stream("127.0.0.1", port)


@pytest.mark.parametrize("attack", ["slow", "idle", "churn"])
def test_scrapes_are_answered_within_two_seconds_under_slow_and_flooding_clients(
    socket_path: Path, tmp_path: Path, attack: str
) -> None:
    with scraped(socket_path, tmp_path) as (daemon, port):
        hostile = {
            "slow": lambda: slow_loris(tcp(port), SCRAPE),
            "idle": lambda: idle_flood(tcp(port)),
            "churn": lambda: churn(socket.AF_INET, ("127.0.0.1", port)),
        }[attack]()
        under_attack(daemon, hostile, lambda: scrape(port)).check()


# The Unix socket.


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon as shipped, whose socket uid 65534 can reach."""
    with configured_daemon(socket_path, tmp_path, "", for_everyone=True) as running:
        yield running


def ping(daemon: RunningDaemon) -> None:
    with Client(daemon.socket_path, timeout=PATIENCE) as client:
        client.ping()


@pytest.mark.parametrize("attack", ["slow", "idle", "churn"])
def test_root_is_answered_on_the_socket_under_slow_and_flooding_clients(
    daemon: RunningDaemon, attack: str
) -> None:
    path = str(daemon.socket_path)
    hostile = {
        "slow": lambda: slow_loris(lambda: trio.open_unix_socket(path), HELLO),
        "idle": lambda: idle_flood(lambda: trio.open_unix_socket(path)),
        "churn": lambda: churn(socket.AF_UNIX, path),
    }[attack]()
    under_attack(daemon, hostile, lambda: ping(daemon)).check()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def refusal_code(conn: socket.socket) -> str | None:
    """The code of the error the daemon sent first on ``conn`` (None: no error)."""
    [frame, *_] = FrameReader(1 << 20).feed(conn.recv(4096))
    reply = decode_reply(frame)
    return reply.code if isinstance(reply, Error) else None


#: Descriptors a daemon may hold for a moment on its own account, beside a flood's.
OWN_MOMENT = 4


def test_a_uid_past_its_connection_limit_holds_few_of_the_daemons_descriptors(
    socket_path: Path, tmp_path: Path
) -> None:
    """uid 65534 at its limit of connections opens 300 more that never say hello:
    the daemon gives at most `REFUSALS_WAITING` of them time to, holding no
    descriptor for the others, and every one still reads its refusal."""
    limit, extra = 8, 300
    config = f"[daemon]\nmax_connections_per_uid = {limit}\n"
    with configured_daemon(socket_path, tmp_path, config, for_everyone=True) as daemon:
        told, tell = os.pipe()
        heard, say = os.pipe()

        def attack() -> None:
            held = [Client(daemon.socket_path) for _ in range(limit)]
            for client in held:
                client.ping()
            os.write(say, b"held")
            os.read(told, 1)
            refused = [socket.socket(socket.AF_UNIX) for _ in range(extra)]
            for conn in refused:
                conn.connect(str(daemon.socket_path))
            os.write(say, b"opened")
            os.read(told, 1)
            codes = [refusal_code(conn) for conn in refused]
            os.write(say, str(codes.count(ErrorCode.LIMIT_EXCEEDED)).encode())

        with attacking_as_nobody(attack):
            assert os.read(heard, 100) == b"held"
            holding = open_fds(daemon.pid)
            os.write(tell, b"!")
            assert os.read(heard, 100) == b"opened"
            peak = 0
            for _ in range(8):  # well within the second a refusal waits for its hello
                peak = max(peak, open_fds(daemon.pid) - holding)
                time.sleep(0.05)
            os.write(tell, b"!")
            refusals = int(os.read(heard, 100))
    # A connection holds its socket and, where the kernel gives one, its peer's
    # pidfd: those waiting for their hello, and those taken and not yet refused.
    # What the daemon has open for a moment meanwhile on its own account (a file of
    # /proc read, a journal written) counts too: a few (65 seen beside a CPU hog).
    print(f"the flood held {peak} descriptors of the daemon's")
    assert peak <= 2 * (REFUSALS_WAITING + ACCEPTS_PER_TURN) + OWN_MOMENT, peak
    assert refusals == extra
