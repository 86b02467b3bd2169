"""The responder of a real torch job (gloo, two ranks, the Flight Recorder on):
what it reduces the Flight Recorder to when one rank waits in an all_reduce the
other never enters."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from watchdogd_protocol import Collective, Evidence, FlightRecord, GroupState

from helpers.fake_daemon import FakeDaemon, ResponderLine
from helpers.processes import Worker, reap, torch_worker, wait_ready
from helpers.waiting import TORCH_PATIENCE, wait_until

#: A rank of a two-rank gloo job: two all_reduces of the default group and a
#: broadcast in a second group, all under a timer of torch's own ``expires()``; then
#: rank 0 enters a third all_reduce, which rank 1 never does: it waits in
#: load_batch.
RANK = """
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic import timer
    from watchdogd_client.torch import WatchdogdTimerClient

    rank = int(sys.argv[2])
    dist.init_process_group(
        "gloo", store=dist.FileStore(sys.argv[1], 2), rank=rank, world_size=2
    )
    timer.configure(WatchdogdTimerClient())
    pair = dist.new_group([0, 1], group_desc="pair")

    def load_batch():
        print("ready", flush=True)
        sys.stdin.read()

    with timer.expires(after=600):
        dist.all_reduce(torch.ones(3, 4))
        dist.all_reduce(torch.ones(2, dtype=torch.int64))
        dist.broadcast(torch.zeros(5), src=0, group=pair)
        if rank == 0:
            print("ready", flush=True)
            dist.all_reduce(torch.ones(3, 4))
        else:
            load_batch()
"""


@pytest.fixture
def ranks(tmp_path: Path, socket_path: Path) -> Iterator[dict[int, ResponderLine]]:
    """Both ranks, started, and their responders' connections, by rank."""
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "WATCHDOGD_JOB": "fr-job"}
    store = str(tmp_path / "store")
    workers: list[Worker] = []
    with FakeDaemon(socket_path) as fake:
        try:
            for rank in (0, 1):
                worker = torch_worker(
                    RANK, store, str(rank), socket=socket_path, env={**env, "RANK": str(rank)}
                )
                workers.append(worker)
            for worker in workers:
                wait_ready(worker)
            lines = [fake.next_responder(), fake.next_responder()]
            by_rank = {line.respond.rank: line for line in lines}
            assert set(by_rank) == {0, 1}
            assert {line.respond.job for line in lines} == {"fr-job"}
            yield {rank: line for rank, line in by_rank.items() if rank is not None}
        finally:
            for worker in workers:
                reap(worker)


def flight_of(line: ResponderLine, ask: int) -> tuple[Evidence, FlightRecord]:
    evidence = line.ask(ask)
    assert evidence.flight is not None, evidence.note
    return evidence, evidence.flight


def caught_up(line: ResponderLine, entered: int | None) -> FlightRecord:
    """The rank's record once it says what the rank did: the default group in
    collective ``entered`` (None: in none) with the second one completed, the pair's
    broadcast completed. Rank 0's "ready" comes just before the call that makes the
    entry, and torch counts a collective completed (its entry retired, its group's
    status) a moment after the call that waited for it returned."""
    asks = itertools.count(1)
    seen: list[FlightRecord] = []

    def now() -> bool:
        seen[:] = [flight_of(line, next(asks))[1]]
        groups = {group.desc: group for group in seen[0].groups}
        default, pair = groups["default_pg"], groups["pair"]
        seq = None if default.entered is None else default.entered.seq
        return (seq, default.completed, pair.entered, pair.completed) == (entered, 2, None, 1)

    try:
        wait_until(now, what="the Flight Recorder to catch up")
    except AssertionError:
        raise AssertionError(f"the Flight Recorder still says {seen}") from None
    return seen[0]


# A job of two torch processes: one such job runs at a time (tests/conftest.py);
# the tests of one torch process below run beside them.
def test_the_waiting_rank_entered_the_all_reduce_its_peer_never_did_and_waits_inside_it(
    ranks: dict[int, ResponderLine],
) -> None:
    waiting = caught_up(ranks[0], entered=3)
    assert waiting.rank == 0
    default, pair = waiting.groups
    assert (default.group, default.desc, default.ranks, default.size) == (
        "0",
        "default_pg",
        [0, 1],
        2,
    )
    assert default.entered == Collective(
        group="0",
        seq=3,
        op="gloo:all_reduce",
        state="scheduled",
        input_sizes=[[3, 4]],
        input_dtypes=["Float"],
    )
    assert default.completed == 2
    assert (pair.group, pair.desc, pair.ranks, pair.entered, pair.completed) == (
        "1",
        "pair",
        [0, 1],
        None,
        1,
    )
    assert [(entry.group, entry.seq, entry.op, entry.state) for entry in waiting.entries] == [
        ("0", 1, "gloo:all_reduce", "completed"),
        ("0", 2, "gloo:all_reduce", "completed"),
        ("1", 1, "gloo:broadcast", "completed"),
        ("0", 3, "gloo:all_reduce", "scheduled"),
    ]
    assert waiting.entries[1].input_dtypes == ["Long"]

    missing = caught_up(ranks[1], entered=None)
    assert missing.rank == 1
    default, pair = missing.groups
    assert (default.desc, default.ranks, default.size, default.entered) == (
        "default_pg",
        [0, 1],
        2,
        None,
    )
    assert [entry.seq for entry in missing.entries] == [1, 2, 1]
    main = ranks[1].ask(100).threads[0]
    assert main.frames[0].function == "load_batch"

    # The waiting rank's stack says the same as its record: its main thread is
    # inside the all_reduce.
    def inside() -> bool:
        main = ranks[0].ask(101).threads[0]
        return "all_reduce" in [frame.function for frame in main.frames]

    wait_until(inside, what="rank 0's main thread in all_reduce")


#: A job of one rank that waits before its first collective.
ALONE = """
    import sys
    import torch.distributed as dist
    from watchdogd_client import expires

    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)

    def load_batch():
        print("ready", flush=True)
        sys.stdin.read()

    with expires(after=600):
        load_batch()
"""


@pytest.mark.parametrize("buffer", ["0", "2000"])
def test_a_rank_before_its_first_collective_and_one_with_the_recorder_off(
    tmp_path: Path, socket_path: Path, buffer: str
) -> None:
    with FakeDaemon(socket_path) as fake:
        worker = torch_worker(
            ALONE,
            str(tmp_path / "store"),
            socket=socket_path,
            env={"TORCH_FR_BUFFER_SIZE": buffer, "RANK": "0"},
        )
        try:
            wait_ready(worker)
            evidence = fake.next_responder().ask(1)
        finally:
            reap(worker)
    assert evidence.threads[0].frames[0].function == "load_batch"
    if buffer == "0":
        # No record, so that a verdict goes by the stacks instead.
        assert evidence.flight is None
        assert evidence.note == "the Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0)"
    else:
        # It entered nothing yet: a rank its peers wait for at their first collective.
        assert evidence.flight == FlightRecord(
            rank=0, groups=[GroupState(group="0", desc="default_pg", ranks=[0], size=1)]
        )
        assert evidence.note == ""


def test_the_adapter_may_do_without_a_responder(socket_path: Path) -> None:
    with FakeDaemon(socket_path) as fake:
        worker = torch_worker(
            """
            import threading
            from torch.distributed.elastic import timer
            from watchdogd_client.torch import WatchdogdTimerClient

            timer.configure(WatchdogdTimerClient(responder=False))
            with timer.expires(after=600):
                print([thread.name for thread in threading.enumerate()])
            """,
            socket=socket_path,
        )
        out, err = worker.communicate(timeout=TORCH_PATIENCE)
    assert worker.returncode == 0, err
    assert out.strip() == "['MainThread']"
    assert [hello.client.split("/")[0] for hello in fake.hellos] == ["python"]
