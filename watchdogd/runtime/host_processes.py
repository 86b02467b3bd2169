"""The service's process port on a real host (`watchdogd.core.ports.ProcessPort`):
pidfds (`watchdogd.host.process`), the exit watcher, the users' names and what the
kernel says of a process's share of the machine.

Invariant: a process the table holds is watched for its exit from the moment it
is tracked, and its handle is the table's until it is untracked.
"""

from __future__ import annotations

from ..core import Peer, Sample
from ..host.exits import ExitWatcher
from ..host.pressure import PressureGauge
from ..host.process import Process, open_process
from ..host.users import UserNames


class HostProcesses:
    """The service's process port on a real host: pidfds, the exit watcher and
    what the kernel says of a process's share of the machine."""

    def __init__(self, watcher: ExitWatcher, names: UserNames) -> None:
        self._watcher = watcher
        self._names = names
        self._pressure = PressureGauge()

    def open(self, pid: int, peer: Peer) -> Process:
        return open_process(pid, peer)

    def alive(self, process: Process) -> bool:
        return process.alive()

    def exited(self, process: Process) -> bool:
        return process.exited()

    def refresh(self, process: Process) -> bool:
        return process.refresh()

    def command(self, process: Process) -> str:
        return process.command()

    def executable(self, process: Process) -> str:
        return process.executable()

    def user_name(self, uid: int) -> str:
        return self._names.name_of(uid) or f"#{uid}"

    def track(self, process: Process) -> None:
        process.remember_command()
        self._watcher.watch(process)

    def untrack(self, process: Process) -> None:
        process.close()  # the table's reference; the watch ends with the last

    def sample(self, process: Process) -> Sample | None:
        return self._pressure.sample(process)
