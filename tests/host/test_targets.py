"""Policy targets on real process trees, groups and cgroups."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import trio

from watchdogd.host.process import open_process, read_stat
from watchdogd.host.targets import open_target

from helpers.cgroups import ScratchCgroup
from helpers.processes import DAEMONIZE, gone, reap, sleeper
from helpers.users import mixed_family, nobody_sleeper
from helpers.waiting import PATIENCE

# A parent with two children: one in the parent's group, one in a session of its own.
FAMILY = textwrap.dedent(
    """
    import os, sys, time
    kids = []
    for new_session in (False, True):
        pid = os.fork()
        if pid == 0:
            if new_session:
                os.setsid()
            time.sleep(300)
            os._exit(0)
        kids.append(pid)
    while os.getsid(kids[1]) != kids[1]:  # not before it is in a session of its own
        time.sleep(0.001)
    print(*kids, flush=True)
    time.sleep(300)
    """
)


def start_family() -> tuple[subprocess.Popen[str], int, int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", FAMILY], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert parent.stdout is not None
    same_group, own_session = map(int, parent.stdout.readline().split())
    return parent, same_group, own_session


def wait_dead(*pids: int) -> None:
    deadline = time.monotonic() + PATIENCE
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if not gone(p)]}"
        time.sleep(0.01)


def kill_all(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_tree_reaches_a_descendant_in_its_own_session() -> None:
    parent, same_group, own_session = start_family()
    process = open_process(parent.pid)
    target = open_target("tree", process, os.getpgrp())
    try:
        assert {member.pid for member in target.members} == {parent.pid, same_group, own_session}
        assert str(target.signal(signal.SIGKILL)) == "sent SIGKILL to 3 processes"
        wait_dead(parent.pid, same_group, own_session)
        assert not target.alive()
        assert str(target.signal(signal.SIGKILL)) == "gone"
    finally:
        target.close()
        process.close()
        kill_all(same_group, own_session)
        reap(parent)


def test_group_reaches_the_group_but_not_another_session() -> None:
    parent, same_group, own_session = start_family()
    process = open_process(parent.pid)
    target = open_target("group", process, os.getpgrp())
    try:
        assert target.kind == "group"
        assert target.pgid == parent.pid
        assert str(target.signal(signal.SIGKILL)) == f"sent SIGKILL to group {parent.pid}"
        wait_dead(parent.pid, same_group)
        assert not gone(own_session)
    finally:
        target.close()
        process.close()
        kill_all(same_group, own_session)
        reap(parent)


def test_group_never_signals_the_daemons_own_group() -> None:
    child = subprocess.Popen(["sleep", "300"])  # in this process's group
    process = open_process(child.pid)
    target = open_target("group", process, os.getpgrp())
    try:
        assert target.kind == "process"
        assert "daemon's own process group" in target.note
        assert str(target.signal(signal.SIGKILL)) == "sent SIGKILL"
        assert child.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        target.close()
        process.close()
        reap(child)


async def test_wait_ends_when_every_member_exits() -> None:
    parent, same_group, own_session = start_family()
    process = open_process(parent.pid)
    target = open_target("tree", process, os.getpgrp())
    try:
        assert await target.wait_exit(0.05) is False
        kill_all(same_group, own_session, parent.pid)
        with trio.fail_after(PATIENCE):
            assert await target.wait_exit(PATIENCE) is True
    finally:
        target.close()
        process.close()
        reap(parent)


@pytest.mark.parametrize("kind", ["process", "group", "tree", "cgroup"])
def test_each_target_holds_its_own_descriptors(kind: str) -> None:
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    process = open_process(child.pid)
    target = open_target(kind, process, os.getpgrp())  # type: ignore[arg-type]
    try:
        assert all(member.fd != process.fd for member in target.members)
    finally:
        target.close()
        process.close()
        reap(child)


async def test_a_cancelled_wait_never_wakes_a_later_target_early() -> None:
    first, second = sleeper(), sleeper()
    handles = [open_process(child.pid) for child in (first, second)]
    try:
        # What the test is about needs the later target on the earlier one's
        # descriptor number: a lower one that came free meanwhile (another test's
        # file, collected now) would take it, so that is tried again.
        gc.collect()
        for _ in range(3):
            earlier = open_target("process", handles[0], os.getpgrp())
            assert await earlier.wait_exit(0.1) is False  # a wait step that ran out
            number = earlier.members[0].fd
            earlier.close()
            later = open_target("process", handles[1], os.getpgrp())
            if later.members[0].fd == number:  # the descriptor number is reused
                break
            later.close()
        else:
            pytest.fail("the kernel never gave the later target the earlier's descriptor")

        async def first_dies_meanwhile() -> None:
            await trio.sleep(0.2)
            first.kill()
            first.wait()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_dies_meanwhile)
            # The first process's exit is not the second one's: the whole grace
            # period is waited for.
            started = trio.current_time()
            assert await later.wait_exit(1.0) is False
            assert trio.current_time() - started >= 1.0
        assert second.poll() is None
        later.close()
    finally:
        for handle in handles:
            handle.close()
        reap(first)
        reap(second)


def test_a_group_target_of_an_exited_process_is_just_the_process() -> None:
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    process = open_process(child.pid)
    reap(child)  # gone: its pid, and its group id, may be anyone's now
    target = open_target("group", process, os.getpgrp())
    try:
        assert target.kind == "process"
        assert str(target.signal(signal.SIGKILL)) == "gone"
    finally:
        target.close()
        process.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run processes of two users")
@pytest.mark.parametrize("kind", ["tree", "group"])
def test_a_non_root_owners_target_leaves_out_what_it_may_not_signal(kind: str) -> None:
    parent, root_child = mixed_family()
    process = open_process(parent.pid)
    try:
        as_root = open_target(kind, process, os.getpgrp(), owner=0)  # type: ignore[arg-type]
        assert {m.pid for m in as_root.members} == {parent.pid, root_child}
        as_root.close()
        as_nobody = open_target(kind, process, os.getpgrp(), owner=65534)  # type: ignore[arg-type]
        assert {m.pid for m in as_nobody.members} == {parent.pid}
        assert str(as_nobody.signal(signal.SIGKILL)) == "sent SIGKILL to 1 process"
        wait_dead(parent.pid)
        assert not gone(root_child)
        as_nobody.close()
    finally:
        process.close()
        kill_all(root_child)
        reap(parent)


# A parent of uid 65534 whose child has the credentials of a setuid-root program it
# ran: real uid 65534, effective and saved uid 0.
SETUID_FAMILY = textwrap.dedent(
    """
    import os, sys, time
    changed, told = os.pipe()
    kid = os.fork()
    if kid == 0:
        os.setresuid(65534, 0, 0)
        os.write(told, b"x")
        time.sleep(300)
        os._exit(0)
    os.read(changed, 1)
    os.setgid(65534)
    os.setuid(65534)
    print(kid, flush=True)
    time.sleep(300)
    """
)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run processes of two users")
@pytest.mark.parametrize("kind", ["tree", "group"])
def test_a_setuid_root_child_is_signalled_as_kill_2_would_let_its_user(kind: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", SETUID_FAMILY],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None
    setuid_child = int(parent.stdout.readline())
    process = open_process(parent.pid)
    try:
        # Its real uid is still the user's, so kill(2) lets that user signal it.
        target = open_target(kind, process, os.getpgrp(), owner=65534)  # type: ignore[arg-type]
        assert {m.pid for m in target.members} == {parent.pid, setuid_child}
        assert str(target.signal(signal.SIGKILL)) == "sent SIGKILL to 2 processes"
        wait_dead(parent.pid, setuid_child)
        target.close()
    finally:
        process.close()
        kill_all(setuid_child)
        reap(parent)


# A group leader with a child B. Told to, it forks D into its group, then it and B
# move to B's group: D is then the only member of the group, and D was never pinned.
LEAVING = textwrap.dedent(
    """
    import os, sys, time
    b = os.fork()
    if b == 0:
        time.sleep(300)
        os._exit(0)
    print(b, flush=True)
    sys.stdin.readline()
    d = os.fork()
    if d == 0:
        time.sleep(300)
        os._exit(0)
    os.setpgid(b, b)
    os.setpgid(0, b)
    print(d, flush=True)
    time.sleep(300)
    """
)


def test_a_group_is_signalled_only_while_a_pinned_member_is_in_it() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEAVING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    assert leader.stdin is not None
    assert leader.stdout is not None
    b = int(leader.stdout.readline())
    process = open_process(leader.pid)
    target = open_target("group", process, os.getpgrp())
    d = 0
    try:
        assert (target.pgid, {m.pid for m in target.members}) == (leader.pid, {leader.pid, b})
        leader.stdin.write("go\n")
        leader.stdin.flush()
        d = int(leader.stdout.readline())
        # The group is no longer the one seen at expiry: nobody pinned is in it.
        assert str(target.signal(signal.SIGKILL)) == "gone"
        time.sleep(0.1)
        assert not gone(d)
    finally:
        target.close()
        process.close()
        kill_all(b, *([d] if d else []))
        reap(leader)


# A worker that, once told, daemonizes a child (DAEMONIZE) and prints its pid.
DAEMONIZING = DAEMONIZE + textwrap.dedent(
    """
    import sys, time
    sys.stdin.readline()
    print(daemonize(), flush=True)
    time.sleep(300)
    """
)


def start_daemonizing(cgroup: ScratchCgroup) -> tuple[subprocess.Popen[str], int]:
    """A worker in ``cgroup`` with a daemon it started: both there, in no tree or
    group of each other's."""
    worker = subprocess.Popen(
        [sys.executable, "-c", DAEMONIZING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert worker.stdin is not None
    assert worker.stdout is not None
    cgroup.add(worker.pid)
    worker.stdin.write("go\n")
    worker.stdin.flush()
    daemon = int(worker.stdout.readline())
    assert read_stat(daemon).ppid != worker.pid
    assert os.getpgid(daemon) != os.getpgid(worker.pid)
    return worker, daemon


def test_cgroup_reaches_a_daemon_outside_the_tree_and_the_group(
    scratch_cgroup: ScratchCgroup,
) -> None:
    worker, daemon = start_daemonizing(scratch_cgroup)
    process = open_process(worker.pid)
    try:
        tree = open_target("tree", process, os.getpgrp())
        assert {m.pid for m in tree.members} == {worker.pid}
        tree.close()
        target = open_target("cgroup", process, os.getpgrp())
        assert (target.kind, target.note) == ("cgroup", "")
        assert {m.pid for m in target.members} == {worker.pid, daemon}
        assert str(target.signal(signal.SIGKILL)) == (
            f"sent SIGKILL to 2 processes of cgroup {scratch_cgroup.path} through cgroup.kill"
        )
        wait_dead(worker.pid, daemon)
        assert str(target.signal(signal.SIGKILL)) == "gone"
        target.close()
    finally:
        process.close()
        kill_all(daemon)
        reap(worker)


async def test_cgroup_signals_other_than_sigkill_go_to_each_member(
    scratch_cgroup: ScratchCgroup,
) -> None:
    first = sleeper()
    later = sleeper()
    process = open_process(first.pid)
    try:
        scratch_cgroup.add(first.pid)
        target = open_target("cgroup", process, os.getpgrp())
        assert {m.pid for m in target.members} == {first.pid}
        scratch_cgroup.child("late").add(later.pid)  # came after the expiry, below it
        assert str(target.signal(signal.SIGTERM)) == (
            f"sent SIGTERM to 2 processes of cgroup {scratch_cgroup.path}"
        )
        with trio.fail_after(PATIENCE):
            assert await target.wait_exit(PATIENCE) is True  # waits for both
        assert first.wait(timeout=PATIENCE) == later.wait(timeout=PATIENCE) == -signal.SIGTERM
        target.close()
    finally:
        process.close()
        reap(first)
        reap(later)


@pytest.mark.parametrize("where", ["root", "daemon's own", "daemon's parent"])
def test_cgroup_is_never_the_root_nor_one_holding_the_daemon(
    scratch_cgroup: ScratchCgroup, where: str
) -> None:
    victim, bystander = sleeper(), sleeper()
    process = open_process(victim.pid)
    daemon_pid = os.getpid()
    try:
        if where == "root":
            root = ScratchCgroup(scratch_cgroup.directory.parent, "/")
            root.add(victim.pid)
            expected = "the root cgroup"
        else:
            scratch_cgroup.add(victim.pid)
            scratch_cgroup.add(bystander.pid)
            daemon_pid = bystander.pid  # stands for the daemon
            if where == "daemon's own":
                expected = f"the daemon's own cgroup, {scratch_cgroup.path}"
            else:
                scratch_cgroup.child("daemon").add(bystander.pid)
                expected = f"it holds the daemon's cgroup, {scratch_cgroup.path}"
        target = open_target("cgroup", process, os.getpgrp(), daemon_pid=daemon_pid)
        assert target.kind == "process"
        assert target.note == f"cgroup target refused ({expected}); acting on the process alone"
        assert str(target.signal(signal.SIGKILL)) == "sent SIGKILL"
        assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
        assert bystander.poll() is None
        target.close()
    finally:
        process.close()
        reap(victim)
        reap(bystander)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run processes of two users")
def test_a_non_root_owners_cgroup_is_signalled_only_where_kill_2_allows(
    scratch_cgroup: ScratchCgroup,
) -> None:
    mine, also_mine, roots = nobody_sleeper(), nobody_sleeper(), sleeper()
    process = open_process(mine.pid)
    try:
        for child in (mine, also_mine, roots):
            scratch_cgroup.add(child.pid)
        target = open_target("cgroup", process, os.getpgrp(), owner=65534)
        assert {m.pid for m in target.members} == {mine.pid, also_mine.pid}
        assert "process by process, only those uid 65534 may signal" in target.note
        assert str(target.signal(signal.SIGKILL)) == (
            f"sent SIGKILL to 2 processes of cgroup {scratch_cgroup.path}; "
            "1 process of another user left alone"
        )
        assert mine.wait(timeout=PATIENCE) == also_mine.wait(timeout=PATIENCE) == -signal.SIGKILL
        time.sleep(0.1)
        assert roots.poll() is None  # cgroup.kill would have killed it
        target.close()
    finally:
        process.close()
        for child in (mine, also_mine, roots):
            reap(child)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run processes of two users")
def test_a_daemon_that_may_not_write_cgroup_kill_kills_each_process(
    scratch_cgroup: ScratchCgroup,
) -> None:
    # A daemon of uid 65534, as the systemd unit runs it (no write to the cgroup
    # file system), on a timer armed by root, over processes it may signal.
    victims = [nobody_sleeper(), nobody_sleeper()]
    for victim in victims:
        scratch_cgroup.add(victim.pid)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            process = open_process(victims[0].pid)
            target = open_target("cgroup", process, os.getpgrp())
            result = str(target.signal(signal.SIGKILL))
        except BaseException as exc:
            result = repr(exc)
        os.write(write_end, result.encode())
        os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            result = pipe.read()
        os.waitpid(child, 0)
        assert result == (
            f"sent SIGKILL to 2 processes of cgroup {scratch_cgroup.path} "
            "one by one (cgroup.kill: Permission denied)"
        )
        for victim in victims:
            assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        for victim in victims:
            reap(victim)
