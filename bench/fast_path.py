"""The fast path beside the socket path and its floors, in one run.

Servers (the echo processes, the daemons, torch's FileTimerServer) are pinned to
CPU 0, the worker to CPU 1, as in bench/worker.py. Three parts, each interleaved:

- what a block costs the worker, in rounds; each round measures, in turn, trio's
  echo round trip (the unit of the bounds), a bare loop that stores a deadline into
  a shared page (a sealed memfd mapped, as a slot page is) and clears it with two
  memoryview stores (the floor), then on one daemon with its state on: the
  module-level ``with expires(after=60): pass`` with its default scope and
  ``client.expires(60, scope=...)``, on the fast path and on the socket path
  (``Client(fast=False)``), the trio client's ``async with client.expires(after=60)``
  on the fast path, torch's own ``expires()`` through ``WatchdogdTimerClient`` and
  through a ``TimerClient`` whose acquire and release do nothing (torch's own cost),
  and torch's ``FileTimerClient`` writing to a ``FileTimerServer``. Wall time and
  CPU per block (this whole process, every thread of it), the daemon's CPU per
  block, and the frames the daemon counted per fast-path block (its request
  counter, less the observer's own ``metrics`` requests);
- the daemon's CPU per second while 1, 4 and 8 worker processes run tight loops of
  ``with expires(after=0.5): pass``, fast path on and off in turn (utime+stime of
  the daemon from /proc/PID/stat before and after);
- deadline -> SIGKILL of a hung block under churn: victims that run hundreds of
  blocks then hang in one, while 4 workers churn blocks, fast path on and off in
  turn (victims and churners alike), three runs of each: the daemon's own ``late``
  (deadline -> first signal, from its ``expired`` events) and the death as this
  process sees it through a pidfd.

Every figure is the median of its rounds, with the min-max; ratios are taken
within a round (a block against the echo of the same round), as this machine
drifts in speed from second to second. Run with ``make bench``; ``--quick``
shortens it; ``--part`` runs one part.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import select
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import trio
from run import (
    CLIENT_CPU,
    SERVER_CPU,
    cpu_seconds,
    echo_server,
    events_config,
    floor_round_trip,
    percentile,
    pin,
    running_daemon,
    wait_for_events,
)
from torch_side import fork, import_torch_timer
from worker import TORCH_DROPPED, blocks, process_cpu, torch_system

from watchdogd.host.timerfd import TimerFd
from watchdogd_client import Client, configure, expires
from watchdogd_client.trio import open_client
from watchdogd_protocol.slot_page import DEADLINE, PAGE_BYTES, word_of

#: The timeout of the load's and the churn's blocks, and of a victim's hung block.
SHORT = 0.5
#: Churning workers beside the victims.
CHURNERS = 4
#: Blocks a victim runs before the one it hangs in.
WARM_BLOCKS = 300


def cpu_of(pid: int) -> float:
    """Seconds on a CPU of every thread of ``pid`` so far, from the scheduler's own
    count in nanoseconds: a fast-path block's share of the daemon's CPU is far
    below /proc/PID/stat's clock tick."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def requests_seen(observer: Client) -> int:
    """Frames the daemon counted so far, but for the observer's ``metrics``."""
    total = 0
    for line in observer.metrics().splitlines():
        if line.startswith("watchdogd_requests_total{") and 'op="metrics"' not in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


class Rows:
    """Figures by name, one value a round, in the order first added."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def print(self, unit_of: Callable[[str], tuple[str, float]]) -> None:
        width = max(len(name) for name in self.values)
        for name, values in self.values.items():
            unit, scale = unit_of(name)
            print(f"{name:<{width}}  {spread(values, scale)}  {unit}")


def spread(values: list[float], scale: float) -> str:
    low, mid, high = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    digits = 3 if abs(mid) < 10 else 1
    return f"{mid:>10.{digits}f}  ({low:.{digits}f}-{high:.{digits}f})"


def store_floor(count: int) -> tuple[float, float]:
    """Seconds per iteration of the least a block can do on the fast path: a
    deadline stored into a word of a sealed memfd's mapping and cleared, two
    memoryview stores; and the same with the deadline taken from the clock."""
    pin(CLIENT_CPU)
    fd = os.memfd_create("bench-floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, PAGE_BYTES)
        mapping = mmap.mmap(fd, PAGE_BYTES)
    finally:
        os.close(fd)
    words = memoryview(mapping).cast("Q")
    at = word_of(0, DEADLINE)
    deadline = int(time.monotonic() * 1_000_000) + 60_000_000
    started = time.perf_counter()
    for _ in range(count):
        words[at] = deadline
        words[at] = 0
    stores = (time.perf_counter() - started) / count
    monotonic = time.monotonic
    started = time.perf_counter()
    for _ in range(count):
        words[at] = int(monotonic() * 1_000_000) + 60_000_000
        words[at] = 0
    clocked = (time.perf_counter() - started) / count
    words.release()
    mapping.close()
    return stores, clocked


def fast_module_block() -> None:
    with expires(after=60):
        pass


def socket_module_block() -> None:
    with expires(after=60):
        pass


def scoped_block(client: Client, scope: str) -> Callable[[], None]:
    def block() -> None:
        with client.expires(60, scope=scope):
            pass

    return block


def trio_blocks(socket_path: Path, count: int) -> tuple[float, float]:
    """Wall and CPU seconds per ``async with client.expires(after=60)`` block of the
    trio client on the fast path, in a trio run of its own (its first block
    registers the scope; a warm-up follows)."""

    async def run() -> tuple[float, float]:
        async with open_client(str(socket_path)) as client:
            for _ in range(min(count, 300)):
                async with client.expires(after=60):
                    pass
            wall, cpu = time.perf_counter(), process_cpu()
            for _ in range(count):
                async with client.expires(after=60):
                    pass
            return (time.perf_counter() - wall) / count, (process_cpu() - cpu) / count

    pin(CLIENT_CPU)
    return trio.run(run)


def torch_blocks(timer: ModuleType, client: Client) -> tuple[Callable[[], None], ...]:
    """Empty blocks of torch's own ``expires()``: through ``WatchdogdTimerClient``
    on ``client``, and through a ``TimerClient`` that does nothing."""
    from watchdogd_client.torch import WatchdogdTimerClient

    # torch is imported at run time, so its classes are untyped here.
    class Nothing(timer.TimerClient):  # type: ignore[misc, name-defined]
        """torch's own cost: a client whose calls do nothing."""

        def acquire(self, scope_id: str, expiration_time: float) -> None:
            pass

        def release(self, scope_id: str) -> None:
            pass

    adapter, nothing = WatchdogdTimerClient(client), Nothing()

    def ours() -> None:
        with timer.expires(after=60, client=adapter):
            pass

    def torchs() -> None:
        with timer.expires(after=60, client=nothing):
            pass

    return ours, torchs


class BlockRound:
    """Part 1's blocks of one run, each timed in turn, its figures into ``rows``."""

    def __init__(self, rows: Rows, daemon: int, observer: Client) -> None:
        self.rows, self.daemon, self.observer = rows, daemon, observer

    def block(
        self, name: str, block: Callable[[], None], count: int, echo: float, server: int = 0
    ) -> float:
        """Time ``block``: its wall and CPU per block, the CPU per block of its
        server (``server``, else the daemon), and the frames the daemon counted per
        block run (warm-up included); its wall per block."""
        before = requests_seen(self.observer)
        wall, cpu, served = blocks(block, count, server or self.daemon, cpu_of)
        frames = requests_seen(self.observer) - before
        self.rows.add(f"{name}: wall per block", wall)
        self.rows.add(f"{name}: worker CPU per block", cpu)
        self.rows.add(f"{name}: {'server' if server else 'daemon'} CPU per block", served)
        self.rows.add(f"{name}: wall / trio echo", wall / echo)
        self.rows.add(f"{name}: worker CPU / trio echo", cpu / echo)
        if not server:
            self.rows.add(f"{name}: frames per block", frames / (count + min(count, 300)))
        return wall

    def trio_block(self, socket_path: Path, count: int, echo: float) -> None:
        before = requests_seen(self.observer)
        wall, cpu = trio_blocks(socket_path, count)
        frames = requests_seen(self.observer) - before
        name = "fast, trio async with client.expires(after=60)"
        self.rows.add(f"{name}: wall per block", wall)
        self.rows.add(f"{name}: worker CPU per block", cpu)
        self.rows.add(f"{name}: wall / trio echo", wall / echo)
        self.rows.add(f"{name}: worker CPU / trio echo", cpu / echo)
        self.rows.add(f"{name}: frames per block", frames / (count + min(count, 300)))


def block_figures(
    socket_path: Path,
    daemon: int,
    trio_echo: Any,
    torch: tuple[ModuleType, Callable[[], None], int] | None,
    quick: bool,
) -> Rows:
    """Part 1 (see the module docstring), in rounds."""
    rounds, scale = (3, 10) if quick else (9, 1)
    many, few = 20_000 // scale, 2_000 // scale
    rows = Rows()
    fast, slow = Client(socket_path), Client(socket_path, fast=False)
    observer = Client(socket_path, fast=False)
    run = BlockRound(rows, daemon, observer)
    for _ in range(rounds):
        echo = floor_round_trip(trio_echo, few)
        stores, clocked = store_floor(10 * many)
        rows.add("trio echo: round trip", echo)
        rows.add("floor: two stores into a shared page", stores)
        rows.add("floor: the same, the deadline read from the clock", clocked)
        configure(fast)
        wall = run.block("fast, module expires(after=60)", fast_module_block, many, echo)
        rows.add("fast, module expires(after=60): wall / floor", wall / stores)
        run.block("fast, client.expires(60, scope=)", scoped_block(fast, "scoped"), many, echo)
        run.trio_block(socket_path, many // 2, echo)
        if torch is not None:
            ours, torchs = torch_blocks(torch[0], fast)
            adapter = run.block("torch expires, WatchdogdTimerClient", ours, few, echo)
            own = run.block("torch expires, a TimerClient doing nothing", torchs, few, echo)
            rows.add("torch adapter's extra over doing nothing: wall", adapter - own)
            rows.add("torch adapter's extra over doing nothing / trio echo", (adapter - own) / echo)
        configure(slow)
        run.block("socket, module expires(after=60)", socket_module_block, few, echo)
        run.block("socket, client.expires(60, scope=)", scoped_block(slow, "socket"), few, echo)
        configure(None)
        if torch is not None:
            run.block("torch FileTimerClient", torch[1], few, echo, server=torch[2])
    for client in (fast, slow, observer):
        client.close()
    print(f"part 1: what a block costs, {rounds} rounds interleaved; median (min-max)")
    return rows


def unit_of_block(name: str) -> tuple[str, float]:
    if name.endswith(("/ trio echo", "/ floor")):
        return "x", 1.0
    if name.endswith("frames per block"):
        return "frames", 1.0
    return "us", 1e6


def looper(socket_path: Path, fast: bool, ready: int, go: int, results: int) -> None:
    """A worker of part 2: tight loops of ``with expires(after=0.5): pass`` from the
    go until the time it reads there; then its count of blocks to ``results``."""
    client = Client(socket_path, fast=fast)
    configure(client)
    for _ in range(100):  # its scope registered, its page mapped
        with expires(after=SHORT):
            pass
    os.write(ready, b"x")
    stop = float(os.read(go, 64).decode())
    done = 0
    while time.monotonic() < stop:
        for _ in range(100):
            with expires(after=SHORT):
                pass
        done += 100
    os.write(results, f"{done}\n".encode())
    os.read(go, 1)  # exits after the bench read the daemon's CPU


def load_run(
    socket_path: Path, daemon: int, observer: Client, *, workers: int, fast: bool, seconds: float
) -> tuple[float, float, float]:
    """``workers`` processes in tight block loops for ``seconds``: the daemon's CPU
    seconds per second, the blocks per second of all of them, and the frames the
    daemon counted per block meanwhile."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    results_r, results_w = os.pipe()

    def worker() -> None:
        for fd in (ready_r, go_w, results_r):  # so that each end sees the others close
            os.close(fd)
        looper(socket_path, fast, ready_w, go_r, results_w)

    children = [fork(worker) for _ in range(workers)]
    for fd in (ready_w, go_r, results_w):
        os.close(fd)
    for _ in range(workers):
        os.read(ready_r, 1)
    frames, cpu = requests_seen(observer), cpu_seconds(daemon)
    stop = time.monotonic() + seconds
    for _ in range(workers):
        os.write(go_w, f"{stop!r}".ljust(64).encode())
    time.sleep(max(0.0, stop - time.monotonic()))
    cpu, frames = cpu_seconds(daemon) - cpu, requests_seen(observer) - frames
    with os.fdopen(results_r) as results:
        os.close(go_w)  # the workers exit
        done = sum(int(line) for line in results)
    for child in children:
        os.waitpid(child, 0)
    os.close(ready_r)
    return cpu / seconds, done / seconds, frames / max(done, 1)


def load_figures(quick: bool) -> Rows:
    """Part 2 (see the module docstring): fast and socket path in turn, round
    after round, each with 1, 4 and 8 workers, on one daemon with its state on."""
    rounds, seconds = (1, 1.5) if quick else (3, 4.0)
    rows = Rows()
    with (
        tempfile.TemporaryDirectory(prefix="wd-bench-") as directory,
        running_daemon(Path(directory)) as (socket_path, _, daemon),
    ):
        observer = Client(socket_path, fast=False)
        for _ in range(rounds):
            for workers in (1, 4, 8):
                for fast in (True, False):
                    path = "fast" if fast else "socket"
                    cpu, rate, frames = load_run(
                        socket_path,
                        daemon,
                        observer,
                        workers=workers,
                        fast=fast,
                        seconds=seconds,
                    )
                    rows.add(f"{workers} workers, {path}: daemon CPU", cpu)
                    rows.add(f"{workers} workers, {path}: blocks per second", rate)
                    rows.add(f"{workers} workers, {path}: daemon CPU per block", cpu / rate)
                    rows.add(f"{workers} workers, {path}: frames per block", frames)
        observer.close()
    print(
        f"part 2: the daemon under tight loops of expires(after={SHORT}), {rounds} rounds of "
        f"{seconds:g} s each, fast and socket in turn; median (min-max)"
    )
    return rows


def unit_of_load(name: str) -> tuple[str, float]:
    if name.endswith("daemon CPU"):
        return "% of one core", 100.0
    if name.endswith("blocks per second"):
        return "/s", 1.0
    if name.endswith("frames per block"):
        return "frames", 1.0
    return "us", 1e6


def churner(socket_path: Path, fast: bool) -> None:
    """Blocks of ``expires(after=0.5)`` until killed."""
    configure(Client(socket_path, fast=fast))
    while True:
        with expires(after=SHORT):
            pass


def victim(socket_path: Path, fast: bool, scope: str) -> None:
    """Hundreds of blocks of ``scope``, then one it hangs in."""
    client = Client(socket_path, fast=fast)
    for _ in range(WARM_BLOCKS):
        with client.expires(SHORT, scope=scope):
            pass
    with client.expires(SHORT, scope=scope):
        while True:
            time.sleep(3600)


@contextmanager
def churning(socket_path: Path, fast: bool) -> Iterator[None]:
    children = [fork(lambda: churner(socket_path, fast)) for _ in range(CHURNERS)]
    try:
        time.sleep(0.3)
        yield
    finally:
        for child in children:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def wake_floor(results: int) -> None:
    """The floor of part 3, on the daemon's CPU: a process that sleeps on a timerfd
    until deadlines 20 to 120 ms apart, as the daemon sleeps until its next look,
    and writes how late it woke each time to ``results`` at SIGTERM."""
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.__setitem__(0, True))
    timer, poller = TimerFd(), select.epoll()
    poller.register(timer.fileno(), select.EPOLLIN)
    late: list[str] = []
    while not stopping[0]:
        deadline = time.monotonic() + random.uniform(0.02, 0.12)
        timer.set(deadline)
        if poller.poll():
            late.append(repr(time.monotonic() - deadline))
            timer.clear()
    os.write(results, " ".join(late).encode())


@contextmanager
def floor_beside() -> Iterator[list[float]]:
    """`wake_floor` on the daemon's CPU for the block; its lateness in the list,
    once the block ends."""
    results_r, results_w = os.pipe()
    child = fork(lambda: wake_floor(results_w), SERVER_CPU)
    os.close(results_w)
    late: list[float] = []
    try:
        yield late
    finally:
        os.kill(child, signal.SIGTERM)
        with os.fdopen(results_r) as results:
            late += [float(value) for value in results.read().split()]
        os.waitpid(child, 0)


class KillRun:
    """One run of part 3: victims started 25 ms apart under churn."""

    def __init__(self, socket_path: Path, observer: Client, fast: bool, scope: str) -> None:
        self.socket_path, self.observer, self.fast, self.scope = socket_path, observer, fast, scope
        self.pidfds: dict[int, int] = {}
        #: When each victim was seen dead, in Unix seconds as the daemon's events
        #: give deadlines (a victim starved on the churners' CPU may die before it
        #: could say when it entered its hung block).
        self.died: dict[int, float] = {}

    def run(self, victims: int) -> tuple[list[float], list[float], list[float], int]:
        """Each victim's deadline -> first signal as the daemon recorded it, its
        deadline -> death seen here, the floor's lateness meanwhile, and how many
        victims were not seen dead within 10 s of their deadline."""
        after = self.observer.events(limit=1).last
        with churning(self.socket_path, self.fast), floor_beside() as floor:
            for _ in range(victims):
                pid = fork(lambda: victim(self.socket_path, self.fast, self.scope))
                self.pidfds[os.pidfd_open(pid)] = pid
                time.sleep(0.025)
            self.watch(victims)
        for pidfd, pid in self.pidfds.items():
            if pid not in self.died:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(pidfd)
        events = wait_for_events(self.observer, after, self.scope, len(self.died))
        deaths = [
            self.died[pid] - (event.deadline or 0.0)
            for pid, event in events.items()
            if pid in self.died
        ]
        late = [event.late or 0.0 for event in events.values()]
        return late, deaths, floor, victims - sum(death <= 10 for death in deaths)

    def watch(self, victims: int) -> None:
        """Each victim's death as a pidfd shows it, until all are dead, or for
        at most 60 s."""
        with select.epoll() as poller:
            for pidfd in self.pidfds:
                poller.register(pidfd, select.EPOLLIN)
            give_up = time.monotonic() + 60
            while len(self.died) < victims and (now := time.monotonic()) < give_up:
                for fd, _ in poller.poll(give_up - now):
                    self.died[self.pidfds[fd]] = time.time()
                    poller.unregister(fd)


def kill_figures(quick: bool) -> Rows:
    """Part 3 (see the module docstring): the fast and the socket path in turn,
    three runs of each, on one daemon with its state on."""
    runs, victims = (1, 20) if quick else (3, 100)
    rows = Rows()
    with tempfile.TemporaryDirectory(prefix="wd-bench-") as directory:
        config = events_config(Path(directory))
        with running_daemon(Path(directory), "--config", str(config)) as (socket_path, _, _):
            observer = Client(socket_path, fast=False)
            for number in range(runs):
                for fast in (True, False):
                    path = "fast" if fast else "socket"
                    scope = f"victim-{path}-{number}"
                    late, deaths, floor, lost = KillRun(socket_path, observer, fast, scope).run(
                        victims
                    )
                    for tag, fraction in (("p50", 0.5), ("p99", 0.99)):
                        sent, seen = percentile(late, fraction), percentile(deaths, fraction)
                        least = percentile(floor, fraction)
                        rows.add(f"{path}: deadline -> SIGKILL sent {tag}", sent)
                        rows.add(f"{path}: deadline -> death seen {tag}", seen)
                        rows.add(f"{path}: floor, a timerfd's wake-up late {tag}", least)
                        rows.add(f"{path}: SIGKILL sent {tag} / the floor's", sent / least)
                    rows.add(f"{path}: victims not dead within 10 s", lost)
            observer.close()
    print(
        f"part 3: {victims} victims a run hung after {WARM_BLOCKS} blocks of "
        f"expires({SHORT}), {CHURNERS} workers churning the same path, a timerfd's "
        f"sleeper on the daemon's CPU as the floor, {runs} runs of each in turn; "
        "median (min-max) of the runs"
    )
    return rows


def unit_of_kill(name: str) -> tuple[str, float]:
    if name.endswith("the floor's"):
        return "x", 1.0
    if name.endswith("10 s"):
        return "victims", 1.0
    return "ms", 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a smoke test")
    parser.add_argument("--part", type=int, choices=(1, 2, 3), help="run this part only")
    options = parser.parse_args()
    print(f"cpus: {os.cpu_count()}, servers on CPU {SERVER_CPU}, the worker on CPU {CLIENT_CPU}")
    pin(CLIENT_CPU)
    # Parts 2 and 3 fork their workers: before this process has threads of its own.
    parts = [
        (2, load_figures, unit_of_load),
        (3, kill_figures, unit_of_kill),
        (1, block_part, unit_of_block),
    ]
    for number, figures, unit_of in parts:
        if options.part in (None, number):
            print(f"load average before part {number}: {load_average()}")
            figures(options.quick).print(unit_of)


def load_average() -> str:
    """This machine's load average, which moves every figure here."""
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def block_part(quick: bool) -> Rows:
    """Part 1 with its servers: trio's echo, a daemon with its state on, and
    torch's FileTimerServer when torch is installed."""
    timer = import_torch_timer()
    with ExitStack() as stack:
        trio_echo = stack.enter_context(echo_server(on_trio=True))
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wd-bench-")))
        (directory / "on").mkdir()
        socket_path, _, daemon = stack.enter_context(running_daemon(directory / "on"))
        torch = None
        if timer is not None:
            (directory / "torch").mkdir()
            block, server = stack.enter_context(torch_system(timer, directory / "torch"))
            torch = (timer, block, server)
        rows = block_figures(socket_path, daemon, trio_echo, torch, quick)
    if timer is not None:
        print(f"torch FileTimer: {TORCH_DROPPED[0]:,} blocks raised (FIFO full)")
    return rows


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
