"""What a responder answers, without a process to ask: the Flight Recorder's dump
reduced to what a verdict needs, and an `Evidence` cut to fit one frame."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from watchdogd_client.evidence import fit_evidence, reduce_flight_record
from watchdogd_protocol import (
    Collective,
    Evidence,
    FlightRecord,
    Frame,
    GroupState,
    ThreadStack,
)
from watchdogd_protocol.responding import MAX_ENTRIES, MAX_GROUPS

#: What torch 2.13's ``_dump_fr_trace_json()`` returned on rank 0 of a two-rank gloo
#: job, while it waited in the default group's third all_reduce: two all_reduces
#: and a broadcast in a second group (``pair``) done before.
GLOO_DUMP = (
    Path(__file__).parents[1] / "data" / "flight_recorder" / "torch-2.13-gloo.json"
).read_bytes()
GROUPS = [
    GroupState(group="0", desc="default_pg", ranks=[0, 1], size=2),
    GroupState(group="1", desc="pair", ranks=[0, 1], size=2),
]


def dump(entries: list[dict[str, Any]], status: dict[str, int] | None = None) -> bytes:
    """A dump of ``entries`` (group 0's unless they say), as torch writes one;
    ``status``: the last collective completed, by the group's id."""
    written = [
        {
            "pg_id": 0,
            "process_group": ["0", "default_pg"],
            "profiling_name": "gloo:all_reduce",
            "state": "scheduled",
            "input_sizes": [[8]],
            "input_dtypes": ["Float"],
            "is_p2p": False,
            **entry,
        }
        for entry in entries
    ]
    pg_status = {
        pg_id: {"last_completed_collective": str(seq), "last_enqueued_collective": "9"}
        for pg_id, seq in (status or {}).items()
    }
    return json.dumps({"version": "2.10", "entries": written, "pg_status": pg_status}).encode()


class TestFlightRecord:
    def test_torchs_own_gloo_dump_gives_the_collective_entered_and_the_last_completed(
        self,
    ) -> None:
        notes: list[str] = []
        record = reduce_flight_record(GLOO_DUMP, 0, GROUPS, notes)
        entered = Collective(
            group="0",
            seq=3,
            op="gloo:all_reduce",
            state="scheduled",
            input_sizes=[[3, 4]],
            input_dtypes=["Float"],
        )
        assert record == FlightRecord(
            rank=0,
            groups=[
                GroupState(
                    group="0",
                    desc="default_pg",
                    ranks=[0, 1],
                    size=2,
                    entered=entered,
                    completed=2,
                ),
                GroupState(group="1", desc="pair", ranks=[0, 1], size=2, completed=1),
            ],
            entries=[
                Collective(
                    group="0",
                    seq=1,
                    op="gloo:all_reduce",
                    state="completed",  # torch says "scheduled", done or not
                    input_sizes=[[3, 4]],
                    input_dtypes=["Float"],
                ),
                Collective(
                    group="0",
                    seq=2,
                    op="gloo:all_reduce",
                    state="completed",
                    input_sizes=[[2]],
                    input_dtypes=["Long"],
                ),
                Collective(
                    group="1",
                    seq=1,
                    op="gloo:broadcast",
                    state="completed",
                    input_sizes=[[5]],
                    input_dtypes=["Float"],
                ),
                entered,
            ],
        )
        assert notes == []

    def test_a_group_torch_did_not_list_is_named_by_its_entries(self) -> None:
        record = reduce_flight_record(GLOO_DUMP, 0, [], [])
        assert record is not None
        assert [(g.group, g.desc, g.ranks, g.completed) for g in record.groups] == [
            ("0", "default_pg", [], 2),
            ("1", "pair", [], 1),
        ]

    def test_groups_waiting_in_a_collective_come_first(self) -> None:
        record = reduce_flight_record(
            dump([{"pg_id": 1, "process_group": ["1", "pair"], "collective_seq_id": 4}]),
            0,
            GROUPS,
            [],
        )
        assert record is not None
        assert [(g.group, g.entered is not None) for g in record.groups] == [
            ("1", True),
            ("0", False),
        ]

    def test_a_group_that_completed_all_it_entered_waits_in_none(self) -> None:
        entries = [{"collective_seq_id": 1}, {"collective_seq_id": 2}]
        record = reduce_flight_record(dump(entries, {"0": 2}), 0, GROUPS[:1], [])
        assert record is not None
        assert (record.groups[0].entered, record.groups[0].completed) == (None, 2)

    def test_a_gloo_entry_retired_is_done_past_what_its_groups_status_says(self) -> None:
        # torch updates pg_status from each work's completion in whatever order
        # those run, and leaves gloo's entries "scheduled" but retires them.
        entries = [
            {"collective_seq_id": 1, "retired": True},
            {"collective_seq_id": 2, "retired": True},
            {"collective_seq_id": 3},
        ]
        record = reduce_flight_record(dump(entries, {"0": 1}), 0, GROUPS[:1], [])
        assert record is not None
        [default] = record.groups
        assert default.completed == 2
        assert default.entered is not None
        assert default.entered.seq == 3
        assert [entry.state for entry in record.entries] == ["completed", "completed", "scheduled"]

    def test_a_nccl_entry_retired_without_completing_timed_out(self) -> None:
        entries = [
            {"collective_seq_id": 1, "state": "completed", "profiling_name": "nccl:all_reduce"},
            {"collective_seq_id": 2, "retired": True, "profiling_name": "nccl:all_reduce"},
        ]
        record = reduce_flight_record(dump(entries), 0, GROUPS[:1], [])
        assert record is not None
        [default] = record.groups
        assert default.completed == 1
        assert default.entered is not None
        assert default.entered.seq == 2

    def test_point_to_point_and_unreadable_entries_are_left_out(self) -> None:
        notes: list[str] = []
        entries: list[dict[str, Any]] = [
            {"collective_seq_id": 1},
            {"collective_seq_id": 0, "is_p2p": True, "profiling_name": "gloo:send"},
            {"collective_seq_id": "many"},
            {"collective_seq_id": 2, "input_sizes": [[-1]]},
        ]
        record = reduce_flight_record(dump(entries), 0, GROUPS[:1], notes)
        assert record is not None
        assert [entry.seq for entry in record.entries] == [1]
        assert notes == ["3 Flight Recorder entries left out"]

    def test_only_the_newest_entries_and_the_first_groups_are_kept(self) -> None:
        notes: list[str] = []
        entries = [{"collective_seq_id": seq} for seq in range(1, 2001)]
        groups = [GroupState(group=str(n)) for n in range(MAX_GROUPS + 5)]
        record = reduce_flight_record(dump(entries), 0, groups, notes)
        assert record is not None
        assert [entry.seq for entry in record.entries] == list(range(2001 - MAX_ENTRIES, 2001))
        assert record.groups[0].entered is not None
        assert record.groups[0].entered.seq == 2000
        assert len(record.groups) == MAX_GROUPS
        assert notes == [f"{MAX_GROUPS} of {MAX_GROUPS + 5} process groups taken"]

    @pytest.mark.parametrize("written", [b"", b"[1, 2]", b'{"entries": 7}'])
    def test_a_dump_that_cannot_be_read_gives_none_and_says_why(self, written: bytes) -> None:
        notes: list[str] = []
        assert reduce_flight_record(written, 0, GROUPS, notes) is None
        [note] = notes
        assert note.startswith("the Flight Recorder's dump could not be read")

    def test_a_process_without_torch_gives_no_record_and_imports_no_torch(self) -> None:
        code = (
            "import sys; from watchdogd_client.evidence import flight_record; notes = []; "
            "print(flight_record(notes), notes, 'torch' in sys.modules)"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert result.stdout.split() == ["None", "[]", "False"]


def evidence(threads: int, frames: int, entries: int) -> Evidence:
    """A main thread and ``threads - 1`` others, ``frames`` deep, with ``entries``
    Flight Recorder entries, numbered so that what is left can be told apart."""
    stacks = [
        ThreadStack(
            name=f"thread-{n}",
            ident=n,
            main=n == 0,
            frames=[Frame(f"/site-packages/pkg/module{d}.py", d, f"f{d}") for d in range(frames)],
        )
        for n in range(threads)
    ]
    collectives = [Collective(group="0", seq=seq, op="gloo:all_reduce") for seq in range(entries)]
    flight = FlightRecord(
        rank=0, groups=[GroupState(group="0", ranks=list(range(512)))], entries=collectives
    )
    return Evidence(id=1, ask=2, threads=stacks, flight=flight)


def size(message: msgspec.Struct) -> int:
    return len(msgspec.msgpack.encode(message))


class TestFit:
    def test_evidence_that_fits_is_kept_whole_with_its_notes(self) -> None:
        whole = evidence(threads=3, frames=5, entries=5)
        fitted = fit_evidence(whole, ["64 of 70 threads taken"])
        assert fitted == msgspec.structs.replace(whole, note="64 of 70 threads taken")

    def test_the_oldest_entries_go_first(self) -> None:
        whole = evidence(threads=3, frames=5, entries=MAX_ENTRIES)
        fitted = fit_evidence(whole, limit=size(whole) - 100)
        assert fitted.threads == whole.threads
        assert fitted.flight is not None
        seqs = [entry.seq for entry in fitted.flight.entries]
        assert seqs == list(range(MAX_ENTRIES - len(seqs), MAX_ENTRIES))
        assert 0 < len(seqs) < MAX_ENTRIES
        assert fitted.note.startswith("cut to fit")
        assert f"the {MAX_ENTRIES - len(seqs)} oldest Flight Recorder entries" in fitted.note

    def test_then_the_frames_of_other_threads_from_the_last_then_those_threads(self) -> None:
        whole = evidence(threads=10, frames=20, entries=MAX_ENTRIES)
        assert whole.flight is not None
        without_entries = msgspec.structs.replace(
            whole, flight=msgspec.structs.replace(whole.flight, entries=[])
        )
        fitted = fit_evidence(whole, limit=size(without_entries) - 3000)
        assert fitted.flight is not None
        assert fitted.flight.entries == []
        framed = [bool(thread.frames) for thread in fitted.threads]
        assert len(fitted.threads) == 10  # the threads are still named
        assert framed == sorted(framed, reverse=True)  # the last lost theirs first
        assert fitted.threads[0].frames == whole.threads[0].frames
        assert "the frames of" in fitted.note

        frameless = [
            thread if thread.main else msgspec.structs.replace(thread, frames=[])
            for thread in whole.threads
        ]
        bare = msgspec.structs.replace(without_entries, threads=frameless)
        fewer = fit_evidence(whole, limit=size(bare) - 10)
        assert 1 <= len(fewer.threads) < 10
        assert [thread.name for thread in fewer.threads[1:]] == [
            f"thread-{n}" for n in range(1, len(fewer.threads))
        ]
        assert fewer.threads[0].main
        assert fewer.threads[0].frames == whole.threads[0].frames
        assert "other threads" in fewer.note

    def test_whatever_the_bound_the_evidence_fits_and_the_main_thread_goes_last(
        self,
    ) -> None:
        whole = evidence(threads=64, frames=64, entries=MAX_ENTRIES)
        for limit in (60 * 1024, 20_000, 5000, 2000, 1200, 400):
            fitted = fit_evidence(whole, ["a note"], limit=limit)
            assert size(fitted) <= limit
            assert fitted.note.startswith("a note; cut to fit")
            if fitted.threads:
                assert fitted.threads[0].main
