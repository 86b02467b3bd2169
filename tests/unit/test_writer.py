"""The one writer of the timers: each change journaled, each new deadline a wake-up,
and no other part of the core that writes the table or the journal."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

import watchdogd.core
from watchdogd.core.timers import Timer, TimerTable
from watchdogd.core.writer import TableWriter

from helpers.fakes import FakeProcess

CORE_DIR = Path(watchdogd.core.__file__).parent
#: The methods of `TimerTable` that change it.
TABLE_WRITES = {"arm", "put", "disarm", "pop_due", "restore", "merge", "clear", "forget"}
#: The methods of a `Journal` that change the state.
JOURNAL_WRITES = {"put", "drop", "commit_soon", "commit"}


@dataclass
class OrderedJournal:
    """Every journal call, in order, as (what, scope)."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    generation: int = 0
    errors: int = 0
    degraded: bool = False

    def put(self, timer: Timer, *, replacing: Timer | None = None, soon: bool = False) -> None:
        if replacing is not None:
            self.calls.append(("drop", replacing.scope))
        self.calls.append(("put", timer.scope))
        if soon:
            self.commit_soon()

    def drop(self, *timers: Timer, soon: bool = False) -> None:
        self.calls += [("drop", timer.scope) for timer in timers]
        if timers and soon:
            self.commit_soon()

    def commit(self, generation: int) -> bool:
        return True

    def commit_soon(self) -> None:
        self.calls.append(("commit", ""))


def make_writer() -> tuple[TableWriter[FakeProcess], OrderedJournal, list[float]]:
    journal, woken = OrderedJournal(), list[float]()
    return TableWriter(TimerTable[FakeProcess](), journal, woken.append), journal, woken


def arm(writer: TableWriter[FakeProcess], process: FakeProcess, scope: str, at: float) -> Timer:
    timer, _ = writer.arm(
        process,
        scope,
        timeout=at,
        policy="kill",
        uid=process.uid,
        owner=process.uid,
        now=0.0,
        exit_releases=False,
        watch=None,
        deadline=at,
    )
    return timer


def test_an_arming_is_journaled_and_wakes_the_scheduler_at_its_deadline() -> None:
    writer, journal, woken = make_writer()
    timer = arm(writer, FakeProcess(200, 1000, 1000), "step", 5.0)
    assert journal.calls == [("put", "step")]
    assert woken == [5.0]
    assert writer.table.get(200, "step") == timer
    assert writer.next_deadline() == 5.0


def test_a_release_is_journaled_and_moves_no_wake_up() -> None:
    writer, journal, woken = make_writer()
    arm(writer, FakeProcess(200, 1000, 1000), "step", 5.0)
    timer, gone = writer.disarm(200, "step")
    assert timer is not None
    assert gone is not None
    assert journal.calls == [("put", "step"), ("drop", "step")]
    assert woken == [5.0]
    assert len(writer.table) == 0


def test_a_deadline_moved_at_a_look_wakes_the_scheduler_but_is_not_journaled() -> None:
    writer, journal, woken = make_writer()
    process = FakeProcess(200, 1000, 1000)
    timer = arm(writer, process, "step", 5.0)
    [item] = writer.pop_due(5.0)
    writer.moved(process, msgspec.structs.replace(item.timer, deadline=6.0))
    assert journal.calls == [("put", "step")]
    assert woken == [5.0, 6.0]
    held = writer.table.get(200, "step")
    assert held is not None
    assert (held.deadline, held.armed_at) == (6.0, timer.armed_at)


def test_a_timer_falling_due_leaves_as_one_record_dropped_and_its_firing_one_put() -> None:
    writer, journal, _ = make_writer()
    timer = arm(writer, FakeProcess(200, 1000, 1000), "step", 5.0)
    [item] = writer.pop_due(5.0)
    writer.fired(item.timer, msgspec.structs.replace(timer, firing=1))
    writer.dropped([msgspec.structs.replace(timer, firing=1)])
    assert journal.calls == [
        ("put", "step"),
        ("drop", "step"),
        ("put", "step"),
        ("drop", "step"),
        ("commit", ""),
    ]


def test_an_exit_drops_every_timer_of_its_process_in_one_commit() -> None:
    writer, journal, _ = make_writer()
    process = FakeProcess(200, 1000, 1000)
    for scope in "ab":
        arm(writer, process, scope, 5.0)
    forgotten = writer.forget(200)
    assert forgotten is not None
    assert forgotten[0] is process
    assert journal.calls[2:] == [("drop", "a"), ("drop", "b"), ("commit", "")]
    assert writer.forget(200) is None
    assert journal.calls[5:] == []


def test_a_stop_empties_the_table_and_leaves_the_state_as_it_is() -> None:
    writer, journal, _ = make_writer()
    process = FakeProcess(200, 1000, 1000)
    arm(writer, process, "step", 5.0)
    assert writer.clear() == [process]
    assert journal.calls == [("put", "step")]


def test_a_restore_drops_what_it_leaves_out_and_wakes_the_scheduler_at_the_soonest() -> None:
    writer, journal, woken = make_writer()
    process = FakeProcess(200, 1000, 1000)
    kept, gone = (
        Timer(
            deadline=at,
            seq=0,
            pid=200,
            scope=scope,
            policy="kill",
            uid=1000,
            owner=1000,
            timeout=at,
            armed_at=0.0,
            start_time=1000,
        )
        for scope, at in (("kept", 3.0), ("gone", 4.0))
    )
    writer.restore([(process, [kept])], [gone])
    assert journal.calls == [("drop", "gone"), ("commit", "")]
    assert woken == [3.0]


def _writes(path: Path) -> list[str]:
    """The calls in ``path`` that change a table held as ``_table`` or a journal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method, owner = node.func.attr, node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if (name == "_table" and method in TABLE_WRITES) or (
            "journal" in name and method in JOURNAL_WRITES
        ):
            found.append(f"{path.stem}:{node.lineno} {name}.{method}")
    return found


def test_no_part_of_the_core_writes_the_table_or_the_journal_but_the_writer() -> None:
    parts = [path for path in CORE_DIR.glob("*.py") if path.stem not in ("writer", "timers")]
    assert len(parts) > 30
    assert [write for path in parts for write in _writes(path)] == []


def test_the_check_of_the_writes_sees_them_in_the_writer() -> None:
    found = _writes(CORE_DIR / "writer.py")
    assert any(write.endswith("_table.arm") for write in found)
    assert any(write.endswith("_journal.drop") for write in found)
