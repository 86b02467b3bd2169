"""Ranks of a job on a real daemon, and its incidents as ``watchdogctl`` shows them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec

from watchdogd_protocol import IncidentInfo

from helpers.daemon import ctl
from helpers.processes import python_worker, wait_ready
from helpers.waiting import wait_until

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


#: A rank of job ``argv[1]``: rank ``argv[2]`` waits in ``wait_in_all_reduce`` under a
#: timer of ``argv[3]`` seconds; with ``argv[4]`` == "elsewhere" it arms a timer
#: once (so its responder starts), then is stuck in ``read_shard`` outside any
#: block, as a rank that never reached the collective its peers wait in; with
#: "outside", it waits in ``wait_in_all_reduce`` so, outside any block (a rank that
#: protects its data loading, not its collective); with "hangs", it is stuck in
#: ``read_shard`` inside its block; with "loads" it is stuck in ``load_batch``
#: instead (another hang); with "regex" it holds the GIL in a catastrophic regular
#: expression instead.
JOB_RANK = """
    import re, sys, time
    from watchdogd_client import expires
    job, rank, after, how = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    if len(sys.argv) > 5:  # a deadline on the wall clock, shared with other ranks
        after = float(sys.argv[5]) - time.time()

    def wait_in_all_reduce():
        time.sleep(300)

    def read_shard():
        time.sleep(300)

    def load_batch():
        time.sleep(300)

    def parse_header():
        re.match(r"(a+)+$", "a" * 64 + "b")

    if how in ("waits", "hangs"):
        with expires(after=after, scope="step", policy="rank", job=job, rank=rank):
            print("ready", flush=True)
            wait_in_all_reduce() if how == "waits" else read_shard()
    with expires(after=60, scope="warmup", job=job, rank=rank):
        pass
    time.sleep(0.3)  # its responder connects and responds
    print("ready", flush=True)
    {"elsewhere": read_shard, "outside": wait_in_all_reduce, "loads": load_batch}.get(
        how, parse_header
    )()
"""


def start_job_rank(
    socket: Path, job: str, rank: int, after: float, how: str, *, until: float | None = None
) -> subprocess.Popen[str]:
    """A `JOB_RANK` worker on the daemon at ``socket``, once it is ready; ``until``
    (a `time.time` instant) in place of ``after`` gives ranks started one after the
    other the same deadline."""
    deadline = () if until is None else (str(until),)
    worker = python_worker(JOB_RANK, job, str(rank), str(after), how, *deadline, socket=socket)
    wait_ready(worker)
    return worker


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


def settled_after(socket: Path, known: set[str], ranks: int) -> IncidentInfo:
    """The one incident kept besides those in ``known``, once its verdict has
    settled over ``ranks`` ranks and whether it counts is said."""
    found: list[IncidentInfo] = []

    def done() -> bool:
        fresh = [i for i in incidents(socket) if i.id not in known]
        if len(fresh) != 1:
            return False
        incident = whole(socket, fresh[0].id)
        found[:] = [incident]
        return len(incident.ranks) == ranks and bool(incident.repeat)

    wait_until(done, what=f"a new incident of {ranks} ranks with a settled verdict")
    return found[0]


def run_job(socket: Path, job: str, culprit: str) -> list[subprocess.Popen[str]]:
    """Ranks 1 (waits, long timer) and 2 (``culprit``), started together, then
    rank 0 whose timer expires in a second."""
    ranks = [
        python_worker(JOB_RANK, job, "1", "60", "waits", socket=socket),
        python_worker(JOB_RANK, job, "2", "60", culprit, socket=socket),
    ]
    for rank in ranks:
        wait_ready(rank)
    ranks.append(start_job_rank(socket, job, 0, 1.0, "waits"))
    return ranks
