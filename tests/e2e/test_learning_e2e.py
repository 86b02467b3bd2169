"""Smarter hang detection through a real daemon and real workers: progress that a
renewing thread can't fake, timeouts learned from releases and kept across a
restart, and `watchdogctl why`."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from helpers.daemon import configured_daemon, ctl, expired_event
from helpers.processes import python_worker, reap, wait_ready

STALL = 1.0
CONFIG = f"""
[policies.stalling]
stall = {STALL}
steps = [ {{ signal = "SIGKILL" }} ]

[history]
min_samples = 20
"""

#: A training loop whose steps advance a counter, and a side thread that renews
#: the timer every 0.1 s with that counter, as a heartbeat would; after
#: ``steps`` steps the loop hangs (and says when), the heartbeat goes on. Each line
#: is one write(2), so the two threads' lines never mix.
HEARTBEAT_WORKER = """
    import os, sys, threading, time
    from watchdogd_client import expires
    steps = int(sys.argv[1])
    done = 0

    def say(line):
        os.write(1, (line + "\\n").encode())

    with expires(after=60, scope="train", policy="stalling") as timer:
        say("ready")

        def heartbeat():
            while True:
                timer.renew(progress=done)
                say("renewed")
                time.sleep(0.1)

        threading.Thread(target=heartbeat, daemon=True).start()
        for done in range(1, steps + 1):
            time.sleep(0.05)
        say(f"stuck {time.time()!r}")
        time.sleep(60)
"""


def test_a_renewing_thread_cannot_keep_a_stuck_loop_alive(
    socket_path: Path, tmp_path: Path
) -> None:
    with configured_daemon(socket_path, tmp_path, CONFIG) as daemon, daemon.client() as client:
        worker = python_worker(HEARTBEAT_WORKER, "10", socket=socket_path)
        try:
            wait_ready(worker)
            assert worker.stdout is not None
            lines = []
            while not (line := worker.stdout.readline()).startswith("stuck"):
                lines.append(line)
            stuck = float(line.split()[1])
            # A renewal that read the counter before its last step may still
            # land after "stuck"; the one that starts after it has printed
            # "renewed" reads 10.
            renewed_after = 0
            while renewed_after < 2:
                renewed_after += worker.stdout.readline().startswith("renewed")
            why = ctl(socket_path, "why", str(worker.pid))
            assert why.returncode == 0, why.stderr
            assert "timer train (policy stalling)" in why.stdout
            assert "progress at 10" in why.stdout
            assert "allows 1.00s without growth" in why.stdout
            assert worker.wait(timeout=10) == -signal.SIGKILL
            renewals_after = renewed_after + worker.stdout.read().count("renewed")
            event = expired_event(client, worker.pid)
        finally:
            reap(worker)
    # The heartbeat went on renewing after the loop stuck; the kill came `stall`
    # seconds after the last growth (seen at most one heartbeat after the last
    # step), not at the 60 s timeout.
    assert renewals_after >= 5
    assert event.reason == "stalled"
    assert event.timeout == 60.0
    assert "stalled: re-armed with its progress at 10 for 1 s" in event.note
    assert event.deadline is not None
    assert STALL - 0.05 <= event.deadline - stuck <= STALL + 0.5


#: Ten workers, each holding the scope ``step`` five times for about 0.2 s: 50
#: releases of one (uid, executable, scope).
STEPPER = """
    import time
    from watchdogd_client import expires
    for _ in range(5):
        with expires(after="auto", ceiling=30, scope="step"):
            time.sleep(0.2)
    print("ready", flush=True)
"""


def suggestion(socket_path: Path) -> dict[str, object]:
    shown = ctl(socket_path, "--json", "suggest")
    assert shown.returncode == 0, shown.stderr
    [row] = [row for row in json.loads(shown.stdout) if row["scope"] == "step"]
    assert isinstance(row, dict)
    return row


def test_auto_arms_what_suggest_prints_and_it_survives_a_restart(
    socket_path: Path, tmp_path: Path
) -> None:
    with configured_daemon(socket_path, tmp_path, CONFIG) as daemon, daemon.client() as client:
        workers = [python_worker(STEPPER, socket=socket_path) for _ in range(10)]
        try:
            for worker in workers:
                wait_ready(worker)
                assert worker.wait(timeout=30) == 0
        finally:
            for worker in workers:
                reap(worker)
        row = suggestion(socket_path)
        assert row["count"] == 50
        # Blocks of 0.2 s sleeps: longer on a loaded machine, never shorter.
        assert 0.2 <= float(row["p99"]) <= 1.0  # type: ignore[arg-type]
        suggested = row["suggested"]
        assert isinstance(suggested, float)
        assert 2 * float(row["p99"]) <= suggested <= 2 * float(row["p99"]) * 1.01  # type: ignore[arg-type]
        table = ctl(socket_path, "suggest")
        assert table.returncode == 0
        assert "step" in table.stdout
        assert "SUGGESTED" in table.stdout

        # A worker of the same executable now arms about what suggest printed; it
        # hangs past it, and its expiry (policy log: recorded, nothing sent) says
        # which timeout was in force and where it came from.
        probe = python_worker(
            """
            from watchdogd_client import Client
            with Client() as client:
                print(client.acquire("step", "auto", ceiling=30, policy="log"), flush=True)
                print("ready", flush=True)
                input()
            """,
            socket=socket_path,
        )
        try:
            assert probe.stdout is not None
            remaining = float(probe.stdout.readline())
            wait_ready(probe)
            assert remaining == pytest.approx(suggested, abs=0.05)
            event = expired_event(client, probe.pid)
            why = client.why(probe.pid)
        finally:
            reap(probe)
        assert event.timeout == pytest.approx(suggested)
        assert event.timeout_from.startswith(f"learned: {suggested:g} s suggested by 50")
        assert event.reason == "timeout"
        assert why.events == [event]
        daemon.stop()
        daemon.start()
        assert suggestion(socket_path) == row
