"""torch's FileTimerServer and watchdogd side by side, on one workload.

Each system gets the same load, round after round, the two taking turns (this
machine's speed drifts over seconds, and the comparison must not):

- 8 worker processes churn as fast as they can through torch's ``TimerClient`` calls,
  ``acquire(scope, time.time() + 60)`` then ``release(scope)``: ``FileTimerClient``
  writing to the server's FIFO, or ``WatchdogdTimerClient`` on a daemon;
- once they are running, 20 victim processes each arm a 1 s timer the same way and
  then hang; a victim whose arm call raised hangs all the same, its timer lost.

The FileTimerServer is set up as torchrun's agent sets it up (``max_interval=0.1``), in
a child process of this one. After a round of reaping, torch's server (2.13 at
least) sends the same signal to its own process (torchrun's agent dies with its
worker); here that one signal is counted and not sent, so that the server lives on to
reap the other victims. The daemon runs as ``python -m watchdogd --no-state``. Servers run on
CPU 0, workers, victims and this process on CPU 1, as in ``bench/run.py``.

Figures, for each system:

- deadline -> death, p50 and p99 (with 100 victims or fewer, p99 is the worst): the
  deadline is the time the victim's arm call returned (acknowledged by the daemon;
  written into the FIFO for torch) plus 1 s, on the monotonic clock; death is when a
  pidfd of the victim, held by this process, became readable. It includes the
  victim's own exit and this process's wake-up, on a CPU the churning workers keep
  busy;
- deadline -> signal sent, as the server itself saw it, which leaves those out: the
  daemon's ``late_ms``; for torch, the time it signalled minus the request's
  ``expiration_time``;
- victims never killed within 10 s of their deadline (lost): counted, then killed
  here; how many of them saw their arm call raise;
- client errors: exceptions raised by the churning workers' calls, by type, and the
  rate of calls that succeeded;
- processes signalled that were no victim (a churning worker killed, a stranger
  reached through a reused pid).

The last column is watchdogd's figure as a multiple of FileTimer's, both measured in
this run. Without torch the benchmark says so in one line and exits.

Run with ``make bench`` (after ``bench/run.py``); ``--quick`` is one shorter round.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import re
import select
import signal
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType, ModuleType
from typing import Protocol

from run import CLIENT_CPU, SERVER_CPU, percentile, pin, running_daemon

CHURNERS = 8
VICTIMS = 20
TIMEOUT = 1.0  # each victim's timer
CHURN_TIMEOUT = 60.0  # the churning workers' timers: never due within a round
MAX_INTERVAL = 0.1  # as torchrun's agent creates its FileTimerServer
LOG_EXPIRED = re.compile(r"event=expired pid=(\d+)\b.*?\blate_ms=([0-9.e+-]+)")


class TimerClient(Protocol):
    """What both systems' clients offer: torch's ``TimerClient`` calls."""

    def acquire(self, scope_id: str, expiration_time: float) -> None: ...

    def release(self, scope_id: str) -> None: ...


@dataclass
class ServerRecord:
    """What a server says it did, read when it stops."""

    late: list[float] = field(default_factory=list)  # deadline -> signal sent, seconds
    signalled: list[int] = field(default_factory=list)  # pids, in order
    self_kills: int = 0  # signals torch's server meant for its own process


@dataclass
class System:
    name: str
    new_client: Callable[[], TimerClient]  # called in each worker, after fork
    record: ServerRecord = field(default_factory=ServerRecord)
    #: The server's process, when it has one of its own.
    pid: int = 0


@dataclass
class Tally:
    """One system's figures, summed over its rounds."""

    seconds: float = 0.0  # of churning
    calls: int = 0  # churning calls that returned
    errors: Counter[str] = field(default_factory=Counter)
    error_example: str = ""
    arm: list[float] = field(default_factory=list)  # seconds per victim's arm call
    arm_failed: int = 0
    death: list[float] = field(default_factory=list)  # deadline -> death, seconds
    lost: int = 0
    lost_unarmed: int = 0
    victims: set[int] = field(default_factory=set)
    churners_killed: int = 0


def import_torch_timer() -> ModuleType | None:
    try:
        with warnings.catch_warnings():
            # torch runs without numpy here, and says so once on import.
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            return importlib.import_module("torch.distributed.elastic.timer")
    except ImportError as missing:
        print(f"torch side by side: skipped, torch is not importable ({missing})")
        return None


@contextmanager
def file_timer_server(timer: ModuleType, directory: Path) -> Iterator[System]:
    """A FileTimerServer in a child process on the server CPU, until the block ends;
    its record is read then."""

    # torch is imported at run time, so its classes are untyped here.
    class BenchServer(timer.FileTimerServer):  # type: ignore[misc, name-defined]
        """torch's server, with its signals recorded and its suicide counted."""

        def __init__(self, path: str) -> None:
            super().__init__(path, run_id="bench", max_interval=MAX_INTERVAL, daemon=True)
            self.record = ServerRecord()

        def _reap_worker(self, worker_pid: int, signal: int) -> bool:
            if worker_pid == os.getpid():
                self.record.self_kills += 1
                return True
            # The timers of a pid being reaped are still in the table here.
            due = [t.expiration_time for (pid, _), t in self._timers.items() if pid == worker_pid]
            if due:
                self.record.late.append(time.time() - min(due))
            self.record.signalled.append(worker_pid)
            return bool(super()._reap_worker(worker_pid, signal))

    def serve() -> None:
        os.close(control_w)
        os.close(report_r)
        server = BenchServer(path)
        server.start()
        os.read(control_r, 1)  # until the bench closes its end
        server.stop()
        with os.fdopen(report_w, "w") as report:
            json.dump(dataclasses.asdict(server.record), report)

    path = str(directory / "watchdog_timer")
    control_r, control_w = os.pipe()
    report_r, report_w = os.pipe()
    child = fork(serve, SERVER_CPU)
    os.close(control_r)
    os.close(report_w)
    system = System(
        "FileTimer",
        lambda: timer.FileTimerClient(path, signal=signal.SIGKILL),
        pid=child,
    )
    try:
        wait_for_reader(path)
        yield system
    finally:
        os.close(control_w)
        with os.fdopen(report_r) as report:
            text = report.read()
        _, status = os.waitpid(child, 0)
        if text:
            system.record = ServerRecord(**json.loads(text))
        else:
            print(f"FileTimerServer's process ended without a report (status {status:#x})")


def wait_for_reader(path: str) -> None:
    """Until the server has the FIFO open for reading, as its clients need."""
    deadline = time.monotonic() + 30
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENOENT before mkfifo, ENXIO before the server's open
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
        else:
            os.close(fd)
            return


@contextmanager
def watchdogd(directory: Path) -> Iterator[System]:
    """The daemon, as ``bench/run.py`` starts it, without state; its record comes
    from its log when the block ends."""
    from watchdogd_client import Client
    from watchdogd_client.torch import WatchdogdTimerClient

    with running_daemon(directory, "--no-state") as (socket_path, log_path, _):
        system = System("watchdogd", lambda: WatchdogdTimerClient(Client(socket_path)))
        try:
            yield system
        finally:
            for pid, late_ms in LOG_EXPIRED.findall(log_path.read_text()):
                system.record.signalled.append(int(pid))
                system.record.late.append(float(late_ms) / 1000)


_stopping = [False]  # set by SIGUSR1 in a churning worker


def _stop(signum: int, frame: FrameType | None) -> None:
    _stopping[0] = True


def churn(client: TimerClient, index: int, results: int) -> None:
    """Arm and release as fast as this process can until SIGUSR1; then write what
    happened, as one JSON line, to ``results``."""
    scope = f"churn-{index}"
    calls = 0
    errors: Counter[str] = Counter()
    example = ""
    while not _stopping[0]:
        for arm in (True, False):
            try:
                if arm:
                    client.acquire(scope, time.time() + CHURN_TIMEOUT)
                else:
                    client.release(scope)
                calls += 1
            except Exception as exc:
                errors[type(exc).__name__] += 1
                example = example or f"{type(exc).__name__}: {exc}"
    line = json.dumps({"calls": calls, "errors": errors, "example": example})
    os.write(results, line.encode() + b"\n")


def hang(client: TimerClient, reports: int) -> None:
    """Arm one timer, say when the call returned and whether it raised, then hang."""
    sent = time.monotonic()
    error = ""
    try:
        client.acquire("victim", time.time() + TIMEOUT)
    except Exception as exc:
        error = type(exc).__name__
    acked = time.monotonic()
    os.write(reports, f"{os.getpid()} {sent} {acked} {error}\n".encode())
    while True:
        time.sleep(3600)


def fork(body: Callable[[], object], cpu: int = CLIENT_CPU) -> int:
    """Run ``body`` in a child process pinned to ``cpu``; the child's pid."""
    child = os.fork()
    if child == 0:
        try:
            pin(cpu)
            body()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    return child


@contextmanager
def churning(system: System, tally: Tally) -> Iterator[None]:
    """8 workers churning from the start of the block to its end; what they did
    goes into ``tally``."""
    ready_r, ready_w = os.pipe()
    results_r, results_w = os.pipe()

    def churner(index: int) -> None:
        signal.signal(signal.SIGUSR1, _stop)
        os.write(ready_w, b"x")
        churn(system.new_client(), index, results_w)

    churners = [fork(partial(churner, index)) for index in range(CHURNERS)]
    os.close(ready_w)
    os.close(results_w)
    started = time.monotonic()
    try:
        for _ in range(CHURNERS):
            os.read(ready_r, 1)
        started = time.monotonic()
        yield
    finally:
        for pid in churners:
            os.kill(pid, signal.SIGUSR1)
        results = read_all(results_r)
        tally.seconds += time.monotonic() - started
        for pid in churners:
            _, status = os.waitpid(pid, 0)
            tally.churners_killed += os.WIFSIGNALED(status)
        os.close(ready_r)
    for line in results.decode().splitlines():
        result = json.loads(line)
        tally.calls += result["calls"]
        tally.errors.update(result["errors"])
        tally.error_example = tally.error_example or result["example"]


def victims_round(system: System, tally: Tally, lost_after: float) -> None:
    """Start the victims, see each die or give up on it ``lost_after`` seconds after
    its timeout, and kill what is left."""
    reports_r, reports_w = os.pipe()
    victims: dict[int, int] = {}  # pidfd -> pid
    died: dict[int, float] = {}
    lines = b""
    try:
        with select.epoll() as poller:
            try:
                for _ in range(VICTIMS):
                    pid = fork(lambda: hang(system.new_client(), reports_w))
                    pidfd = os.pidfd_open(pid)
                    victims[pidfd] = pid
                    poller.register(pidfd, select.EPOLLIN)
            finally:
                os.close(reports_w)
            poller.register(reports_r, select.EPOLLIN)
            cutoff = time.monotonic() + TIMEOUT + lost_after
            while len(died) < VICTIMS and (now := time.monotonic()) < cutoff:
                events = poller.poll(cutoff - now)
                seen = time.monotonic()
                for fd, _ in events:
                    if fd == reports_r:
                        lines += os.read(reports_r, 65536)
                    else:
                        died[victims[fd]] = seen
                        poller.unregister(fd)
    finally:
        for pidfd, pid in victims.items():
            if pid not in died:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(pidfd)
        # Every victim reported before it hung, and all are gone now.
        lines += read_all(reports_r)
    tally.victims.update(victims.values())
    for line in lines.decode().splitlines():
        pid_text, sent, acked, *error = line.split()
        tally.arm.append(float(acked) - float(sent))
        tally.arm_failed += bool(error)
        if (death := died.get(int(pid_text))) is not None:
            tally.death.append(death - (float(acked) + TIMEOUT))
        else:
            tally.lost += 1
            tally.lost_unarmed += bool(error)


def run_round(system: System, tally: Tally, warmup: float, lost_after: float) -> None:
    with churning(system, tally):
        time.sleep(warmup)
        victims_round(system, tally, lost_after)


def read_all(fd: int) -> bytes:
    """Everything until every writer has closed ``fd``; closes it."""
    with os.fdopen(fd, "rb") as reader:
        return reader.read()


def ms(values: list[float], fraction: float) -> float:
    return percentile(values, fraction) * 1e3 if values else math.nan


def figures(tally: Tally, record: ServerRecord) -> list[tuple[str, float, str]]:
    """(name, value, unit) rows, in the same order for each system."""
    strangers = [pid for pid in record.signalled if pid not in tally.victims]
    return [
        ("deadline -> death p50", ms(tally.death, 0.5), "ms"),
        ("deadline -> death p99", ms(tally.death, 0.99), "ms"),
        ("deadline -> signal sent p50, server's view", ms(record.late, 0.5), "ms"),
        ("deadline -> signal sent p99, server's view", ms(record.late, 0.99), "ms"),
        ("victims killed", len(tally.death), f"of {len(tally.victims)}"),
        ("victims never killed (lost)", tally.lost, f"of {len(tally.victims)}"),
        ("victims' arm call p50", ms(tally.arm, 0.5), "ms"),
        ("victims' arm call p99", ms(tally.arm, 0.99), "ms"),
        ("victims' arm calls that raised", tally.arm_failed, f"of {len(tally.victims)}"),
        ("churning calls that returned", tally.calls / tally.seconds, "calls/s"),
        ("churning calls that raised", sum(tally.errors.values()), "calls"),
        ("non-victims signalled", len(strangers) + tally.churners_killed, "processes"),
    ]


def details(name: str, tally: Tally, record: ServerRecord) -> str:
    errors = ", ".join(f"{kind} x{count:,}" for kind, count in tally.errors.most_common())
    parts = [
        f"churning errors: {errors or 'none'}"
        + (f" (e.g. {tally.error_example})" if tally.error_example else ""),
        f"lost victims whose arm call raised: {tally.lost_unarmed} of {tally.lost}",
        f"churning workers killed: {tally.churners_killed}",
    ]
    if name == "FileTimer":
        parts.append(f"server's signals to its own process: {record.self_kills} (not sent)")
    return f"{name}: " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shorter round, for a smoke test")
    options = parser.parse_args()
    timer = import_torch_timer()
    if timer is None:
        return
    rounds = 1 if options.quick else 5
    lost_after = 3.0 if options.quick else 10.0
    warmup = 0.3 if options.quick else 1.0
    pin(CLIENT_CPU)
    print(
        f"torch side by side: {CHURNERS} churning workers, {VICTIMS} victims x {rounds} "
        f"rounds, {TIMEOUT:g} s timeout, lost after {lost_after:g} s; FileTimerServer "
        f"max_interval={MAX_INTERVAL}; servers on CPU {SERVER_CPU}, clients on CPU {CLIENT_CPU}"
    )
    tallies: dict[str, Tally] = {}
    with ExitStack() as stack:
        directories = [
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wd-bench-")))
            for _ in range(2)
        ]
        systems = [
            stack.enter_context(file_timer_server(timer, directories[0])),
            stack.enter_context(watchdogd(directories[1])),
        ]
        for _ in range(rounds):
            for system in systems:
                run_round(system, tallies.setdefault(system.name, Tally()), warmup, lost_after)
                time.sleep(0.5)  # let the server drain what the workers left
    # The servers' records were read as they stopped.
    theirs, ours = (figures(tallies[s.name], s.record) for s in systems)
    width = max(len(name) for name, _, _ in theirs)
    print(f"{'figure':<{width}}  {'FileTimer':>10}  {'watchdogd':>10}  {'wd/FT':>6}  unit")
    for (name, their, unit), (_, our, _) in zip(theirs, ours, strict=True):
        ratio = f"{our / their:6.2f}" if their and not math.isnan(their) else f"{'-':>6}"
        print(f"{name:<{width}}  {their:>10,.2f}  {our:>10,.2f}  {ratio}  {unit}")
    for system in systems:
        print(details(system.name, tallies[system.name], system.record))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
