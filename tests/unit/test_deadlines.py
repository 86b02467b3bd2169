"""The ordered deadlines, and deadlines by key on them (`KeyedDeadlines`), by example
and against plain models (hypothesis), with chunks small enough that every split and
merge happens."""

from __future__ import annotations

import os

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from watchdogd.core.deadlines import Deadlines

from helpers.keyed_deadlines import KeyedDeadlines


class Entry(msgspec.Struct, frozen=True, order=True):
    """An entry as `Deadlines` wants them: ordered by (deadline, seq) first."""

    deadline: float
    seq: int
    name: str = ""


def test_earliest_first_and_replacement() -> None:
    heap: KeyedDeadlines[str] = KeyedDeadlines()
    heap.set("a", 3.0)
    heap.set("b", 1.0)
    heap.set("c", 2.0)
    heap.set("b", 5.0)  # re-arm later
    assert heap.peek() == ("c", 2.0)
    assert heap.pop_due(3.0) == [("c", 2.0), ("a", 3.0)]
    assert list(heap) == [("b", 5.0)]


def test_equal_deadlines_come_out_in_the_order_they_were_set() -> None:
    heap: KeyedDeadlines[int] = KeyedDeadlines()
    for key in (3, 1, 2):
        heap.set(key, 1.0)
    assert [key for key, _ in heap.pop_due(1.0)] == [3, 1, 2]


def test_pop_due_takes_at_most_its_limit_earliest_first() -> None:
    heap: KeyedDeadlines[int] = KeyedDeadlines()
    for key in range(10):
        heap.set(key, float(key))
    heap.remove(1)  # a removed key does not count against the limit
    assert heap.pop_due(5.0, limit=3) == [(0, 0.0), (2, 2.0), (3, 3.0)]
    assert heap.pop_due(5.0, limit=0) == []
    assert heap.pop_due(5.0, limit=10) == [(4, 4.0), (5, 5.0)]
    assert len(heap) == 4


def test_remove_and_absent_keys() -> None:
    heap: KeyedDeadlines[str] = KeyedDeadlines()
    heap.set("a", 1.0)
    assert heap.remove("a") is True
    assert heap.remove("a") is False
    assert heap.peek() is None
    assert heap.next_deadline() is None
    assert heap.pop_due(10.0) == []


def test_a_renewed_key_leaves_nothing_behind() -> None:
    heap: KeyedDeadlines[str] = KeyedDeadlines()
    for i in range(100_000):
        heap.set("renewed", float(i))  # a worker kicking its timer in a loop
    assert len(heap) == 1
    assert heap.pop_due(1e9) == [("renewed", 99_999.0)]


def add(order: Deadlines[Entry], deadline: float, name: str = "") -> Entry:
    return order.insert(deadline, lambda seq: Entry(deadline, seq, name))


def test_ties_are_numbered_in_the_order_they_were_added() -> None:
    order: Deadlines[Entry] = Deadlines(chunk=4)
    for deadline in (5.0, 1.0, 3.0):
        assert add(order, deadline).seq == 0
    assert [add(order, 3.0, name).seq for name in "abcdefghij"] == list(range(1, 11))
    assert add(order, 5.0).seq == 1  # the last entry's deadline
    assert add(order, 0.5).seq == 0  # before the first
    assert [entry.name for entry in order if entry.deadline == 3.0] == ["", *"abcdefghij"]
    assert list(order) == sorted(order)


def test_after_resumes_past_a_position_even_one_no_longer_held() -> None:
    entries = [Entry(float(d), 0) for d in range(20)]
    order = Deadlines(entries, chunk=4)
    assert list(order.after(7.0, 0)) == entries[8:]
    order.remove(entries[8])  # the last entry of a page went away
    assert list(order.after(8.0, 0)) == entries[9:]
    assert list(order.after(7.5, 3)) == entries[9:]
    assert list(order.after(-1.0, 0)) == entries[:8] + entries[9:]
    assert list(order.after(19.0, 0)) == []


def test_remove_wants_the_very_entry() -> None:
    held = Entry(1.0, 0)
    order = Deadlines([held])
    with pytest.raises(ValueError, match="not held"):
        order.remove(Entry(2.0, 0))
    order.remove(held)
    with pytest.raises(ValueError, match="not held"):
        order.remove(held)


def test_sort_puts_entries_in_the_kept_order() -> None:
    entries = [Entry(2.0, 1), Entry(1.0, 5), Entry(2.0, 0), Entry(1.0, 2)]
    Deadlines.sort(entries)
    assert entries == sorted(entries)


keys = st.integers(min_value=0, max_value=20)
times = st.floats(min_value=0, max_value=1000, allow_nan=False)


class HeapAgainstDict(RuleBasedStateMachine):
    """Every operation on the heap agrees with a plain dict of deadlines."""

    def __init__(self) -> None:
        super().__init__()
        self.heap: KeyedDeadlines[int] = KeyedDeadlines()
        self.model: dict[int, float] = {}

    @rule(key=keys, deadline=times)
    def set(self, key: int, deadline: float) -> None:
        self.heap.set(key, deadline)
        self.model[key] = deadline

    @rule(key=keys)
    def remove(self, key: int) -> None:
        assert self.heap.remove(key) == (self.model.pop(key, None) is not None)

    @rule(now=times)
    def pop_due(self, now: float) -> None:
        popped = self.heap.pop_due(now)
        expected = [(key, deadline) for key, deadline in self.model.items() if deadline <= now]
        assert sorted(popped) == sorted(expected)
        # Earliest first (ties in the order they were set, which the model does not track).
        assert [deadline for _, deadline in popped] == sorted(d for _, d in popped)
        for key, _ in popped:
            del self.model[key]

    @precondition(lambda self: self.model)
    @rule()
    def peek(self) -> None:
        top = self.heap.peek()
        assert top is not None
        key, deadline = top
        assert deadline == min(self.model.values())
        assert self.model[key] == deadline

    @rule(key=keys)
    def get(self, key: int) -> None:
        assert self.heap.get(key) == self.model.get(key)

    @invariant()
    def same_contents(self) -> None:
        assert len(self.heap) == len(self.model)
        assert dict(self.heap) == self.model
        assert [deadline for _, deadline in self.heap] == sorted(self.model.values())
        assert self.heap.next_deadline() == (min(self.model.values()) if self.model else None)


HeapAgainstDict.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestHeapAgainstDict = HeapAgainstDict.TestCase


#: A few deadlines, so that ties are common.
few_times = st.integers(min_value=0, max_value=30).map(float)
CHUNK = 8


class DeadlinesAgainstSortedList(RuleBasedStateMachine):
    """`Deadlines` with chunks of 8 agrees with a sorted list, and keeps its layout:
    chunks sorted, none empty, none over twice the chunk, none but the ends under
    a quarter of it."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.order: Deadlines[Entry] = Deadlines(chunk=CHUNK)
        self.model: list[Entry] = []
        self.names = iter(range(10**9))

    @rule(target=held, deadline=few_times)
    def insert(self, deadline: float) -> Entry:
        entry = add(self.order, deadline, str(next(self.names)))
        ties = [e.seq for e in self.model if e.deadline == deadline]
        assert entry.seq == 1 + max(ties, default=-1)
        self.model.append(entry)
        self.model.sort()
        return entry

    @rule(entry=held)
    def remove(self, entry: Entry) -> None:
        if any(e is entry for e in self.model):
            self.order.remove(entry)
            self.model.remove(entry)
        else:
            with pytest.raises(ValueError, match="not held"):
                self.order.remove(entry)

    @rule(now=few_times, limit=st.none() | st.integers(min_value=0, max_value=12))
    def pop_due(self, now: float, limit: int | None) -> None:
        due = [e for e in self.model if e.deadline <= now][:limit]
        assert self.order.pop_due(now, limit) == due
        del self.model[: len(due)]

    @rule(deadline=few_times, seq=st.integers(min_value=0, max_value=5))
    def after(self, deadline: float, seq: int) -> None:
        expected = [e for e in self.model if (e.deadline, e.seq) > (deadline, seq)]
        assert list(self.order.after(deadline, seq)) == expected

    @rule(entries=st.lists(few_times, max_size=30))
    def rebuild(self, entries: list[float]) -> None:
        """A restart: everything held, with more, sorted once and held anew."""
        more = [Entry(d, 1000 + i, "restored") for i, d in enumerate(entries)]
        everything = [*self.order, *more]
        Deadlines.sort(everything)
        self.order = Deadlines(everything, chunk=CHUNK)
        self.model = sorted(self.model + more)

    @invariant()
    def agrees(self) -> None:
        assert list(self.order) == self.model
        assert len(self.order) == len(self.model)
        assert self.order.first() == (self.model[0] if self.model else None)

    @invariant()
    def layout(self) -> None:
        sizes = self.order.chunk_sizes()
        assert all(0 < size <= 2 * CHUNK for size in sizes)
        assert all(size >= CHUNK // 4 for size in sizes[1:-1])


DeadlinesAgainstSortedList.TestCase.settings = settings(
    max_examples=200 if os.environ.get("WATCHDOGD_SOAK", "") == "1" else 80,
    stateful_step_count=60,
    deadline=None,
)
TestDeadlinesAgainstSortedList = DeadlinesAgainstSortedList.TestCase


def test_chunks_split_and_merge_within_their_bounds() -> None:
    order: Deadlines[Entry] = Deadlines(chunk=CHUNK)
    entries = [Entry(float(d % 97), 0, str(d)) for d in range(1000)]
    for entry in entries:
        add(order, entry.deadline, entry.name)
    assert len(order.chunk_sizes()) > 1000 // (2 * CHUNK)
    assert max(order.chunk_sizes()) <= 2 * CHUNK
    kept = list(order)[::10]
    for index, entry in enumerate(list(order)):
        if index % 10:
            order.remove(entry)  # nine in ten: chunks fall under a quarter and merge
    sizes = order.chunk_sizes()
    assert list(order) == kept
    assert sum(sizes) == len(order) == 100
    assert all(CHUNK // 4 <= size <= 2 * CHUNK for size in sizes[1:-1])
    assert list(order) == sorted(order)


@pytest.mark.parametrize("held", [0, 1, 3, 10, 57])
@pytest.mark.parametrize("added", [0, 1, 5, 40])
def test_extend_takes_over_later_entries_and_keeps_the_bounds(held: int, added: int) -> None:
    """A restart's later timers: all after those held, a move of chunks; the short
    last chunk of those held does not stay in the middle."""
    order: Deadlines[Entry] = Deadlines([Entry(float(d), 0) for d in range(held)], chunk=CHUNK)
    later: Deadlines[Entry] = Deadlines(
        [Entry(float(1000 + d), 0) for d in range(added)], chunk=CHUNK
    )
    order.extend(later)
    assert list(order) == [Entry(float(d), 0) for d in range(held)] + [
        Entry(float(1000 + d), 0) for d in range(added)
    ]
    assert len(order) == held + added
    assert len(later) == 0
    assert list(later) == []
    sizes = order.chunk_sizes()
    assert all(CHUNK // 4 <= size <= 2 * CHUNK for size in sizes[1:-1])
    assert order.first() == (Entry(0.0, 0) if held else Entry(1000.0, 0) if added else None)
    add(order, 5000.0)  # and it goes on working
    assert list(order)[-1].deadline == 5000.0


def test_extend_with_entries_among_those_held_sorts_them_in() -> None:
    order: Deadlines[Entry] = Deadlines([Entry(1.0, 0), Entry(5.0, 0)], chunk=CHUNK)
    order.extend(Deadlines([Entry(3.0, 0), Entry(7.0, 0)], chunk=CHUNK))
    assert [entry.deadline for entry in order] == [1.0, 3.0, 5.0, 7.0]
    assert len(order) == 4
