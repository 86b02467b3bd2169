"""The scheduler on trio's autojump clock: no polling, woken only when needed."""

from __future__ import annotations

import trio
import trio.testing

from watchdogd.core.heap import DeadlineHeap
from watchdogd.scheduler import Scheduler


class Harness:
    """A heap of deadlines on trio's clock and a record of every wake-up."""

    def __init__(self) -> None:
        self.heap: DeadlineHeap[str] = DeadlineHeap()
        self.fired: list[tuple[str, float]] = []
        self.wakeups = 0
        self.scheduler = Scheduler(
            clock=trio.current_time, next_deadline=self.heap.next_deadline, fire=self.fire
        )

    def fire(self, now: float) -> None:
        self.wakeups += 1
        self.fired += [(key, now) for key, _ in self.heap.pop_due(now)]

    def arm(self, key: str, after: float) -> None:
        deadline = trio.current_time() + after
        self.heap.set(key, deadline)
        self.scheduler.notify(deadline)


async def test_fires_each_timer_at_its_deadline(autojump_clock: trio.testing.MockClock) -> None:
    harness = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.scheduler.run)
        start = trio.current_time()
        harness.arm("b", 20)
        harness.arm("a", 10)
        await trio.sleep(30)
        nursery.cancel_scope.cancel()
    assert [(key, round(when - start, 6)) for key, when in harness.fired] == [("a", 10), ("b", 20)]


async def test_sleeps_without_polling(autojump_clock: trio.testing.MockClock) -> None:
    harness = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.scheduler.run)
        harness.arm("far", 3600)
        await trio.sleep(3599)
        # The start-up pass, and the one that picked up the new earliest deadline.
        assert harness.wakeups == 2
        await trio.sleep(2)
        nursery.cancel_scope.cancel()
    assert [key for key, _ in harness.fired] == ["far"]
    assert harness.wakeups == 3


async def test_later_rearms_do_not_wake_it(autojump_clock: trio.testing.MockClock) -> None:
    harness = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.scheduler.run)
        harness.arm("kicked", 10)
        for _ in range(100):
            await trio.sleep(1)
            harness.arm("kicked", 10)  # a worker renewing its timer
        assert harness.fired == []
        # One wake-up at the first deadline, which had moved on; none per renewal.
        assert harness.wakeups <= 1 + 100 // 10 + 1
        nursery.cancel_scope.cancel()


async def test_an_earlier_deadline_wakes_it(autojump_clock: trio.testing.MockClock) -> None:
    harness = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.scheduler.run)
        start = trio.current_time()
        harness.arm("late", 100)
        await trio.sleep(1)
        harness.arm("early", 1)
        await trio.sleep(5)
        assert [(key, round(when - start, 6)) for key, when in harness.fired] == [("early", 2)]
        nursery.cancel_scope.cancel()
