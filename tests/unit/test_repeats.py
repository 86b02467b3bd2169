"""The table of jobs' hangs: ``limit`` hangs of one fingerprint within the window
mark a job, a reset clears it, a hang counts once, and the table keeps to bounds of
its own that no uid's flood of jobs can take from another."""

from __future__ import annotations

import msgspec

from watchdogd.core.fingerprint import Fingerprint
from watchdogd.core.repeats import MAX_HANGS, Hang, JobRow, Print, Repeats

DAY = 86_400.0
LOADER = Print(Fingerprint(id="f" * 16, kind="odd_frame", frames=["loader.py read_shard"]))
OTHER = Print(Fingerprint(id="e" * 16, kind="missing", op="gloo:all_reduce", group="0"))


def count(table: Repeats, key: tuple[int, str], incident: str, at: float, shown: Print = LOADER
          ) -> bool:  # fmt: skip
    """Count a hang of ``shown``'s fingerprint; whether it marked the job."""
    hang = Hang(incident, at, shown.fingerprint.id)
    return table.add(key, "alice", hang, shown)[1]


def test_three_hangs_of_one_fingerprint_in_a_day_mark_the_job_until_reset() -> None:
    table = Repeats(limit=3, window=DAY)
    job = (1000, "train")
    assert not count(table, job, "a-1", 1000.0)
    assert not count(table, job, "a-2", 2000.0, OTHER)
    assert not count(table, job, "a-3", 3000.0)
    assert table.repeating(job) == ""
    assert count(table, job, "a-4", 4000.0)
    assert table.repeating(job) == LOADER.fingerprint.id
    assert table.marked() == [job]
    # Marked once: a fourth does not mark it again.
    assert not count(table, job, "a-5", 5000.0)
    # A reset clears it, and the hangs before it count no more.
    before = table.reset(job, 6000.0)
    assert before is not None
    assert before.repeating == LOADER.fingerprint.id
    assert table.repeating(job) == ""
    row = table.get(job)
    assert row is not None
    assert table.count(row, LOADER.fingerprint.id, 6000.0) == 0
    assert not count(table, job, "a-6", 7000.0)
    assert not count(table, job, "a-7", 8000.0)
    assert count(table, job, "a-8", 9000.0)
    assert table.reset((1000, "never-hung"), 1.0) is None


def test_hangs_further_apart_than_the_window_do_not_repeat() -> None:
    table = Repeats(limit=3, window=DAY)
    job = (1000, "train")
    for n in range(6):
        assert not count(table, job, f"a-{n}", n * DAY * 0.6)
    assert table.repeating(job) == ""


def test_a_hang_counts_once() -> None:
    """The same incident settled again (a restart), or two hosts' incidents of one
    expiry within the incident window before they merged: one hang."""
    table = Repeats(limit=2, window=DAY, same_within=30.0)
    job = (1000, "train")
    assert not count(table, job, "a-1", 100.0)
    assert not count(table, job, "a-1", 100.0)
    assert not count(table, job, "b-1", 110.0)
    row = table.get(job)
    assert row is not None
    assert [hang.incident for hang in row.hangs] == ["b-1"]
    assert count(table, job, "a-2", 200.0)


def test_a_row_keeps_its_latest_hangs_and_what_their_fingerprints_are() -> None:
    table = Repeats(limit=MAX_HANGS, window=DAY * 365)
    job = (1000, "train")
    for n in range(MAX_HANGS * 3):
        shown = Print(Fingerprint(id=f"{n:016x}", kind="odd_frame"))
        count(table, job, f"a-{n}", float(n * 100), shown)
    row = table.get(job)
    assert row is not None
    assert len(row.hangs) == MAX_HANGS
    assert row.hangs[-1].incident == f"a-{MAX_HANGS * 3 - 1}"
    described = {shown.fingerprint.id for shown in row.prints}
    assert described <= {hang.fingerprint for hang in row.hangs}
    assert described


def test_one_uids_flood_of_jobs_evicts_its_own_rows_and_marks_stay() -> None:
    table = Repeats(limit=1, keep=5, per_uid=4)
    # Alice's job marked; bob's job hung once; root's own share.
    count(table, (1000, "alice-job"), "a-1", 1.0)
    table.limit = 3
    count(table, (2000, "bob-job"), "b-1", 1.0)
    for n in range(20):
        count(table, (0, f"root-{n}"), f"r-{n}", 2.0 + n)
    # Carol's flood: past the shared bound, her own rows go (she holds the most);
    # alice's and bob's stay, and root's share is its own.
    for n in range(100):
        count(table, (3000, f"carol-{n}"), f"c-{n}", 100.0 + n)
    keys = {row.key for row in table.everything()}
    assert {(1000, "alice-job"), (2000, "bob-job")} <= keys
    assert sum(1 for key in keys if key[0] == 3000) == 3
    assert sum(1 for key in keys if key[0] == 0) == 5
    assert table.repeating((1000, "alice-job"))
    # Within a uid, a marked row outlives its unmarked ones.
    table.limit = 1
    count(table, (3000, "carol-marked"), "c-m", 500.0)
    table.limit = 3
    for n in range(10):
        count(table, (3000, f"carol-late-{n}"), f"c-l-{n}", 600.0 + n)
    assert table.repeating((3000, "carol-marked"))


def test_what_changed_is_taken_and_a_restart_takes_the_rows_back() -> None:
    table = Repeats(limit=1, keep=2, per_uid=2)
    count(table, (1000, "a"), "a-1", 1.0)
    count(table, (1000, "b"), "b-1", 2.0)
    count(table, (1000, "c"), "c-1", 3.0)  # its own oldest, "a", goes
    changed, dropped = table.take()
    assert [row.job for row in changed] == ["b", "c"]
    assert dropped == [(1000, "a")]
    assert table.take() == ([], [])
    # As the record keeps them: encoded, read back, restored.
    rows = msgspec.msgpack.decode(msgspec.msgpack.encode(table.everything()), type=list[JobRow])
    again = Repeats(limit=1, keep=2, per_uid=2)
    again.restore(rows)
    assert again.everything() == table.everything()
    assert again.marked() == [(1000, "b"), (1000, "c")]
    assert again.take() == ([], [])
