"""What the kernel says of a process's share of the machine: the samples the
starvation rule compares (`watchdogd.core.starvation.Sample`).

Where each figure comes from:

- its CPU time: utime + stime of /proc/PID/stat, every thread's, in clock ticks
  (10 ms on most hosts);
- the host's pressure: the ``total=`` of the ``some`` line of /proc/pressure/cpu,
  memory and io (absent on a kernel built without PSI or booted with ``psi=0``);
- its cgroup's: the ``0::`` line of /proc/PID/cgroup names its cgroup in the v2
  hierarchy, whose cpu.pressure, memory.pressure and io.pressure lie under the
  hierarchy's mount: /sys/fs/cgroup on a host of cgroup v2 alone,
  /sys/fs/cgroup/unified on a hybrid one (beside the v1 controllers), found in
  /proc/self/mountinfo on first use. The kernel keeps PSI for every cgroup of the
  v2 hierarchy, whatever controllers it has. The root cgroup's pressure is the
  host's, and is not read twice.

A cgroup the daemon cannot place (no v2 hierarchy mounted, a path outside what
its mount shows; `watchdogd.host.cgroups`) is unknown: the rule then
judges by the host's pressure. /proc is read before the pidfd is checked, so a
sample belongs to the process the handle names, never to one that took its pid.

A sample is at most eight small reads, some tens of microseconds: taken when a
timer whose policy has ``starvation_grace`` is armed and again at its deadline,
and never for any other timer.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Final

from ..core import RESOURCES, Pressure, Sample
from .cgroups import MOUNTINFO, Hierarchy, cgroup_of, host_hierarchy
from .process import Process, read_stat

#: The host's PSI files.
HOST_PRESSURE: Final = "/proc/pressure"
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


class PressureGauge:
    """Takes `Sample` of processes (see the module's docstring)."""

    def __init__(
        self,
        *,
        mountinfo: str = MOUNTINFO,
        host_pressure: str = HOST_PRESSURE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mountinfo = mountinfo
        self._host_pressure = host_pressure
        self._clock = clock
        self._hierarchy: Hierarchy | None = None
        self._looked = False

    @property
    def hierarchy(self) -> Hierarchy | None:
        """Where the cgroup v2 hierarchy is mounted (None when it is not), read on
        first use."""
        if not self._looked:
            self._looked = True
            with contextlib.suppress(OSError):
                self._hierarchy = host_hierarchy(self._mountinfo)
        return self._hierarchy

    def sample(self, process: Process) -> Sample | None:
        """``process`` now; None once it has exited."""
        at = self._clock()
        try:
            cpu = read_stat(process.pid).cpu_ticks / _CLOCK_TICKS
        except (OSError, ValueError, IndexError):
            return None
        cgroup = cgroup_of(process.pid) or ""
        host = read_pressure(os.path.join(self._host_pressure, "{}"))
        directory = self.directory(cgroup)
        if directory is None:
            cgroup, group = "", None
        elif cgroup == "/":
            group = host
        else:
            group = read_pressure(os.path.join(directory, "{}.pressure"))
        if not process.alive():
            return None
        return Sample(at=at, cpu=cpu, host=host, cgroup=cgroup, group=group)

    def directory(self, cgroup: str) -> str | None:
        """The directory of ``cgroup`` (a path as /proc/PID/cgroup gives it), or
        None when the daemon cannot see it."""
        hierarchy = self.hierarchy
        return None if hierarchy is None else hierarchy.directory(cgroup)


def read_pressure(pattern: str) -> Pressure | None:
    """The ``some`` totals of the PSI files ``pattern.format(resource)`` for each
    resource, or None when one cannot be read."""
    totals = []
    for resource in RESOURCES:
        try:
            with open(pattern.format(resource), "rb") as psi:
                some = psi.readline()
            totals.append(int(some.rsplit(b"total=", 1)[1]))
        except (OSError, ValueError, IndexError):
            return None
    return Pressure(*totals)
