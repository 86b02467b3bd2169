"""What protection costs a worker, side by side with its floors, in one run.

Servers (the echo processes, the daemon, torch's FileTimerServer) are pinned to CPU 0,
the worker to CPU 1, as in bench/run.py. Each round measures, in turn:

- the raw floor: a Python AF_UNIX ping-pong with an echo process, a request's size;
- trio's echo: the same echo answered by a trio loop reading as the daemon's
  connections read, doing no other work;
- watchdogd: an empty ``with expires(after=60): pass`` block, against a daemon with
  its durable state on (the default): the worker's wall time per block, its CPU
  per block (``getrusage`` of the whole process, so the responder's thread, which
  carries no request of a block but shares the GIL, is counted) and the daemon's
  CPU per block;
- torch's ``FileTimerClient`` writing to a ``FileTimerServer`` (when torch is
  installed): the same empty block through torch's own ``expires``, its wall time
  and CPU per block, and the server's CPU;
- two blocks that show where the distance to trio's echo lies: a bare worker (the
  block's release and the next acquire in one ``send(2)``, its answers read, nothing
  of the client library but its frames) against the daemon, and the same bare
  worker against the least server that acknowledges an acquire on trio (it decodes
  the requests, keeps the timers in a dict and a heap, writes each batch's changes
  to a journal with one ``write(2)`` and sends the answers, and does nothing else);
- what a new connection costs a worker (once per process, as a rule): a new
  client's first ping (connect, the judgement of the socket, hello, ping),
  connect(2) alone, and the judgement alone (`watchdogd_client.trust`: its
  directory opened and judged, the listener's credentials read) for a path named,
  a user's own and the host's.

Then the burst with the state on: 3,000 deadlines within 10 ms with 200,000 others
armed, the daemon's deadline -> first signal against a bare Python loop over the
same heap and SIGKILLs (bench/run.py's floor), six rounds of each, interleaved.

Every figure is the median of the rounds, with its min-max; ratios are taken
within a round (the block against the trio echo of the same round), as this
machine drifts in speed from second to second. Run with ``make bench``;
``--quick`` shortens it.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from types import ModuleType

import msgspec
import trio
from run import (
    CLIENT_CPU,
    arm_burst,
    arm_many,
    burst_floor,
    cpu_seconds,
    echo_server,
    events_config,
    floor_round_trip,
    percentile,
    pin,
    running_daemon,
    serve_on_trio,
    server_process,
    victims_lateness,
)
from torch_side import file_timer_server, import_torch_timer

from watchdogd_client import Client, expires
from watchdogd_client.paths import Place
from watchdogd_client.trust import vet
from watchdogd_protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    Hello,
    Release,
    Released,
    decode_reply,
    decode_request,
)
from watchdogd_protocol.frames import FrameReader, encode_frame, encode_frame_into

#: The burst of the issue's measurement: deadlines due within 10 ms, others armed.
BURST = 3_000
OTHERS = 200_000
#: Blocks whose torch request was dropped (its FIFO full), over the whole run.
TORCH_DROPPED = [0]


def process_cpu() -> float:
    """CPU seconds of this whole process so far, every thread's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def blocks(
    block: Callable[[], None],
    count: int,
    server: int,
    server_cpu: Callable[[int], float] = cpu_seconds,
) -> tuple[float, float, float]:
    """Run ``block`` ``count`` times on the worker's CPU: wall seconds, this
    process's CPU seconds and the server process's CPU seconds (``server_cpu``
    of its pid), per block."""
    pin(CLIENT_CPU)
    for _ in range(min(count, 300)):
        block()
    wall, cpu, served = time.perf_counter(), process_cpu(), server_cpu(server)
    for _ in range(count):
        block()
    return (
        (time.perf_counter() - wall) / count,
        (process_cpu() - cpu) / count,
        (server_cpu(server) - served) / count,
    )


def watchdogd_block() -> None:
    with expires(after=60):
        pass


def bare_blocks(sock: socket.socket, count: int) -> float:
    """Wall seconds per empty block of a bare worker on ``sock`` (greeted): each
    block's acquire goes in one ``send(2)`` with the release of the block before,
    and the worker reads until both are answered. The last block's release goes
    alone at the end."""
    pin(CLIENT_CPU)
    reader = FrameReader(1 << 20)
    ids = itertools.count(1)

    def exchange(release: int, acquire: bool) -> int:
        """Send the release of arming ``release`` (0: none) and, with ``acquire``,
        an acquire together, and read both answers; the number the daemon gave
        the new arming (0: none made)."""
        frames: list[Acquire | Release] = (
            [Release(id=next(ids), scope="bare", arm=release)] if release else []
        )
        if acquire:
            frames.append(Acquire(id=next(ids), scope="bare", timeout=60.0))
        sock.sendall(b"".join(encode_frame(frame) for frame in frames))
        answers, last = len(frames), b""
        while answers > 0:
            read = reader.feed(sock.recv(65536))
            answers -= len(read)
            last = read[-1] if read else last
        if not acquire:
            return 0
        answer = decode_reply(last)  # the acquire's, sent last
        assert isinstance(answer, Acquired), answer
        return answer.arm

    warm = min(count, 300)
    arm = 0
    for _ in range(warm):
        arm = exchange(arm, True)
    started = time.perf_counter()
    for _ in range(count):
        arm = exchange(arm, True)
    elapsed = time.perf_counter() - started
    exchange(arm, False)
    return elapsed / count


@contextmanager
def bare_worker(socket_path: Path) -> Iterator[socket.socket]:
    """A connection to the daemon at ``socket_path``, greeted, for `bare_blocks`."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(socket_path))
        sock.sendall(encode_frame(Hello(id=0, version=PROTOCOL_VERSION)))
        reader = FrameReader(1 << 20)
        while not reader.feed(sock.recv(65536)):
            pass
        yield sock


def least_server(directory: Path) -> AbstractContextManager[socket.socket]:
    """A process on the servers' CPU answering acquires and releases with the least
    an acknowledging server does on trio, its journal in ``directory``; the
    worker's end of its socket."""

    def serve(conn: socket.socket) -> None:
        journal = os.open(directory / "least.journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        trio.run(serve_on_trio, conn, _LeastServer(journal))

    return server_process(serve)


class _LeastServer:
    """The answers of the least acknowledging server, its journal the file ``journal``."""

    def __init__(self, journal: int) -> None:
        self.journal = journal
        self.reader = FrameReader(1 << 20)
        self.encoder = msgspec.msgpack.Encoder()
        self.timers: dict[str, tuple[float, int]] = {}
        self.deadlines: list[tuple[float, str]] = []
        #: It numbers armings, as the daemon does.
        self.arms = itertools.count(1)

    def __call__(self, data: bytes) -> bytes:
        now = trio.current_time()
        out = bytearray()
        changes: list[tuple[str, float | None]] = []
        for frame in self.reader.feed(data):
            request = decode_request(frame)
            if isinstance(request, Acquire):
                deadline, arm = now + request.timeout, next(self.arms)
                self.timers[request.scope] = (deadline, arm)
                heapq.heappush(self.deadlines, (deadline, request.scope))
                changes.append((request.scope, deadline))
                reply: Acquired | Released = Acquired(
                    id=request.id, remaining=request.timeout, arm=arm, rearmed=False
                )
            else:
                assert isinstance(request, Release)
                found = self.timers.pop(request.scope, None) is not None
                changes.append((request.scope, None))
                reply = Released(id=request.id, found=found)
            encode_frame_into(reply, out)
        if len(self.deadlines) > 1_000:
            self.deadlines.clear()  # nothing here ever falls due: keep the heap small
        os.write(self.journal, self.encoder.encode(changes))
        return bytes(out)


@contextmanager
def torch_system(timer: ModuleType, directory: Path) -> Iterator[tuple[Callable[[], None], int]]:
    """An empty block through torch's ``expires`` and ``FileTimerClient``, and the pid
    of the FileTimerServer's process."""
    with file_timer_server(timer, directory) as system:
        client = system.new_client()

        def block() -> None:
            # torch's client drops a request when the FIFO is full, raising: a
            # block that raised is counted (and cost what it cost), not retried.
            try:
                with timer.expires(after=60, client=client):
                    pass
            except BlockingIOError:
                TORCH_DROPPED[0] += 1

        yield block, system.pid


def burst_figures(directory: Path, victims: int, others: int, rounds: int) -> list[str]:
    """The burst with the state on against the bare loop, ``rounds`` of each: one
    daemon holding ``others`` timers fires a new burst each round, the bare loop
    runs beside it in the same round (before it in one round, after it in the
    next, so neither gains from going first). Ratios are taken within a round."""
    config = events_config(directory)
    rows: dict[str, list[float]] = {}
    with running_daemon(directory, "--config", str(config)) as (path, _, _):
        arm_many(path, others, "other")
        with Client(path) as client:
            for number in range(rounds):
                if number % 2:
                    bare = burst_floor(victims, others)
                    late = daemon_burst(client, victims, f"burst-{number}")
                else:
                    late = daemon_burst(client, victims, f"burst-{number}")
                    bare = burst_floor(victims, others)
                for tag, fraction in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
                    ours, least = percentile(late, fraction), percentile(bare, fraction)
                    rows.setdefault(f"{tag} ours", []).append(ours)
                    rows.setdefault(f"{tag} bare", []).append(least)
                    rows.setdefault(f"{tag} ratio", []).append(ours / least)
    lines = [f"burst, state on: {rounds} rounds beside the bare loop; median (min-max)"]
    for tag in ("p50", "p99", "max"):
        lines.append(
            f"burst {tag}: deadline -> first signal {spread(rows[f'{tag} ours'], 1e3)} ms"
            f"  bare loop {spread(rows[f'{tag} bare'], 1e3)} ms"
            f"  x {spread(rows[f'{tag} ratio'], 1)}"
        )
    return lines


def daemon_burst(client: Client, victims: int, scope: str) -> list[float]:
    """Arm ``victims`` new sleeping processes to fall due within 10 ms; each
    one's lateness from deadline to first signal, as the daemon recorded it."""
    return victims_lateness(client, victims, scope, lambda pids: arm_burst(client, pids, scope))


def connection_figures(socket_path: Path, count: int) -> dict[str, float]:
    """Seconds per new connection of a worker to the daemon at ``socket_path`` (a
    root-owned directory others may not write to, which each kind of path accepts):
    a new client's first ping, connect(2) alone, and the judgement of the socket
    alone."""
    pin(CLIENT_CPU)
    path = str(socket_path)

    def first_ping() -> None:
        with Client(path) as client:
            client.ping()

    def connect() -> None:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)

    def judged(place: Place, sock: socket.socket) -> Callable[[], None]:
        def judge() -> None:
            with vet(place) as vetted:
                vetted.admit(sock)

        return judge

    figures = {}
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        runs = [
            ("new client: connect, judge, hello, ping", first_ping),
            ("new connection: connect(2) alone", connect),
        ] + [
            (f"new connection: the judgement, {origin} path", judged(Place(path, origin), sock))
            for origin in ("named", "user", "host")
        ]
        for name, run in runs:
            for _ in range(min(count, 300)):
                run()
            started = time.perf_counter()
            for _ in range(count):
                run()
            figures[name] = (time.perf_counter() - started) / count
    return figures


def spread(values: list[float], scale: float = 1e6) -> str:
    return (
        f"{statistics.median(values) * scale:9.1f}"
        f"  ({min(values) * scale:.1f}-{max(values) * scale:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a smoke test")
    options = parser.parse_args()
    rounds = 4 if options.quick else 9
    count = 500 if options.quick else 3_000
    timer = import_torch_timer()
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    print(f"cpus: {os.cpu_count()}, servers on CPU 0, the worker on CPU {CLIENT_CPU}")
    with ExitStack() as stack:
        echo = stack.enter_context(echo_server())
        trio_echo = stack.enter_context(echo_server(on_trio=True))
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wd-bench-")))
        (directory / "on").mkdir()
        # Every server is forked here, before the client library starts a thread.
        least = stack.enter_context(least_server(directory))
        socket_path, _, daemon = stack.enter_context(running_daemon(directory / "on"))
        bare = stack.enter_context(bare_worker(socket_path))
        os.environ["WATCHDOGD_SOCKET"] = str(socket_path)
        torch_block = None
        if timer is not None:
            torch_dir = directory / "torch"
            torch_dir.mkdir()
            torch_block, torch_server = stack.enter_context(torch_system(timer, torch_dir))
        for _ in range(rounds):
            raw = floor_round_trip(echo, count)
            trio = floor_round_trip(trio_echo, count)
            wall, cpu, served = blocks(watchdogd_block, count, daemon)
            add("raw echo round trip", raw)
            add("trio echo round trip", trio)
            add("watchdogd: worker wall per block", wall)
            add("watchdogd: worker CPU per block", cpu)
            add("watchdogd: daemon CPU per block", served)
            add("watchdogd: block / trio echo", wall / trio)
            bare_daemon = bare_blocks(bare, count)
            bare_least = bare_blocks(least, count)
            add("bare worker, watchdogd's daemon: wall per block", bare_daemon)
            add("bare worker, watchdogd's daemon / trio echo", bare_daemon / trio)
            add("bare worker, least acknowledging server: wall", bare_least)
            add("bare worker, least acknowledging server / trio echo", bare_least / trio)
            for name, seconds in connection_figures(socket_path, count).items():
                add(name, seconds)
            if torch_block is not None:
                wall, cpu, served = blocks(torch_block, count, torch_server)
                add("torch FileTimer: worker wall per block", wall)
                add("torch FileTimer: worker CPU per block", cpu)
                add("torch FileTimer: server CPU per block", served)
    print(f"{rounds} rounds of {count:,} each, interleaved; median (min-max)")
    for name, values in rows.items():
        if name.endswith("/ trio echo"):
            print(f"{name:<52} {spread(values, 1):>9}  x")
        else:
            print(f"{name:<52} {spread(values)} us")
    if timer is None:
        print("torch FileTimer: skipped (torch is not installed)")
    else:
        total = rounds * (count + min(count, 300))
        print(f"torch FileTimer: {TORCH_DROPPED[0]:,} of {total:,} blocks raised (FIFO full)")
    victims, others = (300, 20_000) if options.quick else (BURST, OTHERS)
    with tempfile.TemporaryDirectory(prefix="wd-bench-") as burst_dir:
        for row in burst_figures(Path(burst_dir), victims, others, 2 if options.quick else 6):
            print(row)


if __name__ == "__main__":
    main()
