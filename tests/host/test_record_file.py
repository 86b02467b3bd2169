"""The record of what happened, on a real file: what a restarted daemon reads back,
a write the daemon died in, damage, the file's bounds, and a disk that refuses."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.lowlevel

from watchdogd.core.counters import Counters
from watchdogd.core.events import EventLog
from watchdogd.core.fingerprint import Fingerprint
from watchdogd.core.incidents import IncidentLog
from watchdogd.core.repeats import Hang, Print, Repeats
from watchdogd.storage.journal import RECORD
from watchdogd.storage.record_file import RecordFile
from watchdogd.storage.whole_record import PART
from watchdogd_protocol import EventInfo, RankInfo, StepResult

from helpers.disks import fill_space, tmpfs
from helpers.special_files import each_special, freed_after, make_special, moved_aside
from helpers.waiting import PATIENCE

DUMP = 'Thread 7 (idle): "MainThread"\n    all_reduce (c10d.py:2288)\n    step (train.py:8)\n'


def event(pid: int, kind: str = "expired", incident: str = "", output: str = "") -> EventInfo:
    steps = [StepResult(step="dump py-spy dump --pid {pid}", result="exit 0", output=output)]
    return EventInfo(seq=0, kind=kind, time=100.0, pid=pid, uid=1000, scope="step",
                     policy="rank", outcome="exited", steps=steps, incident=incident)  # fmt: skip


def logs() -> tuple[EventLog, IncidentLog]:
    return EventLog(100, per_uid=50), IncidentLog("a", window=30.0)


def reopened(path: Path, **options: Any) -> tuple[EventLog, IncidentLog, RecordFile]:
    events, incidents = logs()
    record = RecordFile(str(path), events, incidents, wall=lambda: 110.0, **options)
    record.load()
    return events, incidents, record


#: Record files each schema wrote, one directory each (``record1``, ...): a daemon
#: reads every one of them as it was written (`written_scenario` made them).
DATA = Path(__file__).parent.parent / "data"


def written_scenario(events: EventLog, incidents: IncidentLog) -> str:
    """What the files in `DATA` hold: three events and an incident of two ranks,
    one stack readable by its owner, one by root alone; the incident's id."""
    for pid in (10, 11, 12):
        events.record(event(pid, output=f"output of {pid}"))
    opened, _ = incidents.expired(
        (1000, "train"), "alice", RankInfo(host="a", pid=41, uid=1000, role="expired",
                                           scope="step", rank=1), "timeout", 100.0
    )  # fmt: skip
    incidents.add(opened, RankInfo(host="a", pid=40, uid=1000, role="peer", scope="step", rank=0))
    incidents.dumped(opened, 41, "expired", (1000, 1000))
    incidents.finished(event(41, incident=opened, output=DUMP))
    incidents.dumped(opened, 40, "peer", None)
    incidents.finished(event(40, kind="peer", incident=opened, output=DUMP))
    return opened


def test_the_record_of_every_schema_loads_as_it_was_written(tmp_path: Path) -> None:
    """(A new schema's file is what a `RecordFile` writes of `written_scenario`;
    the files of the schemas before it stay as they were written.)"""
    expected_events, expected = logs()
    opened = written_scenario(expected_events, expected)
    found = sorted(DATA.glob("record*/state.db.record"))
    assert found
    for path in found:
        copy = tmp_path / path.parent.name / path.name
        copy.parent.mkdir()
        copy.write_bytes(path.read_bytes())
        events, incidents, record = reopened(copy)
        record.close()
        assert events.page(None, 100, 0) == expected_events.page(None, 100, 0), path
        assert incidents.get(opened, 0, 0) == expected.get(opened, 0, 0), path
        assert incidents.get(opened, 1000, 1000) == expected.get(opened, 1000, 1000), path


def test_events_come_back_numbered_as_they_were_and_numbering_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    events, _, record = reopened(path)
    for pid in range(10, 15):
        events.record(event(pid))
    record.write_now()
    record.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again, _, record = reopened(path)
    assert again.page(None, 100, 0) == events.page(None, 100, 0)
    assert again.record(event(99)).seq == 6
    record.write_now()
    record.close()
    assert [e.seq for e in reopened(path)[0].page(None, 100, 0)] == [1, 2, 3, 4, 5, 6]


def test_an_incident_keeps_its_ranks_readers_and_verdict(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    events, incidents, record = reopened(path)
    opened = written_scenario(events, incidents)  # rank 0's stack for root alone
    record.write_now()
    record.close()
    _, restored, _ = reopened(path)
    for viewer, gid in ((0, 0), (1000, 1000), (1001, 1001)):
        assert restored.get(opened, viewer, gid) == incidents.get(opened, viewer, gid)
    shown = restored.get(opened, 1000, 1000)
    assert shown is not None
    assert shown.verdict is not None
    assert [r.stack != "" for r in shown.ranks] == [True, False]  # decided at the dump
    # Its window is still open at 110: the job's next expiry joins it.
    joined, new = restored.expired(
        (1000, "train"), "alice", RankInfo(host="a", pid=42, uid=1000, role="expired",
                                           scope="step", rank=2), "timeout", 110.0
    )  # fmt: skip
    assert (joined, new) == (opened, False)


def a_hang(table: Repeats, job: str, incident: str, at: float) -> None:
    shown = Print(Fingerprint(id="f" * 16, kind="odd_frame", frames=["loader.py read_shard"]))
    table.add((1000, job), "alice", Hang(incident, at, shown.fingerprint.id), shown)


def tags(path: Path) -> list[str]:
    """The kind of each record of the file at ``path``, in order."""
    data = path.read_bytes()
    found, offset = [], 0
    while offset < len(data):
        length, _ = RECORD.unpack_from(data, offset)
        offset += RECORD.size
        found.append(msgspec.msgpack.decode(data[offset : offset + length])[0])
        offset += length
    return found


def test_the_jobs_hangs_come_back_written_first_and_a_dropped_row_stays_dropped(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db.record"
    events, incidents = logs()
    table = Repeats(limit=2, keep=2, per_uid=2)
    record = RecordFile(str(path), events, incidents, repeats=table, wall=lambda: 110.0)
    record.load()
    written_scenario(events, incidents)
    for job in ("a", "b"):
        a_hang(table, job, f"{job}-1", 10.0)
    record.write_now()  # the first write: the file whole
    assert tags(path)[:3] == ["header", "job", "job"]
    a_hang(table, "a", "a-2", 200.0)  # marks job a
    a_hang(table, "c", "c-1", 300.0)  # job b, alice's oldest, gives way
    record.write_now()  # appended
    assert tags(path)[-2:] == ["job", "job_dropped"]
    record.close()
    again = Repeats(limit=2, keep=2, per_uid=2)
    reloaded = RecordFile(str(path), *logs(), repeats=again, wall=lambda: 110.0)
    reloaded.load()
    reloaded.close()
    assert again.everything() == table.everything()
    assert again.marked() == [(1000, "a")]


def test_a_file_deleted_while_none_of_it_was_open_is_written_whole_again(
    tmp_path: Path,
) -> None:
    """Deleted with its directory after a whole write had closed it: the next
    write finds a new, empty file there. Appended to, it would hold only the events
    after the deletion; it is written whole, every event in it."""
    path = tmp_path / "state.db.record"
    events, _, record = reopened(path)
    for pid in (10, 11, 12):
        events.record(event(pid))
    record.write_now()
    record.close()
    path.unlink()
    events.record(event(13))
    record.write_now()
    record.close()
    assert [e.pid for e in reopened(path)[0].page(None, 100, 0)] == [10, 11, 12, 13]


def test_a_write_the_daemon_died_in_is_cut_off_and_said_so(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    events, _, record = reopened(path)
    events.record(event(10))
    record.write_now()
    record.close()
    whole = path.read_bytes()
    with open(path, "ab") as out:
        out.write(b"\x00\x00\x10\x00half a record")
    again, _, record = reopened(path)
    assert path.read_bytes() == whole
    [cut] = [e for e in again.page(None, 100, 0) if e.kind == "record_cut"]
    assert cut.note.startswith(f"{path} ended in a record cut short: 17 bytes, ")
    assert f"the first at byte {len(whole)}" in cut.note
    again.record(event(11))
    record.write_now()
    record.close()
    read_back = reopened(path)[0].page(None, 100, 0)
    assert [(e.kind, e.pid) for e in read_back] == [
        ("expired", 10), ("record_cut", os.getpid()), ("expired", 11)
    ]  # fmt: skip
    assert not (tmp_path / "state.db.record.damaged").exists()


def three_events(path: Path) -> list[int]:
    """A record file of three events, each in a write of its own; where each
    record starts, and the end."""
    events, _, record = reopened(path)
    starts = []
    for pid in (10, 11, 12):
        events.record(event(pid))
        starts.append(path.stat().st_size if path.exists() else 0)
        record.write_now()
    record.close()
    return [*starts, path.stat().st_size]


def kinds_and_pids(events: EventLog) -> list[tuple[str, int]]:
    return [(e.kind, e.pid) for e in events.page(None, 100, 0)]


def test_a_damaged_record_is_jumped_over_said_and_the_file_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    starts = three_events(path)
    data = bytearray(path.read_bytes())
    data[starts[1] + 20] ^= 0xFF  # inside the record of pid 11: its checksum fails
    path.write_bytes(bytes(data))
    again, _, record = reopened(path)
    damaged = ("record_damaged", os.getpid())
    assert kinds_and_pids(again) == [("expired", 10), ("expired", 12), damaged]
    [said] = [e for e in again.page(None, 100, 0) if e.kind == "record_damaged"]
    size = starts[2] - starts[1]
    assert f"(bad checksum in the record at byte {starts[1]})" in said.note
    assert f"{size} bytes, the first at byte {starts[1]}, 1 whole records among them" in said.note
    assert f"moved to {path}.damaged" in said.note
    assert (tmp_path / "state.db.record.damaged").read_bytes() == bytes(data)
    record.write_now()  # written whole from what was read
    record.close()
    assert kinds_and_pids(reopened(path)[0]) == [("expired", 10), ("expired", 12), damaged]


def test_a_damaged_length_ends_the_reading_and_says_how_much_was_left(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    starts = three_events(path)
    data = bytearray(path.read_bytes())
    data[starts[1]] = 0x7F  # the length of pid 11's record: far past any record
    path.write_bytes(bytes(data))
    again, _, record = reopened(path)
    record.close()
    assert kinds_and_pids(again) == [("expired", 10), ("record_damaged", os.getpid())]
    [said] = [e for e in again.page(None, 100, 0) if e.kind == "record_damaged"]
    left = starts[3] - starts[1]
    assert f"{left} bytes, the first at byte {starts[1]} dropped" in said.note


def test_a_damaged_last_record_keeps_what_came_before(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    three_events(path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last record
    path.write_bytes(bytes(data))
    again, _, record = reopened(path)
    record.close()
    pids = [pid for kind, pid in kinds_and_pids(again) if kind == "expired"]
    assert pids == [10, 11]
    assert (tmp_path / "state.db.record.damaged").read_bytes() == bytes(data)


@each_special
def test_a_record_that_is_no_regular_file_is_moved_aside_unread_and_written_anew(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db.record"
    make_special(kind, path)
    with freed_after(path):
        events, _, record = reopened(path)
    moved_aside(path, kind, caplog.text)
    events.record(event(10))
    record.write_now()
    record.close()
    assert [e.pid for e in reopened(path)[0].page(None, 100, 0)] == [10]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_fifo_that_takes_the_records_place_under_the_daemon_is_written_over(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db.record"
    events, _, record = reopened(path)
    events.record(event(10))
    record.write_now()
    record.close()  # the next append opens the file again
    path.unlink()
    os.mkfifo(path)
    events.record(event(11))
    started = time.monotonic()
    with freed_after(path, 3.0):
        record.write_now()  # refused, not waited on: the next write is whole
        record.write_now()
    assert time.monotonic() - started < 1.0
    record.close()
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert [e.pid for e in reopened(path)[0].page(None, 100, 0)] == [10, 11]


def test_the_file_is_written_whole_again_before_it_outgrows_its_bounds(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    events, _, record = reopened(path, slack=0)
    largest = 0
    for pid in range(3000):
        events.record(event(pid, output="x" * 200))
        record.write_now()
        largest = max(largest, path.stat().st_size)
    record.close()
    kept = len(events)
    assert kept == 50  # one uid's share
    # The file never holds more than about twice the ring, however many came and
    # went: a record is an event's encoding and its header.
    each = len(msgspec.msgpack.encode(events.page(None, 1, 0)[0])) + 16
    assert largest < (2 * kept + 2) * each
    assert [e.pid for e in reopened(path)[0].page(None, 100, 0)] == list(range(2950, 3000))


class _Steps(trio.abc.Instrument):
    """Counts the steps the record's task takes while a whole write of it is
    under way."""

    def __init__(self, record: RecordFile) -> None:
        self.record = record
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("RecordFile.run") and self.record._replacing is not None:
            self.steps += 1


async def test_a_whole_write_is_framed_in_turns_and_loses_nothing_recorded_meanwhile(
    tmp_path: Path,
) -> None:
    """Framing the whole file (hundreds of MiB of stacks, at most) lets the loop's
    other tasks run between records, a due timer's signal among them; an event
    recorded meanwhile is written after the file it is not in."""
    path = tmp_path / "state.db.record"
    events, _, record = reopened(path)
    record.close()
    events, incidents = logs()
    record = RecordFile(str(path), events, incidents, wall=lambda: 110.0, turn=0.0)
    record.load()
    for pid in range(40):
        events.record(event(pid, output="z" * 1000))
    steps = _Steps(record)
    trio.lowlevel.add_instrument(steps)
    recorded_meanwhile: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(record.run)
        while not path.exists() or record._replacing is not None or not recorded_meanwhile:
            if record._replacing is not None and not recorded_meanwhile:
                recorded_meanwhile.append(events.record(event(1000)).seq)
            await trio.lowlevel.checkpoint()
        while record.written < recorded_meanwhile[0]:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    trio.lowlevel.remove_instrument(steps)
    record.close()
    # A step a record at least (every one of them past its turn of 0 s): the
    # header, 40 events, and the thread's write.
    assert steps.steps >= 40
    assert [e.pid for e in reopened(path)[0].page(None, 100, 0)] == [*range(40), 1000]


def used(disk: Path) -> int:
    """The bytes of ``disk`` that files hold."""
    found = os.statvfs(disk)
    return (found.f_blocks - found.f_bfree) * found.f_frsize


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_a_whole_write_under_way_gives_its_room_back_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The state finds its disk full while the record is written whole: the new
    file, which the write holds open, is emptied at once (removed alone, its room
    would stay taken until the write ended), the write stops without a failure
    and renames nothing into place, and every record is written once the state
    is."""
    with tmpfs(size="64m") as disk:
        path, partial = disk / "state.db.record", disk / "state.db.record.new"
        events, incidents = EventLog(1000, per_uid=1000), IncidentLog("a", window=30.0)
        failing = [False]
        record = RecordFile(str(path), events, incidents, turn=0.0,
                            state_failing=lambda: failing[0])  # fmt: skip
        record.load()
        flooded(events, 65534, range(400), size=64 * 1024)
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                await nursery.start(record.run)
                while not partial.exists() or partial.stat().st_blocks * 512 < 4 * PART:
                    await trio.lowlevel.checkpoint()
                failing[0] = True
                assert record.give_way()
                # A part may be under way in a worker thread, and land after.
                assert used(disk) <= 2 * PART
                while record._replacing is not None:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        assert not path.exists()
        assert not partial.exists()
        assert used(disk) <= 64 * 1024
        assert "record_write_failed" not in caplog.text
        failing[0] = False
        record.write_now()
        record.close()
        events = EventLog(1000, per_uid=1000)
        again = RecordFile(str(path), events, IncidentLog("a", window=30.0))
        again.load()
        again.close()
        assert events.kept(65534) == 400


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_keeps_everything_in_memory_and_writes_it_whole_after() -> None:
    with tmpfs() as disk:
        path = disk / "state.db.record"
        events, _, record = reopened(path)
        events.record(event(10))
        record.write_now()
        filler = fill_space(disk)
        for pid in range(11, 40):
            events.record(event(pid, output="y" * 4000))
            record.write_now()
        assert [e.pid for e in events.page(None, 100, 0)] == list(range(10, 40))
        filler.unlink()
        record.write_now()
        record.close()
        assert [e.pid for e in reopened(path)[0].page(None, 100, 0)] == list(range(10, 40))


def flooded(events: EventLog, uid: int, pids: range, size: int = 40 * 1024) -> None:
    """Events of ``uid``'s processes, each with a dump of ``size`` bytes."""
    for pid in pids:
        stack = 'Thread 1 (idle): "MainThread"\n' + f"    wait (/srv/{'w' * 60}.py:{pid})\n" * (
            size // 80
        )
        events.record(msgspec.structs.replace(event(pid, output=stack), uid=uid))


def test_the_file_keeps_within_its_bound_cutting_other_users_stacks_before_roots(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db.record"
    metrics = Counters()
    events, incidents = logs()
    record = RecordFile(str(path), events, incidents, bound=lambda: 1024 * 1024,
                        metrics=metrics)  # fmt: skip
    record.load()
    largest = 0
    for start in range(0, 400, 20):
        flooded(events, 0 if start % 40 else 65534, range(start, start + 20))
        record.write_now()
        largest = max(largest, path.stat().st_size)
    record.close()
    assert largest <= 1024 * 1024
    assert metrics.record_left_off > 0
    back = reopened(path)[0].page(None, 200, 0)
    assert back[-1].pid == 399  # the newest event, whatever else went
    whole = {e.pid for e in back if "...(trimmed)" not in e.steps[0].output}
    cut = {e.pid for e in back if "...(trimmed)" in e.steps[0].output}
    assert cut
    assert all("left off the record" in e.note for e in back if e.pid in cut)
    # Root's newest dumps are kept whole before any other user's is.
    roots = [e.pid for e in back if e.uid == 0]
    assert whole <= set(roots)
    assert sorted(whole) == roots[-len(whole) :]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_the_file_leaves_the_room_the_state_wants_and_gives_it_back_when_asked() -> None:
    with tmpfs(size="2m") as disk:
        path = disk / "state.db.record"
        events, incidents = logs()
        failing = [False]
        record = RecordFile(str(path), events, incidents, reserve=lambda: 1024 * 1024,
                            state_failing=lambda: failing[0])  # fmt: skip
        record.load()
        for start in range(0, 200, 10):
            flooded(events, 65534, range(start, start + 10))
            record.write_now()
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            assert free >= 1024 * 1024
            assert path.stat().st_size <= (2 * 1024 * 1024 - 1024 * 1024) // 2
        # The state cannot be written: nothing is, here, until it can.
        failing[0] = True
        written = path.read_bytes()
        flooded(events, 65534, range(200, 210))
        record.write_now()
        assert path.read_bytes() == written
        # The state found its disk full: the file goes, its records stay.
        assert record.give_way()
        assert not path.exists()
        assert not record.give_way()  # nothing more to give
        failing[0] = False
        record.write_now()
        record.close()
        assert reopened(path)[0].page(None, 1, 0)[0].pid == 209
