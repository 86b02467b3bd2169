"""Ranks of a job on a real daemon, and its incidents as ``watchdogctl`` shows them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec

from watchdogd_client.protocol import IncidentInfo

from helpers.daemon import ctl
from helpers.processes import python_worker, wait_ready

#: A rank of job ``argv[1]``: rank ``argv[2]`` arms a timer of ``argv[3]`` seconds
#: under policy ``rank`` and waits in a function named after its rank, as a rank
#: waits in a collective.
RANK = """
    import sys, time
    from watchdogd_client import expires
    job, rank, after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

    def waiting_in_rank_{rank}():
        time.sleep(300)

    with expires(after=after, scope="step", policy="rank", job=job, rank=rank):
        print("ready", flush=True)
        waiting_in_rank_{rank}()
"""


def start_rank(socket: Path, job: str, rank: int, after: float) -> subprocess.Popen[str]:
    """A `RANK` worker on the daemon at ``socket``, once it is ready."""
    worker = python_worker(RANK.replace("{rank}", str(rank)), job, str(rank), str(after),
                           socket=socket)  # fmt: skip
    wait_ready(worker)
    return worker


def incidents(socket: Path) -> list[IncidentInfo]:
    """``watchdogctl incidents --json``, read back."""
    shown = ctl(socket, "incidents", "--json")
    assert shown.returncode == 0, shown.stderr
    return msgspec.json.decode(shown.stdout, type=list[IncidentInfo])


def whole(socket: Path, incident: str) -> IncidentInfo:
    """``watchdogctl incident ID --json``, read back."""
    shown = ctl(socket, "incident", incident, "--json")
    assert shown.returncode == 0, shown.stderr
    return msgspec.json.decode(shown.stdout, type=IncidentInfo)


def gathered(socket: Path) -> bool:
    """Whether one incident is kept and the policy of each of its ranks has run."""
    listed = incidents(socket)
    return len(listed) == 1 and all(
        rank.state != "pending" for rank in whole(socket, listed[0].id).ranks
    )
