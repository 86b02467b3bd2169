"""``target = "cgroup"`` carried out by a real daemon on workers in real cgroups."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd.host.cgroups import host_hierarchy
from watchdogd.host.process import read_stat
from watchdogd_client import Client

from helpers.cgroups import ScratchCgroup
from helpers.daemon import RunningDaemon, configured_daemon, expired_event
from helpers.processes import DAEMONIZE, gone, python_worker, reap, sleeper, wait_ready
from helpers.users import as_nobody, nobody_sleeper
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or host_hierarchy() is None,
    reason="needs root and a cgroup v2 hierarchy",
)

CONFIG = """
[policies.cgroup_kill]
target = "cgroup"
steps = [ { signal = "SIGKILL" } ]

[policies.cgroup_term]
target = "cgroup"
steps = [ { signal = "SIGTERM" }, { wait = 1 }, { signal = "SIGKILL" } ]
"""


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as running:
        yield running


def daemonizing_worker(
    policy: str, cgroup: str | Path, daemon: RunningDaemon, *, before: str = ""
) -> tuple[subprocess.Popen[str], int]:
    """A worker that moves itself into ``cgroup`` (its ``cgroup.procs`` file), starts
    a daemon (a double fork and setsid: in neither its tree nor its group), arms a
    timer of 0.3 s with ``policy`` and hangs; returns it and the daemon's pid."""
    source = (
        DAEMONIZE
        + f"""
import signal, sys, time
from watchdogd_client import expires
with open({str(cgroup)!r}, "w") as procs:
    procs.write(str(os.getpid()))
{before}
print(daemonize(), flush=True)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
with expires(after=0.3, policy={policy!r}, scope="hung"):
    print("ready", flush=True)
    time.sleep(30)
"""
    )
    worker = python_worker(source, socket=daemon.socket_path)
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line.strip().isdigit():
        reap(worker)
        raise AssertionError(f"worker failed: {line!r} {worker.stderr and worker.stderr.read()}")
    started = int(line)
    try:
        # Neither in the worker's tree nor in its process group (nor its session).
        assert read_stat(started).ppid != worker.pid
        assert os.getpgid(started) != os.getpgid(worker.pid)
        assert os.getsid(started) != os.getsid(worker.pid)
    except BaseException:
        os.kill(started, signal.SIGKILL)
        reap(worker)
        raise
    return worker, started


def test_a_worker_and_the_daemon_it_started_die_with_their_cgroup(
    daemon: RunningDaemon, scratch_cgroup: ScratchCgroup
) -> None:
    worker, started = daemonizing_worker(
        "cgroup_kill", scratch_cgroup.directory / "cgroup.procs", daemon
    )
    try:
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        wait_until(lambda: gone(started), what="the daemon the worker started to die")
        with daemon.client() as client:
            event = expired_event(client, worker.pid)
    finally:
        reap(worker)
    assert [(s.step, s.result) for s in event.steps] == [
        (
            "SIGKILL",
            f"sent SIGKILL to 2 processes of cgroup {scratch_cgroup.path} through cgroup.kill",
        )
    ]
    assert (event.outcome, event.note) == ("exited", "")


def test_term_then_kill_waits_for_every_process_of_the_cgroup(
    daemon: RunningDaemon, scratch_cgroup: ScratchCgroup
) -> None:
    worker, started = daemonizing_worker(
        "cgroup_term",
        scratch_cgroup.directory / "cgroup.procs",
        daemon,
        before="signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the daemon ignores it",
    )
    try:
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == -signal.SIGTERM
        wait_until(lambda: gone(started), what="the daemon the worker started to die")
        with daemon.client() as client:
            event = expired_event(client, worker.pid)
    finally:
        reap(worker)
    # Killed at the end of the wait, not before, by the daemon's own clock (the
    # test's would count its own delays in seeing each death, beside a busy machine).
    assert event.fired_at is not None
    assert event.time - event.fired_at >= 1.0
    path = scratch_cgroup.path
    assert [(s.step, s.result) for s in event.steps] == [
        ("SIGTERM", f"sent SIGTERM to 2 processes of cgroup {path}"),
        ("wait 1s", "still running after 1s"),
        ("SIGKILL", f"sent SIGKILL to 1 process of cgroup {path} through cgroup.kill"),
    ]
    assert event.outcome == "exited"


def test_a_worker_in_the_root_cgroup_is_acted_on_alone(
    daemon: RunningDaemon, scratch_cgroup: ScratchCgroup
) -> None:
    root_procs = scratch_cgroup.directory.parent / "cgroup.procs"
    worker, started = daemonizing_worker("cgroup_kill", root_procs, daemon)
    try:
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        with daemon.client() as client:
            event = expired_event(client, worker.pid)
        assert not gone(started)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(started, signal.SIGKILL)
        reap(worker)
    assert [s.result for s in event.steps] == ["sent SIGKILL"]
    assert event.note == "cgroup target refused (the root cgroup); acting on the process alone"


def test_a_non_root_timer_spares_another_users_process_in_the_cgroup(
    daemon: RunningDaemon, scratch_cgroup: ScratchCgroup
) -> None:
    mine, also_mine, roots = nobody_sleeper(), nobody_sleeper(), sleeper()
    try:
        for child in (mine, also_mine, roots):
            scratch_cgroup.add(child.pid)
        pid = mine.pid

        def arm(client: Client) -> float:
            return client.acquire("hung", 0.2, pid=pid, policy="cgroup_kill")

        assert as_nobody(arm, daemon.socket_path) == {"ok": 0.2}
        assert mine.wait(timeout=PATIENCE) == also_mine.wait(timeout=PATIENCE) == -signal.SIGKILL
        with daemon.client() as client:
            event = expired_event(client, mine.pid)
        assert roots.poll() is None
    finally:
        for child in (mine, also_mine, roots):
            reap(child)
    assert event.uid == 65534
    assert [s.result for s in event.steps] == [
        f"sent SIGKILL to 2 processes of cgroup {scratch_cgroup.path}; "
        "1 process of another user left alone"
    ]
    assert event.note == (
        f"cgroup {scratch_cgroup.path} signalled process by process, only those uid 65534 "
        "may signal (cgroup.kill is for timers armed by root)"
    )
