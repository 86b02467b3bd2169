"""The daemon's debug level, as an operator debugging it reads it: each connection,
each refusal and why, each wake-up and what it fired, a reload's changes, every
line rate-limited per who caused it; and at the info level none of it."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd_client import Client, RequestRefused

from helpers.daemon import RunningDaemon, expired_event
from helpers.processes import reap, sleeper
from helpers.users import NOBODY, as_nobody
from helpers.waiting import PATIENCE, wait_until

CONFIG = """
[policies.term]
steps = [ { signal = "SIGTERM" }, { wait = 10 }, { signal = "SIGKILL" } ]
"""

RELOADED = """
[daemon]
max_timers_per_uid = 500

[policies.term]
steps = [ { signal = "SIGTERM" }, { wait = 3 }, { signal = "SIGKILL" } ]

[policies.quick]
steps = [ { signal = "SIGKILL" } ]
"""


def started(socket_path: Path, tmp_path: Path, level: str) -> RunningDaemon:
    config = tmp_path / "watchdogd.toml"
    config.write_text(CONFIG)
    # Nobody's requests reach it (the flood below is theirs).
    os.chmod(socket_path.parent, 0o755)
    daemon = RunningDaemon(
        socket_path, tmp_path / "log", ["--config", str(config), "--log-level", level]
    )
    daemon.start()
    return daemon


@pytest.fixture
def debugging(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    daemon = started(socket_path, tmp_path, "debug")
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def lines(daemon: RunningDaemon, event: str) -> list[str]:
    return [line for line in daemon.log().splitlines() if f" DEBUG event={event} " in line]


def test_a_refusal_says_who_asked_what_and_why(debugging: RunningDaemon) -> None:
    with debugging.client() as client, pytest.raises(RequestRefused):
        client.acquire("x", 5, policy="nope")
    [line] = lines(debugging, "refused")
    assert re.search(
        rf"event=refused op=acquire pid={os.getpid()} uid=0 code=unknown_policy "
        r"reason=\"no policy 'nope'; known: .*\"$",
        line,
    ), line
    # The connection's coming and going, for the same caller.
    assert lines(debugging, "connected")
    wait_until(lambda: lines(debugging, "disconnected"), what="the connection's end")


def test_a_wake_up_says_what_it_fired(debugging: RunningDaemon) -> None:
    victim = sleeper()
    try:
        with debugging.client() as client:
            client.acquire("hung", 0.1, pid=victim.pid)
            assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
            expired_event(client, victim.pid)
    finally:
        reap(victim)
    fired = [line for line in lines(debugging, "wakeup") if "fired=1 " in line]
    assert fired, debugging.log()
    assert re.search(rf'timers="{victim.pid}:hung \(kill, late [0-9.]+ms\)"$', fired[0])
    # One that fired nothing (at start, or for a deadline moved since) says no more.
    assert all(line.endswith("fired=0") for line in lines(debugging, "wakeup") if line not in fired)


def test_a_reload_says_what_it_changed(debugging: RunningDaemon, tmp_path: Path) -> None:
    (tmp_path / "watchdogd.toml").write_text(RELOADED)
    os.kill(debugging.pid, signal.SIGHUP)
    wait_until(lambda: lines(debugging, "reload_diff"), what="the reload's changes")
    assert "event=reload_diff changes=3" in lines(debugging, "reload_diff")[0]
    # Each change is a line of its own, after the count: read once all are out.
    wait_until(lambda: len(lines(debugging, "config_changed")) >= 3, what="each change")
    changed = [
        line.split("event=config_changed ", 1)[1] for line in lines(debugging, "config_changed")
    ]
    assert changed == [
        "key=daemon.max_timers_per_uid old=10000 new=500",
        'key=policies.quick old="(none)" new="process: SIGKILL"',
        'key=policies.term.steps old="SIGTERM, wait 10s, SIGKILL" new="SIGTERM, wait 3s, SIGKILL"',
    ]


def test_a_flood_of_refusals_is_rate_limited_and_a_root_timer_stays_on_time(
    debugging: RunningDaemon,
) -> None:
    canary = sleeper()
    try:
        with debugging.client() as client:
            client.acquire("canary", 0.5, pid=canary.pid)

            def flood(nobody: Client) -> int:
                refused = 0
                for _ in range(2000):
                    try:
                        nobody.acquire("x", 5, policy="nope")
                    except RequestRefused:
                        refused += 1
                return refused

            assert as_nobody(flood, debugging.socket_path) == {"ok": 2000}
            assert canary.wait(timeout=PATIENCE) == -signal.SIGKILL
            late = expired_event(client, canary.pid).late
        assert late is not None
        assert late < 0.1
    finally:
        reap(canary)
    theirs = [line for line in lines(debugging, "refused") if f" uid={NOBODY} " in line]
    # A burst of 20, then one a second, each flood's last saying how many it held back.
    assert 20 <= len(theirs) < 2000 // 10, len(theirs)


def test_the_info_level_has_none_of_it(socket_path: Path, tmp_path: Path) -> None:
    daemon = started(socket_path, tmp_path, "info")
    victim = sleeper()
    try:
        with daemon.client() as client:
            with pytest.raises(RequestRefused):
                client.acquire("x", 5, policy="nope")
            client.acquire("hung", 0.1, pid=victim.pid)
            assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
            expired_event(client, victim.pid)
        (tmp_path / "watchdogd.toml").write_text(RELOADED)
        os.kill(daemon.pid, signal.SIGHUP)
        wait_until(lambda: "event=reloaded" in daemon.log(), what="the reload")
    finally:
        reap(victim)
        assert daemon.stop() == 0
    assert " DEBUG " not in daemon.log()
