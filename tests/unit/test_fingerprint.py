"""A hang's fingerprint: the same hang in another run, on other hosts, has the same
one, another hang another; hostile ranks give a bounded one; and only a verdict that
names a culprit that spoke, borne out by this host's own ranks, counts as a hang."""

from __future__ import annotations

import sys

import msgspec
import pytest

from watchdogd.core.fingerprint import (
    COUNTED,
    MAX_FRAMES,
    NAME_CHARS,
    fingerprint_of,
    reader_of,
    uncounted,
)
from watchdogd.core.user_frames import Library
from watchdogd.core.verdict import Decision, decide
from watchdogd_protocol import (
    Collective,
    CollectiveRef,
    Culprit,
    Frame,
    GroupState,
    IncidentInfo,
    RankInfo,
    Verdict,
)

LIBRARY = Library(stdlib=frozenset(sys.stdlib_module_names))


def dump(function: str, file: str = "/home/u/run-1/train.py", line: int = 42) -> str:
    """py-spy's dump of a rank whose main thread waits in ``function``."""
    return (
        'Thread 7 (idle): "MainThread"\n'
        f"    {function} ({file}:{line})\n"
        "    <module> (/home/u/run-1/train.py:120)\n"
    )


def waiting(seq: int, completed: int) -> list[GroupState]:
    entered = Collective(group="0", seq=seq, op="gloo:all_reduce", state="scheduled")
    return [GroupState(group="0", desc="default_pg", size=4, entered=entered, completed=completed)]


def rank(
    number: int, host: str, pid: int, *, stack: str = "", flight: list[GroupState] | None = None,
    role: str = "peer", state: str = "done",
) -> RankInfo:  # fmt: skip
    return RankInfo(
        host=host, pid=pid, uid=1000, role=role, scope="step", state=state, rank=number,
        stack=stack, evidence="" if state == "pending" else "worker", flight=flight or [],
    )  # fmt: skip


def by_stacks(hosts: tuple[str, str], pids: int, *, culprit: str = "read_shard",
              file: str = "/home/u/run-1/loader.py", line: int = 42) -> list[RankInfo]:  # fmt: skip
    """Three ranks in ``wait_in_all_reduce`` and rank 3 stuck in ``culprit``."""
    return [
        rank(0, hosts[0], pids, stack=dump("wait_in_all_reduce"), role="expired"),
        rank(1, hosts[0], pids + 1, stack=dump("wait_in_all_reduce")),
        rank(2, hosts[1], pids + 2, stack=dump("wait_in_all_reduce")),
        rank(3, hosts[1], pids + 3, stack=dump(culprit, file, line)),
    ]


def by_recorder(seq: int, hosts: tuple[str, str], pids: int) -> list[RankInfo]:
    """Ranks 0-2 in all_reduce ``seq``; rank 3 never entered it, in ``read_shard``."""
    return [
        rank(0, hosts[0], pids, flight=waiting(seq, seq - 1), role="expired"),
        rank(1, hosts[0], pids + 1, flight=waiting(seq, seq - 1)),
        rank(2, hosts[1], pids + 2, flight=waiting(seq, seq - 1)),
        rank(3, hosts[1], pids + 3, flight=waiting(seq - 1, seq - 1), stack=dump("read_shard")),
    ]


def decided(ranks: list[RankInfo]) -> Decision:
    return decide(ranks, library=LIBRARY, settled=True)


def test_the_same_hang_in_another_run_on_other_hosts_has_the_same_fingerprint() -> None:
    first = decided(by_stacks(("a", "b"), 100))
    # Another run: other hosts, pids, a checkout elsewhere, the line moved.
    again = decided(by_stacks(("c", "d"), 5000, file="/scratch/run-2/loader.py", line=57))
    assert first.head.kind == again.head.kind == "odd_frame"
    assert first.fingerprint is not None
    assert again.fingerprint == first.fingerprint
    assert first.head.fingerprint == first.fingerprint.id
    assert first.fingerprint.frames == ["loader.py read_shard"]
    assert first.fingerprint.describe() == "odd_frame at loader.py read_shard"
    # By the Flight Recorder: the collective's sequence number is not in it.
    missing = decided(by_recorder(58, ("a", "b"), 100))
    later = decided(by_recorder(1_000_000, ("x", "y"), 9000))
    assert missing.head.kind == later.head.kind == "missing"
    assert missing.fingerprint is not None
    assert missing.fingerprint == later.fingerprint
    assert (missing.fingerprint.op, missing.fingerprint.group) == ("gloo:all_reduce", "0")


def test_another_hang_has_another_fingerprint() -> None:
    seen = {
        fingerprint.id
        for fingerprint in (
            fingerprint_of("odd_frame", None, [Frame("loader.py", 1, "read_shard")]),
            fingerprint_of("odd_frame", None, [Frame("loader.py", 1, "load_batch")]),
            fingerprint_of("odd_frame", None, [Frame("reader.py", 1, "read_shard")]),
            fingerprint_of("missing", None, [Frame("loader.py", 1, "read_shard")]),
            fingerprint_of("missing", CollectiveRef(group="0", seq=5, op="gloo:all_reduce"), []),
            fingerprint_of("missing", CollectiveRef(group="1", seq=5, op="gloo:all_reduce"), []),
            fingerprint_of("missing", CollectiveRef(group="0", seq=5, op="gloo:broadcast"), []),
        )
    }
    assert len(seen) == 7


def test_hostile_ranks_give_a_bounded_fingerprint() -> None:
    names = [Frame("/" + "d" * 5000 + f"/{n}" + "f" * 5000, 2**62, "g" * 10_000) for n in range(99)]
    huge = fingerprint_of(
        "odd_frame", CollectiveRef(group="0" * 9999, seq=-1, op="x" * 9999), names
    )
    assert len(huge.id) == 16
    assert len(huge.frames) == MAX_FRAMES
    assert all(len(frame) <= 2 * NAME_CHARS + 1 for frame in huge.frames)
    assert len(huge.op) == len(huge.group) == NAME_CHARS
    # It reads back as the record keeps it, and nothing longer does.
    encoded = msgspec.msgpack.encode(huge)
    assert msgspec.msgpack.decode(encoded, type=type(huge)) == huge
    longer = msgspec.structs.replace(huge, op="x" * (NAME_CHARS + 1))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(longer), type=type(huge))
    # Culprits by the thousand, in any order, give the same few frames.
    many = [Frame(f"f{n}.py", n, f"fn{n}") for n in range(1000)]
    assert fingerprint_of("odd_frame", None, many) == fingerprint_of("odd_frame", None, many[::-1])


def incident(kind: str = "expired") -> IncidentInfo:
    return IncidentInfo(
        id="a-1", job="train", user="alice", uid=1000, host="a", scope="step",
        reason="timeout", time=1.0, kind=kind,
    )  # fmt: skip


def test_a_verdict_that_names_a_culprit_seen_here_counts() -> None:
    ranks = by_stacks(("a", "b"), 100)
    verdict = decided(ranks).head
    # Host a: its rank 0's own timer expired. Host b: its rank 3 is the culprit
    # and none of its ranks expired, but by stacks alone nothing bears that out there.
    assert uncounted(incident(), verdict, ranks, "a") == ""
    assert uncounted(incident(), verdict, ranks, "b").startswith("not counted here")
    recorded = by_recorder(58, ("a", "b"), 100)
    verdict = decided(recorded).head
    # By the Flight Recorder, host b's rank 2 waits in the collective named.
    assert uncounted(incident(), verdict, recorded, "a") == ""
    assert uncounted(incident(), verdict, recorded, "b") == ""
    assert COUNTED == "counted"


def test_a_lost_host_or_a_verdict_naming_no_culprit_never_counts() -> None:
    ranks = by_stacks(("a", "b"), 100)
    verdict = decided(ranks).head
    assert "host_lost" in uncounted(incident("host_lost"), verdict, ranks, "a")
    assert "names no culprit" in uncounted(incident(), Verdict(kind="undecided"), ranks, "a")


def test_a_culprit_named_for_its_silence_alone_is_no_hang_of_the_job() -> None:
    """Host b froze: its ranks never answered. The verdict names them, by the
    Flight Recorder of the ranks that wait for them, but three frozen hosts are not
    a deterministic hang."""
    recorded = by_recorder(58, ("a", "b"), 100)[:2]
    verdict = decided(recorded).head
    assert verdict.kind == "missing"
    assert verdict.culprits == [Culprit(host="", pid=0, rank=2), Culprit(host="", pid=0, rank=3)]
    assert "gave evidence" in uncounted(incident(), verdict, recorded, "a")
    # Listed by its host but never heard from: the same.
    pending = [*recorded, rank(2, "b", 102, state="pending"), rank(3, "b", 103, state="pending")]
    verdict = decided(pending).head
    assert verdict.kind == "missing"
    assert "gave evidence" in uncounted(incident(), verdict, pending, "a")


def test_forged_ranks_of_another_host_never_make_a_hang_here() -> None:
    """An etcd writer forges host x's ranks of a job this host holds: they wait in
    a collective and name this host's healthy rank, whose own Flight Recorder has
    completed it, as missing. Nothing here bears it out: not counted."""
    healthy = rank(0, "a", 100, flight=waiting(58, 58), stack=dump("train_step"))
    forged = [rank(n, "x", 900 + n, flight=waiting(59, 58)) for n in (1, 2, 3)]
    verdict = decided([healthy, *forged]).head
    assert (verdict.kind, [c.rank for c in verdict.culprits]) == ("missing", [0])
    assert uncounted(incident(), verdict, [healthy, *forged], "a").startswith("not counted here")


def test_a_fingerprints_frames_are_read_by_whoever_may_read_every_culprits_stack() -> None:
    one = msgspec.structs.replace(rank(3, "b", 103), reader_uid=1000, reader_gid=1000)
    two = msgspec.structs.replace(rank(4, "b", 104), reader_uid=1000, reader_gid=None)
    other = msgspec.structs.replace(rank(5, "b", 105), reader_uid=2000, reader_gid=2000)
    culprits = [Culprit(host="b", pid=pid) for pid in (103, 104)]
    assert reader_of(culprits, [one, two, other]) == (1000, 1000)
    assert reader_of([*culprits, Culprit(host="b", pid=105)], [one, two, other]) == (None, None)
    assert reader_of([Culprit(host="b", pid=106)], [rank(6, "b", 106)]) == (None, None)
