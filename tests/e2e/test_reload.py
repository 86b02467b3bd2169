"""SIGHUP reloads, a config that is no regular file or whose disk hangs, and a target
that survives SIGKILL (a frozen cgroup)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd_client import Client, ErrorCode, RequestRefused
from watchdogd_protocol import EventInfo

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.disks import require
from helpers.failing_fs import failing_disk
from helpers.processes import (
    at_timing_priority,
    at_units_priority_all,
    death_time,
    reap,
    sleeper,
)
from helpers.special_files import NAMED, each_special, freed_after, make_special
from helpers.waiting import PATIENCE, wait_until

FIRST = """
[daemon]
unkillable_after = 0.5

[policies.temporary]
steps = [ { signal = "SIGTERM" } ]
"""

SECOND = """
[daemon]
unkillable_after = 0.5

[policies.newcomer]
steps = [ { signal = "SIGKILL" } ]
"""


@pytest.fixture
def configured(socket_path: Path, tmp_path: Path) -> Iterator[tuple[RunningDaemon, Path]]:
    with configured_daemon(socket_path, tmp_path, FIRST) as running:
        yield running, tmp_path / "watchdogd.toml"


def events_of(client: Client, kind: str) -> list[EventInfo]:
    return [event for event in client.events(limit=1000).events if event.kind == kind]


def hangup(daemon: RunningDaemon, client: Client, kind: str) -> EventInfo:
    before = len(events_of(client, kind))
    os.kill(daemon.pid, signal.SIGHUP)
    wait_until(lambda: len(events_of(client, kind)) > before, what=f"a {kind} event")
    return events_of(client, kind)[-1]


def test_reload_applies_a_good_config_and_vanished_policies_fall_back(
    configured: tuple[RunningDaemon, Path],
) -> None:
    daemon, config = configured
    victim = sleeper()
    try:
        with daemon.client() as client:
            client.acquire("kept", 1.0, pid=victim.pid, policy="temporary")
            config.write_text(SECOND)
            event = hangup(daemon, client, "reloaded")
            assert "default 'kill'" in event.note
            names = {policy.name for policy in client.policies().policies}
            assert "newcomer" in names
            assert "temporary" not in names
            with pytest.raises(RequestRefused) as caught:
                client.acquire("new", 1.0, policy="temporary")
            assert caught.value.code == ErrorCode.UNKNOWN_POLICY
            # The armed timer kept its policy's name; at expiry the default acts.
            assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
            wait_until(lambda: bool(events_of(client, "expired")), what="the expiry")
            [expired] = events_of(client, "expired")
            assert expired.policy == "kill"
            assert "'temporary' is no longer configured" in expired.note
    finally:
        reap(victim)


def test_a_bad_config_is_refused_and_the_old_one_stays(
    configured: tuple[RunningDaemon, Path],
) -> None:
    daemon, config = configured
    config.write_text(
        "[policies.broken]\nsteps = [{ signal = 'SIGNOPE' }]\n[daemon]\nmax_timers = 0\n"
    )
    with daemon.client() as client:
        event = hangup(daemon, client, "reload_failed")
        # Both of the file's errors, on the one line an event is.
        assert event.note == (
            f"kept the old config: {config}, line 2: policies.broken.steps[0].signal: no "
            f"signal named 'SIGNOPE'; {config}, line 4: daemon.max_timers: Expected `int` >= 1"
        )
        assert "temporary" in {policy.name for policy in client.policies().policies}
        client.acquire("still", 60, policy="temporary")
        client.release("still")
    assert "event=reload_failed" in daemon.log()


#: How late a root canary may be signalled while the daemon is attacked.
ON_TIME = 0.1
#: What the daemon calls each kind at the config's path: a symlink is followed.
FOLLOWED = {**NAMED, "symlink": "a character device"}


def arm_canary(
    daemon: RunningDaemon, client: Client, timeout: float
) -> tuple[subprocess.Popen[bytes], float]:
    """A root timer on a fresh ``sleep``; the victim, and its deadline on
    CLOCK_MONOTONIC (the daemon's clock too). The daemon runs at the shipped unit's
    priority; the victim and the thread that times it (`on_time`) at real time
    (`helpers.processes.at_timing_priority_now`): what is timed is the daemon."""
    at_units_priority_all(daemon.pid)
    with at_timing_priority():
        victim = sleeper()
    remaining = client.acquire(f"canary-{victim.pid}", timeout, pid=victim.pid)
    # The latest it can be: a slow answer never makes a canary late.
    return victim, time.monotonic() + remaining


def on_time(victim: subprocess.Popen[bytes], deadline: float) -> None:
    with at_timing_priority():
        late = death_time(victim) - deadline
    assert victim.wait() == -signal.SIGKILL
    assert late < ON_TIME, f"the canary died {late * 1000:.0f} ms late"


@each_special
def test_a_config_that_is_no_regular_file_is_refused_at_reload_and_no_timer_waits(
    configured: tuple[RunningDaemon, Path], kind: str
) -> None:
    daemon, config = configured
    config.unlink()
    make_special(kind, config)
    with daemon.client() as client:
        canary, deadline = arm_canary(daemon, client, 1.0)
        try:
            # Today's daemon reads a FIFO in its event loop, until a writer comes
            # (here, after 3 s): the canary waits as long.
            with freed_after(config, 3.0):
                event = hangup(daemon, client, "reload_failed")
                on_time(canary, deadline)
        finally:
            reap(canary)
        assert event.note == (
            f"kept the old config: {config}: cannot read the config file: "
            f"it is {FOLLOWED[kind]}, not a regular file"
        )
        assert "temporary" in {policy.name for policy in client.policies().policies}
        if kind == "directory":
            shutil.rmtree(config)
        else:
            config.unlink()
        config.write_text(SECOND)
        hangup(daemon, client, "reloaded")
        assert "newcomer" in {policy.name for policy in client.policies().policies}
    assert f"it is {FOLLOWED[kind]}, not a regular file" in daemon.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a file system needs root")
def test_a_reload_waiting_on_its_disk_holds_up_no_timer_and_no_stop(
    socket_path: Path, tmp_path: Path
) -> None:
    require("fusermount3", modules=("mfusepy",), install="fuse3 (Debian) and mfusepy (PyPI)")
    with failing_disk(tmp_path / "fuse") as disk:
        config = disk.path / "watchdogd.toml"
        config.write_text(FIRST)
        daemon = RunningDaemon(socket_path, tmp_path / "log", ["--config", str(config)])
        daemon.start()
        try:
            config.write_text(SECOND)
            disk.stall()  # as a hung network file system: its reads wait
            with daemon.client() as client:
                canary, deadline = arm_canary(daemon, client, 1.0)
                try:
                    os.kill(daemon.pid, signal.SIGHUP)
                    on_time(canary, deadline)
                finally:
                    reap(canary)
                assert not events_of(client, "reloaded")
                os.kill(daemon.pid, signal.SIGHUP)  # one more reload, after the one waiting
                disk.unstall()
                wait_until(lambda: len(events_of(client, "reloaded")) == 2, what="two reloads")
                assert "newcomer" in {policy.name for policy in client.policies().policies}
            disk.stall()
            os.kill(daemon.pid, signal.SIGHUP)
            time.sleep(0.2)  # the reload is waiting on the disk
            os.kill(daemon.pid, signal.SIGTERM)
            # A stop does not wait for it. (The process ends once the disk answers:
            # the kernel flushes the file the reading thread holds as it exits.)
            wait_until(lambda: "event=stopped" in daemon.log(), what="the stop", timeout=2.0)
            assert not socket_path.exists()
            disk.unstall()
            assert daemon.process is not None
            assert daemon.process.wait(timeout=PATIENCE) == 0, daemon.log()
        finally:
            disk.unstall()
            daemon.stop(signal.SIGKILL)


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.skipif(
    not FREEZER.is_dir() or os.getuid() != 0,
    reason="needs root and the cgroup v1 freezer",
)
def test_a_target_that_survives_sigkill_is_reported_unkillable(
    configured: tuple[RunningDaemon, Path],
) -> None:
    daemon, _ = configured
    group = FREEZER / f"watchdogd-test-{os.getpid()}"
    group.mkdir()
    victim = sleeper()
    try:
        (group / "cgroup.procs").write_text(str(victim.pid))
        (group / "freezer.state").write_text("FROZEN")
        wait_until(
            lambda: (group / "freezer.state").read_text().strip() == "FROZEN",
            what="the cgroup to freeze",
        )
        with daemon.client() as client:
            client.acquire("frozen", 0.1, pid=victim.pid)
            wait_until(lambda: bool(events_of(client, "unkillable")), what="the unkillable report")
            [report] = events_of(client, "unkillable")
            [expired] = events_of(client, "expired")
        assert report.pid == victim.pid
        assert report.state.startswith("D")  # frozen tasks sleep uninterruptibly
        assert report.wchan
        assert "0.5s after SIGKILL" in report.note
        assert expired.outcome == "unkillable"
        (group / "freezer.state").write_text("THAWED")
        assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL  # the pending SIGKILL lands
    finally:
        (group / "freezer.state").write_text("THAWED")
        reap(victim)
        group.rmdir()
