"""An incident names its culprit: evidence from inside each rank (its responder),
py-spy where a rank cannot answer, and the verdict over them, on a real daemon with
real workers."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

import watchdogd
import watchdogd_client

from helpers.daemon import RunningDaemon, configured_daemon, ctl
from helpers.jobs import incidents, run_job, settled
from helpers.processes import python_worker, reap, wait_ready
from helpers.waiting import wait_until

CONFIG = """
[policies.rank]
steps = [ { dump = true }, { signal = "SIGKILL" } ]
"""


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG) as running:
        yield running


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


TRIO_RANK = """
    import trio
    from watchdogd_client.trio import open_client

    async def wait_in_all_reduce():
        await trio.sleep(300)

    async def main():
        async with open_client() as client:
            async with client.expires(after=1.0, scope="step", policy="rank", job="trio-1", rank=0):
                print("ready", flush=True)
                await wait_in_all_reduce()

    trio.run(main)
"""


def test_a_trio_workers_stack_comes_from_inside_it(daemon: RunningDaemon) -> None:
    worker = python_worker(TRIO_RANK, socket=daemon.socket_path)
    try:
        wait_ready(worker)
        wait_until(lambda: len(incidents(daemon.socket_path)) == 1, what="the trio rank's incident")
        incident = settled(daemon.socket_path, 1)
        [rank] = incident.ranks
        assert rank.evidence == "worker", rank
        # A thread's stack, as py-spy's would be: the loop waits for events; the
        # tasks' own stacks are not threads'.
        assert "trio/_core/_run.py" in rank.stack
    finally:
        reap(worker)
