"""Unblocking a rank from inside, against a daemon the test plays: a real gloo job
of three ranks on a real TCPStore, where ranks 0 and 1 wait in an all_reduce that
rank 2 never enters. The responder cuts its process out of that collective only
where its own Flight Recorder confirms every bound of the request; then the
waiting call raises in the rank's own thread at once, and the store lives on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("torch")

from watchdogd_protocol import Unblocked, UnblockOutcome, UnblockWanted

from helpers.fake_daemon import ResponderLine
from helpers.gloo_job import ranks_on_a_fake_daemon
from helpers.processes import Worker
from helpers.waiting import wait_until

#: A rank of a three-rank gloo job, rank 0 serving the TCPStore: one all_reduce
#: that all complete, then ranks 0 and 1 wait in a second one that rank 2 never
#: enters; a rank whose wait raises says when (the monotonic clock), and writes to
#: the store after.
RANK = """
    import os, sys, time
    import torch
    import torch.distributed as dist
    from watchdogd_client import Client

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    Client().acquire("step", 600)  # its responder starts
    dist.all_reduce(torch.ones(4))
    print("ready", flush=True)
    if rank != 2:
        try:
            dist.all_reduce(torch.ones(4))
            print("completed", flush=True)
        except RuntimeError as exc:
            print("raised", time.monotonic(), str(exc).splitlines()[0][:200], flush=True)
            dist.distributed_c10d._get_default_store().set(f"after-{rank}", "1")
            print("store ok", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def ranks(
    socket_path: Path,
) -> Iterator[tuple[dict[int, ResponderLine], list[Worker]]]:
    """The three ranks, started, with their responders' connections by rank; rank
    2's process does not let its responder unblock it (``WATCHDOGD_UNBLOCK=0``)."""
    without = {2: {"WATCHDOGD_UNBLOCK": "0"}}
    with ranks_on_a_fake_daemon(socket_path, RANK, "unblock-job", 3, env=without) as ranks:
        yield ranks


def waiting(line: ResponderLine) -> Unblocked:
    """The rank's answer once its Flight Recorder says it waits in the all_reduce:
    too soon for a request that wants an hour's wait."""
    asks = iter(range(1, 1000))
    seen: list[Unblocked] = []

    def in_it() -> bool:
        seen[:] = [line.unblock(UnblockWanted(ask=next(asks), waited=3600))]
        return seen[0].outcome == UnblockOutcome.TOO_SOON

    wait_until(in_it, what="the rank to wait in the all_reduce")
    return seen[0]


def test_a_rank_is_cut_out_only_of_the_collective_its_flight_recorder_confirms(
    ranks: tuple[dict[int, ResponderLine], list[Worker]],
) -> None:
    lines, workers = ranks
    assert (lines[0].respond.unblock, lines[2].respond.unblock) == (True, False)
    soon = waiting(lines[0])
    assert soon.collective is not None
    group, seq = soon.collective.group, soon.collective.seq
    assert (soon.collective.op, soon.collective.state) == ("gloo:all_reduce", "scheduled")
    assert 3500 < soon.retry < 3600
    # Each bound holds on its own: another collective, one entered before an hour
    # ago, a process that does not unblock, one that waits in none.
    for wanted, outcome in [
        (UnblockWanted(ask=101, waited=0, group=group, seq=seq + 1), UnblockOutcome.NOT_WAITING),
        (UnblockWanted(ask=102, waited=0, group="9", seq=seq), UnblockOutcome.NOT_WAITING),
        (UnblockWanted(ask=103, waited=0, entered_before=3600), UnblockOutcome.ENTERED_LATER),
    ]:
        assert lines[0].unblock(wanted).outcome == outcome, wanted
    refused = lines[2].unblock(UnblockWanted(ask=104, waited=0))
    assert (refused.outcome, refused.cut) == (UnblockOutcome.FAILED, 0)
    assert "WATCHDOGD_UNBLOCK" in refused.note
    assert workers[0].poll() is None
    assert workers[1].poll() is None
    # Nothing was cut: both still wait.
    assert waiting(lines[1]).outcome == UnblockOutcome.TOO_SOON

    # Too soon, then asked again when it says it will have waited long enough, as
    # the daemon does.
    wanted = UnblockWanted(ask=200, waited=0.5, group=group, seq=seq, reason="test")
    cut = lines[0].unblock(wanted)
    if cut.outcome == UnblockOutcome.TOO_SOON:
        time.sleep(cut.retry)
    asked = time.monotonic()
    cut = lines[0].unblock(msgspec.structs.replace(wanted, ask=201))
    assert cut.outcome == UnblockOutcome.UNBLOCKED, cut
    assert cut.waited >= 0.5
    assert cut.cut >= 2, cut  # its connections to both peers, the store's kept
    assert cut.collective == soon.collective
    assert workers[0].stdout is not None
    said = workers[0].stdout.readline().split(" ", 2)
    assert said[0] == "raised", said
    raised_after = float(said[1]) - asked
    assert raised_after < 1.0, raised_after  # milliseconds, on an idle machine
    assert "Connection closed by peer" in said[2] or "Connection reset" in said[2], said
    assert workers[0].stdout.readline().strip() == "store ok"
    # Rank 1 waits on its own: cut out of nothing, it may still wait for rank 2.
    assert workers[1].poll() is None
    print(f"raised {raised_after * 1000:.1f} ms after the unblock was asked")
    after = lines[0].unblock(UnblockWanted(ask=202, waited=0))
    assert after.outcome == UnblockOutcome.NOT_WAITING  # its collective is over
