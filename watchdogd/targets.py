"""The processes a policy acts on: one process, its process group, or its tree.

Every member is pinned by a pidfd of the target's own (a duplicate for the timer's
process, a new one for others), so a member whose pid is recycled while the policy
runs is never signalled and never waited for by mistake, and several expiries on one
process never share a descriptor.

- ``process``: the timer's process.
- ``group``: its process group, signalled with killpg(2) so that members that appear
  while the policy runs get the signal too. Never the daemon's own group and never
  a pgid <= 1: the policy then acts on the process alone and says so. killpg is sent
  only while a pinned member still belongs to the group, so the pgid cannot have
  been reused. The members found in /proc at expiry are what ``wait`` waits for.
- ``tree``: the process and its descendants, collected from /proc before the first
  signal (a descendant that started its own session is still a child of its
  parent), re-collected from the living members before each later signal, and each
  signalled through its pidfd.
"""

from __future__ import annotations

import os
import select
import signal
from typing import Final

import trio

from .policies import TargetKind
from .process import Process, children_of, read_stat, state_and_wchan

_MAX_MEMBERS: Final = 65536


class Member:
    """One pinned process of a target."""

    __slots__ = ("fd", "pid")

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self.fd = fd

    def exited(self) -> bool:
        """Whether the process has exited (its pidfd is readable)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    def send(self, signum: int) -> bool:
        """Signal it; False if it is gone."""
        try:
            signal.pidfd_send_signal(self.fd, signum)
        except ProcessLookupError:
            return False
        return True


def _pin(pid: int, *, ppid: int | None = None, pgrp: int | None = None) -> Member | None:
    """A pidfd for ``pid``, if it is still the process /proc showed (same parent or
    group, read after the pidfd was opened) and alive."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        stat = read_stat(pid)
    except OSError:
        os.close(fd)
        return None
    member = Member(pid, fd)
    if (ppid is not None and stat.ppid != ppid) or (pgrp is not None and stat.pgrp != pgrp):
        os.close(fd)
        return None
    if member.exited():
        os.close(fd)
        return None
    return member


class Target:
    """The members of a policy's target and how to signal them."""

    def __init__(
        self, kind: TargetKind, members: list[Member], pgid: int = 0, note: str = ""
    ) -> None:
        self.kind: TargetKind = kind
        self.members = members
        self.pgid = pgid
        #: Said in the expiry's event (e.g. why a group target fell back).
        self.note = note

    @property
    def pid(self) -> int:
        return self.members[0].pid

    def alive(self) -> bool:
        """Whether any member is still running."""
        return any(not member.exited() for member in self.members)

    def signal(self, signum: int) -> str:
        """Send ``signum``; returns the step's result."""
        name = signal.Signals(signum).name
        if self.kind == "group":
            return self._signal_group(signum, name)
        if self.kind == "tree":
            self._collect_descendants()
        sent = sum(member.send(signum) for member in self.members if not member.exited())
        if not sent:
            return "gone"
        if self.kind == "tree":
            return f"sent {name} to {sent} process{'es' if sent != 1 else ''}"
        return f"sent {name}"

    def _signal_group(self, signum: int, name: str) -> str:
        # The pgid stays reserved while any process is in the group; a pinned live
        # member still in it proves the group is the one seen at expiry.
        for member in self.members:
            if member.exited():
                continue
            try:
                if read_stat(member.pid).pgrp != self.pgid:
                    continue
            except OSError:
                continue
            try:
                os.killpg(self.pgid, signum)
            except ProcessLookupError:
                return "gone"
            return f"sent {name} to group {self.pgid}"
        return "gone"

    def _collect_descendants(self) -> None:
        known = {member.pid for member in self.members}
        queue = [member.pid for member in self.members if not member.exited()]
        while queue and len(self.members) < _MAX_MEMBERS:
            parent = queue.pop()
            for child in children_of(parent):
                if child in known:
                    continue
                member = _pin(child, ppid=parent)
                if member is not None:
                    known.add(child)
                    self.members.append(member)
                    queue.append(child)

    async def wait_exit(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every member to exit; returns whether they did."""
        with trio.move_on_after(seconds):
            for member in self.members:
                await trio.lowlevel.wait_readable(member.fd)
            return True
        return not self.alive()

    def survivor(self) -> tuple[int, str, str]:
        """A member still alive, with its state and wait channel, for a report."""
        for member in self.members:
            if not member.exited():
                return (member.pid, *state_and_wchan(member.pid))
        return (self.pid, "exited", "")

    def close(self) -> None:
        for member in self.members:
            os.close(member.fd)
        self.members = []


def open_target(kind: TargetKind, process: Process, daemon_pgid: int) -> Target:
    """Pin the members of ``process``'s target of ``kind``."""
    root = Member(process.pid, os.dup(process.fd))
    if kind == "process":
        return Target("process", [root])
    if kind == "tree":
        target = Target("tree", [root])
        target._collect_descendants()
        return target
    try:
        pgid = read_stat(process.pid).pgrp
    except OSError:
        return Target("process", [root])
    if pgid <= 1 or pgid == daemon_pgid:
        why = "the daemon's own" if pgid == daemon_pgid else f"pgid {pgid}"
        note = f"group target refused ({why} process group); acting on the process alone"
        return Target("process", [root], note=note)
    members = [root] + [
        member
        for pid in _group_members(pgid)
        if pid != process.pid and (member := _pin(pid, pgrp=pgid)) is not None
    ]
    return Target("group", members, pgid=pgid)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if read_stat(int(entry)).pgrp == pgid:
                members.append(int(entry))
        except OSError:
            continue
        if len(members) >= _MAX_MEMBERS:
            break
    return members
