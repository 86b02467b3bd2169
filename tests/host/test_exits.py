"""The exit watcher reports processes that exit, at once and once."""

from __future__ import annotations

import subprocess

import trio

from watchdogd.host.exits import ExitWatcher
from watchdogd.host.process import Process, open_process

from helpers.processes import reap, sleeper


async def test_reports_each_exit_once() -> None:
    watcher = ExitWatcher()
    exited: list[int] = []
    quick = subprocess.Popen(["sleep", "0.05"])
    slow = sleeper()
    try:
        processes = {open_process(child.pid) for child in (quick, slow)}
        for process in processes:
            watcher.watch(process)

        def on_exit(process: Process) -> None:
            exited.append(process.pid)

        async with trio.open_nursery() as nursery:
            await nursery.start(watcher.run, on_exit)
            with trio.fail_after(10):
                while not exited:
                    await trio.sleep(0.01)
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
        assert exited == [quick.pid]
        assert len(watcher) == 1
        for process in processes:
            process.close()
        assert len(watcher) == 0  # the last close ends the watch
    finally:
        watcher.close()
        reap(quick)
        reap(slow)


async def test_exits_at_once_leave_other_tasks_a_turn_between_them() -> None:
    """Processes that exit together are reported one a turn of the loop: a slow
    report (a process of ten thousand timers) holds back no deadline for longer
    than its own."""
    watcher = ExitWatcher()
    seen: list[str] = []
    victims = [sleeper() for _ in range(4)]
    try:
        processes = [open_process(victim.pid) for victim in victims]
        for process in processes:
            watcher.watch(process)
        for victim in victims:
            victim.kill()
            victim.wait()

        def on_exit(process: Process) -> None:
            seen.append("exit")

        async def other_task() -> None:
            while True:
                seen.append("turn")
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            await nursery.start(watcher.run, on_exit)
            nursery.start_soon(other_task)
            with trio.fail_after(10):
                while seen.count("exit") < len(victims):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        # The other task runs once in each batch of the loop, in an order of trio's
        # choosing: between one report and the report after next, a whole batch.
        reports = [at for at, what in enumerate(seen) if what == "exit"]
        assert "turn" in seen[reports[0] : reports[2]], seen
        assert "turn" in seen[reports[1] : reports[3]], seen
        for process in processes:
            process.close()
    finally:
        watcher.close()
        for victim in victims:
            reap(victim)
