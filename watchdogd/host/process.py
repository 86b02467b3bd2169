"""Processes as the daemon sees them: pidfds, peer credentials and /proc.

Every signal the daemon sends goes through a pidfd: a `Process`'s own, opened when
the process's first timer was armed, or one that `watchdogd.host.targets` pins a
target's member by. So a pid that was recycled in the meantime is never signalled:
the old pidfd only ever refers to the old process.

Identity comes from the kernel only: `peer_of` reads SO_PEERCRED (pid, uid, gid) and,
where the kernel has it (Linux >= 6.5), SO_PEERPIDFD, a pidfd for the exact process
that connected. A process's uids come from its pidfd where the kernel has
PIDFD_GET_INFO (Linux >= 6.13), else from /proc/PID/status (`uids_of`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from watchdogd_protocol import ErrorCode

from ..core import ROOT, Peer, may_signal
from ..errors import Refusal

#: Linux's SO_PEERPIDFD; Python 3.11's socket module lacks the name.
SO_PEERPIDFD: Final = getattr(socket, "SO_PEERPIDFD", 77)
_CREDENTIALS: Final = struct.Struct("3i")
_COMMAND_BYTES: Final = 4096
#: Characters of a command line a process in the table keeps (a status page shows
#: at most 1 KiB of one).
_REMEMBERED_COMMAND: Final = 1024
#: ioctl(2) PIDFD_GET_INFO (Linux 6.13), _IOWR(0xFF, 11, struct pidfd_info): what
#: the kernel knows of a pidfd's own process, its credentials among it.
_PIDFD_GET_INFO: Final = 0xC040FF0B
_PIDFD_INFO_CREDS: Final = 1 << 1
#: struct pidfd_info as first published (64 bytes): mask, cgroupid; pid, tgid,
#: ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid, a spare word.
_PIDFD_INFO: Final = struct.Struct("=QQ12I")
#: Errors of a kernel without PIDFD_GET_INFO, or of a descriptor it is not for.
_NO_PIDFD_INFO: Final = frozenset({errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP})


def peer_of(sock: socket.socket) -> Peer:
    """Read the credentials of a connected AF_UNIX socket's peer.

    The returned ``pidfd`` belongs to the caller, who must close it."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, gid = _CREDENTIALS.unpack(raw)
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        # ENOPROTOOPT: a kernel without the option, whose caller is opened by pid
        # while it is surely the process that connected. Any other error: the
        # kernel has it, and the process that connected is gone already.
        return Peer(pid=pid, uid=uid, gid=gid, gone=exc.errno != errno.ENOPROTOOPT)
    return Peer(pid=pid, uid=uid, gid=gid, pidfd=pidfd)


class Process:
    """A pidfd for one process, with its uids as last read (`refresh` reads them
    again: a process may change them with setuid(2) at any time).

    Reference-counted: the timer table, a connection whose caller it is, and each
    expiry being carried out hold one reference each (`retain`); the pidfd closes with
    the last, after ``on_last_close`` (set by whoever watches the pidfd) has run.
    """

    __slots__ = (
        "_executable",
        "_refs",
        "armed_command",
        "fd",
        "on_last_close",
        "pid",
        "saved_uid",
        "start_time",
        "uid",
    )

    def __init__(self, pid: int, fd: int, *, uid: int, saved_uid: int, start_time: int) -> None:
        self.pid = pid
        self.fd = fd
        self.uid = uid
        self.saved_uid = saved_uid
        self.start_time = start_time
        self.on_last_close: Callable[[Process], None] | None = None
        #: Its command line when it entered the timer table (at most
        #: `_REMEMBERED_COMMAND` characters): what an expiry in a burst records,
        #: when there is no time to read it again before the signal.
        self.armed_command = ""
        self._executable = ""
        self._refs = 1

    def __repr__(self) -> str:
        return f"<Process pid={self.pid} fd={self.fd} uid={self.uid}>"

    def fileno(self) -> int:
        return self.fd

    def retain(self) -> Process:
        """Take one more reference; balance it with `close`."""
        self._refs += 1
        return self

    @property
    def refs(self) -> int:
        return self._refs

    def close(self) -> None:
        """Drop one reference; the pidfd closes with the last."""
        self._refs -= 1
        if self._refs == 0:
            if self.on_last_close is not None:
                self.on_last_close(self)
                self.on_last_close = None
            os.close(self.fd)
            self.fd = -1

    def alive(self) -> bool:
        """Whether the process still holds its pid (running, stopped or a zombie)."""
        return holds_pid(self.fd)

    def exited(self) -> bool:
        """Whether the process has exited, a zombie included (`has_exited`)."""
        return has_exited(self.fd)

    def refresh(self) -> bool:
        """Read the real and saved uid again; False, with nothing changed, when the
        process has exited.

        The pidfd is checked after the uids are read, so they belong to this process
        and not to one that took its pid after it was reaped (read from /proc).
        """
        try:
            uid, saved_uid = uids_of(self.fd, self.pid)
        except (FileNotFoundError, ProcessLookupError):
            return False
        if not self.alive():
            return False
        self.uid, self.saved_uid = uid, saved_uid
        return True

    def signallable_by(self, uid: int) -> bool:
        """Whether ``uid`` may signal the process now, as kill(2) would judge a
        user's signal: it is still the process's real or saved uid (read again,
        `refresh`; `watchdogd.core.identity.may_signal`). False once the process
        has exited."""
        return self.refresh() and may_signal(uid, self.uid, self.saved_uid)

    def command(self) -> str:
        """The process's command line, or ``[comm]`` when it has none (a zombie)."""
        return command_of(self.pid)

    def executable(self) -> str:
        """The path of the executable it runs (``?`` when it cannot be read), read
        once: the key of its timers' history."""
        if not self._executable:
            try:
                path = os.readlink(f"/proc/{self.pid}/exe")
            except OSError:
                path = "?"
            self._executable = path if self.alive() else "?"
        return self._executable

    def remember_command(self) -> None:
        """Keep its command line as it is now (it entered the timer table)."""
        if not self.armed_command:
            self.armed_command = command_of(self.pid)[:_REMEMBERED_COMMAND]


def holds_pid(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` still holds its pid (running, stopped or a
    zombie not yet reaped)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; we may merely not signal it
    return True


def has_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited: its pidfd is readable from its
    exit on, while it is a zombie too (which still holds its pid: `holds_pid`)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def open_process(pid: int, peer: Peer | None = None) -> Process:
    """Open a pidfd for ``pid`` and read its uids and start time.

    For the peer itself its SO_PEERPIDFD is duplicated, which is exact even if the
    peer's pid has been recycled since it connected. /proc is read after the pidfd is
    open and the process is checked to be alive afterwards, so what was read belongs
    to the process the pidfd refers to (a pid is not reused while its process holds
    it, zombie included). Every way this can fail becomes a `Refusal` (see
    `refusal_for`); nothing a caller names raises anything else.
    """
    try:
        if peer is not None and pid == peer.pid and peer.pidfd is not None:
            fd = os.dup(peer.pidfd)
        else:
            fd = os.pidfd_open(pid)
    except OSError as exc:
        raise refusal_for(pid, exc) from None
    try:
        uid, saved_uid = uids_of(fd, pid)
        start_time = read_start_time(pid)
        process = Process(pid, fd, uid=uid, saved_uid=saved_uid, start_time=start_time)
    except (OSError, ValueError, IndexError) as exc:
        # ValueError/IndexError: /proc showed something unparsable, which happens
        # only when the process went away mid-read.
        os.close(fd)
        raise refusal_for(pid, exc if isinstance(exc, OSError) else None) from None
    except BaseException:
        os.close(fd)
        raise
    if not process.alive():
        process.close()
        raise refusal_for(pid, None)
    return process


def refusal_for(pid: int, exc: OSError | None) -> Refusal:
    """The refusal for a failure to open or read process ``pid``: the one place
    where the errnos of pidfd_open(2), dup(2) and /proc map to error codes.

    - ESRCH, ENOENT, EINVAL, or no error (it died while being read): the process is
      gone, or ``pid`` names a thread that is not a thread-group leader: pidfd_open
      refuses those (EINVAL; ENOENT on newer kernels), and /proc/PID/status then shows
      a Tgid other than PID, which is named in the answer.
    - EPERM, EACCES: the daemon may not look at it (a security module, hidepid).
    - EMFILE, ENFILE, ENOMEM: the daemon is out of descriptors or memory for now.
    - Anything else: the daemon cannot open it, said with the errno's name.
    """
    code = None if exc is None else exc.errno
    if code in (None, errno.ESRCH, errno.ENOENT, errno.EINVAL):
        leader = thread_group_of(pid)
        if leader is not None and leader != pid:
            return Refusal(
                ErrorCode.NOT_A_PROCESS,
                f"pid {pid} is a thread of process {leader}; name the process",
            )
        return Refusal(ErrorCode.NO_SUCH_PROCESS, f"no process with pid {pid}")
    if code in (errno.EPERM, errno.EACCES):
        return Refusal(
            ErrorCode.PERMISSION_DENIED, f"the daemon is not allowed to inspect pid {pid}"
        )
    if code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        return Refusal(
            ErrorCode.UNAVAILABLE,
            f"the daemon is out of {'memory' if code == errno.ENOMEM else 'file descriptors'} "
            "for now; try again later",
        )
    name = errno.errorcode.get(code or 0, str(code))
    return Refusal(ErrorCode.UNAVAILABLE, f"the daemon cannot open pid {pid} ({name})")


def thread_group_of(pid: int) -> int | None:
    """The Tgid of ``pid`` (itself for a process, its process for a thread), or None
    when /proc no longer shows it."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def uids_of(pidfd: int, pid: int) -> tuple[int, int]:
    """The real and saved uid of the process of ``pidfd`` (whose pid is ``pid``):
    from the pidfd itself, one ioctl(2), where the kernel has PIDFD_GET_INFO; else
    `read_uids`, which opens and parses /proc/PID/status (docs/benchmarks.md says
    what each costs). Raises ProcessLookupError once the process has been reaped (a
    zombie still has its uids)."""
    info = bytearray(_PIDFD_INFO.size)
    info[0] = _PIDFD_INFO_CREDS
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info, True)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise ProcessLookupError(pid) from None
        if exc.errno not in _NO_PIDFD_INFO:
            raise
        try:
            return read_uids(pid)
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
    fields = _PIDFD_INFO.unpack(info)
    return fields[5], fields[9]


def read_uids(pid: int) -> tuple[int, int]:
    """The real and saved uid of ``pid``, from /proc/PID/status."""
    with open(f"/proc/{pid}/status", "rb") as status:
        for line in status:
            if line.startswith(b"Uid:"):
                real, _effective, saved, _fs = line.split()[1:5]
                return int(real), int(saved)
    raise ProcessLookupError(pid)


def ptrace_reader(pid: int) -> tuple[int, int] | None:
    """The one user besides root who may read the memory (the stack) of ``pid``
    now, by ptrace's read rule, as (uid, gid): its real, effective and saved uids
    are that uid, its gids that gid, and it is dumpable. None when no such user
    exists (root alone may), or the process is gone.

    The kernel owns a process's /proc files by its effective uid and gid while it
    is dumpable, by root otherwise (a process that changed its credentials, say a
    daemon that dropped root, is not dumpable): the owner of the status file, read
    through the same open file, says which."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            owner = os.fstat(status.fileno())
            uids: set[int] = set()
            gids: set[int] = set()
            for line in status:
                if line.startswith(b"Uid:"):
                    uids = set(map(int, line.split()[1:4]))
                elif line.startswith(b"Gid:"):
                    gids = set(map(int, line.split()[1:4]))
                    break
    except (OSError, ValueError):
        return None
    if len(uids) != 1 or len(gids) != 1:
        return None
    uid, gid = uids.pop(), gids.pop()
    if uid == ROOT or (owner.st_uid, owner.st_gid) != (uid, gid):
        return None
    return uid, gid


@dataclass(slots=True, frozen=True)
class Stat:
    """The fields of /proc/PID/stat the daemon uses."""

    state: str
    ppid: int
    pgrp: int
    start_time: int  # clock ticks since boot
    #: CPU time so far, user and system, of all its threads (clock ticks).
    cpu_ticks: int


def read_stat(pid: int) -> Stat:
    """Parse /proc/PID/stat (raises OSError when the process is gone)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        data = stat.read()
    # The command name (field 2) may contain spaces and parentheses: split after
    # the last ')'. Field 3 is then the first of the rest.
    fields = data[data.rindex(b")") + 2 :].split()
    return Stat(
        state=fields[0].decode(),
        ppid=int(fields[1]),
        pgrp=int(fields[2]),
        start_time=int(fields[19]),
        cpu_ticks=int(fields[11]) + int(fields[12]),
    )


def read_start_time(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22)."""
    return read_stat(pid).start_time


def children_of(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (empty when it is gone)."""
    children: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as listing:
                children += [int(child) for child in listing.read().split()]
        except OSError:
            continue
    return children


def state_and_wchan(pid: int) -> tuple[str, str]:
    """The ``State:`` line of /proc/PID/status and /proc/PID/wchan, for reports."""
    state = wchan = "?"
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"State:"):
                    state = line.split(b":", 1)[1].strip().decode()
                    break
        with open(f"/proc/{pid}/wchan", "rb") as channel:
            wchan = channel.read().decode(errors="replace") or "0"
    except OSError:
        pass
    return state, wchan


def command_of(pid: int) -> str:
    """The command line of ``pid`` (at most 4 KiB of it), or ``[comm]``, or ``?``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            raw = cmdline.read(_COMMAND_BYTES)
        if raw:
            return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/comm", "rb") as comm:
            return "[" + comm.read().strip().decode(errors="replace") + "]"
    except OSError:
        return "?"
