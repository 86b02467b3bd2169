"""Noticing at once when a process with armed timers exits.

A pidfd becomes readable when its process exits. All watched pidfds sit in one epoll
set, and the epoll fd itself is what the trio loop waits on: one registration with
trio however many processes are watched, and no polling.

A process is watched from the first time it enters the timer table until its exit is
reported or its pidfd closes (its last reference goes), whichever comes first. So a
worker that arms and releases in a loop is registered once, not once per timer.

Invariant: a pidfd leaves the epoll set before it is closed (`Process.on_last_close`),
so the set never holds a closed or reused descriptor.
"""

from __future__ import annotations

import select
from collections.abc import Callable

import trio

from ..logs import log
from .process import Process


class ExitWatcher:
    """Reports each watched process's exit once to the ``run`` callback."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._watched: dict[int, Process] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, process: Process) -> None:
        """Watch ``process`` for its exit, if it is not watched already."""
        if process.fd not in self._watched:
            self._epoll.register(process.fd, select.EPOLLIN)
            self._watched[process.fd] = process
            process.on_last_close = self.forget

    def forget(self, process: Process) -> None:
        """Stop watching ``process`` (it is closing)."""
        if self._watched.get(process.fd) is process:
            del self._watched[process.fd]
            self._epoll.unregister(process.fd)
            process.on_last_close = None

    async def run(
        self,
        on_exit: Callable[[Process], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``on_exit`` once for every watched process that exits.

        One exit a turn of the loop (each `wait_readable` is one): forgetting a
        process of ten thousand timers takes tens of milliseconds, and a hundred
        such exits at once must not hold back the deadlines due meanwhile. Each
        turn asks epoll afresh, since a pidfd reported before the turn may have
        closed and its number gone to another process during it."""
        task_status.started()
        while True:
            await trio.lowlevel.wait_readable(self._epoll.fileno())
            for fd, _events in self._epoll.poll(0, 1):
                process = self._watched.get(fd)
                if process is not None:
                    self.forget(process)
                    try:
                        on_exit(process)
                    except Exception:
                        log.exception("handling the exit of %r failed", process)

    def close(self) -> None:
        """Stop watching everything and close the epoll set."""
        for process in list(self._watched.values()):
            self.forget(process)
        self._epoll.close()
