"""Scratch cgroups v2 for tests, and the mount tables of hosts this one is not."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from helpers.waiting import wait_until

# The mount table of a hybrid host (v1 controllers, v2 beside them), trimmed.
HYBRID = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# A systemd host with the unified hierarchy only.
UNIFIED = """\
22 28 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
26 22 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""
# The same host with its v2 line taken out: cgroup v1 controllers only.
V1_ONLY = "\n".join(line for line in HYBRID.splitlines() if "cgroup2" not in line)


class ScratchCgroup:
    """A cgroup v2 made for one test, directly under the hierarchy's root."""

    def __init__(self, directory: Path, path: str) -> None:
        #: Its directory, and its path as /proc/PID/cgroup shows it.
        self.directory = directory
        self.path = path

    def add(self, pid: int) -> None:
        """Move process ``pid`` into it."""
        (self.directory / "cgroup.procs").write_text(str(pid))

    def child(self, name: str) -> ScratchCgroup:
        """A cgroup below it, removed with it."""
        (self.directory / name).mkdir()
        return ScratchCgroup(self.directory / name, f"{self.path}/{name}")

    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.directory / "cgroup.procs").read_text().split()]


def remove_cgroup(directory: Path) -> None:
    with contextlib.suppress(OSError):
        (directory / "cgroup.kill").write_text("1")
    for below in sorted(directory.rglob("cgroup.procs"), key=lambda p: -len(p.parts)):
        for pid in below.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    # Killed processes leave their cgroup as they exit; until then rmdir says EBUSY.
    for cgroup in sorted({p.parent for p in directory.rglob("cgroup.procs")}, key=str)[::-1]:
        wait_until(lambda cgroup=cgroup: _removed(cgroup), what=f"{cgroup} to be removable")


def _removed(cgroup: Path) -> bool:
    try:
        cgroup.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
