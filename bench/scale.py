"""watchdogd at scale: memory per timer and status pages with a million timers, each
figure printed with its ratio to a baseline measured in the same run.

Figures:
- the daemon's RSS per armed timer (VmRSS less an empty daemon's, both read after
  READY), timers on 1,000 live processes with scopes of a dozen bytes: 100,000
  armed by requests through the socket, without state (the baseline) and with
  it (its store holds up to a journal's worth of changes, 8 MiB, until it folds
  them into the database: a fixed cost, a large share of it at this size); and
  100,000 and 1,000,000 loaded from a state file at start. Loading is how the
  large figure is taken (arming a million through the socket takes minutes:
  ``--arm-large`` does it too, the check that loading is a fair stand-in);
- the daemon's memory per fast-path registration (`registration_memory`): 100
  processes registering 100 scopes each, its VmRSS, RssAnon and RssShmem growth
  per registration, and the memory the slot pages hold (their memfds' allocated
  bytes, counted once); and 100 processes of one each, so that what a further
  registration adds is told apart from what a process's first brings (its
  connections, its page). RssAnon and the pages' memory together, beside the
  bound on a timer's memory (`TIMER_BOUND`): what a registration costs the host
  (RssShmem is the pages' memory again, as the daemon maps it);
- a root status page of 1,000 timers with 1,000,000 armed, the first one and one
  half-way through by cursor, against the first page with 1,000 armed; the first
  also once the daemon's command lines are stale (it reads each from /proc again,
  some 10 µs a process, and the page spans 1,000 processes);
- a non-root status (100 timers of its own) with 1,000,000 of root's armed, against
  the same with none of root's: its cost must follow its own timers;
- ``watchdogctl status`` (every page, printed) with 100,000 timers armed, against
  ``watchdogctl ping``;
- the start (to READY) on the state of 1,000,000 timers with the record of what
  happened full (1,000 events, 100 incidents of 64 ranks with 64 KiB stacks: some
  400 MiB), against the same start with no record, and the RSS that adds;
- the longest step of the loop's task that writes that record whole again, against
  the framing of its largest record alone: how long a due timer's signal may wait.

The daemon runs on CPU 0 and clients on CPU 1, as in bench/run.py. Run with
``make bench``; ``--quick`` loads 200,000 timers where the full run loads a million
(``--small`` and ``--large`` set both sizes); ``--memory`` takes the memory
figures alone.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import trio
import trio.lowlevel
from run import CLIENT_CPU, SERVER_CPU, Figure, pin

from watchdogd.core.events import EventLog
from watchdogd.core.incidents import IncidentLog, StoredIncident
from watchdogd.core.timers import Timer
from watchdogd.host.process import read_start_time
from watchdogd.storage.record_file import RecordFile, record_path
from watchdogd.storage.store import Store
from watchdogd_client import Client
from watchdogd_protocol import EventInfo, IncidentInfo, RankInfo, StepResult
from watchdogd_protocol.slot_page import SLOTS

HOLDERS = 1_000
#: The most a timer may cost the daemon at a million (a registration of the fast
#: path with its share of its page: the figures set beside it).
TIMER_BOUND = 300
TIMEOUT = 3600.0
PAGE = 1_000
#: The uid of the non-root caller (nobody).
NOBODY = 65534


def rss(pid: int) -> int:
    """Resident bytes of ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cold_and_warm(call: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Seconds of one status page ``call`` once the daemon's command lines are
    stale (a second after its last page: each is read from /proc again), and the
    median of ``rounds`` calls right after (read once a second at most)."""
    settle_collector()
    time.sleep(1.1)
    started = time.perf_counter()
    call()
    cold = time.perf_counter() - started
    return cold, median_time(call, rounds)


def median_time(call: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``call`` over ``rounds`` calls, after one to warm up."""
    settle_collector()
    call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def settle_collector() -> None:
    """Take what this process holds out of its collector's way before a call is
    timed: the time is the daemon's, and a collection of this process's own heap
    (the states it wrote, a thousand holders) that falls in the middle of a call
    would be timed with it, tens of milliseconds that come and go from run to run."""
    gc.collect()
    gc.freeze()


class Holders:
    """Live processes to hold timers, and their start times."""

    def __init__(self, count: int) -> None:
        self.processes = [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]
        self.starts = [read_start_time(process.pid) for process in self.processes]

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def deadline_of(index: int, base: float) -> float:
    """The deadline of the ``index``-th timer of a written state: timers armed
    10 µs apart, as requests arm them (so no two share a deadline)."""
    return base + index * 1e-5 + TIMEOUT


def write_state(path: Path, count: int, holders: Holders, base: float) -> None:
    """A state file with ``count`` timers, as the daemon writes them, on the holders
    in turn."""
    store, _ = Store.open(str(path))
    for index in range(count):
        slot = index % len(holders.processes)
        armed = base + index * 1e-5
        store.put(
            Timer(deadline=armed + TIMEOUT, pid=holders.processes[slot].pid,
                  scope=f"scope-{index}", policy="kill", uid=0, owner=0, timeout=TIMEOUT,
                  armed_at=armed, start_time=holders.starts[slot])
        )  # fmt: skip
    store.write_now()
    store.close()


@contextmanager
def ready_daemon(state: Path | None, socket_path: Path) -> Iterator[int]:
    """A daemon on ``state`` (None: ``--no-state``), from its sd_notify READY=1 to
    the end of the block. Its cap on timers is raised above the default million,
    which a non-root caller's own timers come on top of."""
    directory = socket_path.parent
    config = directory / "watchdogd.toml"
    # The registrations of `registration_memory` count against their uid's limit.
    config.write_text("[daemon]\nmax_timers = 2_000_000\nmax_timers_per_uid = 100_000\n")
    notify_path = directory / "notify.sock"
    notify_path.unlink(missing_ok=True)
    keep = ["--no-state"] if state is None else ["--state", str(state)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(600)
        daemon = subprocess.Popen(
            [sys.executable, "-m", "watchdogd", "--socket", str(socket_path), *keep,
             "--config", str(config), "--log-level", "warning"],
            env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
        )  # fmt: skip
        pin(SERVER_CPU, daemon.pid)
        try:
            while b"READY=1" not in notify.recv(4096):
                pass
            yield daemon.pid
        finally:
            daemon.terminate()
            daemon.wait()


def loaded_daemon(directory: Path, count: int, holders: Holders, base: float) -> Path:
    """A state file of ``count`` timers, started on once so that its journal is
    folded into the database (a later start reads the database, as a restart does)."""
    state = directory / f"state-{count}.db"
    write_state(state, count, holders, base)
    written = Path(f"{state}.journal.1")
    with ready_daemon(state, directory / "fold.sock"):
        deadline = time.monotonic() + 600
        while written.exists():  # the fold, after READY, removes it once done
            if time.monotonic() > deadline:
                raise RuntimeError(f"{written} was not folded")
            time.sleep(0.1)
    return state


def full_record(path: Path) -> None:
    """The record of what happened with the default rings full: 1,000 events (a
    dump's output each) and 100 incidents of 64 ranks with 64 KiB stacks."""
    events, incidents = EventLog(1000), IncidentLog("bench", keep=100)
    output = "    frame (file.py:1)\n" * 40
    for index in range(1000):
        steps = [StepResult(step="dump", result="exit 0", output=output)]
        events.record(
            EventInfo(seq=0, kind="expired", time=1.0, pid=1000 + index, uid=0, scope="s",
                      policy="kill", outcome="killed", steps=steps)
        )  # fmt: skip
    stack = 'Thread 1 (idle): "MainThread"\n' + "    wait (x.py:1)\n" * 3800
    stored = [
        StoredIncident(
            IncidentInfo(id=f"bench-{number}", job=f"job-{number}", user="root", uid=0,
                         host="bench", scope="s", reason="timeout", time=1.0, rank=0),
            [RankInfo(host="bench", pid=10_000 + rank, uid=0, role="peer", scope="s",
                      rank=rank, state="done", stack=stack[: 64 * 1024], frame="wait (x.py:1)")
             for rank in range(64)],
            2.0, True, [],
        )
        for number in range(100)
    ]  # fmt: skip
    incidents.restore(stored, wall=3.0)
    record = RecordFile(str(path), events, incidents)
    record.write_now()
    record.close()


class _LongestStep(trio.abc.Instrument):
    """The longest step of the record's task."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._began = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("RecordFile.run"):
            self.longest = max(self.longest, time.perf_counter() - self._began)


def whole_write(full: Path, path: Path) -> tuple[float, float, int]:
    """Seconds of the longest step of the loop's task that writes the record
    ``full`` whole again (to ``path``, on the daemon's CPU): what a due timer's
    signal may wait for meanwhile; the framing of its largest record alone (its
    encoding and checksum); and the most memory the write holds at once, traced
    in a second write (tracing slows it: not the one timed)."""
    events, incidents = EventLog(1000), IncidentLog("bench", keep=100)
    RecordFile(str(full), events, incidents).load()
    largest = max(incidents.everything(), key=lambda incident: len(incident.ranks))
    framing = median_time(lambda: zlib.crc32(msgspec.msgpack.encode(largest)), 5)
    steps = _LongestStep()
    pin(SERVER_CPU)
    try:
        _written_whole(RecordFile(str(path), events, incidents), path, steps)
        path.unlink()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            _written_whole(RecordFile(str(path), events, incidents), path, None)
            held = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    finally:
        pin(CLIENT_CPU)
    return steps.longest, framing, held


def _written_whole(record: RecordFile, path: Path, steps: _LongestStep | None) -> None:
    """``record`` (never read: it writes whole) written to ``path``, then closed."""

    async def write() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(record.run)
            while not path.exists():
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(write, instruments=[] if steps is None else [steps])
    finally:
        record.close()


def started(state: Path, socket_path: Path) -> tuple[float, int]:
    """Seconds from the daemon's start to its READY on ``state``, and its RSS then."""
    began = time.monotonic()
    with ready_daemon(state, socket_path) as pid:
        return time.monotonic() - began, rss(pid)


def armed_rss(state: Path | None, socket_path: Path, count: int, holders: Holders) -> float:
    """The daemon's RSS per timer, less an empty daemon's of the same kind, with
    ``count`` timers armed by root through the socket, on the holders in turn."""
    if state is not None:
        Store.open(str(state))[0].close()
    with ready_daemon(state, socket_path) as pid:
        empty = rss(pid)
        with Client(socket_path) as client:
            pids = [process.pid for process in holders.processes]
            for index in range(count):
                client.acquire(f"scope-{index}", TIMEOUT, pid=pids[index % len(pids)])
        time.sleep(2)  # a fold the arming started ends
        return (rss(pid) - empty) / count


def non_root_status(socket_path: Path, timers: int, rounds: int) -> float | None:
    """Median seconds of one status page for uid nobody, holding ``timers`` timers
    on itself; None when this bench cannot change uid (not run as root)."""
    if os.geteuid() != 0:
        return None
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # nobody
        os.close(reader)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            pin(CLIENT_CPU)
            with Client(socket_path) as client:
                for index in range(timers):
                    client.acquire(f"mine-{index}", TIMEOUT)
                page = client.status_page(limit=PAGE)
                assert len(page.timers) == timers, len(page.timers)
                seconds = median_time(lambda: client.status_page(limit=PAGE), rounds)
            os.write(writer, repr(seconds).encode())
        except BaseException as exc:
            os.write(writer, f"error: {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as result:
        answer = result.read()
    os.waitpid(child, 0)
    if not answer or answer.startswith("error"):
        raise RuntimeError(f"the non-root client failed: {answer}")
    return float(answer)


def ctl(socket_path: Path, *command: str) -> float:
    """Seconds ``watchdogctl`` takes for ``command``, output discarded (median of 3)."""
    watchdogctl = Path(sys.executable).parent / "watchdogctl"

    def run() -> None:
        subprocess.run(
            [str(watchdogctl), "--socket", str(socket_path), *command],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    pin(CLIENT_CPU)
    return median_time(run, 3)


#: The memfd name of a slot page, as /proc/PID/fd shows it (`watchdogd.host.slot_pages`).
SLOT_PAGE_LINK = "/memfd:watchdogd-slots (deleted)"


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of ``pid``, in bytes."""
    found = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem"):
                found[name] = int(value.split()[0]) * 1024
    return found


def page_bytes() -> tuple[int, int]:
    """This process's slot pages: how many, and the bytes the kernel holds for them
    (the allocated ranges of each page's memfd: tmpfs allocates a page of memory
    at its first write)."""
    pages, total = 0, 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") != SLOT_PAGE_LINK:
                continue
            page = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
            try:
                total += allocated(page)
                pages += 1
            finally:
                os.close(page)
    return pages, total


def allocated(fd: int) -> int:
    """Bytes of ``fd``'s file that hold data, by SEEK_DATA and SEEK_HOLE."""
    total, offset, size = 0, 0, os.fstat(fd).st_size
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past ``offset``
            break
        offset = os.lseek(fd, start, os.SEEK_HOLE)
        total += offset - start
    return total


def registered(socket_path: Path, scopes: int, ready: int, go: int) -> None:
    """In a worker: register ``scopes`` scopes for the fast path (the first block of
    each arms over the socket and is granted a slot; its release is a store, which
    records its duration in the slot's counts), say how many bytes its pages hold,
    and keep them until ``go`` closes."""
    with Client(socket_path) as client:
        for index in range(scopes):
            with client.expires(60, scope=f"registered-{index}"):
                pass
        pages, held = page_bytes()
        os.write(ready, f"{pages} {held}\n".encode())
        os.read(go, 1)


def registration_memory(socket_path: Path, processes: int, scopes: int) -> tuple[float, ...]:
    """A daemon without state, ``processes`` worker processes registering ``scopes``
    scopes each: the daemon's growth of VmRSS, RssAnon and RssShmem, and the bytes
    the pages hold (counted once, from the workers), each per registration."""
    with ready_daemon(None, socket_path) as pid:
        before = memory_of(pid)
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        children = []
        for _ in range(processes):
            child = os.fork()
            if child == 0:
                try:
                    os.close(ready_r)
                    os.close(go_w)
                    pin(CLIENT_CPU)
                    registered(socket_path, scopes, ready_w, go_r)
                finally:
                    os._exit(0)
            children.append(child)
        os.close(ready_w)
        os.close(go_r)
        with os.fdopen(ready_r) as ready:
            found = [tuple(map(int, ready.readline().split())) for _ in range(processes)]
            time.sleep(1)  # a look at each slot, a harvest of its counts
            after = memory_of(pid)
            os.close(go_w)
        for child in children:
            os.waitpid(child, 0)
    count, wanted = processes * scopes, processes * -(-scopes // SLOTS)
    pages = sum(held for _, held in found)
    if sum(mapped for mapped, _ in found) != wanted:
        raise RuntimeError(f"{found} pages mapped where {wanted:,} were due: not registered")
    return (
        *((after[key] - before[key]) / count for key in ("VmRSS", "RssAnon", "RssShmem")),
        pages / count,
    )


def registration_figures(socket_path: Path, per_timer: float) -> list[Figure]:
    """Memory per fast-path registration, 10,000 of them on 100 processes, against
    a timer armed by requests without state (``per_timer`` bytes) and against the
    bound on the memory of a timer (`TIMER_BOUND`), pages included; and what a
    registration adds to its process's first, from 100 processes of one each."""
    ones = registration_memory(socket_path, 100, 1)
    many = registration_memory(socket_path, 100, 100)
    rss, anon, shmem, pages = many
    marginal = (many[1] * 100 - ones[1]) / 99  # the anonymous memory per further one
    note = "x a timer armed by requests, --no-state"
    bound = f"x the bound of {TIMER_BOUND} B a timer"
    return [
        Figure("fast path: memory per registration, 100 x 100", anon + pages, "B",
               (anon + pages) / TIMER_BOUND,
               f"{bound}; the daemon's RssAnon and the pages' memory, connections included"),
        Figure("fast path: memory per further registration", marginal + pages, "B",
               (marginal + pages) / TIMER_BOUND,
               f"{bound}; RssAnon (100 x 100 - 100 x 1) / 9,900, and the pages' memory"),
        Figure("fast path: daemon RSS per registration, 100 x 100", rss, "B",
               rss / per_timer, f"{note}; connections and pages included"),
        Figure("fast path: daemon RssAnon per registration, 100 x 100", anon, "B",
               anon / per_timer, note),
        Figure("fast path: daemon RssAnon per further registration", marginal, "B",
               marginal / per_timer, f"{note}; (100 x 100 - 100 x 1) / 9,900"),
        Figure("fast path: daemon RssShmem per registration, 100 x 100", shmem, "B",
               shmem / per_timer, "the pages as the daemon maps them"),
        Figure("fast path: page memory per registration, 100 x 100", pages, "B",
               pages / per_timer, "the memfds' allocated bytes, counted once"),
        Figure("fast path: daemon RSS per registration, 100 x 1", ones[0], "B",
               ones[0] / per_timer, f"{note}; a process's first: its connections, its page"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200,000 timers at most")
    parser.add_argument("--small", type=int, default=100_000, help="the smaller size")
    parser.add_argument("--large", type=int, default=1_000_000, help="the larger size")
    parser.add_argument(
        "--arm-large",
        action="store_true",
        help="also arm the larger size through the socket (minutes at a million)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="the memory figures alone: per timer, armed and loaded, and per registration",
    )
    options = parser.parse_args()
    small, large = options.small, 200_000 if options.quick else options.large
    rounds = 21
    figures: list[Figure] = []
    holders = Holders(HOLDERS)
    base = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="wd-scale-") as name:
            directory = Path(name)
            directory.chmod(0o755)  # nobody connects to the socket inside
            empty = directory / "empty.db"
            Store.open(str(empty))[0].close()
            sock = directory / "wd.sock"

            pin(CLIENT_CPU)
            with ready_daemon(empty, sock) as pid:
                empty_rss = rss(pid)
                alone = non_root_status(sock, 100, rounds)
            figures.append(Figure("RSS, empty daemon", empty_rss / 2**20, "MiB", 1.0, ""))

            armed = armed_rss(None, sock, small, holders)
            figures.append(
                Figure(f"RSS per timer, {small:,} armed by requests, --no-state", armed,
                       "B", 1.0, f"on {HOLDERS:,} processes; the memory baseline")
            )  # fmt: skip
            figures += registration_figures(sock, armed)
            if options.memory:
                state = loaded_daemon(directory, large, holders, base)
                with ready_daemon(state, sock) as pid:
                    figures.append(loaded_figure(rss(pid) - empty_rss, large, armed, small))
                print_figures(figures)
                return
            sizes = [small, large] if options.arm_large else [small]
            for size in sizes:
                durable = armed_rss(directory / f"armed-{size}.db", sock, size, holders)
                figures.append(
                    Figure(f"RSS per timer, {size:,} armed by requests, durable state",
                           durable, "B", durable / armed,
                           "x --no-state; the store holds <= 8 MiB of changes until a fold")
                )  # fmt: skip

            one_page = loaded_daemon(directory, PAGE, holders, base)
            with ready_daemon(one_page, sock), Client(sock) as client:
                alone_cold, alone_warm = cold_and_warm(
                    lambda: client.status_page(limit=PAGE), rounds
                )
            for what, seconds in (("command lines read", alone_cold), ("", alone_warm)):
                figures.append(
                    Figure(f"root status page of {PAGE:,}, {PAGE:,} armed{what and ', '}{what}",
                           seconds * 1e3, "ms", 1.0, f"the page baseline; {HOLDERS:,} processes")
                )  # fmt: skip

            state = loaded_daemon(directory, small, holders, base)
            with ready_daemon(state, sock) as pid:
                loaded = (rss(pid) - empty_rss) / small
                figures.append(
                    Figure(f"RSS per timer, {small:,} loaded from the state", loaded, "B",
                           loaded / armed, "x armed by requests, --no-state")
                )  # fmt: skip
                ping = ctl(sock, "ping")
                status = ctl(sock, "status")
                figures.append(
                    Figure("watchdogctl ping", ping, "s", 1.0, "the command-line baseline")
                )
                figures.append(
                    Figure(f"watchdogctl status, {small:,} armed", status, "s",
                           status / ping, f"x ping; every page, {small:,} rows printed")
                )  # fmt: skip

            state = loaded_daemon(directory, large, holders, base)
            with ready_daemon(state, sock) as pid:
                figures.append(loaded_figure(rss(pid) - empty_rss, large, armed, small))
                with Client(sock) as client:
                    first_cold, first = cold_and_warm(
                        lambda: client.status_page(limit=PAGE), rounds
                    )
                    middle = large // 2
                    cursor = f"{deadline_of(middle, base)!r}/0"
                    page = client.status_page(limit=PAGE, cursor=cursor)
                    assert page.timers[0].scope == f"scope-{middle + 1}", page.timers[0]
                    later = median_time(
                        lambda: client.status_page(limit=PAGE, cursor=cursor), rounds
                    )
                for what, seconds, baseline in (
                    ("first, command lines read", first_cold, alone_cold),
                    ("first", first, alone_warm),
                    ("half-way, by cursor", later, alone_warm),
                ):
                    figures.append(
                        Figure(f"root status page of {PAGE:,}, {large:,} armed, {what}",
                               seconds * 1e3, "ms", seconds / baseline,
                               f"x the page with {PAGE:,} armed")
                    )  # fmt: skip
                crowded = non_root_status(sock, 100, rounds)
            # Interleaved, the median of three each: the record added, then taken away.
            record = Path(record_path(str(state)))
            full_record(Path(f"{record}.full"))
            runs: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
            for with_record in (False, True) * 3:
                if with_record:
                    record.write_bytes(Path(f"{record}.full").read_bytes())
                else:
                    record.unlink(missing_ok=True)
                runs[with_record].append(started(state, sock))
            (bare, bare_rss), (full, full_rss) = (sorted(runs[key])[1] for key in (False, True))
            figures.append(
                Figure(f"start to READY, {large:,} timers, no record", bare, "s", 1.0,
                       "the start baseline")
            )  # fmt: skip
            figures.append(
                Figure(f"start to READY, {large:,} timers, record full", full, "s",
                       full / bare, "x no record; 1,000 events, 100 incidents x 64 x 64 KiB")
            )  # fmt: skip
            figures.append(
                Figure("RSS of the full record", (full_rss - bare_rss) / 2**20, "MiB",
                       (full_rss - bare_rss) / max(1, os.path.getsize(f"{record}.full")),
                       "x its file's size")
            )  # fmt: skip
            whole = directory / "whole.record"
            longest, framing, held = whole_write(Path(f"{record}.full"), whole)
            figures.append(
                Figure("a whole write of the full record: the loop's longest step",
                       longest * 1e3, "ms", longest / framing,
                       "x framing its largest record, an incident of 64 ranks")
            )  # fmt: skip
            figures.append(
                Figure("a whole write of the full record: the most memory it holds",
                       held / 2**20, "MiB", held / max(1, whole.stat().st_size),
                       "x the file's size (a part of it at a time)")
            )  # fmt: skip
            if alone is not None and crowded is not None:
                figures.append(
                    Figure("non-root status, 100 own timers, none of root's", alone * 1e3,
                           "ms", 1.0, "the non-root baseline")
                )  # fmt: skip
                figures.append(
                    Figure(f"non-root status, 100 own timers, {large:,} of root's",
                           crowded * 1e3, "ms", crowded / alone, "x with none of root's")
                )  # fmt: skip
    finally:
        holders.close()
    print_figures(figures)


def loaded_figure(grown: int, large: int, armed: float, small: int) -> Figure:
    """RSS per timer of a daemon that grew by ``grown`` bytes loading ``large``
    timers, against ``armed`` bytes per timer of ``small`` armed by requests."""
    loaded = grown / large
    return Figure(f"RSS per timer, {large:,} loaded from the state", loaded, "B",
                  loaded / armed, f"x armed by requests, --no-state ({small:,})")  # fmt: skip


def print_figures(figures: list[Figure]) -> None:
    width = max(len(f.name) for f in figures)
    print(f"{'figure':<{width}}  {'value':>12}  {'unit':<5} {'ratio':>8}  note")
    for f in figures:
        print(f"{f.name:<{width}}  {f.value:>12,.2f}  {f.unit:<5} {f.ratio:>8.2f}  {f.note}")


if __name__ == "__main__":
    main()
