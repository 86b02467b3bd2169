"""An incident names its culprit: evidence from inside each rank (its responder),
py-spy where a rank cannot answer, and the verdict over them, on a real daemon with
real workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

import watchdogd
import watchdogd_client
from watchdogd_client.protocol import IncidentInfo

from helpers.daemon import RunningDaemon, configured_daemon, ctl
from helpers.jobs import incidents, whole
from helpers.processes import python_worker, reap, wait_ready
from helpers.waiting import wait_until

CONFIG = """
[policies.rank]
steps = [ { dump = true }, { signal = "SIGKILL" } ]
"""

#: A rank of job ``argv[1]``: rank ``argv[2]`` waits in ``wait_in_all_reduce`` under a
#: timer of ``argv[3]`` seconds; with ``argv[4]`` == "elsewhere" it arms a timer
#: once (so its responder starts), then is stuck in ``read_shard`` outside any
#: block, as a rank that never reached the collective its peers wait in; with
#: "regex" it holds the GIL in a catastrophic regular expression instead.
RANK = """
    import re, sys, time
    from watchdogd_client import expires
    job, rank, after, how = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

    def wait_in_all_reduce():
        time.sleep(300)

    def read_shard():
        time.sleep(300)

    def parse_header():
        re.match(r"(a+)+$", "a" * 64 + "b")

    if how == "waits":
        with expires(after=after, scope="step", policy="rank", job=job, rank=rank):
            print("ready", flush=True)
            wait_in_all_reduce()
    with expires(after=60, scope="warmup", job=job, rank=rank):
        pass
    time.sleep(0.3)  # its responder connects and responds
    print("ready", flush=True)
    read_shard() if how == "elsewhere" else parse_header()
"""


def start(socket: Path, job: str, rank: int, after: float, how: str) -> subprocess.Popen[str]:
    worker = python_worker(RANK, job, str(rank), str(after), how, socket=socket)
    wait_ready(worker)
    return worker


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG) as running:
        yield running


def settled(socket: Path, ranks: int) -> IncidentInfo:
    """The one incident kept, once its verdict has settled over ``ranks`` ranks."""
    found: list[IncidentInfo] = []

    def done() -> bool:
        listed = incidents(socket)
        if len(listed) != 1:
            return False
        incident = whole(socket, listed[0].id)
        found[:] = [incident]
        verdict = incident.verdict
        return len(incident.ranks) == ranks and verdict is not None and verdict.settled

    wait_until(done, what=f"an incident of {ranks} ranks with a settled verdict")
    return found[0]


def run_job(socket: Path, job: str, culprit: str) -> list[subprocess.Popen[str]]:
    """Ranks 1 (waits, long timer) and 2 (``culprit``), then rank 0 whose timer
    expires in a second."""
    ranks = [start(socket, job, 1, 60, "waits"), start(socket, job, 2, 60, culprit)]
    ranks.append(start(socket, job, 0, 1.0, "waits"))
    return ranks


def test_a_rank_stuck_outside_any_block_is_named_from_its_own_stacks(
    daemon: RunningDaemon,
) -> None:
    socket = daemon.socket_path
    ranks = run_job(socket, "train-9", "elsewhere")
    try:
        incident = settled(socket, 3)
        verdict = incident.verdict
        assert verdict is not None
        assert (verdict.kind, verdict.basis) == ("odd_frame", "stacks")
        assert [(c.rank, c.pid) for c in verdict.culprits] == [(2, ranks[1].pid)]
        assert "read_shard" in verdict.text, verdict.text
        shown = {r.rank: (r.role, r.evidence) for r in incident.ranks}
        assert shown == {0: ("expired", "worker"), 1: ("peer", "worker"), 2: ("peer", "worker")}
        text = ctl(socket, "incident", incident.id)
        assert text.stdout.startswith("verdict: odd_frame (by the stacks): rank 2 "), text.stdout
        # Counted once, and an event of its own.
        metrics = ctl(socket, "metrics").stdout
        assert 'watchdogd_incident_verdicts_total{kind="odd_frame"} 1.0' in metrics
        events = ctl(socket, "events", "--json").stdout
        assert '"kind":"verdict"' in events.replace(" ", "")
    finally:
        for rank in ranks:
            reap(rank)


def test_a_daemon_without_py_spy_still_gets_every_ranks_stack(
    socket_path: Path, tmp_path: Path
) -> None:
    """The daemon runs from a directory with no py-spy and a PATH without it: every
    rank's stack comes from inside the rank."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    path = "/usr/bin:/bin"
    assert shutil.which("py-spy", path=f"{path}:{bare}") is None
    # Its packages as the venv has them: site-packages (whose .pth files a
    # PYTHONPATH entry does not read) and both editable packages' roots.
    site = sysconfig.get_paths()["purelib"]
    roots = [str(Path(str(module.__file__)).parents[1]) for module in (watchdogd, watchdogd_client)]
    config = tmp_path / "watchdogd.toml"
    config.write_text(CONFIG)
    running = RunningDaemon(
        socket_path,
        tmp_path / "log",
        ["--config", str(config)],
        env={"PATH": path, "PYTHONPATH": os.pathsep.join([*roots, site])},
        command=[str(bare / "python"), "-m", "watchdogd", "--socket", str(socket_path)],
    )
    running.start()
    ranks = run_job(socket_path, "train-10", "elsewhere")
    try:
        incident = settled(socket_path, 3)
        assert {r.rank: r.evidence for r in incident.ranks} == {
            0: "worker",
            1: "worker",
            2: "worker",
        }
        assert all(r.stack.startswith("Thread ") for r in incident.ranks)
        assert incident.verdict is not None
        assert incident.verdict.kind == "odd_frame"
    finally:
        for rank in ranks:
            reap(rank)
        assert running.stop() == 0, running.log()


def test_a_rank_holding_the_gil_in_c_code_is_dumped_by_py_spy(daemon: RunningDaemon) -> None:
    """Its responder cannot run while a regular expression holds the GIL: the daemon
    waits ``evidence_timeout`` for it, then takes its stack with py-spy, and the
    verdict still comes."""
    socket = daemon.socket_path
    ranks = run_job(socket, "train-11", "regex")
    try:
        incident = settled(socket, 3)
        by_rank = {r.rank: r for r in incident.ranks}
        assert by_rank[2].evidence == "py-spy", by_rank[2]
        assert "parse_header" in by_rank[2].stack
        assert (by_rank[0].evidence, by_rank[1].evidence) == ("worker", "worker")
        verdict = incident.verdict
        assert verdict is not None
        assert verdict.kind == "odd_frame"
        assert [c.rank for c in verdict.culprits] == [2]
    finally:
        for rank in ranks:
            reap(rank)
