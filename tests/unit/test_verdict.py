"""The verdict: the rank a job waits for, by Flight Recorder and by stacks, the frame
a rank waits in, what a viewer who may not see a stack is told, and input that
must not break it."""

from __future__ import annotations

import sys

import msgspec
import pytest

from watchdogd.core.user_frames import Library, pick, threads_of, where
from watchdogd.core.verdict import (
    MAX_CULPRITS,
    decide,
    flight_text,
    for_viewer,
    summary,
)
from watchdogd_protocol import (
    Collective,
    CollectiveRef,
    Culprit,
    FlightRecord,
    Frame,
    GroupState,
    RankInfo,
    ThreadStack,
    Verdict,
)

LIBRARY = Library(stdlib=frozenset(sys.stdlib_module_names))
SITE = "/home/u/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"

#: py-spy's dump of a gloo rank waiting in an all_reduce (torch 2.13, py-spy 0.4).
WAITING = """\
Process 29116: /home/u/venv/bin/python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 29116 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    train_step (train.py:88)
    <module> (train.py:120)
Thread 29201 (idle): "loader"
    Condition.wait (threading.py:327)
    Queue.get (queue.py:171)
    fill (loader.py:17)
    Thread.run (threading.py:982)
"""
#: py-spy's dump of the rank that never got there.
READING = """\
Process 4242: /home/u/venv/bin/python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    Condition.wait (threading.py:327)
    Event.wait (threading.py:629)
    read_shard (loader.py:42)
    train_step (train.py:80)
    <module> (train.py:120)
"""


def entered(seq: int, *, op: str = "gloo:all_reduce", sizes: list[list[int]] | None = None,
            dtypes: list[str] | None = None) -> Collective:  # fmt: skip
    return Collective(
        group="0",
        seq=seq,
        op=op,
        state="scheduled",
        input_sizes=[[4, 3]] if sizes is None else sizes,
        input_dtypes=["Float"] if dtypes is None else dtypes,
    )


def world(last: Collective | None, completed: int, members: int = 4) -> list[GroupState]:
    """The default group of ``members`` ranks, as one rank's Flight Recorder has it."""
    return [
        GroupState(
            group="0",
            desc="default_pg",
            ranks=list(range(members)),
            size=members,
            entered=last,
            completed=completed,
        )
    ]


def rank(
    number: int | None,
    host: str,
    pid: int,
    *,
    flight: list[GroupState] | None = None,
    stack: str = "",
    state: str = "done",
    role: str = "hung",
) -> RankInfo:
    return RankInfo(
        host=host,
        pid=pid,
        uid=1000,
        role=role,
        scope="step",
        state=state,
        rank=number,
        stack=stack,
        evidence="" if state == "pending" else "py-spy" if stack else "worker",
        flight=flight or [],
    )


def job(culprit: RankInfo | None) -> list[RankInfo]:
    """Ranks 0, 1 and 3 of four on hosts a and b waiting in all_reduce #58, and
    rank 2 as given (None: it never answered)."""
    waiting = [
        rank(0, "a", 100, flight=world(entered(58), 57), stack=WAITING),
        rank(1, "a", 101, flight=world(entered(58), 57), stack=WAITING),
        rank(3, "b", 4243, flight=world(entered(58), 57), stack=WAITING),
    ]
    return waiting if culprit is None else [*waiting, culprit]


def verdict_of(
    ranks: list[RankInfo],
    *,
    settled: bool = True,
    threads: dict[tuple[str, int], list[ThreadStack]] | None = None,
) -> Verdict:
    return decide(ranks, library=LIBRARY, settled=settled, threads=threads).verdict


ALL_REDUCE_58 = CollectiveRef(group="0", seq=58, op="gloo:all_reduce")
LOADER = rank(2, "b", 4242, flight=world(entered(57), 57), stack=READING, role="peer")


# By the Flight Recorder.


def test_a_rank_that_never_entered_the_collective_its_peers_wait_in_is_missing() -> None:
    verdict = verdict_of(job(LOADER))
    assert verdict.kind == "missing"
    assert verdict.basis == "flight_recorder"
    assert verdict.culprits == [Culprit(host="b", pid=4242, rank=2)]
    assert verdict.collective == ALL_REDUCE_58
    assert verdict.settled
    assert verdict.text == (
        "rank 2 on host b (pid 4242) never entered gloo:all_reduce #58 of the default group, "
        "which ranks 0, 1 and 3 wait in; it is in loader.py:42 read_shard"
    )


def test_a_member_that_never_answered_is_missing_by_its_number_once_settled() -> None:
    verdict = verdict_of(job(None))
    assert verdict.kind == "missing"
    assert verdict.culprits == [Culprit(host="", pid=0, rank=2)]
    assert verdict.text.startswith("rank 2 (never answered) never entered gloo:all_reduce #58")


def test_before_it_settles_a_rank_not_heard_from_is_waited_for_not_accused() -> None:
    for ranks in (job(None), job(rank(2, "b", 4242, state="pending"))):
        verdict = verdict_of(ranks, settled=False)
        assert (verdict.kind, verdict.basis, verdict.culprits) == (
            "undecided",
            "flight_recorder",
            [],
        )
        assert verdict.collective == ALL_REDUCE_58
        assert verdict.text == (
            "ranks 0, 1 and 3 wait in gloo:all_reduce #58 of the default group; "
            "rank 2 has not reported yet"
        )
    # A rank whose record is behind is named at once.
    assert verdict_of(job(LOADER), settled=False).kind == "missing"


def test_a_rank_without_a_flight_record_is_missing_and_its_stack_says_where_it_is() -> None:
    verdict = verdict_of(job(rank(2, "b", 4242, stack=READING)))
    assert verdict.kind == "missing"
    assert verdict.culprits == [Culprit(host="b", pid=4242, rank=2)]
    assert verdict.text.endswith("; it is in loader.py:42 read_shard")


@pytest.mark.parametrize(
    ("odd", "differ", "shown"),
    [
        (entered(58, sizes=[[4, 4]]), "sizes", "gloo:all_reduce of [4, 4] Float"),
        (entered(58, dtypes=["Half"]), "dtypes", "gloo:all_reduce of [4, 3] Half"),
        (entered(58, op="gloo:broadcast"), "op", "gloo:broadcast of [4, 3] Float"),
    ],
)
def test_a_rank_that_entered_the_collective_otherwise_is_a_mismatch(
    odd: Collective, differ: str, shown: str
) -> None:
    verdict = verdict_of(job(rank(2, "b", 4242, flight=world(odd, 57), stack=READING)))
    assert verdict.kind == "mismatch"
    assert verdict.basis == "flight_recorder"
    assert verdict.culprits == [Culprit(host="b", pid=4242, rank=2)]
    assert verdict.collective == ALL_REDUCE_58
    assert verdict.text == (
        f"rank 2 on host b (pid 4242) entered #58 of the default group as {shown}, where "
        f"ranks 0, 1 and 3 entered it as gloo:all_reduce of [4, 3] Float: {differ} differ; "
        "it is in loader.py:42 read_shard"
    )


def test_inputs_a_record_leaves_out_are_not_held_against_it() -> None:
    cut = entered(58, sizes=[], dtypes=[])
    verdict = verdict_of(job(rank(2, "b", 4242, flight=world(cut, 57))))
    assert verdict.kind != "mismatch"


def test_a_mismatch_with_no_side_larger_names_every_rank_that_entered() -> None:
    ranks = [
        rank(0, "a", 100, flight=world(entered(9), 8, members=2)),
        rank(1, "b", 200, flight=world(entered(9, op="gloo:broadcast"), 8, members=2)),
    ]
    verdict = verdict_of(ranks)
    assert verdict.kind == "mismatch"
    assert [culprit.rank for culprit in verdict.culprits] == [0, 1]
    assert "as many ranks one way as another" in verdict.text


def test_the_group_most_ranks_wait_in_is_the_one_judged() -> None:
    pipeline = GroupState(group="3", desc="pp", ranks=[1, 3], entered=entered(5), completed=4)
    ranks = [
        rank(0, "a", 100, flight=world(entered(58), 57)),
        rank(1, "a", 101, flight=[*world(entered(58), 57), pipeline]),
        rank(2, "b", 4242, flight=world(entered(57), 57)),
        rank(3, "b", 4243, flight=[*world(entered(58), 57), pipeline]),
    ]
    verdict = verdict_of(ranks)
    assert (verdict.kind, verdict.collective) == ("missing", ALL_REDUCE_58)
    assert "group 3 (pp)" not in verdict.text


def test_ranks_that_all_entered_alike_leave_the_flight_recorder_undecided() -> None:
    ranks = job(rank(2, "b", 4242, flight=world(entered(58), 57), stack=WAITING))
    verdict = verdict_of(ranks)
    assert (verdict.kind, verdict.basis, verdict.culprits) == ("undecided", "flight_recorder", [])
    assert verdict.collective == ALL_REDUCE_58
    assert "which every member entered alike" in verdict.text
    assert verdict.groups == ["train.py:88 train_step: ranks 0-3"]


def test_without_a_rank_waiting_the_flight_recorder_gives_way_to_the_stacks() -> None:
    done = world(entered(58), 58)
    ranks = [
        rank(0, "a", 100, flight=done, stack=WAITING),
        rank(1, "a", 101, flight=done, stack=WAITING),
        rank(2, "b", 4242, flight=done, stack=READING),
    ]
    verdict = verdict_of(ranks)
    assert (verdict.kind, verdict.basis) == ("odd_frame", "stacks")
    assert verdict.culprits == [Culprit(host="b", pid=4242, rank=2)]


# By stacks.


def thread(
    *frames: tuple[str, int, str], name: str = "MainThread", main: bool = True
) -> ThreadStack:
    return ThreadStack(name=name, main=main, frames=[Frame(*frame) for frame in frames])


def worker_stack(user: tuple[str, int, str]) -> list[ThreadStack]:
    """A rank's threads as its responder gives them: full paths, the main thread
    not first, waiting in torch, this client and the standard library above the
    user's frame."""
    other = thread((f"{STDLIB}/selectors.py", 468, "select"), name="io", main=False)
    main = thread(
        (f"{STDLIB}/threading.py", 327, "wait"),
        ("<frozen importlib._bootstrap>", 1178, "_find_and_load"),
        (f"{SITE}/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
        ("/srv/watchdogd/client/watchdogd_client/arming.py", 61, "expires"),
        user,
        ("/home/u/job/train.py", 120, "<module>"),
    )
    return [other, main]


def test_a_small_minority_against_a_large_majority_is_an_odd_frame_from_the_workers() -> None:
    ranks = [rank(n, "ab"[n // 2], 100 + n) for n in range(4)]
    step = ("/home/u/job/train.py", 88, "train_step")
    threads = {(r.host, r.pid): worker_stack(step) for r in ranks}
    threads["b", 102] = worker_stack(("/home/u/job/loader.py", 42, "read_shard"))
    verdict = verdict_of(ranks, threads=threads)
    assert (verdict.kind, verdict.basis) == ("odd_frame", "stacks")
    assert verdict.culprits == [Culprit(host="b", pid=102, rank=2)]
    assert verdict.collective is None
    assert verdict.text == (
        "rank 2 on host b (pid 102) waits elsewhere than ranks 0, 1 and 3; "
        "it is in loader.py:42 read_shard; they are in train.py:88 train_step"
    )


def test_an_odd_frame_from_py_spy_where_an_installed_package_is_the_users() -> None:
    # A plain-Python job of three ranks on two hosts, one stuck in another library.
    stuck = """\
Thread 7 (active): "MainThread"
    select (selectors.py:468)
    _poll (requests/adapters.py:501)
    fetch (loader.py:30)
"""
    ranks = [
        rank(0, "a", 100, stack=WAITING),
        rank(1, "b", 200, stack=WAITING),
        rank(2, "b", 201, stack=stuck),
    ]
    verdict = verdict_of(ranks)
    assert verdict.kind == "odd_frame"
    assert verdict.culprits == [Culprit(host="b", pid=201, rank=2)]
    assert verdict.text == (
        "rank 2 on host b (pid 201) waits elsewhere than ranks 0 and 1; "
        "it is in requests/adapters.py:501 _poll; they are in train.py:88 train_step"
    )


@pytest.mark.parametrize(
    ("file", "owned"),
    [
        ("threading.py", True),
        ("concurrent/futures/_base.py", True),
        ("torch/distributed/distributed_c10d.py", True),
        ("watchdogd_client/responder.py", True),
        ("train.py", False),
        ("mypkg/loader.py", False),
        ("requests/adapters.py", False),
        (f"{STDLIB}/threading.py", True),
        ("/opt/conda/lib/python3.12/selectors.py", True),
        ("/usr/lib64/python3.13t/queue.py", True),
        ("<frozen importlib._bootstrap>", True),
        (f"{SITE}/torch/nn/modules/module.py", True),
        ("/usr/lib/python3/dist-packages/watchdogd_client/arming.py", True),
        (f"{SITE}/numpy/core/fromnumeric.py", False),
        (f"{SITE}/six.py", False),
        ("/usr/lib/python3/dist-packages/yaml/reader.py", False),
        ("/srv/pytorch/torch/distributed/distributed_c10d.py", True),
        ("/home/u/job/train.py", False),
        ("<string>", False),
        ("", True),
    ],
)
def test_what_is_the_users_frame_is_told_from_the_file_name(file: str, owned: bool) -> None:
    assert LIBRARY.owns(file) is owned


def test_a_rank_caught_in_the_clients_own_call_is_left_out_of_the_stacks() -> None:
    """Three ranks wait in train_step; the fourth's stack was taken while its
    acquire was on its way: it is not an odd frame, it is not placed at all."""
    ranks = [rank(n, "ab"[n // 2], 100 + n) for n in range(4)]
    step = ("/home/u/job/train.py", 88, "train_step")
    threads = {(r.host, r.pid): worker_stack(step) for r in ranks}
    threads["b", 103] = [
        thread(
            (f"{STDLIB}/socket.py", 700, "recv"),
            (f"{SITE}/watchdogd_client/client.py", 390, "_exchange"),
            ("/home/u/job/train.py", 86, "train_step"),
        )
    ]
    verdict = verdict_of(ranks, threads=threads)
    assert verdict.kind != "odd_frame"
    assert verdict.culprits == []


def test_the_frame_a_rank_waits_in_is_its_main_threads_innermost_of_the_users() -> None:
    assert pick(WAITING, LIBRARY) == Frame("train.py", 88, "train_step")
    assert pick(READING, LIBRARY) == Frame("loader.py", 42, "read_shard")
    threads = worker_stack(("/home/u/job/loader.py", 42, "read_shard"))
    assert pick(threads, LIBRARY) == Frame("/home/u/job/loader.py", 42, "read_shard")
    # A worker's own threads as an incident keeps them: py-spy's layout, full paths.
    kept = (
        'Thread 140 (worker): "MainThread"\n'
        f"    wait ({STDLIB}/threading.py:327)\n"
        f"    all_reduce ({SITE}/torch/distributed/distributed_c10d.py:3252)\n"
        "    train_step (/home/u/job/train.py:88)\n"
        'Thread 141 (worker): "loader"\n'
        "    fill (/home/u/job/loader.py:17)\n"
    )
    assert pick(kept, LIBRARY) == Frame("/home/u/job/train.py", 88, "train_step")
    # No thread marked main nor named MainThread: the first.
    unnamed = 'Thread 7 (active): "worker"\n    spin (spin.py:3)\n'
    assert pick(unnamed, LIBRARY) == Frame("spin.py", 3, "spin")
    assert pick('Thread 7 (idle): "MainThread"\n    wait (threading.py:327)\n', LIBRARY) is None
    assert pick("py-spy: no such process", LIBRARY) is None
    assert pick([], LIBRARY) is None
    # Caught inside the client's own call, between two of the user's steps: where
    # it passes, not where it waits.
    calling = (
        'Thread 140 (worker): "MainThread"\n'
        f"    recv ({STDLIB}/socket.py:700)\n"
        f"    _exchange ({SITE}/watchdogd_client/client.py:390)\n"
        f"    __enter__ ({SITE}/watchdogd_client/base.py:133)\n"
        "    train_step (/home/u/job/train.py:86)\n"
    )
    assert pick(calling, LIBRARY) is None
    in_place = (
        'Thread 1 (idle): "MainThread"\n    _call (/src/client/watchdogd_client/client.py:9)\n'
    )
    assert pick(in_place, LIBRARY) is None
    assert pick('Thread 1 (idle): "MainThread"\n    _call (watchdogd_client/client.py:9)\n'
                '    step (train.py:3)\n', LIBRARY) is None  # fmt: skip
    assert where(Frame(f"{SITE}/numpy/core/fromnumeric.py", 57, "sum")) == (
        "numpy/core/fromnumeric.py:57 sum"
    )


def test_a_py_spy_dump_is_read_thread_by_thread_past_locals_and_native_frames() -> None:
    dump = """\
Process 7: python x.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 0x7F3A2B (idle): "MainThread"
    __futex_abstimed_wait_common (libc.so.6)
    wait (threading.py:327)
        Arguments:
            timeout: None
    main (x.py:9)
Thread 8 (active+gil): "pool (1)"
    run (x.py:3)
"""
    threads = threads_of(dump)
    assert [(t.name, t.ident, t.main) for t in threads] == [
        ("MainThread", 0x7F3A2B, True),
        ("pool (1)", 8, False),
    ]
    assert threads[0].frames == [Frame("threading.py", 327, "wait"), Frame("x.py", 9, "main")]


@pytest.mark.parametrize(
    ("majority", "minority", "kind"),
    [(2, 1, "odd_frame"), (4, 2, "odd_frame"), (1, 1, "undecided"), (3, 2, "undecided")],
)
def test_a_minority_is_small_when_it_is_a_third_of_the_ranks_at_most(
    majority: int, minority: int, kind: str
) -> None:
    ranks = [rank(n, "a", 100 + n, stack=WAITING) for n in range(majority)]
    ranks += [rank(majority + n, "b", 200 + n, stack=READING) for n in range(minority)]
    assert verdict_of(ranks).kind == kind


def test_undecided_stacks_list_each_frame_with_its_ranks() -> None:
    ranks = [
        rank(0, "a", 100, stack=WAITING),
        rank(1, "a", 101, stack=WAITING),
        rank(2, "b", 200, stack=READING),
        rank(3, "b", 201, stack=READING),
    ]
    verdict = verdict_of(ranks)
    assert (verdict.kind, verdict.basis, verdict.culprits) == ("undecided", "stacks", [])
    assert (
        verdict.text == "4 ranks wait in 2 frames, none a small minority against a large majority"
    )
    assert verdict.groups == [
        "train.py:88 train_step: ranks 0 and 1",
        "loader.py:42 read_shard: ranks 2 and 3",
    ]


# What a viewer sees.


def test_a_viewer_who_may_not_see_the_culprits_stack_is_told_who_but_not_where() -> None:
    decision = decide(job(LOADER), library=LIBRARY, settled=True)
    hidden = for_viewer(decision, lambda culprit: culprit.rank != 2)
    assert hidden.text == (
        "rank 2 on host b (pid 4242) never entered gloo:all_reduce #58 of the default group, "
        "which ranks 0, 1 and 3 wait in"
    )
    assert (hidden.culprits, hidden.collective) == (decision.verdict.culprits, ALL_REDUCE_58)
    assert for_viewer(decision, lambda culprit: True) == decision.verdict


def test_a_viewer_sees_the_frames_of_the_ranks_whose_stacks_they_may_see() -> None:
    ranks = [rank(n, "a", 100 + n, stack=WAITING) for n in range(3)]
    ranks.append(rank(3, "b", 4242, stack=READING))
    decision = decide(ranks, library=LIBRARY, settled=True)
    majority_only = for_viewer(decision, lambda culprit: culprit.rank == 0)
    assert majority_only.text == (
        "rank 3 on host b (pid 4242) waits elsewhere than ranks 0-2; "
        "they are in train.py:88 train_step"
    )
    nothing = for_viewer(decision, lambda culprit: False)
    assert "train.py" not in nothing.text
    assert "read_shard" not in nothing.text
    split = [rank(n, "a", 100 + n, stack=[WAITING, READING][n % 2]) for n in range(2)]
    groups = for_viewer(decide(split, library=LIBRARY, settled=True), lambda c: c.rank == 0)
    assert groups.groups == ["train.py:88 train_step: rank 0", "rank 1: stack not shown"]


# Few ranks, and input meant to break it.


def test_an_empty_incident_and_a_lone_rank_are_undecided() -> None:
    empty = verdict_of([], settled=False)
    assert (empty.kind, empty.basis, empty.culprits, empty.text) == (
        "undecided",
        "",
        [],
        "no rank has reported yet",
    )
    alone = verdict_of([rank(0, "a", 100, stack=WAITING)])
    assert (alone.kind, alone.basis) == ("undecided", "stacks")
    assert alone.text == "rank 0 is the only rank with a stack: none to compare"
    mute = verdict_of([rank(0, "a", 100)])
    assert mute.text == "no rank's Flight Recorder or stack says where it waits"


def test_a_lone_rank_waiting_for_a_peer_that_never_answered_names_it() -> None:
    verdict = verdict_of([rank(0, "a", 100, flight=world(entered(3), 2, members=2))])
    assert verdict.kind == "missing"
    assert verdict.culprits == [Culprit(host="", pid=0, rank=1)]
    assert "which rank 0 waits in" in verdict.text


def test_a_rank_listed_twice_counts_once() -> None:
    twice = [*job(LOADER), *job(LOADER)]
    assert verdict_of(twice) == verdict_of(job(LOADER))
    # Rank 2 restarted: the process that exited and the new one, still behind.
    gone = rank(2, "b", 4000, state="gone")
    verdict = verdict_of([gone, *job(LOADER)])
    assert verdict.culprits == [Culprit(host="b", pid=4242, rank=2)]


def test_a_huge_group_never_answering_is_counted_not_walked() -> None:
    size = 2**31 - 1
    huge = GroupState(group="0", desc="default_pg", size=size, entered=entered(7), completed=6)
    verdict = verdict_of([rank(0, "a", 100, flight=[huge])])
    assert verdict.kind == "missing"
    assert len(verdict.culprits) == MAX_CULPRITS
    assert verdict.culprits[0] == Culprit(host="", pid=0, rank=1)
    assert f"and {size - 1 - 5} more never entered" in verdict.text


HOSTILE: list[list[RankInfo]] = [
    # Numbers past the protocol's bounds.
    [rank(0, "a", 1, flight=world(entered(2**63 - 1), 2**63 - 2)), rank(1, "a", 2)],
    [rank(0, "a", 1, flight=world(entered(10**5000), -(10**5000))), rank(1, "a", 2)],
    [rank(-5, "a", 1, flight=world(entered(3), 2)), rank(2**40, "b", 2, stack=WAITING)],
    # Empty groups and records.
    [
        rank(0, "a", 1, flight=[GroupState(group="")]),
        rank(1, "a", 2, flight=[GroupState(group="")]),
    ],
    [rank(0, "a", 1, flight=[GroupState(group="0", entered=entered(1))])],
    [rank(0, "a", 1, flight=[GroupState(group="0", ranks=[2**40, -1], entered=entered(1))])],
    # The same group twice in one record, and members that are not in the incident.
    [rank(0, "a", 1, flight=world(entered(3), 2) * 3 + world(entered(9), 1, members=4000))],
    # Stacks that are not dumps.
    [rank(0, "a", 1, stack="\x00" * 10), rank(1, "a", 2, stack="    f (x.py:" + "9" * 5000 + ")")],
    [
        rank(n, "a", n, stack=f'Thread {"9" * 5000} (idle): "MainThread"\n    f (x.py:1)\n')
        for n in range(3)
    ],
    [rank(None, "a", 1, stack=WAITING), rank(None, "a", 1, stack=READING)],
]


@pytest.mark.parametrize("ranks", HOSTILE)
def test_hostile_input_gives_a_verdict_never_an_exception(ranks: list[RankInfo]) -> None:
    for settled in (False, True):
        decision = decide(ranks, library=LIBRARY, settled=settled)
        verdict = decision.verdict
        assert verdict.kind in ("missing", "mismatch", "odd_frame", "undecided")
        assert msgspec.json.decode(msgspec.json.encode(verdict), type=Verdict) == verdict
        assert len(verdict.text) < 4096
        for_viewer(decision, lambda culprit: False)


# What an incident keeps of a Flight Recorder, and shows.


def test_a_summary_keeps_the_groups_a_rank_waits_in_first_and_bounded() -> None:
    idle = [
        GroupState(group=str(n), ranks=[n, n + 1], entered=entered(3), completed=3)
        for n in range(1, 12)
    ]
    record = FlightRecord(rank=0, groups=[*idle, *world(entered(58), 57), idle[0]])
    kept = summary(record)
    assert len(kept) == 8
    assert kept[0] == GroupState(
        group="0", desc="default_pg", size=4, entered=entered(58), completed=57
    )
    assert [group.group for group in kept[1:]] == [str(n) for n in range(1, 8)]
    assert kept[1].ranks == [1, 2]


def test_the_summary_of_a_ranks_flight_recorder_reads_a_line_per_group() -> None:
    groups = [
        *world(entered(58), 57),
        GroupState(group="1", desc="undefined", ranks=[0, 2], completed=-1),
    ]
    assert flight_text(groups).splitlines() == [
        "the default group, 4 ranks: last entered #58 gloo:all_reduce of [4, 3] Float, "
        "scheduled; last completed #57",
        "group 1, 2 ranks: entered nothing recorded; last completed none",
    ]
