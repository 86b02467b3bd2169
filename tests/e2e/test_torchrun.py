"""A torchrun job through a real daemon: a hung rank opens an incident naming the job
torchrun runs (``TORCHELASTIC_RUN_ID``), the rank and the user's own ``with`` line,
the daemon kills that rank after dumping it, and torchrun restarts the job, which
finishes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.daemon import configured_daemon
from helpers.jobs import gathered, incidents, whole
from helpers.waiting import PATIENCE, wait_until

pytest.importorskip("torch")


CONFIG = """
[policies.rank]
steps = [ { dump = true, timeout = 20 }, { signal = "SIGKILL" } ]
"""

TORCHRUN = str(Path(sys.executable).parent / "torchrun")

#: Two ranks with gloo. In the first attempt rank 1 hangs in a step of its own
#: (torch's default scope) while rank 0 waits for it in a collective; in the
#: second both finish.
TRAIN = """\
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.elastic.timer as timer

from watchdogd_client.torch import WatchdogdTimerClient

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
store, rank, world_size = next(dist.rendezvous("env://"))
# torchrun's store outlives an attempt: without a prefix of its own, an attempt's
# gloo would find the addresses the ranks of the last one published.
store = dist.PrefixStore(f"attempt{attempt}", store)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
timer.configure(WatchdogdTimerClient(policy="rank"))


def hung_in_step():
    time.sleep(300)


def all_reduce_the_step():
    dist.all_reduce(torch.ones(1))


with timer.expires(after=60):
    dist.barrier()  # past here, every rank holds this timer
    if attempt == "0" and rank == 1:
        with timer.expires(after=2):
            hung_in_step()
    all_reduce_the_step()
print(f"attempt {attempt} rank {rank} done", flush=True)
dist.destroy_process_group()
"""


def line_of(text: str) -> int:
    return next(n for n, line in enumerate(TRAIN.splitlines(), 1) if line.strip() == text)


def torchrun(
    job: str, script: Path, socket: Path, log_dir: Path
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as 2 ranks of ``job`` under torchrun, allowed one restart."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("WATCHDOGD_JOB", "WATCHDOGD_RANK")
    }
    env["WATCHDOGD_SOCKET"] = str(socket)
    command = [
        TORCHRUN,
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",  # the agent's store on a port of its choosing
        f"--rdzv-id={job}",
        f"--log-dir={log_dir}",
        str(script),
    ]
    agent = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = agent.communicate(timeout=PATIENCE * 6)
    except subprocess.TimeoutExpired:
        # The workers run in sessions of their own: end them by their pids.
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        agent.kill()
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)
        output, _ = agent.communicate()
        raise AssertionError(f"torchrun did not finish:\n{output}") from None
    return subprocess.CompletedProcess(command, agent.returncode, output)


def test_a_hung_rank_of_torchrun_opens_an_incident_and_torchrun_restarts(
    socket_path: Path, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = f"train-{os.getpid()}"
    with configured_daemon(socket_path, tmp_path, CONFIG) as daemon:
        socket = daemon.socket_path
        run = torchrun(job, script, socket, tmp_path / "torchelastic")
        assert run.returncode == 0, run.stdout
        # It restarted once: the second attempt's ranks finished, the first's did not.
        finished = sorted(re.findall(r"attempt \d+ rank \d+ done", run.stdout))
        assert finished == ["attempt 1 rank 0 done", "attempt 1 rank 1 done"], run.stdout

        wait_until(lambda: gathered(socket), what="both ranks' stacks", timeout=PATIENCE * 3)
        [listed] = incidents(socket)
        assert (listed.job, listed.rank, listed.scope, listed.reason) == (
            job,
            1,
            f"{script}:{line_of('with timer.expires(after=2):')}",
            "timeout",
        )
        assert listed.uid == os.getuid()
        incident = whole(socket, listed.id)
        hung, peer = incident.ranks
        assert (hung.rank, hung.role, hung.state) == (1, "expired", "done")
        assert hung.frame.startswith("hung_in_step ("), hung.stack
        assert (peer.rank, peer.role, peer.state) == (0, "peer", "done")
        assert peer.scope == f"{script}:{line_of('with timer.expires(after=60):')}"
        assert "all_reduce_the_step (" in peer.stack, peer.stack
