"""The deadline heap, by example and against a dict model (hypothesis)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from watchdogd.core.heap import DeadlineHeap


def test_earliest_first_and_replacement() -> None:
    heap: DeadlineHeap[str] = DeadlineHeap()
    heap.set("a", 3.0)
    heap.set("b", 1.0)
    heap.set("c", 2.0)
    heap.set("b", 5.0)  # re-arm later
    assert heap.peek() == ("c", 2.0)
    assert heap.pop_due(3.0) == [("c", 2.0), ("a", 3.0)]
    assert list(heap) == [("b", 5.0)]


def test_equal_deadlines_come_out_in_the_order_they_were_set() -> None:
    heap: DeadlineHeap[int] = DeadlineHeap()
    for key in (3, 1, 2):
        heap.set(key, 1.0)
    assert [key for key, _ in heap.pop_due(1.0)] == [3, 1, 2]


def test_pop_due_takes_at_most_its_limit_earliest_first() -> None:
    heap: DeadlineHeap[int] = DeadlineHeap()
    for key in range(10):
        heap.set(key, float(key))
    heap.remove(1)  # a stale entry does not count against the limit
    assert heap.pop_due(5.0, limit=3) == [(0, 0.0), (2, 2.0), (3, 3.0)]
    assert heap.pop_due(5.0, limit=0) == []
    assert heap.pop_due(5.0, limit=10) == [(4, 4.0), (5, 5.0)]
    assert len(heap) == 4


def test_remove_and_absent_keys() -> None:
    heap: DeadlineHeap[str] = DeadlineHeap()
    heap.set("a", 1.0)
    assert heap.remove("a") is True
    assert heap.remove("a") is False
    assert heap.peek() is None
    assert heap.next_deadline() is None
    assert heap.pop_due(10.0) == []


def test_stale_entries_are_pruned_so_the_heap_stays_bounded() -> None:
    heap: DeadlineHeap[str] = DeadlineHeap()
    for i in range(100_000):
        heap.set("renewed", float(i))  # a worker kicking its timer in a loop
    assert len(heap) == 1
    assert heap.heap_size() <= 2 * len(heap) + 64 + 1
    assert heap.pop_due(1e9) == [("renewed", 99_999.0)]


keys = st.integers(min_value=0, max_value=20)
times = st.floats(min_value=0, max_value=1000, allow_nan=False)


class HeapAgainstDict(RuleBasedStateMachine):
    """Every operation on the heap agrees with a plain dict of deadlines."""

    def __init__(self) -> None:
        super().__init__()
        self.heap: DeadlineHeap[int] = DeadlineHeap()
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
        assert self.heap.next_deadline() == (min(self.model.values()) if self.model else None)
        assert self.heap.heap_size() <= 2 * len(self.model) + 64 + 1


HeapAgainstDict.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestHeapAgainstDict = HeapAgainstDict.TestCase
