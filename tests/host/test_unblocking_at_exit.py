"""A rank cut out of its collective that ends at once, against a daemon the test
plays: a real gloo job of two ranks, where rank 0 waits in an all_reduce that rank
1 never enters. Rank 0's program exits as soon as its collective raises, and its
log is slow to write (a filter that takes a second a record), so the program ends while
its responder is still answering: the daemon hears the answer all the same."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from watchdogd_protocol import UnblockOutcome, UnblockWanted

from helpers.fake_daemon import ResponderLine
from helpers.gloo_job import ranks_on_a_fake_daemon
from helpers.processes import Worker
from helpers.waiting import PATIENCE, wait_until

#: A rank of a two-rank gloo job, rank 0 serving the TCPStore: one all_reduce that
#: both complete, then rank 0 waits in a second one that rank 1 never enters and
#: exits the moment it raises; its log takes a second per record (a filter that
#: waits, holding no lock that the interpreter's exit would wait for).
RANK = """
    import logging, os, sys, time
    import torch
    import torch.distributed as dist
    from watchdogd_client import Client

    def slow(record):
        time.sleep(1.0)
        return True

    logging.getLogger("watchdogd_client").addFilter(slow)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    Client().acquire("step", 600)  # its responder starts
    dist.all_reduce(torch.ones(4))
    print("ready", flush=True)
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(4))
        except RuntimeError:
            print("raised", flush=True)
            sys.exit(0)
    sys.stdin.read()
"""


@pytest.fixture
def ranks(socket_path: Path) -> Iterator[tuple[ResponderLine, Worker]]:
    """Rank 0's responder connection and process, both ranks started."""
    with ranks_on_a_fake_daemon(socket_path, RANK, "exit-job", 2) as (lines, workers):
        yield lines[0], workers[0]


def test_a_rank_that_exits_once_cut_out_still_answers(
    ranks: tuple[ResponderLine, Worker],
) -> None:
    line, worker = ranks
    asks = iter(range(1, 1000))

    def waiting() -> bool:
        # Too soon for an hour's wait once its Flight Recorder says it waits.
        wanted = UnblockWanted(ask=next(asks), waited=3600)
        return line.unblock(wanted).outcome == UnblockOutcome.TOO_SOON

    wait_until(waiting, what="rank 0 to wait in the all_reduce")
    try:
        cut = line.unblock(UnblockWanted(ask=next(asks), waited=0))
    except queue.Empty:
        pytest.fail("rank 0 ended without answering")
    assert cut.outcome == UnblockOutcome.UNBLOCKED, cut
    assert worker.wait(timeout=PATIENCE) == 0
    assert worker.stdout is not None
    assert worker.stdout.readline().strip() == "raised"
