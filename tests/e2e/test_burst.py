"""Many expiries at once, in batches: every victim is signalled once, every
expiry gets its event, and the daemon keeps answering through the burst."""

from __future__ import annotations

import shutil
import signal
import socket
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd.runtime.executor import BATCH
from watchdogd_client import Client
from watchdogd_protocol import (
    Acquire,
    Acquired,
    EventInfo,
    FrameReader,
    Hello,
    ReplyMessage,
    decode_reply,
    encode_frame,
)

from helpers.daemon import RunningDaemon
from helpers.metrics import samples
from helpers.processes import reap, sleeper
from helpers.waiting import PATIENCE, wait_until

CONFIG = """
[daemon]
events = 5000

[policies.term_quick]
steps = [ { signal = "SIGTERM" }, { wait = 1.0 }, { signal = "SIGKILL" } ]
"""

#: More than two passes' worth, so that firing and settling interleave.
VICTIMS = 2 * BATCH + BATCH // 2


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    directory = Path(tempfile.mkdtemp(prefix="wd-burst-", dir="/tmp"))
    config = directory / "watchdogd.toml"
    config.write_text(CONFIG)
    running = RunningDaemon(
        directory / "watchdogd.sock", directory / "watchdogd.log", ["--config", str(config)]
    )
    running.start()
    yield running
    assert running.stop() == 0, running.log()
    shutil.rmtree(directory, ignore_errors=True)


def arm_all(socket_path: Path, requests: list[Acquire]) -> list[ReplyMessage]:
    """Send every request in one write, so their deadlines fall within the same
    few milliseconds, and read every reply."""
    frames = [encode_frame(Hello(id=0, version=1))] + [encode_frame(r) for r in requests]
    replies: list[ReplyMessage] = []
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(socket_path))
        raw.sendall(b"".join(frames))
        reader = FrameReader(1 << 20)
        while len(replies) < len(frames):
            replies += [decode_reply(frame) for frame in reader.feed(raw.recv(1 << 16))]
    return replies[1:]


def expired_events(client: Client) -> list[EventInfo]:
    events: list[EventInfo] = []
    after = 0
    while batch := client.events(after=after, limit=1000).events:
        events += [event for event in batch if event.kind == "expired"]
        after = batch[-1].seq
    return events


def test_a_burst_of_several_batches_signals_each_victim_once_and_records_each(
    daemon: RunningDaemon,
) -> None:
    victims = [sleeper() for _ in range(VICTIMS)]
    policies = {
        victim.pid: ("term_quick" if i % 3 == 0 else "kill") for i, victim in enumerate(victims)
    }
    try:
        replies = arm_all(
            daemon.socket_path,
            [
                Acquire(
                    id=i + 1,
                    scope="burst",
                    timeout=1.0,
                    pid=victim.pid,
                    policy=policies[victim.pid],
                )
                for i, victim in enumerate(victims)
            ],
        )
        assert all(isinstance(reply, Acquired) for reply in replies), replies[:3]
        with Client(daemon.socket_path) as client:
            # Through the burst and after it, the daemon answers.
            while any(victim.poll() is None for victim in victims):
                client.ping()
            for victim in victims:
                expected = (
                    -signal.SIGTERM if policies[victim.pid] == "term_quick" else -signal.SIGKILL
                )
                assert victim.wait(timeout=PATIENCE) == expected
            found: list[EventInfo] = []

            def all_recorded() -> bool:
                found[:] = expired_events(client)
                return len(found) >= VICTIMS

            wait_until(all_recorded, what="an expired event for every victim")
            metrics = client.metrics()
    finally:
        for victim in victims:
            reap(victim)
    by_pid = Counter(event.pid for event in found)
    assert set(by_pid) == set(policies)
    assert set(by_pid.values()) == {1}
    for event in found:
        assert event.outcome == "exited", event
        assert event.late is not None, event
        assert event.late >= 0, event  # never early
        assert event.command == "sleep 300", event
        if policies[event.pid] == "kill":
            assert [step.result for step in event.steps] == ["sent SIGKILL"], event
        else:
            # SIGTERM killed it at once: the wait saw it exit, or it was gone before.
            term, wait, kill = (step.result for step in event.steps)
            assert term == "sent SIGTERM", event
            assert kill == "skipped: target exited", event
            assert wait in ("exited", "skipped: target exited"), event
    kills = VICTIMS - sum(policy == "term_quick" for policy in policies.values())
    counted = {
        (labels["policy"], labels["outcome"]): value
        for labels, value in samples(metrics, "watchdogd_expiries_total")
    }
    assert counted == {("kill", "exited"): kills, ("term_quick", "exited"): VICTIMS - kills}
