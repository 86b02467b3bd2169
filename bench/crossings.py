"""The layers one acquire and one expiry pass through, counted by a trace of the
daemon's calls.

A daemon of the tree named (``--tree``, this checkout by default) runs in a child
process with its state on, in a temporary directory, under a profile hook
(``sys.setprofile``, and ``threading.setprofile`` for its worker threads); this
process arms timers on it over its socket, with that tree's blocking client, on
real sleeping processes. The hook records while a window is open:

- **an acquire**: from the ``recv`` on the connection that reads the frame to the
  ``send`` that writes the reply;
- **an expiry**: from the scheduler's wake-up at the deadline until the daemon is
  quiet again, its policy (SIGKILL, the default) run, the victim's exit seen and
  the event recorded.

Each call of a frame of the daemon's is given a layer: its module's package under
``watchdogd`` (``cli``, ``runtime``, ``fleet``, ``storage``, ``host``, ``core``; a
module at the package's root, ``watchdogd/logs.py``, is a layer of its own name),
or ``watchdogd_protocol`` or ``watchdogd_client``. Frames of the standard library
and of third-party modules are skipped, their calls taken as made by the nearest
frame of the daemon's below them. A crossing is a call whose layer differs from
its caller's; a task that trio's loop resumes, or a function a worker thread runs,
is taken as called by the runtime, whose loop runs them. The path is the layer the
daemon's code stands in after each call and return, repeats collapsed. A task woken
by a timeout of its own (``trio.sleep``: the event file's writer, the incidents'
settling) is not part of either: it runs on its period whatever comes in.

The daemon runs on one CPU, and each victim on the same one at nice 19, with a
heap to let go of: signalled, it dies only once the daemon waits, so its run always
watches for its exit, as a worker's that takes a while to die does (a victim gone
before the daemon looked would take a pass less, by chance). Each is measured in
`ROUNDS` rounds after one unrecorded round that loads what the daemon loads at
first use; the figure is the round with the median count. Run with
``make bench``; ``--tree PATH`` traces the daemon of another checkout of the
project, with this venv's packages (msgspec, trio...) and that tree's own code.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol

#: The daemon's layers: the packages under ``watchdogd``.
LAYERS: Final = ("cli", "runtime", "fleet", "storage", "host", "core")
#: The client's distribution's packages, each a layer of its own.
PACKAGES: Final = ("watchdogd_protocol", "watchdogd_client")
#: The layer a task resumed by the loop, or a worker thread's function, is called from.
LOOP_LAYER: Final = "runtime"
#: trio's run loop: a frame below one of its frames was resumed by it, not called.
LOOP_MODULE: Final = "trio._core._run"
#: trio's sleeps: a task resumed in one was woken by its own timeout.
TIMED_MODULE: Final = "trio._timeouts"
#: The recorded rounds.
ROUNDS: Final = 3
#: The timeout of each traced timer, and how long the daemon is let be quiet after
#: its victim died before the expiry's window closes (seconds).
TIMEOUT: Final = 0.4
QUIET: Final = 0.3
PATIENCE: Final = 20.0

#: The victims' heap, and what they run.
HEAP: Final = 64 << 20
VICTIM: Final = """
import os, sys, time
heap = b"x" * int(sys.argv[1])
# Filled at the priority it started at (at nice 19 beside a busy machine, its
# start and its heap would take seconds), then on the daemon's CPU at nice 19.
os.sched_setaffinity(0, {int(sys.argv[2])})
os.setpriority(os.PRIO_PROCESS, 0, 19)
print("filled", flush=True)
time.sleep(300)
"""

#: Calls of the standard library that mark a window's ends: what reads a frame,
#: what writes a reply, what signals a process.
READS: Final = frozenset({"recv", "recv_into", "recvmsg"})
WRITES: Final = frozenset({"send", "sendall", "sendmsg"})

#: One recorded event: ("call", layer, caller's layer), ("return", layer, the
#: caller's layer it returns to), or ("mark", "read" | "write" | "signal", layer).
Event = tuple[str, str, str]


class Frame(Protocol):
    """What the hook reads of a frame (a `types.FrameType`, or a test's stand-in)."""

    @property
    def f_back(self) -> Frame | None: ...

    @property
    def f_globals(self) -> dict[str, Any]: ...


@functools.cache
def layer_of(module: str) -> str | None:
    """The layer of a frame of ``module``; None for one not the project's."""
    top, _, rest = module.partition(".")
    if top in PACKAGES:
        return top
    if top != "watchdogd" or not rest:
        return None
    return rest.partition(".")[0]


def _module(frame: Frame) -> str:
    return str(frame.f_globals.get("__name__", ""))


def caller_layer(frame: Frame) -> str:
    """The layer of the nearest frame of the project's below ``frame``: the frames
    between are the standard library's or a third party's. A frame that trio's loop
    resumed, or the first of a worker thread, has none: `LOOP_LAYER`."""
    back = frame.f_back
    while back is not None:
        module = _module(back)
        layer = layer_of(module)
        if layer is not None:
            return layer
        if module == LOOP_MODULE:
            break
        back = back.f_back
    return LOOP_LAYER


def mark_of(function: object) -> str | None:
    """The window's mark a call of the built-in ``function`` is, if any."""
    if function is getattr(signal, "pidfd_send_signal", None):
        return "signal"
    if isinstance(getattr(function, "__self__", None), socket.socket):
        name = getattr(function, "__name__", "")
        if name in READS:
            return "read"
        if name in WRITES:
            return "write"
    return None


@dataclass
class Step:
    """What one thread ran of the project's code from the call (or resumption) of
    its outermost frame of the project's to that frame's return (or suspension)."""

    number: int
    root: object
    events: list[Event] = field(default_factory=list)
    #: Still going down the frames resumed (no return yet).
    descending: bool = True
    #: Resumed in one of trio's sleeps: a task's own period, not what came in.
    timed: bool = False


class Recorder:
    """The profile hook. While `on`, it records each thread's steps; `stop` ends
    the window and gives the events of its steps, in the order they began, less
    the timed ones."""

    def __init__(self) -> None:
        self.on = False
        self._lock = threading.Lock()
        self._steps: dict[int, Step] = {}
        self._ended: list[Step] = []
        self._numbers = 0

    def start(self) -> None:
        with self._lock:
            self._steps.clear()
            self._ended.clear()
            self.on = True

    def stop(self) -> list[Event]:
        with self._lock:
            self.on = False
            # A step still going counts with what it ran so far: the client may
            # close a window on a reply before the task that sent it has yielded.
            steps = sorted([*self._ended, *self._steps.values()], key=lambda step: step.number)
            return [event for step in steps if not step.timed for event in step.events]

    def __call__(self, frame: Frame, event: str, arg: object) -> None:
        # Cheap refusals first: the hook runs at every call of the daemon's, and
        # a slower daemon would split its work into more passes than it does.
        if not self.on or event in ("c_return", "c_exception"):
            return
        if event == "c_call" and mark_of(arg) is None:
            return
        with self._lock:
            if self.on:
                self._see(threading.get_ident(), frame, event, arg)

    def _see(self, thread: int, frame: Frame, event: str, arg: object) -> None:
        step = self._steps.get(thread)
        module = _module(frame)
        layer = layer_of(module)
        if event == "call":
            if step is None:
                if layer is None:
                    return
                self._numbers += 1
                step = self._steps[thread] = Step(self._numbers, frame)
            elif step.descending and module == TIMED_MODULE:
                step.timed = True
            if layer is not None:
                step.events.append(("call", layer, caller_layer(frame)))
        elif step is None:
            return
        elif event == "c_call":
            step.events.append(("mark", mark_of(arg) or "", layer or caller_layer(frame)))
        elif event == "return":
            # A resumed task's descent ends at the first return: that of the
            # primitive it waited in.
            step.descending = False
            if layer is not None:
                step.events.append(("return", layer, caller_layer(frame)))
            if frame is step.root:
                self._ended.append(self._steps.pop(thread))


@dataclass(frozen=True)
class Crossings:
    """The layers a stretch of calls stood in, in order, and its crossings."""

    path: tuple[str, ...]
    count: int

    def __str__(self) -> str:
        return f"{' -> '.join(self.path)}: {self.count} crossings"


def crossings(
    events: Iterable[Event], *, start: str | None = None, end: str | None = None
) -> Crossings:
    """Reduce ``events`` to the path and the crossings, from the first mark
    ``start`` (from the first event without one) to the first mark ``end`` after
    it (to the last event without one)."""
    path: list[str] = []
    count = 0
    started = start is None

    def stand(layer: str) -> None:
        if not path or path[-1] != layer:
            path.append(layer)

    for kind, name, other in events:
        if kind == "mark":
            if not started and name == start:
                started = True
                stand(other)
            elif started and name == end:
                break
            continue
        if not started:
            continue
        if kind == "call":
            count += name != other
            stand(other)
            stand(name)
        else:
            stand(other)
    return Crossings(tuple(path), count)


# The daemon's side: a child process, with the traced tree first on its path.


def serve(socket_path: str, state: str, commands: int, answers: int) -> None:
    """Run the daemon under the hook; each byte read from ``commands`` opens a
    window (``+``) or closes it (``-``), answered on ``answers`` (a closed window
    with its events, as a line of JSON)."""
    from watchdogd.cli.watchdogd import main

    os.sched_setaffinity(0, {daemon_cpu()})  # its threads too: they inherit it
    recorder = Recorder()

    def control() -> None:
        with open(commands, "rb", buffering=0) as reading, open(answers, "wb", 0) as writing:
            while command := reading.read(1):
                if command == b"+":
                    recorder.start()
                    writing.write(b"[]\n")
                else:
                    writing.write(json.dumps(recorder.stop()).encode() + b"\n")

    threading.Thread(target=control, daemon=True).start()
    threading.setprofile(recorder)
    sys.setprofile(recorder)
    args = ["--socket", socket_path, "--state", state, "--log-level", "warning"]
    main.main(args, prog_name="watchdogd", standalone_mode=False)


# This process's side: the client, the victims, the windows.


@dataclass
class Daemon:
    """The traced daemon: its process, its socket and the control of its windows."""

    process: subprocess.Popen[bytes]
    socket_path: Path
    commands: int
    answers: BinaryIO

    def start(self) -> None:
        """Open a window; returns once the hook records."""
        self._tell(b"+")

    def stop(self) -> list[Event]:
        """Close the window: what the hook recorded in it."""
        return [(kind, name, other) for kind, name, other in self._tell(b"-")]

    def _tell(self, command: bytes) -> list[list[str]]:
        os.write(self.commands, command)
        line = self.answers.readline()
        if not line:
            raise RuntimeError("the traced daemon exited")
        answer: list[list[str]] = json.loads(line)
        return answer


@contextmanager
def traced_daemon(tree: Path, directory: Path) -> Iterator[Daemon]:
    """A daemon of ``tree`` under the hook, serving in ``directory``."""
    commands_read, commands = os.pipe()
    answers, answers_write = os.pipe()
    socket_path = directory / "watchdogd.sock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(tree_path(tree))}
    argv = [sys.executable, __file__, "--serve", str(socket_path), str(directory / "state.db")]
    with open(directory / "watchdogd.log", "wb") as log:
        process = subprocess.Popen(
            [*argv, str(commands_read), str(answers_write)],
            pass_fds=(commands_read, answers_write),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
            env=env,
        )
    os.close(commands_read)
    os.close(answers_write)
    try:
        with open(answers, "rb") as reading:
            yield Daemon(process, socket_path, commands, reading)
    finally:
        os.close(commands)
        process.terminate()
        if process.wait() not in (0, -signal.SIGTERM):
            sys.stderr.write((directory / "watchdogd.log").read_text())


def tree_path(tree: Path) -> list[str]:
    """The entries that put ``tree``'s packages first on a path."""
    return [str(tree), str(tree / "client")]


def daemon_cpu() -> int:
    """The CPU the traced daemon and its victims run on."""
    return min(os.sched_getaffinity(0))


@contextmanager
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A sleeping process with a heap of `HEAP` bytes, given once it filled it and
    killed at the end, if it still lives. It runs on the daemon's CPU at nice 19
    (SCHED_IDLE would starve its exit for a minute beside any busy process): once
    signalled, it dies only when the daemon waits, and takes a
    while to (its heap is let go first), as a worker's does; the run always
    watches for its exit. Whether a victim died before the daemon looked would
    otherwise change the count from round to round."""
    process = subprocess.Popen(
        [sys.executable, "-c", VICTIM, str(HEAP), str(daemon_cpu())],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    try:
        if process.stdout.readline() != b"filled\n":
            raise RuntimeError(f"the victim {process.pid} did not start")
        yield process
    finally:
        process.kill()  # a round that failed leaves no victim behind
        process.wait()
        process.stdout.close()


def listening(daemon: Daemon) -> None:
    """Return once ``daemon`` answers on its socket."""
    from watchdogd_client import Client, DaemonUnavailable

    until = time.monotonic() + PATIENCE
    while True:
        try:
            with Client(daemon.socket_path, responder=False, fast=False) as client:
                client.ping()
                return
        except DaemonUnavailable:
            if daemon.process.poll() is not None or time.monotonic() > until:
                raise
            time.sleep(0.02)


def measure(tree: Path, rounds: int) -> tuple[list[Crossings], list[Crossings]]:
    """The acquires' and the expiries' crossings, one of each a round."""
    from watchdogd_client import Client

    acquires, expiries = [], []
    with (
        tempfile.TemporaryDirectory(prefix="wd-crossings-") as directory,
        traced_daemon(tree, Path(directory)) as daemon,
    ):
        listening(daemon)
        with Client(daemon.socket_path, responder=False, fast=False) as client:
            client.ping()
            for number in range(rounds + 1):
                with victim() as process:
                    daemon.start()
                    client.acquire(f"traced-{number}", TIMEOUT, pid=process.pid)
                    acquire = daemon.stop()
                    time.sleep(TIMEOUT / 4)  # the scheduler woken by the arming sleeps again
                    daemon.start()
                    process.wait(PATIENCE)
                    time.sleep(QUIET)
                    expiry = daemon.stop()
                if number:  # the first round loads what the daemon loads at first use
                    acquires.append(crossings(acquire, start="read", end="write"))
                    expiries.append(crossings(expiry))
    return acquires, expiries


def median(measured: Sequence[Crossings]) -> Crossings:
    """The round whose count is the median of the rounds'."""
    return sorted(measured, key=lambda found: found.count)[len(measured) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, help="the checkout whose daemon is traced")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="the recorded rounds")
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.serve:
        socket_path, state, commands, answers = options.serve
        serve(socket_path, state, int(commands), int(answers))
        return
    tree = (options.tree or Path(__file__).resolve().parent.parent).resolve()
    sys.path[:0] = tree_path(tree)
    acquires, expiries = measure(tree, options.rounds)
    print(f"layers crossed in the daemon of {tree}, median of {options.rounds} rounds")
    for what, measured in (("acquire", acquires), ("expiry", expiries)):
        counts = ", ".join(str(found.count) for found in measured)
        found = median(measured)
        print(f"{what}: {found.count} crossings (rounds {counts})")
        print(f"  {' -> '.join(found.path)}")


if __name__ == "__main__":
    main()
