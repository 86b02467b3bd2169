"""Starvation judged by a real daemon on real victims in cgroups of their own: one
starved of its CPU by a hog is given its grace, one hung in a sleep is killed on
time, and one that spins beyond its CPU (its own pressure) is not spared.

Each victim is pinned to one CPU and put in a fresh cgroup v2 before it arms its
timer. These tests hold on a host busy with other work too (CI runs the suite
beside ``stress-ng --cpu 2``): a hung victim's cgroup stays quiet whatever the
host's pressure, and a spinning one has the CPU it waits for."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd_client import Client
from watchdogd_protocol import EventInfo

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.processes import reap, wait_ready
from helpers.waiting import wait_until

TIMEOUT = 1.5
GRACE = 1.5
CONFIG = f"""
[policies.patient]
steps = [ {{ signal = "SIGKILL" }} ]
starvation_grace = {GRACE}
"""
#: A victim: joins the cgroup ``argv[1]`` and CPU ``argv[2]``, says "ready", waits
#: for a line, arms its timer and then, by ``argv[3]``: works at nice 19, sleeps,
#: or spins in three threads (hashing releases the GIL) on its one CPU.
VICTIM = f"""
import hashlib, os, sys, threading, time
from watchdogd_client import Client
cgroup, cpu, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
    procs.write(str(os.getpid()))
os.sched_setaffinity(0, {{cpu}})
client = Client()
client.ping()
print("ready", flush=True)
sys.stdin.readline()
if mode == "work":
    os.nice(19)
client.acquire("victim", {TIMEOUT}, policy="patient")
print("armed", flush=True)
if mode == "work":
    while True:
        sum(range(1000))
elif mode == "sleep":
    time.sleep(60)
else:
    data = b"x" * (1 << 20)
    def spin():
        while True:
            hashlib.sha256(data).digest()
    for _ in range(3):
        threading.Thread(target=spin, daemon=True).start()
    threading.Event().wait()
"""
#: A CPU hog at nice 0 on CPU ``argv[1]``.
HOG = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
while True:
    pass
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    directory = Path(tempfile.mkdtemp(prefix="wd-starve-", dir="/tmp"))
    with configured_daemon(directory / "watchdogd.sock", directory, CONFIG) as running:
        yield running
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def client(daemon: RunningDaemon) -> Iterator[Client]:
    with daemon.client() as connected:
        yield connected


#: The CPU the victims (and the hog) are pinned to.
CPU = max(os.sched_getaffinity(0))


def start(source: str, *args: str, socket: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", source, *args],
        env={**os.environ, "WATCHDOGD_SOCKET": str(socket)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_ready(process)
    return process


def victimize(
    daemon: RunningDaemon, cgroup: Path, mode: str, *, hog: bool = False
) -> tuple[int, int, list[EventInfo]]:
    """Run a victim in ``mode`` (beside a hog on its CPU, if ``hog``) until its
    timer expired; returns its pid, how it ended, and the events of its pid."""
    processes = []
    try:
        victim = start(VICTIM, str(cgroup), str(CPU), mode, socket=daemon.socket_path)
        processes.append(victim)
        if hog:
            processes.append(start(HOG, str(CPU), socket=daemon.socket_path))
        assert victim.stdin is not None
        assert victim.stdout is not None
        victim.stdin.write("go\n")
        victim.stdin.flush()
        assert victim.stdout.readline().strip() == "armed"
        status = victim.wait(timeout=TIMEOUT + GRACE + 10)
    finally:
        for process in processes:
            reap(process)
    with daemon.client() as client:
        expired: list[EventInfo] = []

        def recorded() -> bool:
            expired[:] = [e for e in client.events(limit=1000).events if e.pid == victim.pid]
            return any(e.kind == "expired" for e in expired)

        wait_until(recorded, what=f"the expiry of pid {victim.pid}")
    return victim.pid, status, expired


def the(kind: str, events: list[EventInfo]) -> EventInfo:
    [event] = [event for event in events if event.kind == kind]
    return event


def armed_for(event: EventInfo) -> float:
    assert event.deadline is not None
    assert event.armed_at is not None
    return event.deadline - event.armed_at


def test_a_victim_starved_by_a_hog_gets_its_grace(
    daemon: RunningDaemon, cgroup: Path, client: Client
) -> None:
    pid, status, events = victimize(daemon, cgroup, "work", hog=True)
    assert status == -signal.SIGKILL
    extended, expired = the("extended", events), the("expired", events)
    name = "/" + cgroup.name
    # The period runs from the sample taken at arming to the one taken at the
    # deadline, which a busy machine can delay by some milliseconds: the note
    # says what was measured.
    period = re.match(r"starved: over the (\d+\.\d\d)s it was armed", extended.note)
    assert period is not None, extended.note
    assert TIMEOUT - 0.1 < float(period[1]) < TIMEOUT + 0.5
    assert f"its cgroup {name} waited for cpu" in extended.note
    assert extended.note.endswith(f"given {GRACE:g}s more, once")
    assert "watchdogd_extensions_total" in client.metrics()
    # Still hogged after its grace: killed then, and its expiry says so.
    assert armed_for(expired) >= TIMEOUT + GRACE
    assert f"it had been given {GRACE:g}s more as starved" in expired.note
    assert expired.outcome == "exited"
    assert pid == extended.pid


def killed_on_time(daemon: RunningDaemon, cgroup: Path, mode: str) -> EventInfo:
    """Run a victim in ``mode``, which must be killed at its deadline with no
    extension; returns its expiry's event."""
    _, status, events = victimize(daemon, cgroup, mode)
    assert status == -signal.SIGKILL
    assert [event.kind for event in events] == ["expired"]
    assert armed_for(events[0]) == pytest.approx(TIMEOUT, abs=1e-3)
    return events[0]


def test_a_victim_hung_in_a_sleep_is_killed_on_time(daemon: RunningDaemon, cgroup: Path) -> None:
    expired = killed_on_time(daemon, cgroup, "sleep")
    assert expired.note.startswith("not starved: ")
    assert "under starvation_pressure 50%" in expired.note


def test_a_victim_that_causes_its_own_pressure_is_not_spared(
    daemon: RunningDaemon, cgroup: Path
) -> None:
    expired = killed_on_time(daemon, cgroup, "spin")
    assert expired.note.endswith("over starvation_cpu 25%: it had the CPU and used it")
    # It did wait, for the CPU its own threads held.
    waited = re.search(r"waited for cpu (\d+)%", expired.note)
    assert waited is not None
    assert int(waited.group(1)) >= 50
