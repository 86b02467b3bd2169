"""Jobs that span hosts, against a real etcd: three daemons on this machine stand in
for three hosts (their own sockets, states and host names). A job of six ranks, two
per host: rank 3 hangs, and every host shows one incident with six stacks; a frozen
daemon is a lost host; etcd killed leaves local expiries on time and the fleet heals
when it is back."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from watchdogd.fleet.records import MAX_RANKS_BYTES, encode_ranks
from watchdogd_protocol import IncidentInfo, RankInfo

from helpers.daemon import RunningDaemon, configured_daemon, ctl, expired_event
from helpers.etcd import EtcdServer, registered
from helpers.jobs import incidents, start_rank, whole
from helpers.processes import reap
from helpers.waiting import PATIENCE, wait_until

HOSTS = ("host-a", "host-b", "host-c")
LEASE = 2

CONFIG = """
[daemon]
incident_window = 30

[policies.rank]
steps = [ {{ dump = true, timeout = 20 }}, {{ signal = "SIGKILL" }} ]

[fleet]
etcd = ["{etcd}"]
host = "{host}"
prefix = "/watchdogd-test"
lease = {lease}
"""


@contextlib.contextmanager
def fleet_of_three(etcd: EtcdServer, root: Path) -> Iterator[list[RunningDaemon]]:
    daemons = []
    try:
        for host in HOSTS:
            directory = Path(root) / host
            directory.mkdir()
            config = directory / "watchdogd.toml"
            config.write_text(CONFIG.format(etcd=etcd.url, host=host, lease=LEASE))
            daemon = RunningDaemon(
                directory / "watchdogd.sock", directory / "log", ["--config", str(config)]
            )
            daemon.start()
            daemons.append(daemon)
        for daemon in daemons:
            wait_until(lambda d=daemon: fleet_state(d) == "connected", what="the fleet")
        yield daemons
    finally:
        for daemon in daemons:
            with contextlib.suppress(ProcessLookupError):
                daemon.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            daemon.stop()


def fleet_state(daemon: RunningDaemon) -> str:
    with daemon.client() as client:
        return client.status().daemon.fleet


def six_stacks(daemon: RunningDaemon) -> IncidentInfo | None:
    listed = incidents(daemon.socket_path)
    if len(listed) != 1:
        return None
    incident = whole(daemon.socket_path, listed[0].id)
    if len(incident.ranks) == 6 and all(rank.state == "done" for rank in incident.ranks):
        return incident
    return None


def test_a_hung_rank_gives_every_host_the_stacks_of_all_six(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    with fleet_of_three(own_etcd, tmp_path) as daemons:
        ranks = []
        try:
            for number in (0, 1, 2, 4, 5):
                ranks.append(start_rank(daemons[number // 2].socket_path, "run-6", number, 120))
            # Every host has registered the job before rank 3 hangs.
            wait_until(
                lambda: all(
                    ("root", "run-6") in [tuple(j) for j in registered(own_etcd, host)]
                    for host in HOSTS
                ),
                what="every host's jobs in etcd",
            )
            hung = start_rank(daemons[1].socket_path, "run-6", 3, 0.5)
            ranks.append(hung)
            deadline = time.time() + 0.5
            found: dict[str, IncidentInfo] = {}

            def everywhere() -> bool:
                for daemon, host in zip(daemons, HOSTS, strict=True):
                    if host not in found and (incident := six_stacks(daemon)) is not None:
                        found[host] = incident
                return len(found) == 3

            wait_until(everywhere, what="six stacks on every host", timeout=PATIENCE * 3)
            gathered = time.time() - deadline
        finally:
            for worker in ranks:
                reap(worker)
    ids = {incident.id for incident in found.values()}
    assert len(ids) == 1
    incident = found["host-a"]
    assert (incident.job, incident.rank, incident.host, incident.reason) == (
        "run-6",
        3,
        "host-b",
        "timeout",
    )
    for view in found.values():
        assert sorted((rank.host, rank.rank, rank.role) for rank in view.ranks) == [
            ("host-a", 0, "peer"),
            ("host-a", 1, "peer"),
            ("host-b", 2, "peer"),
            ("host-b", 3, "expired"),
            ("host-c", 4, "peer"),
            ("host-c", 5, "peer"),
        ]
        for rank in view.ranks:
            assert rank.frame.startswith(f"waiting_in_rank_{rank.rank} ("), rank.stack
    print(f"six stacks on every host {gathered:.2f} s after the deadline")


def test_a_frozen_daemon_is_a_lost_host(own_etcd: EtcdServer, tmp_path: Path) -> None:
    with fleet_of_three(own_etcd, tmp_path) as daemons:
        ranks = [
            start_rank(daemon.socket_path, "run-lost", index, 120)
            for index, daemon in enumerate(daemons)
        ]
        try:
            wait_until(
                lambda: all(registered(own_etcd, host) for host in HOSTS),
                what="every host's jobs in etcd",
            )
            frozen = daemons[2]
            assert frozen.process is not None
            frozen.process.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            for daemon in daemons[:2]:
                wait_until(
                    lambda d=daemon: any(i.kind == "host_lost" for i in incidents(d.socket_path)),
                    what="host_lost",
                    timeout=LEASE + 2 + PATIENCE,
                )
            took = time.monotonic() - stopped
            frozen.process.send_signal(signal.SIGCONT)
            [lost] = incidents(daemons[0].socket_path)
            assert (lost.kind, lost.job) == ("host_lost", "run-lost")
            assert "host-c" in lost.reason
            print(f"host_lost on both other hosts {took:.2f} s after the freeze")
            # A clean stop is no lost host.
            daemons[1].stop()
            time.sleep(LEASE + 1)
            assert len(incidents(daemons[0].socket_path)) == 1
        finally:
            for worker in ranks:
                reap(worker)


def test_without_etcd_expiries_stay_on_time_and_the_fleet_heals(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    with fleet_of_three(own_etcd, tmp_path) as daemons:
        own_etcd.kill()
        wait_until(
            lambda: all(fleet_state(d).startswith("disconnected") for d in daemons),
            what="the fleet seen down",
        )
        with daemons[0].client() as client:
            victim = subprocess.Popen(["sleep", "300"])
            try:
                client.acquire("alone", 0.2, pid=victim.pid, job="run-alone")
                assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
                event = expired_event(client, victim.pid)
                assert event.late is not None
                assert event.late < 0.05
                kinds = [e.kind for e in client.events(limit=100).events]
                assert "fleet_degraded" in kinds
            finally:
                reap(victim)
        own_etcd.start()
        for daemon in daemons:
            wait_until(lambda d=daemon: fleet_state(d) == "connected", what="the fleet healed")
        wait_until(
            lambda: all(registered(own_etcd, host) is not None for host in HOSTS),
            what="registration again",
        )
        with daemons[0].client() as client:
            assert "fleet_restored" in [e.kind for e in client.events(limit=100).events]
            text = client.metrics()
        assert "watchdogd_fleet_connected 1.0" in text
        status = ctl(daemons[0].socket_path, "status")
        assert "fleet connected" in status.stdout


def test_a_fleet_that_cannot_be_joined_leaves_the_host_protected(
    socket_path: Path, tmp_path: Path
) -> None:
    """A TLS file the daemon cannot read: it starts, says why it is not in the
    fleet, and its timers fire as ever."""
    config = CONFIG.format(etcd="https://127.0.0.1:1", host="alone", lease=LEASE)
    config += 'ca = "/nonexistent/ca.pem"\n'
    with configured_daemon(socket_path, tmp_path, config) as daemon:
        state = fleet_state(daemon)
        assert state.startswith("disconnected: not joined: "), state
        with daemon.client() as client:
            victim = subprocess.Popen(["sleep", "300"])
            try:
                client.acquire("alone", 0.1, pid=victim.pid, job="a/job/with/slashes")
                assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
            finally:
                reap(victim)


def test_a_hosts_ranks_are_cut_to_fit_one_etcd_value() -> None:
    ranks = [
        RankInfo(host="a", pid=pid, uid=0, role="peer", scope="s", stack="x" * 600_000)
        for pid in range(8)
    ]
    cut = encode_ranks([(rank, "") for rank in ranks], MAX_RANKS_BYTES)
    assert len(cut) <= MAX_RANKS_BYTES
    assert all(rank["stack"] for rank in msgspec.json.decode(cut))
    whole = encode_ranks([(ranks[0], "")], MAX_RANKS_BYTES * 2)
    assert msgspec.json.decode(whole)[0]["stack"] == ranks[0].stack
