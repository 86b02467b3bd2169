"""The cgroup v2 hierarchy, as a ``cgroup`` policy target uses it.

Where the hierarchy is mounted comes from /proc/self/mountinfo (`find_hierarchy`
parses its text, so a host without cgroup v2 is a plain input): at /sys/fs/cgroup on
a systemd host, at /sys/fs/cgroup/unified on a hybrid one, beside the v1
controllers; a host with v1 controllers only has none. A process's cgroup is the
``0::`` line of /proc/PID/cgroup, a path from the hierarchy's root as the reader's
cgroup namespace sees it.

An open `Cgroup` holds a descriptor of its directory: whatever it reads or writes
goes to that very cgroup. Once the cgroup is removed its files are gone from the
descriptor (ENOENT), even if a cgroup of the same name is made again, so a later
``cgroup.kill`` can never reach another cgroup that took the name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final

#: Where the daemon reads its own mounts.
MOUNTINFO: Final = "/proc/self/mountinfo"
_ESCAPED: Final = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """Where the cgroup v2 hierarchy is mounted."""

    #: The mount point.
    mount: str
    #: The cgroup seen at the mount point: ``/`` unless the mount is a namespace's or
    #: a bind mount of a part of the hierarchy.
    root: str = "/"

    def directory(self, cgroup: str) -> str | None:
        """The directory of ``cgroup`` (a path as /proc/PID/cgroup gives it), or
        None when it lies outside what this mount shows (or names a ``..``)."""
        if not cgroup.startswith("/") or "/.." in cgroup:
            return None
        if self.root == "/":
            return self.mount + (cgroup if cgroup != "/" else "")
        if cgroup == self.root:
            return self.mount
        if cgroup.startswith(self.root + "/"):
            return self.mount + cgroup[len(self.root) :]
        return None


def find_hierarchy(mountinfo: str) -> Hierarchy | None:
    """The cgroup v2 mount named in ``mountinfo`` (the text of a /proc/PID/mountinfo),
    preferring one of the whole hierarchy; None on a host that has none."""
    found: list[Hierarchy] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        # ID PARENT MAJ:MIN ROOT MOUNT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if fields[separator + 1 : separator + 2] == ["cgroup2"]:
            found.append(Hierarchy(mount=_unescape(fields[4]), root=_unescape(fields[3])))
    whole = [hierarchy for hierarchy in found if hierarchy.root == "/"]
    return next(iter(whole or found), None)


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as octal escapes.
    return _ESCAPED.sub(lambda match: chr(int(match.group(1), 8)), field)


def host_hierarchy(mountinfo: str = MOUNTINFO) -> Hierarchy | None:
    """The cgroup v2 mount the daemon sees, read from the file ``mountinfo``."""
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as mounts:
        return find_hierarchy(mounts.read())


def cgroup_of(pid: int) -> str | None:
    """The cgroup v2 path of ``pid`` (``/`` for the root cgroup), or None when it
    has none or is gone."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="surrogateescape") as lines:
            for line in lines:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        pass
    return None


def contains(cgroup: str, other: str) -> bool:
    """Whether ``other`` is ``cgroup`` or lies below it."""
    return cgroup in (other, "/") or other.startswith(cgroup + "/")


class Cgroup:
    """An open cgroup v2 directory (see the module's docstring)."""

    __slots__ = ("fd", "path")

    def __init__(self, path: str, fd: int) -> None:
        #: Its path in the hierarchy, as /proc/PID/cgroup names it.
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, path: str, directory: str) -> Cgroup:
        """Open cgroup ``path``, whose directory is ``directory``; raises OSError."""
        return cls(path, os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))

    def pids(self, limit: int) -> list[int]:
        """The processes of the cgroup and of every cgroup below it, at most
        ``limit`` of them. A cgroup that cannot be read (removed meanwhile, or a
        threaded one) adds none."""
        pids: list[int] = []
        for _, _, _, fd in os.fwalk(".", dir_fd=self.fd):
            try:
                procs = os.open("cgroup.procs", os.O_RDONLY | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                continue
            with open(procs, "rb") as listing:
                try:
                    pids += [int(pid) for pid in listing.read().split()]
                except OSError:
                    continue
            if len(pids) >= limit:
                return pids[:limit]
        return pids

    def kill(self) -> str:
        """SIGKILL every process in it and below it through ``cgroup.kill`` (Linux
        >= 5.14), which also reaches processes forked while the kill goes on.
        Returns "" once done, or why it could not be used."""
        try:
            fd = os.open("cgroup.kill", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return "no cgroup.kill"
        except OSError as exc:
            return f"cgroup.kill: {exc.strerror}"
        try:
            os.write(fd, b"1")
        except OSError as exc:
            return f"cgroup.kill: {exc.strerror}"
        finally:
            os.close(fd)
        return ""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
