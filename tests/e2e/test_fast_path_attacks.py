"""The fast path under attack by hostile local users: processes of uid 65534 and
uid 4321 (forked from the test and changed to those users) against a real daemon
run as root whose socket anyone may reach (``socket_mode = 0o666``, the default).
Each attack uses only what such a user has: its own registrations, its own page
(its words and counts, its descriptor, the memfd behind it), its own descriptor
table and its own processes. Meanwhile root's canaries (sleepers armed by root over
the socket with a short timer) are signalled within 100 ms of their deadlines.

Scaled down here (seconds each); ``WATCHDOGD_SOAK=1`` runs them at the issue's
sizes: thousands of scopes and of requests, tens of thousands of descriptors."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import mmap
import os
import random
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from watchdogd.core.slot_shares import LOOKS_PER_UID
from watchdogd.core.slots import period_of
from watchdogd_client import Client, RequestRefused
from watchdogd_client.engine import Connection, Engine
from watchdogd_client.fastpath import FastPath, _exchange, fast_path
from watchdogd_client.trio import open_client
from watchdogd_protocol import (
    Acquire,
    Acquired,
    MapPage,
    PageMapped,
    Release,
    Released,
    Welcome,
)
from watchdogd_protocol.slot_page import (
    BLOCKS,
    BUCKETS,
    DEADLINE,
    MAX_MICROSECONDS,
    PAGE_BYTES,
    PERIOD,
    SLOTS,
    TAKEN,
    count_of,
    taken_of,
    word_of,
)

from helpers.daemon import RunningDaemon, configured_daemon, expired_event
from helpers.metrics import samples
from helpers.processes import (
    UNIT_NICE,
    at_timing_priority,
    at_units_priority_all,
    become,
    death_time,
    fork_at_pid,
    reap,
    rss_mib,
    sleeper,
)
from helpers.users import NOBODY, OTHER
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as other uids")

SOAK = os.environ.get("WATCHDOGD_SOAK", "") == "1"
#: How long an attack runs while root's canaries are timed.
ATTACK_SECONDS = 20.0 if SOAK else 2.0
#: Scopes one attacker registers (its uid's limit is 10,000).
SCOPES = 8_000 if SOAK else 1_000
#: Descriptors one attacker holds for a restart to search.
DESCRIPTORS = 19_000 if SOAK else 8_000
#: Rounds of requests of a service that registers a scope per request.
ROUNDS_OF_REQUESTS = 40 if SOAK else 4
#: A canary's timer, and how late it may be signalled.
CANARY = 0.3
ON_TIME = 0.1
#: What /proc/PID/fd shows for a slot page's descriptor.
PAGE_LINK = "/memfd:watchdogd-slots (deleted)"
#: fcntl(2)'s F_ADD_SEALS and fallocate(2)'s FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE.
F_ADD_SEALS = 1033
PUNCH_HOLE = 0x01 | 0x02
#: setns(2)'s flag for a time namespace (Python 3.11 lacks os.setns).
CLONE_NEWTIME = 0x80

#: The daemon's descriptors beyond its own: those a connection or two may add.
SPARE_DESCRIPTORS = 8


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, "[daemon]\n", for_everyone=True) as running:
        yield running


def daemon_with(config: str, socket_path: Path, tmp_path: Path) -> Any:
    return configured_daemon(socket_path, tmp_path, config, for_everyone=True)


def descriptors_of(pid: int) -> int:
    """How many of ``pid``'s descriptors are of the kinds a connection, its caller
    or a page brings (sockets, pidfds, memfds): its storage's files, opened as it
    writes (a journal's next file, a record, a watch), are not counted."""
    kinds = ("socket:", "anon_inode:[pidfd]", "/memfd:")
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(kinds)
    return count


# Root's canaries.


class Canaries:
    """Root's canaries, one after another from a thread of the test while the
    block runs: each a sleeper armed by root over the socket for `CANARY`
    seconds, its death timed through a pidfd. On leaving the block every one
    must have died within `ON_TIME` of its deadline.

    The daemon runs at the shipped unit's ``Nice=-10`` while they do; the thread
    that times them and the sleepers it starts at real time
    (`helpers.processes.at_timing_priority_now`): what is timed is the daemon."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self._daemon = daemon
        self._stop = threading.Event()
        #: For each canary, how late it died (at most) and how late the daemon
        #: says it fired: the first is the bound, the second says whose it was.
        self.lates: list[tuple[float, float]] = []
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Canaries:
        at_units_priority_all(self._daemon.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(PATIENCE * 3)
        if exc[0] is not None:
            return
        assert not self._thread.is_alive(), "a canary never died"
        if self._failure is not None:
            raise self._failure
        assert self.lates, "no canary ran"
        shown = [
            f"{max(died, fired) * 1000:.1f} (fired {fired * 1000:.1f})"
            for died, fired in self.lates
        ]
        assert max(max(late) for late in self.lates) < ON_TIME, f"canaries late (ms): {shown}"

    def _run(self) -> None:
        try:
            with at_timing_priority(), self._daemon.client(fast=False) as client:
                while not self._stop.is_set() or not self.lates:
                    victim = sleeper()
                    try:
                        sent = time.monotonic()
                        remaining = client.acquire("canary", CANARY, pid=victim.pid)
                        answered = time.monotonic()
                        died = death_time(victim)
                        # Its deadline is between the request's sending and its
                        # answer, a timeout on: a death before the earliest is
                        # early; its lateness is at least that after the latest,
                        # and what the daemon itself recorded (a slow round trip
                        # on a loaded machine widens the one, never the other).
                        assert died > sent + remaining - 0.002, "a canary died early"
                        late = expired_event(client, victim.pid).late
                        assert late is not None
                        self.lates.append((died - answered - remaining, late))
                    finally:
                        reap(victim)
        except BaseException as exc:
            self._failure = exc


# The attackers: forked children of the test, each running as its user the
# functions below that the test names, one at a time.

_state: dict[str, Any] = {}


class Actor:
    """A forked child of the test process, running as ``uid``, that calls the
    functions of this module it is told to and answers with what they return."""

    def __init__(self, uid: int, socket: Path) -> None:
        commands, self._commands = os.pipe()
        said, say = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the actor, which never returns
            try:
                os.close(self._commands)
                os.close(said)
                # Pages the test process mapped in earlier tests are not the
                # actor's: its count of its own page descriptors starts at none.
                for fd in page_descriptors():
                    os.close(fd)
                become(uid)
                _state["socket"] = str(socket)
                _state["say"] = say
                _serve(commands, say)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(0)
        os.close(commands)
        os.close(say)
        self.pid = pid
        self._said = os.fdopen(said)
        self._pidfd = os.pidfd_open(pid)
        #: Processes it made that outlive it, by pidfd: killed at `close`.
        self.others: list[int] = []
        self._reaped = False

    def __call__(self, name: str, *args: object) -> Any:
        self.tell(name, *args)
        return self.said()

    def tell(self, name: str, *args: object) -> None:
        """Have it call ``name`` without waiting for it to return."""
        os.write(self._commands, json.dumps([name, args]).encode() + b"\n")

    def death_time(self, timeout: float = PATIENCE) -> float:
        """When it exited, on CLOCK_MONOTONIC, seen through its pidfd."""
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        assert poller.poll(timeout * 1000), f"actor {self.pid} is still running"
        return time.monotonic()

    def said(self) -> Any:
        """The next answer on its pipe (its own, or a child's that holds it)."""
        line = self._said.readline()
        assert line, f"actor {self.pid} is gone"
        outcome = json.loads(line)
        if "error" in outcome:
            raise AssertionError(f"in actor {self.pid}:\n{outcome['error']}")
        return outcome["ok"]

    def keep(self, pid: int) -> None:
        """Kill ``pid`` (which it made) at `close`."""
        self.others.append(os.pidfd_open(pid))

    def exit(self) -> None:
        """End it (what it forked lives on) and reap it: its pid is free."""
        self.tell("_leave")
        os.waitpid(self.pid, 0)
        self._reaped = True

    def close(self) -> None:
        for pidfd in [self._pidfd, *self.others]:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        os.close(self._commands)
        if not self._reaped:
            os.waitpid(self.pid, 0)
        self._said.close()


def _serve(commands: int, say: int) -> None:
    with os.fdopen(commands) as reading:
        for line in reading:
            name, args = json.loads(line)
            _answer(say, functools.partial(globals()[name], *args))


def _leave() -> None:
    """Exit now (actors made after this one hold its pipes: no end of file comes)."""
    os._exit(0)


def _answer(say: int, action: Callable[[], object]) -> None:
    try:
        outcome = {"ok": action()}
    except BaseException:
        outcome = {"error": traceback.format_exc()}
    os.write(say, json.dumps(outcome).encode() + b"\n")


def _client() -> Client:
    client = _state.get("client")
    if client is None:
        client = _state["client"] = Client(_state["socket"], timeout=5.0, reconnect_timeout=0.0)
    return client


def _fast() -> FastPath:
    path = fast_path(_state["socket"])
    assert path is not None
    return path


def page_descriptors() -> list[int]:
    """This process's descriptors of slot pages."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == PAGE_LINK:
                found.append(int(name))
    return found


def _fork(work: Callable[[], object]) -> int:
    """A child of this process, in a process group of its own (so that this
    process's pid is free once it exits), running ``work``; its pid."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the attacker's child
        try:
            os.setpgid(0, 0)
            work()
        finally:
            os._exit(0)
    return child


def _mapped(fds: list[int]) -> list[memoryview]:
    """The pages of ``fds`` mapped again here (a child of fork() inherits a page's
    descriptor, not its mapping), as 64-bit words."""
    return [memoryview(mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED)).cast("Q") for fd in fds]


def register(scope: str, timeout: float, policy: str | None = None) -> int:
    """Arm ``scope`` over the socket, which registers it (for blocks of the same
    arming: ``policy`` or none): the page id granted."""
    if policy is None:
        _client().acquire(scope, timeout)
    else:
        _client().acquire(scope, timeout, policy=policy)
    return _fast()._slots[scope].page.id


def register_many(prefix: str, count: int, timeout: float, policy: str) -> list[str]:
    """Register ``count`` scopes; the first refusals, if any."""
    refused = []
    for number in range(count):
        try:
            _client().acquire(f"{prefix}{number}", timeout, policy=policy)
        except RequestRefused as exc:
            refused.append(str(exc))
    return refused[:3]


def register_released(prefix: str, count: int, timeout: float) -> list[str]:
    """Register ``count`` scopes of ``timeout`` seconds, each released by a store
    as soon as it is granted; the first refusals, if any."""
    refused = []
    for number in range(count):
        try:
            _client().acquire(f"{prefix}{number}", timeout, policy="log")
        except RequestRefused as exc:
            refused.append(str(exc))
        _client().release(f"{prefix}{number}")
    return refused[:3]


def register_storing(prefix: str, count: int, timeout: float, seconds: float) -> None:
    """Register ``count`` scopes, storing a deadline ``seconds`` from now after
    each into every slot whose period says it is not open: one closed by that
    registration is armed by a store at once, long before the daemon's next look."""
    for number in range(count):
        with contextlib.suppress(RequestRefused):
            _client().acquire(f"{prefix}{number}", timeout, policy="log")
        deadline = int((time.monotonic() + seconds) * 1_000_000)
        for page in _fast()._pages.values():
            for index in range(SLOTS):
                if not page.words[word_of(index, PERIOD)]:
                    page.words[word_of(index, DEADLINE)] = deadline


def slots_held() -> int:
    """How many scopes of this process hold a slot."""
    return len(_fast()._slots)


def release_many(prefix: str, count: int) -> None:
    """Release each of ``register_many``'s scopes by a store."""
    for number in range(count):
        _client().release(f"{prefix}{number}")


def rearm_many(prefix: str, count: int, timeout: float, policy: str) -> None:
    """Arm each over the socket again with ``timeout``, nearer than its period."""
    for number in range(count):
        _client().acquire(f"{prefix}{number}", timeout, policy=policy)


def release(scope: str) -> bool:
    """Release ``scope`` as a block's end does (by a store, if it may)."""
    return _client().release(scope)


def store(scope: str, word: int) -> None:
    """Store ``word`` as the deadline of ``scope``'s slot, whatever its period says."""
    slot = _fast()._slots[scope]
    slot.words[slot.deadline] = word


def give_up_root() -> int:
    """Become uid 65534 for good (real, effective and saved): its uid now."""
    become(NOBODY)
    return os.getuid()


def enter_time_namespace(pid: int) -> bool:
    """Join the time namespace of ``pid`` (setns(2)): whether the clock moved."""
    before = time.monotonic()
    fd = os.open(f"/proc/{pid}/ns/time", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWTIME):
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)
    return time.monotonic() - before > 3600


def hang(scope: str, after: float, seconds: float) -> None:
    """A block of ``scope`` that outlives its timeout by far."""
    with _client().expires(after, scope=scope):
        time.sleep(seconds)


def unregister(scope: str) -> bool:
    """Release ``scope`` as another caller would (naming its pid): the registration
    goes, and with its last one the process leaves the daemon's table."""
    return _client().release(scope, pid=os.getpid())


def store_everywhere(seconds: float) -> int:
    """Store a deadline ``seconds`` from now into every slot of every page this
    process holds, granted, open, closing or not: the pages."""
    deadline = int((time.monotonic() + seconds) * 1_000_000)
    for page in _fast()._pages.values():
        for index in range(SLOTS):
            page.words[word_of(index, DEADLINE)] = deadline
    return len(_fast()._pages)


def abuse_pages() -> dict[str, int]:
    """Shrink, grow, seal and punch holes in every page this process holds: what
    each attempt got (0, or the errno that refused it)."""
    outcomes: dict[str, int] = {}
    libc = ctypes.CDLL(None, use_errno=True)
    for fd in page_descriptors():
        attempts: dict[str, Callable[[int], object]] = {
            "shrink": lambda page: os.ftruncate(page, PAGE_BYTES // 2),
            "grow": lambda page: os.ftruncate(page, PAGE_BYTES * 2),
            "write past the end": lambda page: os.pwrite(page, b"x", PAGE_BYTES),
            "seal": lambda page: fcntl.fcntl(page, F_ADD_SEALS, 0x0008),
        }
        for name, attempt in attempts.items():
            try:
                attempt(fd)
                outcomes[name] = 0
            except OSError as exc:
                outcomes[name] = exc.errno or 0
        punched = libc.fallocate(fd, PUNCH_HOLE, ctypes.c_long(0), ctypes.c_long(PAGE_BYTES))
        outcomes["punch a hole"] = ctypes.get_errno() if punched else 0
    return outcomes


def scribble(seconds: float) -> int:
    """For ``seconds``, from a forked child (its pid): random words over every
    page this process holds, absurd deadlines in every slot (the largest word,
    past the largest deadline, the distant past) and counts no block made."""
    fds = page_descriptors()

    def work() -> None:
        pages = _mapped(fds)
        counts = [page.cast("B").cast("I") for page in pages]
        rng = random.Random(0)
        absurd = [2**64 - 1, MAX_MICROSECONDS + 1, MAX_MICROSECONDS, 1]
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            for page, count in zip(pages, counts, strict=True):
                for _ in range(256):
                    page[rng.randrange(len(page))] = rng.getrandbits(64)
                for index in range(SLOTS):
                    page[word_of(index, DEADLINE)] = rng.choice(absurd)
                    page[word_of(index, BLOCKS)] = rng.getrandbits(64)
                    page[word_of(index, TAKEN)] = rng.getrandbits(64)
                    count[count_of(index, rng.randrange(BUCKETS))] = rng.getrandbits(32)
                    count[taken_of(index, rng.randrange(BUCKETS))] = rng.getrandbits(32)
            time.sleep(0.001)

    return _fork(work)


def count_plausibly(seconds: float) -> int:
    """For ``seconds``, from a forked child (its pid): every bucket of every slot
    of every page this process holds counts one block past what the daemon last
    took, and each slot's blocks as many: counts no bound refuses, in every row."""
    fds = page_descriptors()

    def work() -> None:
        pages = _mapped(fds)
        counts = [page.cast("B").cast("I") for page in pages]
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            for page, count in zip(pages, counts, strict=True):
                for bucket in range(BUCKETS):
                    taken = count[taken_of(0, bucket) : taken_of(SLOTS, bucket)]
                    row = count_of(0, bucket)
                    count[row : row + SLOTS] = array("I", [(n + 1) % 2**32 for n in taken])
                for index in range(SLOTS):
                    page[word_of(index, BLOCKS)] = (page[word_of(index, TAKEN)] + BUCKETS) % 2**64
            time.sleep(0.01)

    return _fork(work)


def keep_suggesting(seconds: float) -> int:
    """A child (its pid) that asks for `suggest` over and over for ``seconds``, each
    a harvest asked for of every slot of this uid's (refusals and all)."""

    def work() -> None:
        client = Client(_state["socket"], timeout=5.0, reconnect_timeout=0.0)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            with contextlib.suppress(RequestRefused):
                client.suggest()

    return _fork(work)


def keep_releasing(seconds: float, first: int) -> int:
    """A child (its pid) that keeps this process's pages and, for ``seconds``,
    stores 0 (released) into the deadline of every slot from ``first`` on."""
    fds = page_descriptors()

    def work() -> None:
        pages = _mapped(fds)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            for page in pages:
                for index in range(first, SLOTS):
                    page[word_of(index, DEADLINE)] = 0
            time.sleep(0.001)

    return _fork(work)


def keep_ahead(seconds: float, ahead: float) -> int:
    """A child (its pid) that keeps the deadline of every slot this process was
    granted ``ahead`` seconds from now, for ``seconds``."""
    granted = [(slot.page.id, slot.deadline) for slot in _fast()._slots.values()]
    fds = {os.fstat(fd).st_ino: fd for fd in page_descriptors()}

    def work() -> None:
        pages = dict(zip(fds, _mapped(list(fds.values())), strict=True))
        words = [(pages[page], at) for page, at in granted]
        step = int(ahead * 1_000_000)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            deadline = int(time.monotonic() * 1_000_000) + step
            for page, at in words:
                page[at] = deadline

    return _fork(work)


def store_past_in_ungranted(granted: int) -> int:
    """Store deadlines long past, and absurd ones, into every slot from
    ``granted`` on of the page of this process: how many."""
    [page] = _fast()._pages.values()
    for index in range(granted, SLOTS):
        page.words[word_of(index, DEADLINE)] = 1 if index % 2 else 2**64 - 1
    return SLOTS - granted


def crowd(count: int) -> dict[str, int]:
    """Fill this process's descriptor table: ``count`` descriptors of memfds named
    as pages are (one sealed and laid out as a page, its inode another), a FIFO
    open for reading and writing, and its real page moved last by dup2 and closed
    where it was."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    forged = os.memfd_create("watchdogd-slots", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(forged, PAGE_BYTES)
    os.pwrite(forged, os.pread(page_descriptors()[0], 16, 0), 0)
    fcntl.fcntl(forged, F_ADD_SEALS, 0x0001 | 0x0002 | 0x0004)
    fifo = f"/tmp/fifo-{os.getpid()}"
    os.mkfifo(fifo)
    held = [os.open(fifo, os.O_RDWR | os.O_NONBLOCK), forged]
    os.unlink(fifo)
    plain = os.memfd_create("watchdogd-slots", os.MFD_CLOEXEC)
    held += [os.dup(plain) for _ in range(min(count, hard - 256))]
    last = hard - 1
    for fd in [fd for fd in page_descriptors() if os.fstat(fd).st_ino in _fast()._pages]:
        os.dup2(fd, last)
        os.close(fd)
        last -= 1
    _state["crowd"] = held
    return {"held": len(held), "pages at": last + 1}


def close_pages() -> int:
    """Close every descriptor of the pages this process was handed (their
    mappings stay): how many."""
    fds = [fd for fd in page_descriptors() if os.fstat(fd).st_ino in _fast()._pages]
    for fd in fds:
        os.close(fd)
    return len(fds)


def serve(count: int, after: float, rounds: int, pause: float) -> list[dict[str, int]]:
    """A trio service that runs each of ``count`` requests in a task of its own,
    inside ``expires(after)`` with its default scope (one per task), for
    ``rounds`` rounds ``pause`` seconds apart: what it held after each (its
    slots, its pages mapped, its descriptors of pages), or the first refusal."""
    held = []

    async def run() -> None:
        async with open_client(_state["socket"], responder=False) as client:

            async def handle() -> None:
                async with client.expires(after):
                    await trio.sleep(0)

            for _ in range(rounds):
                for _ in range(count):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(handle)
                await trio.sleep(pause)
                path = _fast()
                held.append(
                    {
                        "slots": len(path._slots),
                        "pages": len(path._pages),
                        "descriptors": len(page_descriptors()),
                    }
                )

    trio.run(run)
    return held


# Raw requests, as a client that skips the library's own checks sends them.


def _raw() -> tuple[socket.socket, Engine, Connection]:
    """A connection of its own to the daemon, greeted."""
    engine = Engine(_state["socket"], client="attacker", reconnect_timeout=0.0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(PATIENCE)
    sock.connect(_state["socket"])
    connection = engine.connect()
    answer, _ = _exchange(sock, connection, connection.hello_id, connection.hello)
    answer.result(Welcome)
    return sock, engine, connection


def _ask(
    raw: tuple[socket.socket, Engine, Connection], request: Any, expected: type
) -> dict[str, Any]:
    """``request`` on ``raw``: the reply (as a dict) and whether a descriptor came
    with it, or the refusal's code."""
    sock, _, connection = raw
    try:
        answer, fd = _exchange(sock, connection, request.id, connection.send(request, expected))
    except ConnectionError as exc:
        return {"closed": str(exc)}
    if fd is not None:
        os.close(fd)
    if answer.error is not None:
        return {"refused": getattr(answer.error, "code", repr(answer.error)), "descriptor": fd}
    reply = answer.reply
    assert reply is not None
    return {"reply": {f: getattr(reply, f) for f in reply.__struct_fields__}, "descriptor": fd}


def map_page(page: int) -> dict[str, Any]:
    """Ask for page ``page`` on a connection of its own."""
    raw = _raw()
    try:
        return _ask(raw, MapPage(id=raw[1].next_id(), page=page), PageMapped)
    finally:
        raw[0].close()


def map_page_from_a_child(page: int) -> dict[str, Any]:
    """A child of fork() (which inherited this process's descriptors) asks."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        _answer(write_end, lambda: {**map_page(page), "inherited": page_descriptors()})
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        outcome = json.loads(pipe.read())
    os.waitpid(child, 0)
    assert "ok" in outcome, outcome
    result: dict[str, Any] = outcome["ok"]
    return result


def map_page_once_exited(page: int) -> int:
    """Open a connection, then fork a child that keeps it and, once this process
    exited, asks on it for page ``page`` and answers on this process's pipe; the
    child's pid."""
    raw = _raw()
    parent = os.getpid()  # read here: the child may first run once this process is gone

    def work() -> None:
        while os.getppid() == parent:
            time.sleep(0.01)
        request = MapPage(id=raw[1].next_id(), page=page)
        _answer(_state["say"], lambda: _ask(raw, request, PageMapped))

    return _fork(work)


def flood_map_page(page: int, connections: int, requests: int) -> int:
    """Ask for page ``page`` ``requests`` times on each of ``connections``
    connections, reading no answer (each would bring a descriptor): how many
    connections took them all."""
    took = 0
    for _ in range(connections):
        sock, engine, connection = _raw()
        sock.setblocking(False)
        frames = b"".join(
            connection.send(MapPage(id=engine.next_id(), page=page), PageMapped)
            for _ in range(requests)
        )
        with contextlib.suppress(BlockingIOError):
            took += sock.send(frames) == len(frames)
        _state.setdefault("flood", []).append(sock)
    return took


def release_stored(scope: str) -> dict[str, Any]:
    """Release ``scope`` as a block armed by a store whose slot closed would."""
    raw = _raw()
    try:
        request = Release(id=raw[1].next_id(), scope=scope, stored=True)
        return _ask(raw, request, Released)
    finally:
        raw[0].close()


def acquire_slot(scope: str, timeout: float) -> dict[str, Any]:
    """Ask for a slot with an arm of ``scope``, whatever this process's clock."""
    raw = _raw()
    try:
        request = Acquire(id=raw[1].next_id(), scope=scope, timeout=timeout, slot=True)
        return _ask(raw, request, Acquired)
    finally:
        raw[0].close()


# Processes of root's, as workers.


def hang_in_a_block(socket: str, after: float, hang: float) -> Callable[[], None]:
    def work() -> None:
        with Client(socket, timeout=5.0).expires(after, scope="victim"):
            time.sleep(hang)

    return work


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def own_timers(daemon: RunningDaemon, uid: int) -> list[str]:
    """The scopes armed on ``uid``'s processes, as root's status lists them."""
    with daemon.client(fast=False) as client:
        return [timer.scope for timer in client.status().timers if timer.uid == uid]


def slot_outcomes(daemon: RunningDaemon) -> dict[str, float]:
    """What became of the fast path's slots, as the daemon counts it by outcome."""
    with daemon.client(fast=False) as client:
        text = client.metrics()
    return {
        labels["outcome"]: value for labels, value in samples(text, "watchdogd_slot_outcomes_total")
    }


def within_looks(count: int) -> float:
    """A timeout at which ``count`` registrations of one uid all get slots: each
    asks for two looks a period of the uid's `LOOKS_PER_UID` a second (a tenth
    more, for room)."""
    return 1.1 * count * 2 / LOOKS_PER_UID / period_of(1.0)


# The attacks.


def test_a_worker_scribbling_on_its_page_and_registering_thousands_never_delays_a_root_canary(
    daemon: RunningDaemon,
) -> None:
    before = rss_mib(daemon.pid)
    attacker = Actor(NOBODY, daemon.socket_path)
    try:
        # Released at once, so none falls due while the others register, and looked
        # at each period (a second or more) while the attack goes on.
        assert attacker("register_released", "s", SCOPES, within_looks(SCOPES)) == []
        assert attacker("slots_held") == SCOPES
        registered = rss_mib(daemon.pid)
        refused = attacker("abuse_pages")
        assert {name: code for name, code in refused.items() if name != "punch a hole"} == {
            "shrink": errno.EPERM,
            "grow": errno.EPERM,
            "write past the end": errno.EPERM,
            "seal": errno.EPERM,
        }
        with Canaries(daemon):
            attacker.keep(attacker("scribble", ATTACK_SECONDS))
            attacker.keep(attacker("keep_suggesting", ATTACK_SECONDS))
            time.sleep(ATTACK_SECONDS)
        # The daemon read what was scribbled: deadlines past its bound, counts no
        # process could have made.
        outcomes = slot_outcomes(daemon)
        assert outcomes["clamped"] > 0, outcomes
        assert outcomes["scribbled"] > 0, outcomes
        after = rss_mib(daemon.pid)
        # Each registration's record, and each page's 64 KiB once read whole.
        pages = SCOPES // SLOTS + 1
        assert registered - before < 8 + SCOPES * 2 / 1024, (before, registered)
        assert after - registered < 8 + pages / 16, (registered, after)
        assert attacker("register", "still-served", 60, "log")
    finally:
        attacker.close()


#: The slots whose counts move in every row, and for how long: as many at the
#: suite's size as at the soak's, registered in a few seconds, so that their
#: looks come together (each of them a period apart, 8.8 s).
COUNTED = 8_000
COUNTING_SECONDS = 20.0 if SOAK else 12.0


def test_counts_that_pass_every_bound_in_every_row_never_delay_a_root_canary(
    daemon: RunningDaemon,
) -> None:
    """Counts no bound refuses, one block more in every bucket of every slot before
    each look, and `suggest` asked for over and over: each harvest would read every
    row of its page. Without a bound on the rows a uid's harvests read, canaries
    fired 0.3-1.1 s late to the looks alone; a `suggest` that read every slot of
    its uid's took 16-25 ms a request here, one that reads only the slots that
    moved, until the uid's share is spent, 3.5-5 ms."""
    attacker = Actor(NOBODY, daemon.socket_path)
    try:
        assert attacker("register_released", "p", COUNTED, within_looks(COUNTED)) == []
        assert attacker("slots_held") == COUNTED

        with Canaries(daemon):
            attacker.keep(attacker("count_plausibly", COUNTING_SECONDS))
            attacker.keep(attacker("keep_suggesting", COUNTING_SECONDS))
            time.sleep(COUNTING_SECONDS)
        # The daemon read what was counted, and left for later what was past the
        # uid's share of harvests.
        outcomes = slot_outcomes(daemon)
        assert outcomes["deferred"] > 0, outcomes
        assert outcomes["scribbled"] == 0, outcomes
    finally:
        attacker.close()


def test_a_page_of_a_process_that_exited_is_never_handed_to_the_next_process_on_its_pid(
    daemon: RunningDaemon,
) -> None:
    attacker = Actor(NOBODY, daemon.socket_path)
    try:
        attacker("register", "bait", 60)
        # Its registration goes (the process leaves the daemon's table), a child
        # keeps its page and releases whatever is stored in it, and it exits.
        assert attacker("unregister", "bait")
        attacker.keep(attacker("keep_releasing", 3 * PATIENCE, 1))
        pid = attacker.pid
        attacker.exit()
        # A worker of root's takes its pid and hangs in a protected block.
        victim = fork_at_pid(pid, hang_in_a_block(str(daemon.socket_path), 0.5, PATIENCE))
        try:
            entered = time.monotonic()
            assert victim.wait() == -signal.SIGKILL
            assert time.monotonic() - entered < 0.5 + 1.0
        finally:
            victim.close()
    finally:
        attacker.close()


def test_a_process_that_takes_the_pid_of_roots_worker_never_gets_its_page(
    daemon: RunningDaemon,
) -> None:
    worker = Actor(0, daemon.socket_path)
    try:
        page = worker("register", "step", 60)
        assert worker("unregister", "step")  # its process leaves the table
        pid = worker.pid
        worker.exit()
    finally:
        worker.close()
    said, say = os.pipe()

    def ask() -> None:
        _state["socket"] = str(daemon.socket_path)
        _answer(say, lambda: map_page(page))

    taker = fork_at_pid(pid, ask, uid=NOBODY)
    try:
        os.close(say)
        with os.fdopen(said) as pipe:
            outcome = json.loads(pipe.readline())
        assert outcome["ok"]["refused"] == "invalid_request", outcome
        assert taker.wait() == 0
    finally:
        taker.close()


def test_the_daemon_keeps_nothing_of_a_process_whose_registrations_went_before_it_exited(
    daemon: RunningDaemon,
) -> None:
    with daemon.client(fast=False) as client:
        client.ping()
        before = descriptors_of(daemon.pid)
    for _ in range(200 if SOAK else 20):
        attacker = Actor(NOBODY, daemon.socket_path)
        try:
            attacker("register", "bait", 60)
            assert attacker("unregister", "bait")
            attacker.exit()
        finally:
            attacker.close()
    with daemon.client(fast=False) as client:
        wait_until(
            lambda: client.status_page(limit=1).daemon.processes == 0,
            what="the attackers to leave the table",
        )
        assert descriptors_of(daemon.pid) <= before + SPARE_DESCRIPTORS


#: The per-uid limit of the tests of limits, and how many rounds of registrations
#: past it they make.
LIMIT = 1_000 if SOAK else 50
ROUNDS = 5
#: The timeout of the reclaim test's arms nearer than a registration's period: long
#: enough that arming a round's registrations again and releasing them all ends
#: before the first falls due (a block that fires takes its registration with it,
#: and then there is nothing to reclaim), on a loaded machine too.
NEARER = LIMIT / 100


def test_registrations_past_the_limit_reclaim_their_own_and_the_uid_stays_within_its_bound(
    socket_path: Path, tmp_path: Path
) -> None:
    config = f"[daemon]\nmax_timers_per_uid = {LIMIT}\n"
    with daemon_with(config, socket_path, tmp_path) as daemon:
        attacker = Actor(NOBODY, daemon.socket_path)
        other = Actor(OTHER, daemon.socket_path)
        try:
            with Canaries(daemon):
                for round_ in range(ROUNDS):
                    # Registered with a period of days, looked at soon (an arm
                    # nearer than the period), released: reclaimed at the next
                    # round, whose registrations are all taken once the round
                    # before's, closed by it, were let go of (a uid with as many
                    # closing as its limit is refused, by design: how soon they
                    # go is the daemon's next look, not this test's; a second
                    # try arms again those it took).
                    prefix = f"r{round_}-"
                    wait_until(
                        lambda prefix=prefix: (
                            not attacker("register_many", prefix, LIMIT, 1000, "log")
                        ),
                        what=f"every registration of round {round_} to be taken",
                    )
                    attacker("rearm_many", prefix, LIMIT, NEARER, "log")
                    attacker("release_many", prefix, LIMIT)
                    time.sleep(0.3)
                # Another user, meanwhile, has its own limit whole.
                assert other("register_many", "o", LIMIT, 60, "log") == []
            # Each registration past the first round took the place of one of the
            # round before's, and each round's closed ones went before the round
            # after next could take their places.
            outcomes = slot_outcomes(daemon)
            assert outcomes["reclaimed"] >= (ROUNDS - 1) * LIMIT, outcomes
            assert outcomes["retired"] >= (ROUNDS - 2) * LIMIT, outcomes
            assert outcomes["lost"] == 0, outcomes
            # Every slot it ever had, armed: what the daemon still holds is listed.
            attacker("store_everywhere", 1000)
            time.sleep(0.2)
            assert len(own_timers(daemon, NOBODY)) <= 2 * LIMIT
        finally:
            attacker.close()
            other.close()


def test_stores_into_closed_slots_never_let_a_uid_hold_more_than_twice_its_limit(
    socket_path: Path, tmp_path: Path
) -> None:
    config = f"[daemon]\nmax_timers_per_uid = {LIMIT}\n"
    with daemon_with(config, socket_path, tmp_path) as daemon:
        attacker = Actor(NOBODY, daemon.socket_path)
        try:
            with Canaries(daemon):
                for round_ in range(ROUNDS):
                    # Each round reclaims the last one's, whose slots, closed, are
                    # armed by stores at once, and never seen released again.
                    prefix = f"r{round_}-"
                    attacker("register_storing", prefix, LIMIT, NEARER, 1000)
                    attacker("release_many", prefix, LIMIT)
                    time.sleep(0.4)
            attacker("store_everywhere", 1000)
            time.sleep(0.2)
            assert len(own_timers(daemon, NOBODY)) <= 2 * LIMIT
            assert slot_outcomes(daemon)["reclaimed"] >= LIMIT
        finally:
            attacker.close()


def test_map_page_hands_a_process_its_own_pages_and_nobody_elses(daemon: RunningDaemon) -> None:
    roots = Actor(0, daemon.socket_path)
    attacker = Actor(NOBODY, daemon.socket_path)
    sibling = Actor(NOBODY, daemon.socket_path)
    try:
        root_page = roots("register", "step", 60)
        own_page = attacker("register", "step", 60)
        assert attacker("map_page", own_page)["descriptor"] is not None
        # Another user's page, and a page of its own user's other process.
        for page in (root_page, own_page):
            assert sibling("map_page", page)["refused"] == "invalid_request"
        # A child of its fork holds its page's descriptor (inherited, as every
        # descriptor is), but is not the process the page is for.
        child = attacker("map_page_from_a_child", own_page)
        assert child["refused"] == "invalid_request"
        assert child["inherited"]
        # A connection whose process exited, kept by a child of it: refused as a
        # connection of no process, or, once the daemon saw the exit and let the
        # page go with its process, as a page of nobody's.
        attacker.keep(attacker("map_page_once_exited", own_page))
        attacker.exit()
        assert attacker.said()["refused"] in ("no_such_process", "invalid_request")
    finally:
        roots.close()
        attacker.close()
        sibling.close()


def test_a_restart_that_searches_descriptor_tables_full_of_forgeries_never_delays_a_root_canary(
    daemon: RunningDaemon,
) -> None:
    moved = Actor(NOBODY, daemon.socket_path)
    lost = Actor(NOBODY, daemon.socket_path)
    try:
        for attacker in (moved, lost):
            attacker("register_many", "c", 5, 60, "log")
            # Thousands of memfds named as pages are (one sealed and laid out as
            # one), a FIFO, and the real page moved last by dup2.
            assert attacker("crowd", DESCRIPTORS)["held"] >= min(DESCRIPTORS, 1000)
        assert lost("close_pages") == 1
        for attacker in (moved, lost):
            # Looked at a second from now, as the state will say; released.
            attacker("rearm_many", "c", 5, 1.2, "log")
            attacker("release_many", "c", 5)
        looked = time.monotonic() + 1.2
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with Canaries(daemon), daemon.client(fast=False) as client:
            # One more canary, due as the looks that search begin.
            with at_timing_priority():
                victim = sleeper()
                try:
                    due = looked + 0.02 - time.monotonic()
                    remaining = client.acquire("due", due, pid=victim.pid)
                    deadline = time.monotonic() + remaining
                    late = death_time(victim) - deadline
                finally:
                    reap(victim)
            assert late < ON_TIME, (
                f"a canary due as the search began died {late * 1000:.0f} ms late"
            )
            # The page moved by dup2 was found again: its slots are read.
            moved("store_everywhere", 1000)
            wait_until(
                lambda: len([s for s in own_timers(daemon, NOBODY) if s.startswith("c")]) == 5,
                what="the moved page's slots to be read",
            )
    finally:
        moved.close()
        lost.close()


def test_deadlines_stored_in_slots_never_granted_fire_nothing(daemon: RunningDaemon) -> None:
    attacker = Actor(NOBODY, daemon.socket_path)
    try:
        with Canaries(daemon):
            attacker("register", "granted", 0.5)
            assert attacker("release", "granted")
            # Long past, and past every bound, in the 62 slots of its page it was
            # never granted; under the default policy, SIGKILL.
            assert attacker("store_past_in_ungranted", 1) == SLOTS - 1
            time.sleep(1.0)  # two looks at its granted slot, and more
            # Its next registration takes one of them: what it stored there is
            # overwritten by the arm.
            attacker("register", "second", 0.5)
            assert attacker("release", "second")
            time.sleep(1.0)
        with daemon.client(fast=False) as client:
            assert [e for e in client.events(limit=1000).events if e.pid == attacker.pid] == []
        assert attacker("register", "third", 60)  # alive, and served
    finally:
        attacker.close()


def test_a_release_sent_as_stored_never_disarms_what_root_armed_on_the_worker(
    daemon: RunningDaemon,
) -> None:
    attacker = Actor(NOBODY, daemon.socket_path)
    try:
        attacker("register", "step", 60)
        with daemon.client(fast=False) as client:
            client.acquire("step", 600, pid=attacker.pid, policy="term")
        assert attacker("release_stored", "step")["reply"]["found"] is False
        # Its old slot, stored into: closed, so the client says so over the socket.
        assert attacker("release", "step") is False
        with daemon.client(fast=False) as client:
            [timer] = [t for t in client.status().timers if t.pid == attacker.pid]
        assert (timer.scope, timer.policy) == ("step", "term")
        assert timer.remaining > 590
    finally:
        attacker.close()


def test_a_process_that_gives_up_root_after_registering_never_fires_roots_policy_by_a_store(
    socket_path: Path, tmp_path: Path
) -> None:
    config = '[policies.rooted]\nsteps = [ { signal = "SIGUSR1" } ]\nroot_only = true\n'
    with daemon_with(config, socket_path, tmp_path) as daemon:
        worker = Actor(0, daemon.socket_path)
        try:
            with Canaries(daemon):
                worker("register", "step", 0.5, "rooted")
                assert worker("release", "step")
                assert worker("give_up_root") == NOBODY
                worker("store", "step", 1)  # long past
                time.sleep(1.0)  # two looks
            assert worker("register", "again", 60)  # alive: no SIGUSR1 came
            with daemon.client(fast=False) as client:
                assert [e for e in client.events(limit=1000).events if e.pid == worker.pid] == []
        finally:
            worker.close()


#: A process that asks the daemon itself for a slot, from wherever it runs.
ASK_FOR_A_SLOT = """
import json, socket, sys
from watchdogd_client.engine import Engine
from watchdogd_client.fastpath import _exchange
from watchdogd_protocol import Acquire, Acquired, Welcome
engine = Engine(sys.argv[1], client="attacker", reconnect_timeout=0.0)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
connection = engine.connect()
_exchange(sock, connection, connection.hello_id, connection.hello)[0].result(Welcome)
request = Acquire(id=engine.next_id(), scope="step", timeout=60, slot=True, policy="log")
reply = _exchange(sock, connection, request.id, connection.send(request, Acquired))[0]
print(json.dumps(reply.result(Acquired).slot is not None), flush=True)
"""


def test_a_process_in_another_time_namespace_gets_no_slot_even_when_it_asks_itself(
    daemon: RunningDaemon,
) -> None:
    command = ["unshare", "--time", "--monotonic", "86400", "--kill-child", sys.executable, "-c"]
    asked = subprocess.run(
        [*command, ASK_FOR_A_SLOT, str(daemon.socket_path)],
        capture_output=True,
        text=True,
        timeout=PATIENCE * 3,
        check=True,
    )
    assert json.loads(asked.stdout) is False


def test_a_process_that_moves_to_another_time_namespace_after_registering_is_still_on_time(
    daemon: RunningDaemon,
) -> None:
    elsewhere = subprocess.Popen(
        ["unshare", "--time", "--monotonic", "86400", "--kill-child", "sleep", "60"]
    )
    worker = Actor(0, daemon.socket_path)
    try:
        wait_until(
            lambda: any(
                os.readlink(f"/proc/{pid}/ns/time") != os.readlink("/proc/self/ns/time")
                for pid in _children(elsewhere.pid)
            ),
            what="a process in another time namespace",
        )
        [moved] = _children(elsewhere.pid)
        worker("register", "step", 0.5)
        assert worker("release", "step")
        assert worker("enter_time_namespace", moved)
        entered = time.monotonic()
        worker.tell("hang", "step", 0.5, PATIENCE)
        died = worker.death_time(timeout=2.0)
        # Its block began after ``entered`` (once the worker read the command):
        # never killed early, not an offset off; and on time by the daemon's record.
        assert 0.5 <= died - entered < 0.5 + 1.0
        with daemon.client() as client:
            late = expired_event(client, worker.pid).late
        assert late is not None
        assert late < ON_TIME
    finally:
        worker.close()
        reap(elsewhere)


def test_a_service_registering_a_scope_per_request_keeps_the_daemon_and_itself_bounded(
    socket_path: Path, tmp_path: Path
) -> None:
    # Released registrations are seen idle within a period (0.175 s), closed
    # after slot_idle and retired after the closing wait: all within a round. A
    # round's registrations are as many as its uid's reads a second allow.
    config = "[daemon]\nslot_idle = 0.3\n"
    per_round = 150
    with daemon_with(config, socket_path, tmp_path) as daemon:
        before = descriptors_of(daemon.pid)
        service = Actor(NOBODY, daemon.socket_path)
        try:
            with Canaries(daemon):
                held = service("serve", per_round, 0.2, ROUNDS_OF_REQUESTS, 0.9)
            # Each request registered; on a slow machine a round outlasts
            # slot_idle, and its first registrations are retired before its end.
            assert 0 < held[0]["slots"] <= per_round, held
            assert descriptors_of(daemon.pid) <= before + SPARE_DESCRIPTORS + 2 * (
                per_round // SLOTS + 2
            )
            # What the service holds is what the daemon still reads, not every
            # scope it ever registered.
            last = held[-1]
            assert last["slots"] <= 2 * per_round, held
            # Its descriptors of pages are its mappings' (one each), round after round.
            assert all(h["descriptors"] == h["pages"] for h in held), held
            assert last["pages"] <= 2 * (per_round // SLOTS + 2), held
        finally:
            service.close()


#: Registrations whose deadlines a process keeps just ahead of the daemon's looks.
STORMED = 8_000 if SOAK else 2_000


def test_deadlines_kept_just_ahead_of_every_look_never_delay_a_root_canary(
    daemon: RunningDaemon,
) -> None:
    attacker = Actor(NOBODY, daemon.socket_path)
    timeout = max(3.0, within_looks(STORMED))
    try:
        # Released at once, so none falls due before the storm begins.
        assert attacker("register_released", "s", STORMED, timeout) == []
        assert attacker("slots_held") == STORMED
        # Each look finds the slot's deadline 50 ms on.
        attacker.keep(attacker("keep_ahead", ATTACK_SECONDS + period_of(timeout) + 5, 0.05))
        time.sleep(period_of(timeout))  # the first looks, a period after the registrations
        with Canaries(daemon):
            time.sleep(ATTACK_SECONDS)
    finally:
        attacker.close()


def test_registrations_with_the_shortest_period_left_released_never_delay_a_root_canary(
    daemon: RunningDaemon,
) -> None:
    attacker = Actor(NOBODY, daemon.socket_path)
    try:
        with Canaries(daemon):
            # Each released at once by a store, and then looked at every period
            # (2 ms) for as long as it idles: a request would buy hundreds of
            # looks a second, were the uid's looks not bounded (the rest of its
            # arms are plain timers, released over the socket).
            assert attacker("register_released", "s", STORMED, 0.0025) == []
            assert 0 < attacker("slots_held") <= LOOKS_PER_UID * period_of(0.0025) / 2
            time.sleep(ATTACK_SECONDS)
    finally:
        attacker.close()


def test_map_pages_left_unread_hold_nothing_in_the_daemon(daemon: RunningDaemon) -> None:
    before = descriptors_of(daemon.pid), rss_mib(daemon.pid)
    attacker = Actor(NOBODY, daemon.socket_path)
    try:
        page = attacker("register", "step", 60, "log")
        with Canaries(daemon):
            attacker("flood_map_page", page, 64, 2_000)
            time.sleep(ATTACK_SECONDS / 2)
            # A connection's own descriptors (its socket, its caller's pidfds),
            # never one per page it was sent.
            assert descriptors_of(daemon.pid) <= before[0] + SPARE_DESCRIPTORS + 64 * 3 + 2
        assert rss_mib(daemon.pid) - before[1] < 16
    finally:
        attacker.close()
    with daemon.client(fast=False) as client:
        wait_until(
            lambda: client.status_page(limit=1).daemon.connections <= 1,
            what="the flood's connections to close",
        )
        assert descriptors_of(daemon.pid) <= before[0] + SPARE_DESCRIPTORS


def test_a_service_registering_a_scope_per_request_past_its_limit_is_never_refused(
    socket_path: Path, tmp_path: Path
) -> None:
    # A limit its requests pass within a second: each registration is released
    # at once, and the daemon's first look at it comes most of a second later.
    limit = 500
    config = f"[daemon]\nmax_timers_per_uid = {limit}\n"
    with daemon_with(config, socket_path, tmp_path) as daemon:
        service = Actor(NOBODY, daemon.socket_path)
        try:
            service("serve", 4 * limit, 1.0, 1, 0.0)
            assert len(own_timers(daemon, NOBODY)) <= 2 * limit
        finally:
            service.close()


def test_the_canaries_run_the_daemon_at_the_priority_the_unit_gives_it() -> None:
    unit = (Path(__file__).parents[2] / "systemd" / "watchdogd.service").read_text()
    assert f"\nNice={UNIT_NICE}\n" in unit
