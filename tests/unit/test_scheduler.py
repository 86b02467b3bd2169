"""The scheduler on trio's autojump clock: no polling, woken only when needed."""

from __future__ import annotations

import trio
import trio.testing

from watchdogd.runtime.scheduler import Scheduler

from helpers.keyed_deadlines import KeyedDeadlines


class Harness:
    """A heap of deadlines on trio's clock and a record of every wake-up."""

    def __init__(self) -> None:
        self.heap: KeyedDeadlines[str] = KeyedDeadlines()
        self.fired: list[tuple[str, float]] = []
        self.wakeups = 0
        self.scheduler = Scheduler(
            clock=trio.current_time, next_deadline=self.heap.next_deadline, fire=self.fire
        )

    def fire(self, now: float) -> bool:
        self.wakeups += 1
        self.fired += [(key, now) for key, _ in self.heap.pop_due(now)]
        return False

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


class Batched:
    """Fires at most ``batch`` due keys a pass and settles each fired key later,
    one a pass, logging the order of everything it does."""

    def __init__(self, batch: int) -> None:
        self.heap: KeyedDeadlines[str] = KeyedDeadlines()
        self.batch = batch
        self.unsettled: list[str] = []
        self.log: list[str] = []
        self.scheduler = Scheduler(
            clock=trio.current_time,
            next_deadline=self.heap.next_deadline,
            fire=self.fire,
            settle=self.settle,
        )

    def fire(self, now: float) -> bool:
        due = self.heap.pop_due(now, self.batch)
        self.log += [f"fire {key}" for key, _ in due]
        self.unsettled += [key for key, _ in due]
        return len(due) == self.batch

    def settle(self, until: float) -> bool:
        if self.unsettled:
            self.log.append(f"settle {self.unsettled.pop(0)}")
        return bool(self.unsettled)


async def test_a_burst_is_fired_in_passes_before_any_follow_up_work(
    autojump_clock: trio.testing.MockClock,
) -> None:
    harness = Batched(batch=2)
    for key in "abcde":
        harness.heap.set(key, trio.current_time())  # all due at the first pass
    others: list[int] = []

    async def bystander() -> None:
        # Another task gets turns between passes: the burst never holds the loop.
        while len(harness.log) < 10:
            others.append(len(harness.log))
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        await nursery.start(harness.scheduler.run)
        nursery.start_soon(bystander)
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    fires = [f"fire {key}" for key in "abcde"]
    settles = [f"settle {key}" for key in "abcde"]
    assert harness.log == fires + settles
    assert any(0 < seen < len(harness.log) for seen in others), others


async def test_new_expiries_come_before_follow_up_work_still_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    harness = Batched(batch=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.scheduler.run)
        for key in ("a", "b", "c"):
            harness.heap.set(key, trio.current_time() + 1)
        harness.scheduler.notify(trio.current_time() + 1)
        await trio.sleep(1)
        # "a", "b" and "c" fired; one settle a pass. A timer due meanwhile fires
        # at the next pass, ahead of the settling still to do.
        harness.heap.set("d", trio.current_time())
        harness.scheduler.poll(trio.current_time())
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert harness.log.index("fire d") < harness.log.index("settle c")
    assert sorted(harness.log) == sorted(
        [f"{what} {key}" for key in "abcd" for what in ("fire", "settle")]
    )


async def test_poll_wakes_the_task_to_settle(autojump_clock: trio.testing.MockClock) -> None:
    harness = Batched(batch=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.scheduler.run)
        harness.heap.set("x", trio.current_time() + 3600)
        harness.scheduler.notify(trio.current_time() + 3600)
        await trio.sleep(1)
        # Due at once; a connection task's poll fires it before the task runs.
        harness.heap.set("y", trio.current_time())
        harness.scheduler.notify(trio.current_time())
        harness.scheduler.poll(trio.current_time())
        assert harness.log == ["fire y"]
        await trio.sleep(0.001)
        assert harness.log == ["fire y", "settle y"]
        nursery.cancel_scope.cancel()
