"""A hang that repeats, across hosts, against a real etcd: three frozen hosts are not
a job's hang that repeats, and verdicts an etcd writer forges, naming a culprit the
same way three times, never mark a job whose ranks here bear none of them out."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import msgspec
import trio

from watchdogd.fleet.etcd import EtcdClient
from watchdogd_protocol import HangsReply, IncidentInfo

from helpers.daemon import RunningDaemon, ctl
from helpers.etcd import EtcdServer, registered
from helpers.fleet import daemons_of
from helpers.jobs import incidents, start_rank, whole
from helpers.processes import reap, sleeper
from helpers.waiting import PATIENCE, wait_until

_T = TypeVar("_T")
PREFIX = "/watchdogd-test"
LEASE = 2
CONFIG = """
[daemon]
incident_window = 1

[policies.rank]
steps = [ {{ dump = true }}, {{ signal = "SIGKILL" }} ]

[fleet]
etcd = ["{etcd}"]
host = "{host}"
prefix = "/watchdogd-test"
lease = 2
"""


def job_of(daemon: RunningDaemon, job: str) -> tuple[int, HangsReply]:
    shown = ctl(daemon.socket_path, "job", job, "--json", "--wait", "0")
    assert shown.returncode in (0, 3), shown.stderr
    return shown.returncode, msgspec.json.decode(shown.stdout, type=HangsReply)


def connected(daemon: RunningDaemon) -> bool:
    with daemon.client() as client:
        return client.status().daemon.fleet == "connected"


def test_three_frozen_hosts_are_not_a_hang_that_repeats(etcd: EtcdServer, tmp_path: Path) -> None:
    hosts = ("fa", "fb", "fc", "fd")
    with daemons_of(etcd, tmp_path, CONFIG, hosts) as daemons:
        held = [sleeper() for _ in daemons]
        try:
            for daemon, process in zip(daemons, held, strict=True):
                wait_until(lambda d=daemon: connected(d), what="the fleet")
                with daemon.client() as client:
                    client.acquire("held", 120, pid=process.pid, job="run-f")
            wait_until(
                lambda: all(["root", "run-f"] in registered(etcd, host, PREFIX) for host in hosts),
                what="every host's job in etcd",
            )
            for frozen in daemons[1:]:
                assert frozen.process is not None
                frozen.process.send_signal(signal.SIGSTOP)
            survivor = daemons[0].socket_path

            def three_settled() -> bool:
                listed = incidents(survivor)
                return len(listed) == 3 and all(i.repeat for i in listed)

            wait_until(three_settled, what="three lost hosts", timeout=LEASE + PATIENCE * 2)
            status, reply = job_of(daemons[0], "run-f")
            assert (status, reply.repeating, reply.hangs) == (0, "", [])
            assert [i.kind for i in reply.incidents] == ["host_lost"] * 3
            assert all(i.repeat.startswith("not counted: a host_lost") for i in reply.incidents)
        finally:
            for daemon in daemons[1:]:
                with contextlib.suppress(ProcessLookupError):
                    daemon.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            for process in held:
                reap(process)


def etcd_call(etcd: EtcdServer, call: Callable[[EtcdClient], Awaitable[_T]]) -> _T:
    async def run() -> _T:
        async with EtcdClient([etcd.url], timeout=30) as client:
            return await call(client)

    return trio.run(run)


def forge(etcd: EtcdServer, *puts: tuple[str, object]) -> None:
    """Put each value (as JSON) at its key, in order."""

    async def write(client: EtcdClient) -> None:
        for key, value in puts:
            await client.put(key, json.dumps(value).encode())

    etcd_call(etcd, write)


def key(*parts: str) -> str:
    return "/".join((PREFIX, *(quote(part, safe="") for part in parts)))


def forged_rank(number: int) -> dict[str, object]:
    """Rank ``number`` of host hx, in all_reduce #5 of the default group of four."""
    entered = {"group": "0", "seq": 5, "op": "gloo:all_reduce", "state": "scheduled"}
    return {
        "host": "hx", "pid": 900 + number, "uid": 0, "role": "expired", "scope": "step",
        "state": "done", "rank": number, "evidence": "worker", "reader": "root",
        "flight": [{"group": "0", "desc": "default_pg", "size": 4, "entered": entered,
                    "completed": 4}],
    }  # fmt: skip


def test_forged_verdicts_naming_a_culprit_here_never_mark_its_job(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    """An etcd writer forges three incidents of root's job from a host hx, each
    with ranks 1-3 waiting in all_reduce #5 for rank 0, a healthy rank here. Each
    settles here as `missing`, naming rank 0, with one fingerprint; none counts,
    since no rank here expired or waits in that collective."""
    with daemons_of(etcd, tmp_path, CONFIG, ("h1",)) as [daemon]:
        wait_until(lambda: connected(daemon), what="the fleet")
        rank = start_rank(daemon.socket_path, "train-f", 0, 120)
        try:
            wait_until(
                lambda: ["root", "train-f"] in registered(etcd, "h1", PREFIX),
                what="the job in etcd",
            )
            now = time.time()
            for n in range(3):
                incident = f"hx-{n}"
                head = {"id": incident, "job": "train-f", "user": "root", "uid": 0,
                        "host": "hx", "scope": "step", "reason": "timeout",
                        "time": now - 30 + 10 * n}  # fmt: skip
                forge(
                    etcd,
                    (key("incidents", incident), head),
                    (key("ranks", "root", "train-f", incident, "hx"),
                     [forged_rank(number) for number in (1, 2, 3)]),
                )  # fmt: skip

            def three_settled() -> list[IncidentInfo]:
                listed = [whole(daemon.socket_path, i.id) for i in incidents(daemon.socket_path)]
                return listed if len(listed) == 3 and all(i.repeat for i in listed) else []

            wait_until(lambda: bool(three_settled()), what="three forged incidents settled")
            shown = three_settled()
            verdicts = [i.verdict for i in shown]
            assert all(v is not None and v.kind == "missing" for v in verdicts), verdicts
            assert {c.rank for v in verdicts if v for c in v.culprits} == {0}
            assert len({v.fingerprint for v in verdicts if v}) == 1
            assert all(i.repeat.startswith("not counted here") for i in shown), shown
            status, reply = job_of(daemon, "train-f")
            assert (status, reply.repeating, reply.hangs) == (0, "", [])
        finally:
            reap(rank)
