"""One user's evidence is held to its budget, in memory and on disk, and never
takes the room root's timers need.

Responders of uid 65534 (real processes, on raw connections) answer every ask
with as much evidence as a frame holds, for incident after incident of their
job: the daemon keeps at most the uid's budget of it and trims the rest, counted
and said; root's incident keeps its evidence whole; the record beside the state
stays within its bound; on a 2 MiB state disk root's armings stay durable and
survive a SIGKILL; and a root canary is signalled on time throughout.
``WATCHDOGD_SOAK=1`` runs them at the sizes the attack was first seen at (120
responders, 25 incidents) on the default budgets. Needs root (other uids, a
tmpfs)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd.core.evidence_budget import EVIDENCE_BYTES_PER_UID
from watchdogd.core.kept_evidence import stack_text
from watchdogd.storage.record_file import RECORD_BYTES, record_path
from watchdogd_client import Client
from watchdogd_protocol import Evidence

from helpers.canaries import Canary
from helpers.daemon import RunningDaemon, configured_daemon
from helpers.disks import Raw, tmpfs
from helpers.evidence_flood import evidence_flood, threads
from helpers.processes import at_units_priority_all, reap, rss_mib
from helpers.users import NOBODY

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: other uids, a tmpfs")

SOAK = os.environ.get("WATCHDOGD_SOAK", "") == "1"
MIB = 1024 * 1024
#: The flood's responders and incidents: at full size under soak.
RESPONDERS, ROUNDS = (120, 25) if SOAK else (40, 12)
#: The budgets: the defaults under soak; scaled down with the flood otherwise.
BUDGET = EVIDENCE_BYTES_PER_UID if SOAK else 2 * MIB
RECORD = RECORD_BYTES if SOAK else 8 * MIB
#: How far a round's expiries are apart: past the incident's window, so each is
#: an incident of its own.
WINDOW, PAUSE = 0.3, 0.6
CONFIG = f"""
[daemon]
incident_window = {WINDOW}
incident_bytes_per_uid = {BUDGET}
record_bytes = {RECORD}
"""
#: What the daemon's memory may grow by beyond the budget: the flood's asks and
#: answers in flight, the record's writes, the allocator's slack; without the
#: budget it keeps all the flood gives, far more (docs/benchmarks.md).
MARGIN = (40 if SOAK else 24) * MIB
#: How many times root re-arms its timer of a round: some 10 KiB of journal.
KICKS = 100
#: How late a root canary may be signalled.
ON_TIME = 0.1
#: What one answer of the flood is, as an incident keeps it.
GIVEN = len(stack_text(Evidence(id=1, ask=1, threads=threads())).encode())


def metric(client: Client, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", client.metrics(), re.MULTILINE)
    assert found is not None, name
    return float(found[1])


def roots_incident(client: Client) -> list[int]:
    """The stack sizes of root's incident of the flood's job."""
    [listed] = [i for i in client.incidents() if i.uid == 0]
    return [len(r.stack.encode()) for r in client.incident(listed.id).ranks if r.role == "peer"]


def test_one_users_evidence_stays_within_its_budget_in_memory_and_in_the_record(
    socket_path: Path, tmp_path: Path
) -> None:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as daemon:
        at_units_priority_all(daemon.pid)  # as deployed, as the canary is timed
        record = Path(record_path(daemon.state_path))
        with daemon.client() as client:
            with evidence_flood(socket_path, 4, 1, PAUSE, uid=0) as roots:
                roots.run()
            assert roots_incident(client) == [GIVEN] * 4
            before = rss_mib(daemon.pid) * MIB
            largest_file = peak = 0.0
            with evidence_flood(socket_path, RESPONDERS, ROUNDS, PAUSE) as flood:
                flood.start()
                for index in range(ROUNDS):
                    canary = Canary(client, 1.0) if index == ROUNDS // 2 else None
                    flood.wait_round()
                    peak = max(peak, rss_mib(daemon.pid) * MIB)
                    largest_file = max(largest_file, record.stat().st_size)
                    if canary is not None:
                        late = canary.lateness()
                        canary.close()
            peak = max(peak, rss_mib(daemon.pid) * MIB)
            trimmed = metric(client, "watchdogd_evidence_trimmed_bytes_total")
            kept = [i for i in client.incidents(limit=1000) if i.uid == NOBODY]
            roots_after = roots_incident(client)
    given = RESPONDERS * ROUNDS * GIVEN
    assert late < ON_TIME, f"the canary was signalled {late * 1000:.0f} ms late"
    assert peak - before < BUDGET + MARGIN, f"grew {(peak - before) / MIB:.0f} MiB"
    assert largest_file <= RECORD
    # What the uid gave past its budget was trimmed, and counted: in all, and on
    # each incident that lost some; no incident of its was lost whole while its
    # stacks could still be cut.
    assert trimmed >= given - BUDGET
    assert sum(i.trimmed for i in kept) > 0
    assert "event=evidence_trimmed uid=65534" in daemon.log()
    assert "uid=0" not in "".join(re.findall(r"event=evidence_trimmed uid=\d+", daemon.log()))
    assert roots_after == [GIVEN] * 4  # root's evidence, untouched


@contextlib.contextmanager
def daemon_on_small_disk(socket_path: Path, tmp_path: Path) -> Iterator[tuple[Path, RunningDaemon]]:
    """A daemon whose state is on a 2 MiB tmpfs, its socket open to uid 65534."""
    os.chmod(socket_path.parent, 0o755)
    config = tmp_path / "watchdogd.toml"
    config.write_text(CONFIG.replace(f"record_bytes = {RECORD}\n", ""))
    with tmpfs(size="2m", inodes=256) as disk:
        args = ["--state", str(disk / "state.db"), "--config", str(config)]
        daemon = RunningDaemon(socket_path, tmp_path / "watchdogd.log", args)
        daemon.start()
        at_units_priority_all(daemon.pid)  # as deployed, as the canary is timed
        try:
            yield disk, daemon
        finally:
            daemon.stop(signal.SIGKILL)


def test_another_users_evidence_never_costs_roots_timers_their_room_on_a_2_mib_disk(
    socket_path: Path, tmp_path: Path
) -> None:
    """The flood gives many times the evidence the disk holds: the record leaves
    the state its room, cut to fit and saying so; every arming of root's is
    durable, and a SIGKILL loses none of them."""
    workers = [subprocess.Popen(["sleep", "600"]) for _ in range(ROUNDS + 1)]
    try:
        with daemon_on_small_disk(socket_path, tmp_path) as (disk, daemon):
            raw = Raw(socket_path)
            armed = ["before"]
            assert raw.acquire("before", 600, workers[0].pid).durable
            with evidence_flood(socket_path, RESPONDERS, ROUNDS, PAUSE) as flood, daemon.client(
            ) as client:  # fmt: skip
                flood.start()
                for index in range(ROUNDS):
                    canary = Canary(client, 1.0) if index == ROUNDS // 2 else None
                    flood.wait_round()
                    armed.append(f"during-{index}")
                    # Root's workers re-arm their timers as they go: changes that
                    # take the journal past the page it was in.
                    durable = all(
                        raw.acquire(armed[-1], 600 + kick, workers[index + 1].pid).durable
                        for kick in range(KICKS)
                    )
                    assert durable, f"round {index}: {daemon.log()[-2000:]}"
                    if canary is not None:
                        late = canary.lateness()
                        canary.close()
                left_off = metric(client, "watchdogd_record_left_off_bytes")
            raw.close()
            log = daemon.log()
            assert "event=state_degraded" not in log
            assert "event=record_trimmed" in log
            assert left_off > 0
            room = os.statvfs(disk)
            assert room.f_bavail * room.f_frsize >= 256 * 1024  # the state's room, kept
            assert late < ON_TIME, f"the canary was signalled {late * 1000:.0f} ms late"
            daemon.stop(signal.SIGKILL)
            daemon.start()
            with daemon.client() as client:
                kept = {t.scope for t in client.status().timers if t.uid == 0}
            assert set(armed) <= kept
    finally:
        for worker in workers:
            reap(worker)


def test_a_flood_that_ran_before_is_read_back_within_the_budget(
    socket_path: Path, tmp_path: Path
) -> None:
    """A record written before the budget was lowered holds more than the uid may
    keep now: the restarted daemon trims what it reads back, as it trims what
    comes."""
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as daemon:
        with evidence_flood(socket_path, 24, 2, PAUSE) as flood:
            flood.run()
        with daemon.client() as client:
            held = sum(len(r.stack.encode()) for i in client.incidents() for r in
                       client.incident(i.id).ranks)  # fmt: skip
    assert held > MIB
    lowered = tmp_path / "watchdogd.toml"
    lowered.write_text(
        CONFIG.replace(f"incident_bytes_per_uid = {BUDGET}", f"incident_bytes_per_uid = {MIB}")
    )
    daemon = RunningDaemon(socket_path, tmp_path / "log", ["--config", str(lowered)])
    daemon.start()
    try:
        with daemon.client() as client:
            kept = sum(len(r.stack.encode()) for i in client.incidents() for r in
                       client.incident(i.id).ranks)  # fmt: skip
        assert kept <= MIB
    finally:
        daemon.stop()
