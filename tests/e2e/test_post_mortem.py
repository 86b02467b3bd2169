"""What happened stays known across a restart: the events and the incidents a
daemon recorded come back after it is SIGKILLed, a follower of its events goes on
at the next new event, an incident still open goes on gathering, and a record file
cut short or damaged says what it dropped."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from watchdogd.core.events import EventLog
from watchdogd.core.incidents import IncidentLog
from watchdogd.storage.journal import RECORD
from watchdogd.storage.record_file import RecordFile, record_path
from watchdogd.storage.store import default_state_path

from helpers.daemon import SHORT_RESTART, RunningDaemon, ctl, ctl_command
from helpers.jobs import gathered, incidents, start_rank
from helpers.processes import reap, sleeper
from helpers.waiting import PATIENCE, wait_until

CONFIG = """
[policies.rank]
steps = [ { dump = true, timeout = 20 }, { signal = "SIGKILL" } ]
"""


def daemon_with(config: str, socket_path: Path, tmp_path: Path) -> RunningDaemon:
    path = tmp_path / "watchdogd.toml"
    path.write_text(config)
    return RunningDaemon(socket_path, tmp_path / "watchdogd.log", ["--config", str(path)])


def written(socket_path: Path, incident: str, ranks: int) -> bool:
    """Whether the record file beside the daemon's state holds ``incident`` with
    ``ranks`` ranks that are all done: read as a restarted daemon reads it."""
    events, kept = EventLog(1000), IncidentLog("here")
    RecordFile(record_path(default_state_path(str(socket_path))), events, kept).load()
    found = [i for i in kept.everything() if i.info.id == incident]
    return bool(found) and [r.state for r in found[0].ranks] == ["done"] * ranks


class Follower:
    """``watchdogctl events --follow --json``, its lines read as they come."""

    def __init__(self, socket_path: Path) -> None:
        self.process = subprocess.Popen(
            ctl_command(socket_path, "events", "--follow", "--json"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[dict[str, object]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(json.loads(line))

    def stop(self) -> str:
        self.process.terminate()
        _, err = self.process.communicate(timeout=PATIENCE)
        self._reader.join(timeout=PATIENCE)
        return err


def test_events_and_an_incident_survive_a_kill_and_a_follower_goes_on(
    socket_path: Path, tmp_path: Path
) -> None:
    """The daemon stays down longer than it says a restart takes: the follower
    says it waits, and goes on once the daemon is back."""
    daemon = daemon_with(SHORT_RESTART + CONFIG, socket_path, tmp_path)
    daemon.start()
    ranks = [start_rank(socket_path, "train-9", 0, 120)]
    follower: Follower | None = None
    victim = sleeper()
    try:
        hung = start_rank(socket_path, "train-9", 1, 0.5)
        ranks.append(hung)
        wait_until(lambda: gathered(socket_path), what="every rank's stack", timeout=PATIENCE * 3)
        [listed] = incidents(socket_path)
        wait_until(lambda: written(socket_path, listed.id, 2), what="the incident written")
        before_events = ctl(socket_path, "events", "--json").stdout
        before_incident = ctl(socket_path, "incident", listed.id, "--json").stdout
        follower = Follower(socket_path)
        wait_until(lambda: len(follower.lines) >= 2, what="the follower's first events")
        with daemon.client() as client:
            client.ping()
            patience = max(client.reconnect_timeout, client._engine.restart)

        daemon.stop(signal.SIGKILL)
        time.sleep(patience + 1.0)
        daemon.start()
        assert ctl(socket_path, "incident", listed.id, "--json").stdout == before_incident
        after_events = ctl(socket_path, "events", "--json").stdout
        assert after_events.startswith(before_events)
        state = record_path(default_state_path(str(socket_path)))
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o600  # stacks may hold secrets

        with daemon.client() as client:
            client.acquire("after-the-restart", 0.2, pid=victim.pid)
        assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL

        watching = follower

        def seen_expiry() -> bool:
            return any(line.get("pid") == victim.pid for line in watching.lines)

        wait_until(seen_expiry, what="the follower to print the new expiry")
        numbers = [int(str(line["seq"])) for line in watching.lines]
        assert numbers == list(range(numbers[0], numbers[-1] + 1))  # no gap, no repeat
        follower = None
        told = watching.stop()
        assert "waiting for it" in told
        assert "the daemon is back" in told
    finally:
        if follower is not None:
            follower.stop()
        daemon.stop(signal.SIGKILL)
        reap(victim)
        for worker in ranks:
            reap(worker)


def test_an_incident_open_at_a_restart_goes_on_gathering(socket_path: Path, tmp_path: Path) -> None:
    """Rank 2 expires after the daemon came back, within the incident's window:
    it joins the incident rank 1 opened before the kill."""
    daemon = daemon_with(CONFIG, socket_path, tmp_path)
    daemon.start()
    ranks = [start_rank(socket_path, "train-10", 0, 120)]
    try:
        late = start_rank(socket_path, "train-10", 2, PATIENCE)
        ranks.append(late)
        hung = start_rank(socket_path, "train-10", 1, 0.5)
        ranks.append(hung)
        wait_until(lambda: gathered(socket_path), what="every rank's stack", timeout=PATIENCE * 3)
        [listed] = incidents(socket_path)
        wait_until(lambda: written(socket_path, listed.id, 3), what="the incident written")
        daemon.stop(signal.SIGKILL)
        daemon.start()
        wait_until(lambda: late.poll() is not None, what="rank 2's expiry", timeout=PATIENCE * 2)
        wait_until(lambda: gathered(socket_path), what="rank 2's stack", timeout=PATIENCE * 3)
        [again] = incidents(socket_path)
        assert again.id == listed.id
        shown = json.loads(ctl(socket_path, "incident", listed.id, "--json").stdout)
        assert sorted((r["rank"], r["role"]) for r in shown["ranks"]) == [
            (0, "peer"),
            (1, "expired"),
            (2, "expired"),
        ]
    finally:
        daemon.stop(signal.SIGKILL)
        for worker in ranks:
            reap(worker)


def test_a_number_a_follower_saw_is_never_given_to_another_event(
    socket_path: Path, tmp_path: Path
) -> None:
    """The daemon is SIGKILLed as soon as a follower has seen an event, well within
    the record file's interval between writes: the reply that showed the number
    waited for its write, so after the restart the next event gets the next
    number, and the follower, going on after the one it saw, gets it."""
    daemon = daemon_with("", socket_path, tmp_path)
    daemon.start()
    first, second = sleeper(), sleeper()
    try:
        with daemon.client() as client:
            client.acquire("first", 0.05, pid=first.pid)
            seen = client.events(after=0, wait=PATIENCE)
        daemon.stop(signal.SIGKILL)
        [event] = [e for e in seen.events if e.kind == "expired"]
        assert event.pid == first.pid
        daemon.start()
        with daemon.client() as client:
            client.acquire("second", 0.05, pid=second.pid)
            assert second.wait(timeout=PATIENCE) == -signal.SIGKILL
            after = client.events(after=seen.last, wait=PATIENCE)
            assert [e.pid for e in after.events if e.kind == "expired"] == [second.pid]
            numbers = [e.seq for e in client.events(after=0).events]
        assert numbers == sorted(set(numbers))  # none given twice
    finally:
        daemon.stop(signal.SIGKILL)
        reap(first)
        reap(second)


def record_starts(path: str) -> list[int]:
    """Where each record of the record file ``path`` starts."""
    data = Path(path).read_bytes()
    starts, offset = [], 0
    while offset < len(data):
        starts.append(offset)
        length, _ = RECORD.unpack_from(data, offset)
        offset += RECORD.size + length
    return starts


def three_expiries(daemon: RunningDaemon) -> str:
    """Three root timers expire, each in a record of its own; the record file."""
    with daemon.client() as client:
        for _ in range(3):
            victim = sleeper()
            try:
                client.acquire("brief", 0.05, pid=victim.pid)
                assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
                # A reply that shows an event's number is sent once it is written.
                wait_until(
                    lambda pid=victim.pid: any(e.pid == pid for e in client.events().events),
                    what="the expiry",
                )
            finally:
                reap(victim)
    return record_path(daemon.state_path)


def expired_pids(daemon: RunningDaemon) -> list[int]:
    with daemon.client() as client:
        return [e.pid for e in client.events(limit=1000).events if e.kind == "expired"]


@pytest.mark.parametrize("harm", ["cut", "damaged"])
def test_a_record_cut_short_or_damaged_says_what_it_dropped(
    daemon: RunningDaemon, harm: str
) -> None:
    path = three_expiries(daemon)
    pids = expired_pids(daemon)
    daemon.stop(signal.SIGKILL)
    *_, second, third = record_starts(path)
    data = bytearray(Path(path).read_bytes())
    if harm == "cut":
        Path(path).write_bytes(data[: third + 20])  # mid-frame: the last expiry's record
        kept, dropped, first = pids[:2], 20, third
    else:
        data[second + 20] ^= 0xFF  # inside the second expiry's record: its checksum fails
        Path(path).write_bytes(bytes(data))
        kept, dropped, first = [pids[0], pids[2]], third - second, second
    daemon.start()
    assert expired_pids(daemon) == kept
    shown = ctl(daemon.socket_path, "events", "--json")
    [said] = [json.loads(line) for line in shown.stdout.splitlines() if f"record_{harm}" in line]
    assert said["kind"] == f"record_{harm}"
    assert f"{dropped} bytes, the first at byte {first}" in said["note"]
    assert daemon.log().count(f"event=record_{harm} pid={daemon.pid}") == 1
