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

A cgroup the daemon cannot place (no v2 hierarchy mounted, only a part of it
mounted, a path outside the daemon's cgroup namespace) is unknown: the rule then
judges by the host's pressure. /proc is read before the pidfd is checked, so a
sample belongs to the process the handle names, never to one that took its pid.

A sample is at most eight small reads, some tens of microseconds: taken when a
timer whose policy has ``starvation_grace`` is armed and again at its deadline,
and never for any other timer.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Final

from .core.starvation import RESOURCES, Pressure, Sample
from .process import Process, read_stat

#: Where the daemon reads its own mounts.
MOUNTINFO: Final = "/proc/self/mountinfo"
#: The host's PSI files.
HOST_PRESSURE: Final = "/proc/pressure"
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
#: The kernel writes space, tab, newline and backslash in mount paths as octal.
_ESCAPED: Final = re.compile(r"\\([0-7]{3})")


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
        #: The cgroup v2 mount point; None until looked for, "" when there is none.
        self._mount: str | None = None

    @property
    def mount(self) -> str:
        """Where the whole cgroup v2 hierarchy is mounted ("" when it is not)."""
        if self._mount is None:
            try:
                with open(self._mountinfo, encoding="utf-8", errors="surrogateescape") as mounts:
                    self._mount = cgroup2_mount(mounts.read())
            except OSError:
                self._mount = ""
        return self._mount

    def sample(self, process: Process) -> Sample | None:
        """``process`` now; None once it has exited."""
        at = self._clock()
        try:
            cpu = read_stat(process.pid).cpu_ticks / _CLOCK_TICKS
            cgroup = cgroup_of(process.pid)
        except (OSError, ValueError, IndexError):
            return None
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
        mount = self.mount
        if not (mount and cgroup.startswith("/")) or "/.." in cgroup:
            return None
        return mount if cgroup == "/" else mount + cgroup


def cgroup2_mount(mountinfo: str) -> str:
    """The mount point of the whole cgroup v2 hierarchy in ``mountinfo`` (the text
    of a /proc/PID/mountinfo), or "" when it has none."""
    for line in mountinfo.splitlines():
        fields = line.split()
        # ID PARENT MAJ:MIN ROOT MOUNT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if fields[separator + 1 : separator + 2] == ["cgroup2"] and fields[3] == "/":
            return _ESCAPED.sub(lambda match: chr(int(match.group(1), 8)), fields[4])
    return ""


def cgroup_of(pid: int) -> str:
    """The cgroup v2 path of ``pid`` (``/`` for the root cgroup), or "" when it has
    none; raises OSError when it is gone."""
    with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="surrogateescape") as lines:
        for line in lines:
            if line.startswith("0::"):
                return line[3:].rstrip("\n")
    return ""


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
