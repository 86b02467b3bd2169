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
- ``cgroup``: every process in the process's cgroup v2 and in the cgroups below it
  (`watchdogd.host.cgroups`), listed from ``cgroup.procs`` at expiry and again before
  each signal, so a process that left the tree and the group (a double fork and
  setsid) is still a member. SIGKILL is sent by writing to the cgroup's
  ``cgroup.kill``, which also kills what forks during the kill; without it (Linux <
  5.14), and for any other signal, each member is signalled through its pidfd (for
  SIGKILL, listing again until no new member appears). Never the root cgroup, nor
  the daemon's own cgroup or one that contains it: the policy then acts on the
  process alone and says so, as it does when the process has no cgroup v2 the
  daemon can see. The cgroup's directory is held open from expiry on, so a later
  step never reaches another cgroup that took its name. A member is a process
  listed there whose /proc/PID/cgroup, read after its pidfd was opened, is the
  cgroup or one below it.

kill(2)'s rule (`watchdogd.core.identity.may_signal`) holds for every member: for a
timer armed by a non-root caller, only processes whose real or saved uid is the
caller's are members, and its group is signalled member by member rather than with
killpg(2), its cgroup member by member rather than with ``cgroup.kill`` (which would
reach every process in it, whoever's: even a cgroup found to hold the caller's
processes only at expiry may take in another's by the time of the write, a setuid
program run there, say). A cgroup's processes that are not the caller's are left
alone, and each step says how many. The uids are read when the target is opened, at
expiry (and for a tree or a cgroup, of each member found later, when it is found),
not taken from when the timer was armed: a timer's own process that no longer has
the caller's uid as its real or saved uid (it called setuid(2) since) is ``denied``,
and no step acts on it. (A timer armed by root acts on its process whatever its uids
became, as root's kill(2) would.) Whatever is read from /proc about a member is
trusted only once its pidfd shows it still alive afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Final

import trio

from ..core import (
    ROOT,
    Delivery,
    SignalResult,
    TargetKind,
    may_signal,
)
from .cgroups import Cgroup, cgroup_of, contains, host_hierarchy
from .process import (
    Process,
    children_of,
    command_of,
    has_exited,
    holds_pid,
    read_stat,
    read_uids,
    state_and_wchan,
    uids_of,
)

_MAX_MEMBERS: Final = 65536
#: Times a cgroup signalled member by member with SIGKILL is listed again for
#: processes forked while it was being signalled.
_KILL_ROUNDS: Final = 8


class Member:
    """One pinned process of a target."""

    __slots__ = ("fd", "pid", "waited")

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self.fd = fd
        #: trio waited on the descriptor: it must hear of its closing.
        self.waited = False

    def exited(self) -> bool:
        """Whether the process has exited (its pidfd is readable)."""
        return has_exited(self.fd)

    def send(self, signum: int) -> bool | None:
        """Signal it; False if it is gone, None if the daemon may not (EPERM: it
        runs as an ordinary user, or without CAP_KILL)."""
        try:
            signal.pidfd_send_signal(self.fd, signum)
        except ProcessLookupError:
            return False
        except PermissionError:
            return None
        return True


def _pin(
    pid: int,
    *,
    ppid: int | None = None,
    pgrp: int | None = None,
    cgroup: str | None = None,
    owner: int = ROOT,
) -> Member | None:
    """A pidfd for ``pid``, if it is still the process /proc showed (same parent,
    group or cgroup, read after the pidfd was opened), alive, and one ``owner`` may
    signal."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    member = Member(pid, fd)
    try:
        stat = read_stat(pid)
        allowed = may_signal(owner, *uids_of(fd, pid))
    except OSError:
        _close(fd)
        return None
    related = (ppid is None or stat.ppid == ppid) and (pgrp is None or stat.pgrp == pgrp)
    if cgroup is not None:
        now_in = cgroup_of(pid)
        related = related and now_in is not None and contains(cgroup, now_in)
    if not (allowed and related) or member.exited():
        _close(fd)
        return None
    return member


def _close(fd: int, *, waited: bool = False) -> None:
    # trio may still have a descriptor it waited on registered from a cancelled
    # wait; it must forget it before the number can be reused. (Outside trio there
    # is nothing to forget.)
    if waited:
        with contextlib.suppress(RuntimeError):
            trio.lowlevel.notify_closing(fd)
    os.close(fd)


class Target:
    """The members of a policy's target and how to signal them."""

    def __init__(
        self,
        kind: TargetKind,
        members: list[Member],
        *,
        owner: int = ROOT,
        pgid: int = 0,
        cgroup: Cgroup | None = None,
        note: str = "",
        denied: str = "",
    ) -> None:
        self.kind: TargetKind = kind
        self.members = members
        #: The uid that armed the timer: members are the processes it may signal.
        self.owner = owner
        self.pgid = pgid
        #: A ``cgroup`` target's cgroup, held open.
        self.cgroup = cgroup
        #: Said in the expiry's event (e.g. why a group target fell back).
        self.note = note
        #: Why ``owner`` may no longer act on the timer's process; when set, no step
        #: is carried out.
        self.denied = denied

    @property
    def pid(self) -> int:
        return self.members[0].pid

    def alive(self) -> bool:
        """Whether any member is still running."""
        return any(not member.exited() for member in self.members)

    def command(self) -> str:
        """The command line of the timer's process, or ``?`` once its pid may be
        someone else's (it was reaped). A process killed already shows ``[name]``."""
        root = self.members[0]
        command = command_of(root.pid)
        return command if holds_pid(root.fd) else "?"

    def signal(self, signum: int, *, alive: bool = False) -> SignalResult:
        """Send ``signum``; returns the step's result. ``alive``: the target was
        just seen alive (a process target then skips checking again)."""
        if self.cgroup is not None:
            return self._signal_cgroup(signum)
        if self.kind == "group" and self.owner == ROOT:
            return self._signal_group(signum)
        if self.kind == "tree":
            self._collect_descendants()
        if alive and self.kind == "process":
            results = [self.members[0].send(signum)]
        else:
            results = [member.send(signum) for member in self.members if not member.exited()]
        sent = results.count(True)
        if not sent:
            return _unsent(signum, results)
        if self.kind != "process":
            return SignalResult(Delivery.SENT, signum, f"to {_processes(sent)}")
        return SignalResult(Delivery.SENT, signum)

    def _signal_group(self, signum: int) -> SignalResult:
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
            to = f"to group {self.pgid}"
            try:
                os.killpg(self.pgid, signum)
            except ProcessLookupError:
                return SignalResult(Delivery.GONE, signum)
            except PermissionError:
                return SignalResult(Delivery.REFUSED, signum, to)
            return SignalResult(Delivery.SENT, signum, to)
        return SignalResult(Delivery.GONE, signum)

    def _signal_cgroup(self, signum: int) -> SignalResult:
        assert self.cgroup is not None
        others = self._collect_cgroup()
        living = [member for member in self.members if not member.exited()]
        if not living:
            return SignalResult(Delivery.GONE, signum)
        where = f"cgroup {self.cgroup.path}"
        why = ""
        if signum == signal.SIGKILL and self.owner == ROOT:
            why = self.cgroup.kill()
            if not why:
                to = f"to {_processes(len(living))} of {where} through cgroup.kill"
                return SignalResult(Delivery.SENT, signum, to)
        results = [member.send(signum) for member in living]
        for _ in range(_KILL_ROUNDS if signum == signal.SIGKILL else 0):
            known = len(self.members)
            others = max(others, self._collect_cgroup())
            if len(self.members) == known:
                break
            results += [member.send(signum) for member in self.members[known:]]
        sent = results.count(True)
        if not sent:
            return _unsent(signum, results)
        to = f"to {_processes(sent)} of {where}"
        if why:
            to += f" one by one ({why})"
        if others:
            to += f"; {_processes(others)} of another user left alone"
        return SignalResult(Delivery.SENT, signum, to)

    def _collect_cgroup(self) -> int:
        """Pin the processes of the cgroup not pinned yet; returns how many of those
        listed are alive and not the owner's to signal."""
        assert self.cgroup is not None
        known = {member.pid for member in self.members}
        others = 0
        for pid in self.cgroup.pids(_MAX_MEMBERS):
            if len(self.members) >= _MAX_MEMBERS:
                break
            if pid in known:
                continue
            member = _pin(pid, cgroup=self.cgroup.path, owner=self.owner)
            if member is not None:
                known.add(pid)
                self.members.append(member)
            elif self.owner != ROOT and _belongs_to_another(pid, self.owner):
                others += 1
        return others

    def _collect_descendants(self) -> None:
        known = {member.pid for member in self.members}
        queue = [member.pid for member in self.members if not member.exited()]
        parents = {member.pid: member for member in self.members}
        while queue and len(self.members) < _MAX_MEMBERS:
            parent = queue.pop()
            children = children_of(parent)
            if parents[parent].exited():
                continue  # what /proc listed may belong to whoever has the pid now
            for child in children:
                if child in known:
                    continue
                member = _pin(child, ppid=parent, owner=self.owner)
                if member is not None:
                    known.add(child)
                    self.members.append(member)
                    parents[child] = member
                    queue.append(child)

    async def wait_exit(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every member to exit; returns whether they did."""
        with trio.move_on_after(seconds):
            for member in self.members:
                member.waited = True
                await trio.lowlevel.wait_readable(member.fd)
        return not self.alive()

    def survivor(self) -> tuple[int, str, str]:
        """A member still alive, with its state and wait channel, for a report."""
        for member in self.members:
            if not member.exited():
                return (member.pid, *state_and_wchan(member.pid))
        return (self.pid, "exited", "")

    def close(self) -> None:
        for member in self.members:
            _close(member.fd, waited=member.waited)
        self.members = []
        if self.cgroup is not None:
            self.cgroup.close()


def open_target(
    kind: TargetKind,
    process: Process,
    daemon_pgid: int,
    owner: int = ROOT,
    *,
    daemon_pid: int | None = None,
) -> Target:
    """Pin the members of ``process``'s target of ``kind``, for a timer armed by uid
    ``owner``, whose right to signal ``process`` is checked again now (see `Target`).
    ``daemon_pgid`` and the cgroup of ``daemon_pid`` (by default this process) are
    never a target."""
    root = Member(process.pid, os.dup(process.fd))
    # Root needs no second look: whatever the uids became, kill(2) lets it signal.
    denied = "" if owner == ROOT else _denied(process, owner)
    if denied:
        return Target("process", [root], owner=owner, denied=denied)
    if kind == "process":
        return Target("process", [root], owner=owner)
    if kind == "tree":
        target = Target("tree", [root], owner=owner)
        target._collect_descendants()
        return target
    if kind == "cgroup":
        return _open_cgroup(root, owner, os.getpid() if daemon_pid is None else daemon_pid)
    try:
        pgid = read_stat(process.pid).pgrp
    except OSError:
        pgid = 0
    if root.exited():
        # Its pid, and what /proc says about it, may be someone else's by now.
        return Target("process", [root], owner=owner)
    if pgid <= 1 or pgid == daemon_pgid:
        why = "the daemon's own" if pgid == daemon_pgid else f"pgid {pgid}"
        note = f"group target refused ({why} process group); acting on the process alone"
        return Target("process", [root], owner=owner, note=note)
    members = [root] + [
        member
        for pid in _group_members(pgid)
        if pid != process.pid and (member := _pin(pid, pgrp=pgid, owner=owner)) is not None
    ]
    return Target("group", members, owner=owner, pgid=pgid)


def _open_cgroup(root: Member, owner: int, daemon_pid: int) -> Target:
    cgroup, why = _cgroup_of(root, daemon_pid)
    if cgroup is None:
        alone = f"cgroup target refused ({why}); acting on the process alone" if why else ""
        return Target("process", [root], owner=owner, note=alone)
    note = ""
    if owner != ROOT:
        note = (
            f"cgroup {cgroup.path} signalled process by process, only those uid {owner} "
            "may signal (cgroup.kill is for timers armed by root)"
        )
    target = Target("cgroup", [root], owner=owner, cgroup=cgroup, note=note)
    target._collect_cgroup()
    return target


def _cgroup_of(root: Member, daemon_pid: int) -> tuple[Cgroup | None, str]:
    """The open cgroup of ``root``'s process, or None and why not ("" when the
    process has exited: its steps are skipped anyway)."""
    path = cgroup_of(root.pid)
    if root.exited():
        return None, ""  # what /proc said may be about whoever has its pid now
    if path is None:
        return None, f"pid {root.pid} is in no cgroup v2"
    if path == "/":
        return None, "the root cgroup"
    daemons = cgroup_of(daemon_pid)
    if daemons is None:
        return None, "the daemon's own cgroup cannot be read"
    if contains(path, daemons):
        mine = "the daemon's own cgroup" if daemons == path else "it holds the daemon's cgroup"
        return None, f"{mine}, {path}"
    try:
        hierarchy = host_hierarchy()
    except OSError as exc:
        return None, f"cannot read the mounts: {exc.strerror}"
    directory = None if hierarchy is None else hierarchy.directory(path)
    if directory is None:
        return None, f"cgroup {path} is not under a cgroup v2 mount the daemon sees"
    try:
        cgroup = Cgroup.open(path, directory)
    except OSError as exc:
        return None, f"cannot open cgroup {path}: {exc.strerror}"
    # Still there after the directory was opened: the descriptor is its cgroup's.
    if cgroup_of(root.pid) != path or root.exited():
        cgroup.close()
        return None, "" if root.exited() else f"pid {root.pid} moved out of cgroup {path}"
    return cgroup, ""


def signal_process(process: Process, signum: int, owner: int = ROOT) -> SignalResult:
    """Send ``signum`` to ``process`` through its own pidfd, before its target is
    opened (a run's first signal, `watchdogd.core.expiry.Phase.FIRST_SIGNAL`), if
    uid ``owner``, which armed its timer, may still signal it (its uids read from
    the pidfd, as `open_target` checks them). `Delivery.NOT_SENT` when it may not,
    or the kernel answers anything but ESRCH or EPERM: the target, once opened,
    sends it or says why not."""
    if owner != ROOT and not process.signallable_by(owner):
        return SignalResult(Delivery.NOT_SENT, signum)
    try:
        signal.pidfd_send_signal(process.fd, signum)
    except ProcessLookupError:
        return SignalResult(Delivery.GONE, signum)
    except PermissionError:
        return SignalResult(Delivery.REFUSED, signum)
    except OSError:
        return SignalResult(Delivery.NOT_SENT, signum)
    return SignalResult(Delivery.SENT, signum)


def _unsent(signum: int, results: list[bool | None]) -> SignalResult:
    """No member took ``signum``: refused if the kernel refused any (``None``)."""
    return SignalResult(Delivery.REFUSED if None in results else Delivery.GONE, signum)


def _processes(count: int) -> str:
    return f"{count} process{'es' if count != 1 else ''}"


def _belongs_to_another(pid: int, owner: int) -> bool:
    """Whether ``pid`` is alive and ``owner`` may not signal it (for a count only)."""
    try:
        return not may_signal(owner, *read_uids(pid))
    except OSError:
        return False


def _denied(process: Process, owner: int) -> str:
    """Why ``owner`` may not signal ``process`` now, or "" if it may (or the process
    has exited: its steps are skipped anyway)."""
    if process.signallable_by(owner) or not process.alive():
        return ""
    return (
        f"uid {owner} may no longer signal pid {process.pid}: its real uid is now "
        f"{process.uid} and its saved uid {process.saved_uid}"
    )


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
