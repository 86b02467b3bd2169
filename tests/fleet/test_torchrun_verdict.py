"""A torchrun job of 4 ranks on 2 "hosts" (2 nodes of 2 gloo ranks, each node on
its own daemon, one real etcd), where rank 2 stops before an ``all_reduce`` the
other three enter: with the Flight Recorder on, both hosts name it ``missing`` from
that collective, within 3 s of the first deadline, and the sentence names the
function it is in; with the Flight Recorder off, the stacks name it (``odd_frame``)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd_protocol import IncidentInfo

from helpers.daemon import RunningDaemon
from helpers.etcd import EtcdServer
from helpers.fleet import daemons_of
from helpers.jobs import incidents, whole
from helpers.waiting import PATIENCE, wait_until

pytest.importorskip("torch")


TORCHRUN = str(Path(sys.executable).parent / "torchrun")
HOSTS = ("host-a", "host-b")

CONFIG = """
[daemon]
incident_window = 30

[policies.rank]
steps = [ {{ dump = true, timeout = 20 }}, {{ signal = "SIGKILL" }} ]

[fleet]
etcd = ["{etcd}"]
host = "{host}"
prefix = "/watchdogd-test"
lease = 2
"""

#: Each rank all-reduces three steps under a 4 s timer; at the third, rank 2 reads a
#: shard instead, outside any block, and never enters the all_reduce.
TRAIN = """\
import time

import torch
import torch.distributed as dist
import torch.distributed.elastic.timer as timer

from watchdogd_client.torch import WatchdogdTimerClient

dist.init_process_group("gloo")
rank = dist.get_rank()
timer.configure(WatchdogdTimerClient(policy="rank"))


def read_shard():
    time.sleep(300)


def all_reduce_the_step(tensor):
    dist.all_reduce(tensor)


tensor = torch.ones(4)
for step in range(3):
    if step == 2 and rank == 2:
        read_shard()
    with timer.expires(after=4):
        all_reduce_the_step(tensor)
"""


def two_hosts(
    etcd: EtcdServer, root: Path
) -> contextlib.AbstractContextManager[list[RunningDaemon]]:
    return daemons_of(etcd, root, CONFIG, HOSTS)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def nodes(
    job: str, script: Path, daemons: list[RunningDaemon], log_dir: Path, *, recorder: bool
) -> Iterator[None]:
    """Two torchrun agents, one a node, each node's ranks on its own daemon."""
    port = free_port()
    agents = []
    try:
        for node, daemon in enumerate(daemons):
            env = {k: v for k, v in os.environ.items() if not k.startswith("WATCHDOGD_")}
            env.update(WATCHDOGD_SOCKET=str(daemon.socket_path), WATCHDOGD_JOB=job)
            # torch records collectives by default: off is said outright.
            env["TORCH_FR_BUFFER_SIZE"] = "2000" if recorder else "0"
            command = [
                TORCHRUN,
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                f"--log-dir={log_dir / str(node)}",
                str(script),
            ]
            agents.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        yield
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, 9)
            agent.wait()


def verdicts(daemons: list[RunningDaemon], kind: str) -> dict[str, IncidentInfo] | None:
    """Each host's one incident, once both carry a verdict of ``kind`` over 4 ranks."""
    seen = {}
    for daemon, host in zip(daemons, HOSTS, strict=True):
        listed = incidents(daemon.socket_path)
        if len(listed) != 1:
            return None
        incident = whole(daemon.socket_path, listed[0].id)
        if incident.verdict is None or incident.verdict.kind != kind or len(incident.ranks) < 4:
            return None
        seen[host] = incident
    return seen


@pytest.mark.parametrize(("recorder", "kind"), [(True, "missing"), (False, "odd_frame")])
def test_a_rank_that_never_entered_the_collective_is_named_on_both_hosts(
    own_etcd: EtcdServer, tmp_path: Path, recorder: bool, kind: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = f"train-{os.getpid()}-{kind}"
    with (
        two_hosts(own_etcd, tmp_path) as daemons,
        nodes(job, script, daemons, tmp_path / "torchelastic", recorder=recorder),
    ):
        found: dict[str, IncidentInfo] = {}

        def named() -> bool:
            seen = verdicts(daemons, kind)
            if seen is not None:
                found.update(seen)
            return seen is not None

        wait_until(named, what=f"a {kind} verdict on both hosts", timeout=PATIENCE * 6)
        for host, incident in found.items():
            verdict = incident.verdict
            assert verdict is not None
            assert [(c.host, c.rank) for c in verdict.culprits] == [("host-b", 2)], (host, verdict)
            if recorder:
                assert verdict.collective is not None
                assert verdict.collective.op == "gloo:all_reduce", verdict
                assert verdict.basis == "flight_recorder"
            assert "read_shard" in verdict.text, verdict.text
        assert found["host-a"].id == found["host-b"].id
        # Named on each host within 3 s of the first deadline (the incident's time):
        # when its verdict settled, by that daemon's own event.
        first = min(incident.time for incident in found.values())
        for daemon in daemons:
            with daemon.client() as client:
                settled = [
                    event.time
                    for event in client.events(limit=1000).events
                    if event.kind == "verdict" and event.incident == found["host-a"].id
                ]
            assert len(settled) == 1, settled
            assert settled[0] - first < 3.0, (settled[0] - first, daemon.log())
