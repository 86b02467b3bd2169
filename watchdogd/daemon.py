"""The daemon: listener, exit watcher, scheduler and request handling, wired together.

`run` is the whole daemon and is callable in-process (tests start it in a nursery and
cancel it). Deadlines are kept on ``clock``, by default ``time.monotonic``
(CLOCK_MONOTONIC: wall-clock jumps never fire or delay a timer).

SIGTERM and SIGINT stop it cleanly: connections close, the socket file it created is
removed, and no timer fires on the way out.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import signal
import time
from collections.abc import Callable
from typing import Final

import trio

from ._version import __version__
from .actions import Actions
from .config import Config
from .exits import ExitWatcher
from .logs import log, logfmt
from .process import Peer, Process, open_process
from .scheduler import Scheduler
from .server import open_listener, serve
from .service import Service

DEFAULT_POLICY: Final = "kill"
POLICIES: Final = frozenset({DEFAULT_POLICY})


class HostProcesses:
    """The service's process port on a real host: pidfds and the exit watcher."""

    def __init__(self, watcher: ExitWatcher) -> None:
        self._watcher = watcher

    def open(self, pid: int, peer: Peer) -> Process:
        return open_process(pid, peer)

    def alive(self, process: Process) -> bool:
        return process.alive()

    def command(self, process: Process) -> str:
        return process.command()

    def track(self, process: Process) -> None:
        self._watcher.watch(process)

    def untrack(self, process: Process) -> None:
        process.close()  # the table's reference; the watch ends with the last


def raise_nofile_limit() -> None:
    """Lift the soft RLIMIT_NOFILE to the hard limit: every tracked process and every
    connection holds a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run(
    config: Config,
    socket_path: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[Service[Process]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon on ``socket_path`` until cancelled or sent SIGTERM/SIGINT.

    ``task_status.started`` receives the service once the socket accepts connections.
    """
    settings = config.daemon
    raise_nofile_limit()
    listener = open_listener(socket_path, settings.socket_mode)
    watcher = ExitWatcher()
    actions = Actions(clock)

    def fire(now: float) -> None:
        actions.carry_out(service.expire_due(now))

    def next_deadline() -> float | None:
        return service.table.next_deadline()

    scheduler = Scheduler(clock=clock, next_deadline=next_deadline, fire=fire)
    service: Service[Process] = Service(
        settings,
        HostProcesses(watcher),
        policies=POLICIES,
        default_policy=DEFAULT_POLICY,
        daemon_pid=os.getpid(),
        now=clock(),
        on_deadline=scheduler.notify,
    )
    # Signals are caught before the socket is announced, so a SIGTERM sent as soon
    # as the daemon answers still stops it cleanly.
    try:
        with contextlib.ExitStack() as stack:
            signals = (
                stack.enter_context(trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT))
                if handle_signals
                else None
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(watcher.run, service.process_exited)
                await nursery.start(scheduler.run)
                await nursery.start(functools.partial(serve, listener, service, clock=clock))
                log.info(
                    logfmt("listening", socket=socket_path, pid=os.getpid(), version=__version__)
                )
                task_status.started(service)
                if signals is not None:
                    async for signum in signals:
                        log.info(logfmt("stopping", signal=signal.Signals(signum).name))
                        nursery.cancel_scope.cancel()
                        break
    finally:
        listener.close()
        log.info(logfmt("stopped", timers=len(service.table)))
        service.close()
        watcher.close()
