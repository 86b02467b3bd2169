"""SIGHUP reloads, and a target that survives SIGKILL (a frozen cgroup)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd_client import Client, ErrorCode, RequestRefused
from watchdogd_client.protocol import EventInfo

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.processes import reap, sleeper
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
