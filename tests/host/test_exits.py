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
