"""A whole write of the record (`watchdogd.storage.whole_record`): handed out in
parts as it is framed, so that no copy of the whole file is held, and never more
than its target written, even when what it holds must be cut to fit."""

from __future__ import annotations

import math

from watchdogd.storage.record_entries import SCHEMA, Entry, EventRecord, Header, framed
from watchdogd.storage.whole_record import PART, START_OVER, StartOver, Step, WholeWrite
from watchdogd_protocol import EventInfo, StepResult

#: An event whose step's output makes a record of about 256 KiB.
OUTPUT = "x" * (256 * 1024)


def event(seq: int, uid: int = 1000) -> EventRecord:
    step = StepResult(step="dump py-spy dump --pid {pid}", result="exit 0", output=OUTPUT)
    info = EventInfo(seq=seq, kind="expired", time=100.0, pid=seq, uid=uid, scope="step",
                     policy="rank", outcome="exited", steps=[step])  # fmt: skip
    return EventRecord(info)


def steps_of(whole: WholeWrite) -> list[Step]:
    return [step for step in whole.framed(math.inf) if step is not None]


def size_of(step: Step) -> int:
    return len(step) if isinstance(step, bytes | bytearray) else 0


def written(steps: list[Step]) -> bytes:
    """The file the steps make: what follows the last start over."""
    file = bytearray()
    for step in steps:
        if isinstance(step, StartOver):
            file.clear()
        else:
            assert step is not None
            file += step
    return bytes(file)


def test_a_whole_write_that_fits_is_handed_out_part_by_part_in_order() -> None:
    entries: list[Entry] = [Header(SCHEMA), *(event(seq) for seq in range(1, 21))]
    whole = WholeWrite(list(entries), written=20, target=1 << 30)
    steps = steps_of(whole)
    assert START_OVER not in steps
    assert len(steps) > 1  # some 5 MiB: never one piece
    assert all(size_of(step) < PART + len(OUTPUT) + 1024 for step in steps)
    assert written(steps) == b"".join(framed(entry) for entry in entries)
    assert whole.size == len(written(steps))
    assert whole.left == 0


def test_a_whole_write_past_its_target_never_writes_more_than_it_and_starts_over() -> None:
    entries: list[Entry] = [Header(SCHEMA), *(event(seq) for seq in range(1, 21))]
    target = 2 * PART
    whole = WholeWrite(list(entries), written=20, target=target)
    steps = steps_of(whole)
    first = steps[: steps.index(START_OVER)]
    assert sum(map(size_of, first)) <= target
    assert steps.count(START_OVER) == 1
    file = written(steps)
    assert len(file) == whole.size <= target
    assert whole.left > 0  # cut to fit, and counted
