"""pidfds, peer credentials and /proc, on real processes."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import resource
import signal
import socket
import subprocess
import threading

import pytest

from watchdogd.core.identity import ROOT, may_signal
from watchdogd.errors import Refusal
from watchdogd.host import process as process_module
from watchdogd.host.process import (
    open_process,
    peer_of,
    ptrace_reader,
    read_start_time,
    read_stat,
    read_uids,
    refusal_for,
    uids_of,
)
from watchdogd_protocol import ErrorCode

from helpers.processes import reap, sleeper
from helpers.waiting import wait_until


def test_open_reads_identity_and_signals_exactly_that_process() -> None:
    child = sleeper()
    try:
        process = open_process(child.pid)
        assert (process.uid, process.saved_uid) == (os.getuid(), os.getuid())
        assert process.start_time == read_start_time(child.pid)
        # Popen returns once exec began; the kernel fills the new program's
        # arguments a moment later (until then /proc shows "[sleep]").
        wait_until(lambda: process.command() == "sleep 300", what="the command line")
        assert process.alive()
        signal.pidfd_send_signal(process.fd, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        process.close()
    finally:
        reap(child)


def test_a_reaped_process_is_never_signalled_again() -> None:
    child = sleeper()
    process = open_process(child.pid)
    reap(child)
    assert not process.alive()
    # Whatever process may hold the pid now, the pidfd refers to the old one.
    with pytest.raises(ProcessLookupError):
        signal.pidfd_send_signal(process.fd, signal.SIGKILL)
    process.close()


def test_may_signal_root_anything_and_a_user_its_real_or_saved_uid() -> None:
    assert may_signal(ROOT, 1000, 1000)
    assert may_signal(1000, 1000, 0)  # its real uid
    assert may_signal(1000, 0, 1000)  # its saved uid: a setuid program run by 1000
    assert not may_signal(1001, 1000, 1000)
    assert not may_signal(1000, 0, 0)


def test_signallable_by_follows_may_signal_until_the_process_is_gone() -> None:
    child = sleeper()
    other = 65534 if os.getuid() != 65534 else 65533
    process = open_process(child.pid)
    try:
        assert process.signallable_by(os.getuid())
        assert process.signallable_by(ROOT)
        assert not process.signallable_by(other)
        reap(child)
        assert not process.signallable_by(os.getuid())
    finally:
        process.close()
        reap(child)


def test_a_zombie_still_holds_its_pid() -> None:
    child = subprocess.Popen(["true"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    process = open_process(child.pid)
    assert process.alive()
    assert process.command() == "[true]"
    process.close()
    child.wait()


def test_missing_pid_is_refused() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    with pytest.raises(Refusal) as caught:
        open_process(child.pid)
    assert caught.value.code == ErrorCode.NO_SUCH_PROCESS


def test_references_close_the_pidfd_with_the_last() -> None:
    process = open_process(os.getpid())
    fd = process.fd
    process.retain()
    process.close()
    os.fstat(fd)  # still open
    process.close()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)


def test_peer_credentials_come_from_the_kernel() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        peer = peer_of(left)
        assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())
        if peer.pidfd is not None:  # Linux >= 6.5
            process = open_process(peer.pid, peer)
            assert process.fd != peer.pidfd
            assert process.alive()
            process.close()
            os.close(peer.pidfd)


def test_a_peer_the_kernel_gives_no_pidfd_for_is_never_taken_for_its_pid() -> None:
    """The kernel has SO_PEERPIDFD but gives no pidfd (here: a socket with no peer;
    on kernels before 6.9: a peer reaped already). Its pid is not to be opened."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lonely:
        peer = peer_of(lonely)
    assert peer.pidfd is None
    assert peer.gone


def test_start_time_parses_names_with_spaces_and_parentheses(tmp_path: os.PathLike[str]) -> None:
    odd = os.path.join(tmp_path, "a) b (c")
    os.symlink("/bin/sleep", odd)
    child = subprocess.Popen([odd, "300"])
    try:
        assert read_start_time(child.pid) > 0
        assert read_uids(child.pid) == (os.getuid(), os.getuid())
    finally:
        reap(child)


def child_with_uids(real: int, effective: int, saved: int) -> tuple[int, int]:
    """A forked child that sets its uids and waits to be killed: its pid, and a
    pipe it writes a byte to once its uids are set."""
    changed, told = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - waits to be killed
        os.close(changed)
        os.setresuid(real, effective, saved)
        os.write(told, b"x")
        signal.pause()
        os._exit(0)
    os.close(told)
    return child, changed


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to change a process's uids")
def test_refresh_reads_the_uids_again_and_refuses_once_the_process_is_gone() -> None:
    child, changed = child_with_uids(65534, 65534, 0)
    reaped = False
    try:
        process = open_process(child)
        assert os.read(changed, 1) == b"x"  # it has changed its uids, maybe after the open
        assert process.refresh()
        assert (process.uid, process.saved_uid) == (65534, 0)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        reaped = True
        assert not process.refresh()
        assert (process.uid, process.saved_uid) == (65534, 0)  # kept, not someone else's
        process.close()
    finally:
        os.close(changed)
        if not reaped:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to change a process's uids")
def test_uids_of_a_pidfd_are_what_proc_shows_and_a_zombie_keeps_them() -> None:
    """Real 65534, effective 1, saved 0, as a setuid program that dropped part of
    its privilege: the pidfd (PIDFD_GET_INFO, on this kernel) says what
    /proc/PID/status says; a descriptor that is no pidfd (what a kernel without
    PIDFD_GET_INFO answers with ENOTTY too) falls back to /proc; once reaped, the
    process is gone."""
    child, changed = child_with_uids(65534, 1, 0)
    pidfd = os.pidfd_open(child)
    not_a_pidfd, other_end = os.pipe()
    try:
        assert os.read(changed, 1) == b"x"
        assert read_uids(child) == (65534, 0)
        assert uids_of(pidfd, child) == (65534, 0)
        if tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 13):
            # Read from the pidfd itself, not from /proc.
            fcntl.ioctl(pidfd, process_module._PIDFD_GET_INFO, bytearray(64), True)
        assert uids_of(not_a_pidfd, child) == (65534, 0)
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: read_stat(child).state == "Z", what="a zombie")
        assert uids_of(pidfd, child) == (65534, 0)
        os.waitpid(child, 0)
        with pytest.raises(ProcessLookupError):
            uids_of(pidfd, child)
    finally:
        for fd in (changed, pidfd, not_a_pidfd, other_end):
            os.close(fd)
        with contextlib.suppress(OSError):  # reaped already, unless it failed first
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)


def test_a_thread_id_is_refused_naming_its_process() -> None:
    started = threading.Event()
    stop = threading.Event()

    def run() -> None:
        started.set()
        stop.wait()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        started.wait()
        assert thread.native_id is not None
        assert thread.native_id != os.getpid()
        with pytest.raises(Refusal) as caught:
            open_process(thread.native_id)
    finally:
        stop.set()
        thread.join()
    assert caught.value.code == ErrorCode.NOT_A_PROCESS
    assert caught.value.message == (
        f"pid {thread.native_id} is a thread of process {os.getpid()}; name the process"
    )


def test_out_of_descriptors_is_a_refusal_to_retry() -> None:
    child = sleeper()
    read_end, write_end = os.pipe()
    forked = os.fork()
    if forked == 0:  # pragma: no cover - reports through the pipe
        code = "none"
        try:
            os.close(read_end)
            highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, highest + 8))
            with contextlib.suppress(OSError):
                while True:  # use up every descriptor left
                    os.open("/dev/null", os.O_RDONLY)
            try:
                open_process(child.pid).close()
            except Refusal as refusal:
                code = refusal.code
        finally:
            os.write(write_end, str(code).encode())
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            assert pipe.read() == ErrorCode.UNAVAILABLE
        os.waitpid(forked, 0)
    finally:
        reap(child)


@pytest.mark.parametrize(
    ("number", "code"),
    [
        (errno.ESRCH, ErrorCode.NO_SUCH_PROCESS),
        (errno.ENOENT, ErrorCode.NO_SUCH_PROCESS),
        (errno.EINVAL, ErrorCode.NO_SUCH_PROCESS),
        (errno.EPERM, ErrorCode.PERMISSION_DENIED),
        (errno.EACCES, ErrorCode.PERMISSION_DENIED),
        (errno.EMFILE, ErrorCode.UNAVAILABLE),
        (errno.ENFILE, ErrorCode.UNAVAILABLE),
        (errno.EIO, ErrorCode.UNAVAILABLE),
    ],
)
def test_every_errno_maps_to_a_refusal(number: int, code: ErrorCode) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    refusal = refusal_for(gone.pid, OSError(number, os.strerror(number)))
    assert refusal.code == code
    assert refusal.message


def child_with_credentials(uid: tuple[int, int, int], gid: int, *, dumpable: bool) -> int:
    """A forked child with these uids and gid, made dumpable again or not (a change
    of credentials makes a process not dumpable); its pid, once they are set."""
    changed, told = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - waits to be killed
        os.close(changed)
        os.setresgid(gid, gid, gid)
        os.setresuid(*uid)
        if dumpable:
            ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        os.write(told, b"x")
        signal.pause()
        os._exit(0)
    os.close(told)
    assert os.read(changed, 1) == b"x"
    os.close(changed)
    return child


_PR_SET_DUMPABLE = 4


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to change a process's uids")
def test_ptrace_reader_is_the_one_user_the_kernel_lets_read_the_process() -> None:
    nobody = 65534
    children = {
        "all nobody's, dumpable": child_with_credentials((nobody,) * 3, nobody, dumpable=True),
        "saved uid root": child_with_credentials((nobody, nobody, 0), nobody, dumpable=True),
        "not dumpable": child_with_credentials((nobody,) * 3, nobody, dumpable=False),
    }
    try:
        readers = {what: ptrace_reader(pid) for what, pid in children.items()}
        assert readers == {
            "all nobody's, dumpable": (nobody, nobody),
            "saved uid root": None,
            "not dumpable": None,
        }
        assert ptrace_reader(os.getpid()) is None  # root's: root alone
    finally:
        for pid in children.values():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert ptrace_reader(next(iter(children.values()))) is None  # gone
