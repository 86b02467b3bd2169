"""Attacks on a fleet, end to end: two real daemons stand in for two hosts of one real
etcd (tests/helpers/etcd.py, no TLS), an etcd writer forges keys through etcd's own
API (`EtcdClient`), and hostile local users are real uids (65534, and 1001-1003,
which have no passwd entry on this machine).

Through every attack each daemon keeps running and answering, its root canaries (a
root timer on a real ``sleep`` child) die within `ON_TIME` of their deadline, the
fleet's task meets no error it did not expect (``watchdogd_fleet_unexpected_errors``
stays 0), and afterwards a fresh incident of root's job reaches both hosts. What
each attack must not achieve is asserted beside it: a forged key is rejected whole
and counted, huge keys swell no daemon, one user's many jobs or incidents spend
only that user's share, a daemon that cannot read its watch does not say it is
connected, identity crosses hosts by user name, and a stack reaches only the users
ptrace would let read it. (The lateness figures are bench/fleet_attack.py's.)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import msgspec
import pytest
import trio

from watchdogd.cli.watchdogctl import main as ctl_main
from watchdogd.core.config import parse_config
from watchdogd.errors import ConfigError
from watchdogd.fleet.etcd import EtcdClient
from watchdogd.fleet.member import MAX_JOBS_PER_UID, head_ttl
from watchdogd.fleet.publish import PUBLISH_BURST, PUBLISH_RATE
from watchdogd.fleet.records import MAX_HOST_BYTES
from watchdogd_client import Client
from watchdogd_protocol import EventInfo, IncidentInfo

from helpers.daemon import RunningDaemon, ctl_command
from helpers.etcd import EtcdServer, running_etcd
from helpers.metrics import sample
from helpers.processes import reap, sleeper
from helpers.users import NOBODY
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as other uids")

_T = TypeVar("_T")

#: How late a root canary may die: generous, for a busy machine (what it takes is
#: measured by bench/fleet_attack.py); a fleet task that stalled the loop would
#: leave it seconds late, one that stopped the daemon would leave it alive.
ON_TIME = 1.0
#: A uid with no passwd entry here, as a Kubernetes pod's often has none.
NAMELESS = 1003
#: Users that exist only in the passwd files the namespaced daemons see.
ALICE_H1, ALICE_H2, BOB_H2 = 1001, 1002, 1001
#: What etcd takes in one request here: above its default of 1.5 MiB, so that one
#: key can be over the daemons' own bound on a watch message (4 MiB).
ETCD_REQUEST_BYTES = 8 * 1024 * 1024
HOSTS = ("h1", "h2")
#: Seconds an incident stays open to more expiries of its job.
WINDOW = 10.0

CONFIG = """
[daemon]
incident_window = {window}

[policies.rank]
steps = [ {{ dump = true, timeout = 20 }}, {{ signal = "SIGKILL" }} ]

# A job whose peers take a second to dump: how many dumps run at once shows.
[policies.slow_peers]
peers = "slow_dump"

[policies.slow_dump]
steps = [ {{ dump = ["sleep", "1"], timeout = 20 }} ]

[fleet]
etcd = ["{etcd}"]
host = "{host}"
prefix = "{prefix}"
lease = 5
"""


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module (each test keeps to a prefix of its own), taking
    requests up to `ETCD_REQUEST_BYTES` (etcd reads its flags from ETCD_*)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ETCD_MAX_REQUEST_BYTES", str(ETCD_REQUEST_BYTES))
        with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
            yield server


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    return f"/attacks/{request.node.name}"


@dataclass
class Fleet:
    etcd: EtcdServer
    prefix: str
    hosts: list[RunningDaemon]

    def key(self, *parts: str) -> str:
        """A key of the fleet's layout, each part quoted as the daemons quote it."""
        return "/".join((self.prefix, *(quote(part, safe="") for part in parts)))


@contextlib.contextmanager
def two_hosts(
    etcd: EtcdServer, prefix: str, logs: Path, *, passwd: tuple[Path, Path] | None = None
) -> Iterator[Fleet]:
    """Daemons ``h1`` and ``h2`` on ``etcd`` under ``prefix``, their sockets where
    every uid can reach them; with ``passwd``, each in a mount namespace of its own
    where that file is /etc/passwd. Each must exit 0 at the end: a daemon that an
    attack killed fails the test here too."""
    directory = Path(tempfile.mkdtemp(prefix="wd-attack-", dir="/tmp"))
    directory.chmod(0o755)
    daemons: list[RunningDaemon] = []
    try:
        for index, host in enumerate(HOSTS):
            config = logs / f"{host}.toml"
            config.write_text(CONFIG.format(etcd=etcd.url, host=host, prefix=prefix, window=WINDOW))
            socket_path = directory / f"{host}.sock"
            command = None
            if passwd is not None:
                # unshare(1) execs in the same process: the daemon's pid is this one's.
                command = [
                    "unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/passwd && exec "$@"',
                    str(passwd[index]), sys.executable, "-m", "watchdogd",
                    "--socket", str(socket_path),
                ]  # fmt: skip
            daemon = RunningDaemon(
                socket_path, logs / f"{host}.log", ["--config", str(config)], command=command
            )
            daemon.start()
            daemons.append(daemon)
        for daemon in daemons:
            wait_until(lambda d=daemon: fleet_state(d) == "connected", what="the fleet")
        yield Fleet(etcd, prefix, daemons)
    finally:
        statuses = [(daemon, daemon.stop()) for daemon in daemons]
        shutil.rmtree(directory, ignore_errors=True)
    for daemon, status in statuses:
        assert status == 0, f"watchdogd exited {status}:\n{daemon.log()[-4000:]}"


def fleet_state(daemon: RunningDaemon) -> str:
    with daemon.client() as client:
        return client.status_page(limit=1).daemon.fleet


def restart(daemon: RunningDaemon) -> None:
    """Stop ``daemon`` cleanly and start it again, as systemd would."""
    assert daemon.stop() == 0, daemon.log()[-4000:]
    daemon.start()


# What an etcd writer does.


def etcd_call(etcd: EtcdServer, call: Callable[[EtcdClient], Awaitable[_T]]) -> _T:
    async def run() -> _T:
        async with EtcdClient([etcd.url], timeout=30) as client:
            return await call(client)

    return trio.run(run)


def forge(etcd: EtcdServer, puts: dict[str | bytes, bytes], deletes: tuple[str, ...] = ()) -> None:
    async def write(client: EtcdClient) -> None:
        for key, value in puts.items():
            await client.put(key, value)
        for key in deletes:
            await client.delete(key)

    etcd_call(etcd, write)


def head(
    incident: str, *, user: str = "root", job: str = "train", when: float | None = None
) -> bytes:
    """An incident's head as a host would put it, with what the attacker chose."""
    return json.dumps(
        {"id": incident, "job": job, "user": user, "uid": 0, "host": "x", "scope": "s",
         "reason": "timeout", "time": time.time() if when is None else when}
    ).encode()  # fmt: skip


def heads_in_etcd(fleet: Fleet) -> list[tuple[dict[str, object], int]]:
    """Every incident's head in etcd, with the lease it is put under."""
    found = etcd_call(fleet.etcd, lambda client: client.range(fleet.key("incidents", "")))
    return [(json.loads(kv.value), kv.lease) for kv in found.kvs]


def granted_ttl(etcd: EtcdServer, lease: int) -> int:
    """The seconds ``lease`` was granted, as etcd's gateway tells them."""
    request = urllib.request.Request(
        f"{etcd.url}/v3/lease/timetolive", data=json.dumps({"ID": str(lease)}).encode()
    )
    with urllib.request.urlopen(request, timeout=PATIENCE) as reply:
        return int(json.load(reply)["grantedTTL"])


def host_key(fleet: Fleet, host: str) -> list[list[str]]:
    """The jobs ``host`` registered, as (user name, job)."""
    kv = etcd_call(fleet.etcd, lambda client: client.get(fleet.key("hosts", host)))
    return [] if kv is None else list(json.loads(kv.value)["jobs"])


# What the daemons show.


def metric(daemon: RunningDaemon, name: str, **labels: str) -> float | None:
    """A sample of the daemon's metrics (None: not shown)."""
    with daemon.client() as client:
        text = client.metrics()
    return sample(text, name, **labels)


def rejected(daemon: RunningDaemon, reason: str) -> float:
    return metric(daemon, "watchdogd_fleet_rejected_total", reason=reason) or 0.0


def rss_mib(pid: int) -> float:
    """The resident memory of ``pid``; ProcessLookupError once it is exiting (a
    zombie has no memory) or gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(pid)


def assert_unharmed(fleet: Fleet) -> None:
    """Each daemon runs, answers, and its fleet task met nothing unexpected."""
    for daemon in fleet.hosts:
        assert daemon.process is not None
        assert daemon.process.poll() is None, daemon.log()[-4000:]
        with daemon.client(timeout=ON_TIME) as client:
            client.ping()
        assert metric(daemon, "watchdogd_fleet_unexpected_errors") == 0.0, daemon.log()[-4000:]


#: What a child says to this process, a line at a time.
Say = Callable[[str], None]
PR_SET_DUMPABLE = 4


class Child:
    """A child of this process that became another uid (`fork_as`)."""

    def __init__(self, pid: int, said: int) -> None:
        self.pid = pid
        self._said = said
        self._buffer = b""
        self.status: int | None = None

    def line(self, timeout: float = PATIENCE) -> str:
        """The next line it says ("" once it has ended without one)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._said], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"pid {self.pid} said nothing within {timeout} s")
            data = os.read(self._said, 65536)
            if not data:
                return ""
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def wait(self, timeout: float = PATIENCE) -> int:
        """Its exit code, once it has exited by itself."""
        wait_until(self._exited, what=f"pid {self.pid} to exit", timeout=timeout)
        assert self.status is not None
        return os.waitstatus_to_exitcode(self.status)

    def _exited(self) -> bool:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = status
        return bool(pid)

    def kill(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            _, self.status = os.waitpid(self.pid, 0)
        os.close(self._said)


def fork_as(uid: int, work: Callable[[Say], int | None], *, saved_uid: int | None = None) -> Child:
    """A child that becomes ``uid`` (gid ``uid``, no other groups; saved uid
    ``saved_uid`` when given) with setresgid and setresuid, then runs ``work``
    and exits with what it returns. It goes on in this interpreter rather than
    exec one: the interpreter lives under /root, which other uids cannot enter.
    With all three uids changed it makes itself dumpable again, as a process
    exec'd as ``uid`` would be (a change of credentials leaves one not
    dumpable)."""
    said, say = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, which never returns
        status = 1
        try:
            os.close(said)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid if saved_uid is None else saved_uid)
            if saved_uid is None:
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)

            def tell(text: str) -> None:
                os.write(say, f"{text}\n".encode())

            status = work(tell) or 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(say)
    return Child(pid, said)


@contextlib.contextmanager
def forked_as(
    uid: int, work: Callable[[Say], int | None], *, saved_uid: int | None = None
) -> Iterator[Child]:
    """`fork_as`, killed and reaped at the end."""
    child = fork_as(uid, work, saved_uid=saved_uid)
    try:
        yield child
    finally:
        child.kill()


def ctl_as(uid: int, daemon: RunningDaemon, *args: str) -> tuple[int, str, str]:
    """``watchdogctl ARGS`` run by ``uid`` (`fork_as`): its exit status, stdout and
    stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:

        def run(say: Say) -> int:
            sys.stdout = open(out.fileno(), "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(err.fileno(), "w", closefd=False)  # noqa: SIM115
            try:
                ctl_main.main(["--socket", str(daemon.socket_path), *args], prog_name="watchdogctl")
            except SystemExit as exit:
                return exit.code if isinstance(exit.code, int) else 1
            return 0

        child = fork_as(uid, run)
        code = child.wait(timeout=30)
        child.kill()
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def incident_as(uid: int, daemon: RunningDaemon, incident: str) -> IncidentInfo | str:
    """``watchdogctl incident ID --json`` run by ``uid``: the incident, or the error."""
    code, out, err = ctl_as(uid, daemon, "incident", incident, "--json")
    if code != 0:
        return err
    return msgspec.json.decode(out, type=IncidentInfo)


def listed_as(uid: int, daemon: RunningDaemon) -> list[str]:
    code, out, err = ctl_as(uid, daemon, "incidents", "--json")
    assert code == 0, err
    return [i.id for i in msgspec.json.decode(out, type=list[IncidentInfo])]


# Root's canaries, and a fresh incident of root's.


@dataclass(eq=False)
class Canary:
    victim: subprocess.Popen[bytes]
    deadline: float
    died: float | None = None
    watcher: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.watcher = threading.Thread(target=self._wait, daemon=True)
        self.watcher.start()

    def _wait(self) -> None:
        self.victim.wait()
        self.died = time.monotonic()


class Canaries:
    """Root timers on real ``sleep`` children of this process, each killed at its
    deadline; a thread waiting on each notes when it died."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.client = daemon.client()
        self.armed: list[Canary] = []

    def arm(self, timeout: float) -> None:
        victim = sleeper()
        remaining = self.client.acquire(f"canary-{len(self.armed)}", timeout, pid=victim.pid)
        # The latest it can be: a slow answer never makes a canary late.
        self.armed.append(Canary(victim, time.monotonic() + remaining))

    def assert_on_time(self) -> list[float]:
        """Each canary died by SIGKILL within `ON_TIME` of its deadline (its death
        as seen here, and its first signal as the daemon recorded it); the
        lateness of each death."""
        lateness = []
        for canary in self.armed:
            canary.watcher.join(PATIENCE * 2)
            assert canary.died is not None, f"canary pid {canary.victim.pid} never died"
            assert canary.victim.returncode == -signal.SIGKILL
            lateness.append(canary.died - canary.deadline)
            event = expiry(self.client, canary.victim.pid)
            assert event.late is not None
            assert event.late < ON_TIME, f"signalled {event.late:.3f} s late"
        assert self.armed
        assert max(lateness) < ON_TIME, lateness
        return lateness

    def close(self) -> None:
        for canary in self.armed:
            reap(canary.victim)
        self.client.close()


def expiry(client: Client, pid: int) -> EventInfo:
    """The ``expired`` event of ``pid``, once recorded. Read from the oldest kept
    page by page: another uid's flood of events may fill the latest page, though
    it never evicts root's."""
    found: list[EventInfo] = []

    def recorded() -> bool:
        after = 0
        while page := client.events(after=after, limit=1000).events:
            found.extend(e for e in page if e.kind == "expired" and e.pid == pid)
            after = page[-1].seq
        return bool(found)

    wait_until(recorded, what=f"the expiry of pid {pid}")
    return found[0]


@contextlib.contextmanager
def canaries(daemon: RunningDaemon) -> Iterator[Canaries]:
    armed = Canaries(daemon)
    try:
        yield armed
    finally:
        armed.close()


def fresh_incident(fleet: Fleet, job: str, *, on_origin: bool = True) -> str:
    """Root's ``job`` held on both hosts, its timer on h1 expires: the incident it
    opens is shown on h2 (and, with ``on_origin``, on h1), by ``watchdogctl
    incident ID``; its id."""
    origin, other = fleet.hosts
    held, hung = sleeper(), sleeper()
    try:
        with other.client() as client:
            client.acquire("held", 120, pid=held.pid, job=job)
        with origin.client() as client:
            client.acquire("hung", 0.2, pid=hung.pid, job=job)
            assert hung.wait(timeout=PATIENCE) == -signal.SIGKILL
            incident = expiry(client, hung.pid).incident
        assert incident
        for daemon in (other, origin) if on_origin else (other,):
            wait_until(
                lambda d=daemon: shows(d, incident),
                what=f"incident {incident} on {daemon.socket_path.stem}",
                timeout=PATIENCE * 2,
            )
            shown = subprocess.run(
                ctl_command(daemon.socket_path, "incident", incident),
                capture_output=True, text=True, check=False, timeout=30,
            )  # fmt: skip
            assert shown.returncode == 0, shown.stderr
            assert f"incident {incident}: job {job} of root" in shown.stdout
        with other.client() as client:
            client.release("held", pid=held.pid)
        return incident
    finally:
        reap(held)
        reap(hung)


def shows(daemon: RunningDaemon, incident: str) -> bool:
    with daemon.client() as client:
        return incident in [i.id for i in client.incidents(limit=1000)]


def held_by_root(fleet: Fleet, job: str) -> list[subprocess.Popen[bytes]]:
    """A root process on each host holding an hour's timer of ``job``."""
    held = []
    for daemon in fleet.hosts:
        process = sleeper()
        held.append(process)
        with daemon.client() as client:
            client.acquire("held", 3600, pid=process.pid, job=job)
    return held


# 1. Malformed records.


def test_malformed_records_are_rejected_and_counted_and_stop_nobody(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    with two_hosts(etcd, prefix, tmp_path) as fleet, canaries(fleet.hosts[0]) as canary:
        # Root's job "train" is held on both hosts: a head of it that were taken
        # would start its peer policy there and be listed.
        held = held_by_root(fleet, "train")
        try:
            canary.arm(3.0)
            ten_years = time.time() + 10 * 365 * 86_400
            forge(
                etcd,
                {
                    fleet.key("incidents", "x-superscript"): head("x-superscript", user="\u00b2"),
                    fleet.key("incidents", "x-nul"): head("x-nul", user="ro\0ot"),
                    fleet.key("incidents", "x-future"): head("x-future", when=ten_years),
                    fleet.key("incidents", "x-other"): head("x-mismatch"),
                    fleet.key("incidents", "x-junk"): b"\xff{not json",
                    fleet.key("hosts", "x"): b'{"host":"x","state":"up","jobs":[["\\u00b2","x"]]}',
                    fleet.prefix.encode() + b"/hosts/\xff": b"{}",
                },
            )
            expected = {"name": 3, "time": 1, "mismatch": 1, "decode": 1, "key": 1}

            def counted(daemon: RunningDaemon) -> bool:
                return all(rejected(daemon, r) >= n for r, n in expected.items())

            for daemon in fleet.hosts:
                wait_until(lambda d=daemon: counted(d), what="the forged keys rejected")
            # The forged host was never taken, so its end is no lost host.
            forge(etcd, {}, deletes=(fleet.key("hosts", "x"),))
            canary.assert_on_time()
            assert_unharmed(fleet)
            for daemon in fleet.hosts:
                with daemon.client() as client:
                    kept = client.incidents(limit=1000)
                assert not [i for i in kept if i.id.startswith("x-") or i.kind == "host_lost"]
            # A daemon that starts while the forged heads are there reads them
            # first, and rejects them again.
            restart(fleet.hosts[1])
            wait_until(lambda: fleet_state(fleet.hosts[1]) == "connected", what="h2 back")
            wait_until(
                lambda: (
                    rejected(fleet.hosts[1], "name") >= 2 and rejected(fleet.hosts[1], "time") >= 1
                ),
                what="the forged heads read again and rejected",
            )
            assert_unharmed(fleet)
            fresh_incident(fleet, "after-malformed")
        finally:
            for process in held:
                reap(process)


def test_every_incident_kept_can_be_read(etcd: EtcdServer, prefix: str, tmp_path: Path) -> None:
    """An incident id longer than an `Incident` request may name is never kept, and
    a host name is at most Linux's 64 characters, so that its own ids fit too."""
    with two_hosts(etcd, prefix, tmp_path) as fleet:
        held = held_by_root(fleet, "train")
        try:
            h1 = fleet.hosts[0]
            before = rejected(h1, "name")
            long_id = "x-" + "a" * 200
            forge(etcd, {fleet.key("incidents", long_id): head(long_id)})
            wait_until(lambda: rejected(h1, "name") > before, what="the long id rejected")
            assert not shows(h1, long_id)
        finally:
            for process in held:
                reap(process)
    with pytest.raises(ConfigError, match="host"):
        parse_config('[fleet]\netcd = ["http://127.0.0.1:1"]\nhost = "' + "h" * 65 + '"\n', "h65")
    parse_config('[fleet]\netcd = ["http://127.0.0.1:1"]\nhost = "' + "h" * 64 + '"\n', "h64")


def ranks_from(daemon: RunningDaemon, incident: str) -> set[str]:
    """The hosts whose ranks of ``incident`` ``daemon`` shows."""
    with daemon.client() as client:
        return {rank.host for rank in client.incident(incident).ranks}


def test_forged_heads_never_hold_up_the_ranks_of_a_real_incident(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    with two_hosts(etcd, prefix, tmp_path) as fleet:
        h1, h2 = fleet.hosts
        held = [process for n in range(4) for process in held_by_root(fleet, f"job-{n}")]
        try:
            forge(etcd, {fleet.key("incidents", f"x-{n}"): head(f"x-{n}", job=f"job-{n}")
                         for n in range(4)})  # fmt: skip
            for daemon in fleet.hosts:
                wait_until(
                    lambda d=daemon: all(shows(d, f"x-{n}") for n in range(4)),
                    what="the forged heads taken",
                )
            incident = fresh_incident(fleet, "real")
            # Each host shows the other's rank of it, as it does within a second
            # without the forged heads.
            wait_until(
                lambda: ranks_from(h1, incident) == ranks_from(h2, incident) == {"h1", "h2"},
                what="each host's ranks on the other",
                timeout=5,
            )
        finally:
            for process in held:
                reap(process)


def children_of(daemon: RunningDaemon, command: str) -> int:
    """How many processes of ``command`` ``daemon`` runs now."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, after = stat[stat.index("(") + 1 :].rsplit(")", 1)
        count += name == command and int(after.split()[1]) == daemon.pid
    return count


def test_forged_heads_of_many_held_jobs_take_turns_to_dump(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    """Well-formed heads of every job a host holds, forged at once: each starts the
    job's peer policy (a dump, which takes a second here), but no more dumps run at
    once than the daemon's ``max_dumps`` (4 by default), and none is dropped."""
    jobs = 12
    with two_hosts(etcd, prefix, tmp_path) as fleet:
        h1 = fleet.hosts[0]
        workers = [sleeper() for _ in range(jobs)]
        try:
            with h1.client() as client:
                for number, worker in enumerate(workers):
                    client.acquire(
                        "held", 3600, pid=worker.pid, job=f"job-{number}", policy="slow_peers"
                    )
            wait_until(lambda: len(host_key(fleet, "h1")) == jobs, what="h1's jobs")
            forge(etcd, {fleet.key("incidents", f"x-{n}"): head(f"x-{n}", job=f"job-{n}")
                         for n in range(jobs)})  # fmt: skip
            most, sampling = 0, True

            def sample() -> None:
                nonlocal most
                while sampling:
                    most = max(most, children_of(h1, "sleep"))
                    time.sleep(0.002)

            def dumped() -> bool:
                with h1.client() as client:
                    kept = [client.incident(i.id) for i in client.incidents() if i.host == "x"]
                return len(kept) == jobs and all(
                    r.state == "done" for incident in kept for r in incident.ranks
                )

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                wait_until(dumped, what="every forged head's dump", timeout=PATIENCE * 3)
            finally:
                sampling = False
                sampler.join(PATIENCE)
            assert 1 <= most <= 4, f"{most} dumps at once"
            assert_unharmed(fleet)
        finally:
            for worker in workers:
                reap(worker)
        fresh_incident(fleet, "after-dumps")


# 2. Huge host keys.


def huge_host(name: str, jobs: int) -> bytes:
    """A host key naming ``jobs`` jobs (100,000 make 1.4 MB: within etcd's
    default bound on a request, 1.5 MiB)."""
    listed = ",".join(f'["u","{number:05x}"]' for number in range(jobs))
    return f'{{"host":"{name}","state":"up","jobs":[{listed}]}}'.encode()


def test_huge_host_keys_swell_and_stall_no_daemon(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    with two_hosts(etcd, prefix, tmp_path) as fleet, canaries(fleet.hosts[0]) as canary:
        before = max(rss_mib(daemon.pid) for daemon in fleet.hosts)
        peak, slowest = before, 0.0
        sampling = True

        def sample() -> None:
            nonlocal peak, slowest
            with fleet.hosts[0].client(timeout=PATIENCE) as client:
                while sampling:
                    # h2 restarts meanwhile: its pid changes, and for a moment it has none.
                    with contextlib.suppress(ProcessLookupError):
                        peak = max([peak] + [rss_mib(daemon.pid) for daemon in fleet.hosts])
                    # The request `watchdogctl events` sends.
                    sent = time.monotonic()
                    client.events(limit=100)
                    slowest = max(slowest, time.monotonic() - sent)
                    time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            for timeout in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0):
                canary.arm(timeout)
            huge = huge_host("big", 100_000)
            assert 1_300_000 < len(huge) < 1_500_000
            bigs: dict[str | bytes, bytes] = {
                fleet.key("hosts", f"big-{n}"): huge.replace(b'"big"', f'"big-{n}"'.encode())
                for n in range(8)
            }
            forge(etcd, bigs)
            # Over a host's bound in jobs, though under its bound in bytes.
            over = huge_host("over", 1001)
            assert len(over) < MAX_HOST_BYTES
            # 65 hosts of 1,000 jobs fill the bound on other hosts' jobs; the 66th
            # is over it.
            many = [fleet.key("hosts", f"many-{n}") for n in range(66)]
            small: dict[str | bytes, bytes] = {fleet.key("hosts", "over"): over}
            small |= {key: huge_host(key.rsplit("/", 1)[1], 1000) for key in many}
            forge(etcd, small)
            for daemon in fleet.hosts:
                wait_until(
                    lambda d=daemon: (
                        rejected(d, "size") >= 8
                        and rejected(d, "decode") >= 1
                        and rejected(d, "budget") >= 1
                    ),
                    what="the huge keys rejected",
                )
            # Lost hosts of 1,000 jobs each, none of them held here.
            forge(etcd, {}, deletes=(fleet.key("hosts", "big-0"), *many))
            canary.assert_on_time()
            # A daemon that starts now reads the huge keys a page at a time.
            restart(fleet.hosts[1])
            wait_until(lambda: fleet_state(fleet.hosts[1]) == "connected", what="h2 back")
            wait_until(lambda: rejected(fleet.hosts[1], "size") >= 7, what="h2 read them")
        finally:
            sampling = False
            sampler.join(PATIENCE)
        assert slowest < ON_TIME, f"events answered {slowest:.2f} s late"
        assert peak < 150, f"RSS peaked at {peak:.0f} MiB"
        assert peak - before < 50, f"RSS grew from {before:.0f} to {peak:.0f} MiB"
        assert all(fleet_state(daemon) == "connected" for daemon in fleet.hosts)
        assert_unharmed(fleet)
        fresh_incident(fleet, "after-huge")


# 3. One local user's many jobs.


def many_jobs(socket: Path, count: int) -> Callable[[Say], None]:
    """Arms ``count`` hour-long timers on itself, each of a job of its own of 128
    bytes; says how many, and waits to be killed."""

    def work(say: Say) -> None:
        with Client(socket) as client:
            say("ready")
            for number in range(count):
                client.acquire(f"s{number}", 3600, job=f"{number:05d}".ljust(128, "-"))
            say(str(count))
            time.sleep(300)

    return work


def test_one_users_thousands_of_jobs_leave_root_on_time(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    # ``max_timers_per_uid`` is 10,000 by default: all of them are allowed. Twenty
    # times the bound of a host key's jobs here, a hundred times under make soak.
    count = 10_000 if os.environ.get("WATCHDOGD_SOAK", "") == "1" else 2_000
    with two_hosts(etcd, prefix, tmp_path) as fleet:
        h1 = fleet.hosts[0]
        held = sleeper()
        try:
            with h1.client() as client:
                client.acquire("held", 3600, pid=held.pid, job="root-job")
            with (
                forked_as(NAMELESS, many_jobs(h1.socket_path, count)) as flooder,
                canaries(h1) as canary,
            ):
                assert flooder.line() == "ready"
                # Canaries due all the while the user arms, and after.
                armed: list[str] = []
                reader = threading.Thread(
                    target=lambda: armed.append(flooder.line(timeout=PATIENCE * 6)), daemon=True
                )
                reader.start()
                while reader.is_alive():
                    canary.arm(0.3)
                    reader.join(0.25)
                for _ in range(4):
                    canary.arm(0.3)
                    time.sleep(0.25)
                assert armed == [str(count)]

                # Root's job registered first; of the other uid's, its bound, by
                # the name a uid without a passwd entry goes by.
                def registered() -> bool:
                    jobs = host_key(fleet, "h1")
                    theirs = [job for user, job in jobs if user == f"#{NAMELESS}"]
                    return ["root", "root-job"] in jobs and len(theirs) == MAX_JOBS_PER_UID

                wait_until(registered, what="h1's jobs cut to their bound")
                canary.assert_on_time()
                assert_unharmed(fleet)
        finally:
            reap(held)
        fresh_incident(fleet, "after-many-jobs")


# 4. One local user's flood of incidents.


def incident_flood(socket: Path, seconds: float, *, at_least: int = 0) -> Callable[[Say], None]:
    """For ``seconds`` (and on until ``at_least`` of them, within thirty times
    that long: a machine busy with CPU hogs floods slower), arms timers of policy
    ``log`` due at once, each of a job of its own: every expiry opens an incident.
    Says how many."""

    def work(say: Say) -> None:
        with Client(socket) as client:
            say("ready")
            start, number = time.monotonic(), 0
            while (elapsed := time.monotonic() - start) < seconds or (
                number < at_least and elapsed < 30 * seconds
            ):
                client.acquire(f"f{number}", 0.001, policy="log", job=f"flood-{number}")
                number += 1
            say(str(number))

    return work


def test_one_users_flood_of_incidents_spends_only_its_own_share(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    seconds = 4.0
    with two_hosts(etcd, prefix, tmp_path) as fleet:
        h1, h2 = fleet.hosts
        with (
            forked_as(NOBODY, incident_flood(h1.socket_path, seconds, at_least=1001)) as flooder,
            canaries(h1) as canary,
        ):
            assert flooder.line() == "ready"
            started = time.monotonic()
            roots: list[str] = []
            while time.monotonic() < started + seconds - 1.0:
                canary.arm(0.3)
                # Opened on h1 while nobody's changes fill its share of the queue
                # (whether h1 keeps it is asserted last).
                job = f"root-during-{len(roots)}"
                roots.append(fresh_incident(fleet, job, on_origin=False))
            flooded = int(flooder.line())
            elapsed = time.monotonic() - started
            nobodys = [lease for h, lease in heads_in_etcd(fleet) if h["user"] == "nobody"]
            assert flooder.wait() == 0
            canary.assert_on_time()
        assert flooded > 1000, "the flood did not happen"
        # The flood's heads in etcd: its burst and its rate, no more.
        assert PUBLISH_BURST <= len(nobodys) <= PUBLISH_BURST + PUBLISH_RATE * elapsed + 2
        # What was dropped was nobody's: at most the two changes of each of its
        # incidents (opened, then its policy done), and every one of root's
        # reached etcd.
        dropped = metric(h1, "watchdogd_fleet_dropped")
        assert dropped is not None
        assert 0 < dropped <= 2 * flooded
        ids = {h["id"] for h, _ in heads_in_etcd(fleet)}
        assert set(roots) <= ids
        # Each head leaves etcd once its window and the follow of its ranks are
        # over, not a day later.
        assert granted_ttl(etcd, nobodys[0]) == head_ttl(WINDOW) <= WINDOW + 180
        assert_unharmed(fleet)
        assert all(fleet_state(daemon) == "connected" for daemon in fleet.hosts)
        # A daemon that starts after the flood reads what it left, and watches.
        restart(h2)
        wait_until(lambda: fleet_state(h2) == "connected", what="h2 back")
        fresh_incident(fleet, "after-flood")


def test_another_users_flood_of_incidents_never_evicts_roots(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    with two_hosts(etcd, prefix, tmp_path) as fleet:
        h1, h2 = fleet.hosts
        # Root's incidents kept on h1: one h1 opened, one h2 did.
        local = fresh_incident(fleet, "root-local")
        remote = fresh_incident(Fleet(etcd, prefix, [h2, h1]), "root-remote")
        with forked_as(NOBODY, incident_flood(h1.socket_path, 1.0, at_least=1001)) as flooder:
            assert flooder.line() == "ready"
            flooded = int(flooder.line())
            assert flooder.wait() == 0
        assert flooded > 1000, "the flood did not happen"
        with h1.client() as client:
            kept = {incident.id for incident in client.incidents(limit=1000)}
        assert {local, remote} <= kept
        assert_unharmed(fleet)


def test_a_daemon_that_cannot_read_its_watch_never_says_connected(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    """One key over what a watch message may hold: neither daemon can read the
    hosts and heads, though both still register; each says so until it is gone."""
    with two_hosts(etcd, prefix, tmp_path) as fleet:
        big = fleet.key("hosts", "zz-huge")
        forge(etcd, {big: b"x" * (5 * 1024 * 1024)})
        for daemon in fleet.hosts:
            wait_until(
                lambda d=daemon: fleet_state(d).startswith("disconnected: watch: "),
                what="the watch seen down",
            )
        # The register loop goes on meanwhile (a new job reaches h1's key), each
        # half second: its success must not make the fleet "connected" again.
        held = sleeper()
        try:
            with fleet.hosts[0].client() as client:
                client.acquire("held", 3600, pid=held.pid, job="while-blind")
            stop = time.monotonic() + 2.0
            states = set()
            while time.monotonic() < stop:
                states |= {fleet_state(daemon) for daemon in fleet.hosts}
                time.sleep(0.05)
            assert ["root", "while-blind"] in host_key(fleet, "h1")
            assert all(state.startswith("disconnected: watch: ") for state in states), states
            status = subprocess.run(
                ctl_command(fleet.hosts[0].socket_path, "status"),
                capture_output=True, text=True, check=False, timeout=30,
            )  # fmt: skip
            assert "fleet disconnected: watch: " in status.stdout
            assert metric(fleet.hosts[0], "watchdogd_fleet_connected") == 0.0
        finally:
            reap(held)
        forge(etcd, {}, deletes=(big,))
        for daemon in fleet.hosts:
            wait_until(
                lambda d=daemon: fleet_state(d) == "connected",
                what="the watch back",
                timeout=PATIENCE * 3,
            )
        assert_unharmed(fleet)
        fresh_incident(fleet, "after-blind")


# 5. Two hosts, two passwd databases.


def passwd_files(directory: Path) -> tuple[Path, Path]:
    """This machine's passwd with alice as 1001 (h1's), and with alice as 1002
    and bob as 1001 (h2's)."""
    base = Path("/etc/passwd").read_text()
    for line in base.splitlines():
        name, _, uid, *_ = line.split(":")
        if name in ("alice", "bob") or int(uid) in (1001, 1002, NAMELESS):
            pytest.skip(f"this machine has a user {name} ({uid}) of its own")

    def user(name: str, uid: int) -> str:
        return f"{name}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n"

    h1, h2 = directory / "passwd-h1", directory / "passwd-h2"
    h1.write_text(base + user("alice", ALICE_H1))
    h2.write_text(base + user("alice", ALICE_H2) + user("bob", BOB_H2))
    for path in (h1, h2):
        path.chmod(0o644)
    return h1, h2


def waiting_in_rank_0() -> None:
    time.sleep(300)


def waiting_in_rank_1() -> None:
    time.sleep(300)


def rank(socket: Path, number: int, after: float) -> Callable[[Say], None]:
    """Rank ``number`` of job ``train``: arms ``after`` seconds of policy ``rank``
    (a dump, then SIGKILL) and waits in a function named after its rank."""
    waits = {0: waiting_in_rank_0, 1: waiting_in_rank_1}

    def work(say: Say) -> None:
        with (
            Client(socket) as client,
            client.expires(after, "step", policy="rank", job="train", rank=number),
        ):
            say("ready")
            waits[number]()

    return work


def forged_rank(pid: int, reader: str) -> dict[str, object]:
    """A rank that a forged host ``h3`` says it found, whose stack ``reader`` may
    read."""
    return {"host": "h3", "pid": pid, "uid": BOB_H2, "role": "peer", "scope": "s",
            "state": "done", "stack": f"secret of {reader}", "frame": f"frame of {reader}",
            "reader": reader}  # fmt: skip


def stacks(incident: IncidentInfo) -> dict[tuple[str, int], str]:
    return {(rank.host, rank.pid): rank.stack for rank in incident.ranks}


def settled(uid: int, daemon: RunningDaemon, incident: str, hosts: set[str]) -> bool:
    """Whether ``uid`` sees ``incident`` on ``daemon`` with a rank done of each of
    ``hosts``."""
    seen = incident_as(uid, daemon, incident)
    return isinstance(seen, IncidentInfo) and hosts <= {
        rank.host for rank in seen.ranks if rank.state == "done"
    }


def test_users_are_matched_across_hosts_by_name_not_number(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    if subprocess.run(["pgrep", "-x", "nscd"], capture_output=True, check=False).returncode == 0:
        pytest.skip(
            "nscd is running: it would answer the daemons' lookups from its cache of "
            "this machine's passwd, whatever file their namespaces mount"
        )
    passwd = passwd_files(tmp_path)
    with (
        two_hosts(etcd, prefix, tmp_path, passwd=passwd) as fleet,
        # alice's job on both hosts: uid 1002 on h2, and 1001 on h1, where rank 0
        # hangs.
        forked_as(ALICE_H2, rank(fleet.hosts[1].socket_path, 1, 120)) as peer,
    ):
        h1, h2 = fleet.hosts
        assert peer.line() == "ready"
        wait_until(lambda: ["alice", "train"] in host_key(fleet, "h2"), what="h2's jobs")
        with forked_as(ALICE_H1, rank(h1.socket_path, 0, 0.3)) as hung:
            assert hung.line() == "ready"
            with h1.client() as client:
                wait_until(lambda: bool(client.incidents()), what="alice's incident on h1")
                [opened] = client.incidents()
            assert (opened.user, opened.uid) == ("alice", ALICE_H1)
            # Ranks of a host h3 that an etcd writer forged, whose readers are alice,
            # bob (no user of h1), and the nameless uid 1001 of h3 (neither h1's
            # alice nor h2's bob).
            ranks = [forged_rank(77, "alice"), forged_rank(78, "bob"), forged_rank(79, "#1001")]
            # After the head is in etcd: each host follows an incident's ranks from
            # its head on (a host's ranks come after the head it answers), so ranks
            # forged before it are never read, and a busy h1 may publish it late.
            wait_until(
                lambda: opened.id in [h["id"] for h, _ in heads_in_etcd(fleet)],
                what="the incident's head in etcd",
            )
            key = fleet.key("ranks", "alice", "train", opened.id, "h3")
            forge(etcd, {key: json.dumps(ranks).encode()})
            for daemon, uid in ((h1, ALICE_H1), (h2, ALICE_H2)):
                wait_until(
                    lambda d=daemon, u=uid: settled(u, d, opened.id, {"h1", "h2", "h3"}),
                    what=f"the whole incident as alice on {daemon.socket_path.stem}",
                    timeout=PATIENCE * 2,
                )
            pids = {"h1": hung.pid, "h2": peer.pid}
        for daemon, uid in ((h1, ALICE_H1), (h2, ALICE_H2)):
            seen = incident_as(uid, daemon, opened.id)
            assert isinstance(seen, IncidentInfo)
            assert (seen.user, seen.uid) == ("alice", uid)
            shown = stacks(seen)
            # alice's own ranks on both hosts, and the one whose reader is alice.
            assert "waiting_in_rank_0" in shown["h1", pids["h1"]]
            assert "waiting_in_rank_1" in shown["h2", pids["h2"]]
            assert shown["h3", 77] == "secret of alice"
            # Neither bob's nor a nameless uid's, whatever its number.
            assert shown["h3", 78] == shown["h3", 79] == ""
            hidden = [r for r in seen.ranks if r.pid in (78, 79)]
            assert all(r.frame == "" and "root only" in r.note for r in hidden), hidden
        # bob on h2 has alice's h1 number, 1001, and may not see her incident.
        assert listed_as(BOB_H2, h2) == []
        refused = incident_as(BOB_H2, h2, opened.id)
        assert isinstance(refused, str)
        assert "no_such_incident" in refused or "no incident" in refused, refused
        # Nor may h1's uid 1002, alice's h2 number, which has no name on h1.
        assert listed_as(ALICE_H2, h1) == []
        assert isinstance(incident_as(ALICE_H2, h1, opened.id), str)
        # Root sees every stack.
        as_root = incident_as(0, h2, opened.id)
        assert isinstance(as_root, IncidentInfo)
        assert stacks(as_root)["h3", 78] == "secret of bob"
        assert_unharmed(fleet)
        fresh_incident(fleet, "after-names")


# 6. Stacks by ptrace's read rule.


def holding_a_secret() -> None:
    time.sleep(300)


def waiting_openly() -> None:
    time.sleep(300)


def dropped_privileges(say: Say) -> None:
    """What a root process that `fork_as` made real and effective uid 1002 with
    saved uid 0 does: waits. ptrace's read rule refuses uid 1002 (the saved uid
    differs, and the change made it not dumpable), though that uid may signal it."""
    say("ready")
    holding_a_secret()


def arms(socket: Path, after: float, policy: str, pid: int | None = None) -> Callable[[Say], None]:
    """Arms ``after`` seconds of ``policy`` of job ``j6`` on itself (or on ``pid``),
    then waits (or, having armed another's, ends)."""

    def work(say: Say) -> None:
        with Client(socket) as client:
            client.acquire("step", after, policy=policy, job="j6", pid=pid)
        say("ready")
        if pid is None:
            waiting_openly()

    return work


def uids_of(pid: int) -> list[int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return [int(n) for n in next(line for line in status if line[:4] == "Uid:").split()[1:]]


def test_a_stack_reaches_only_a_user_ptrace_would_let_read_it(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    uid = ALICE_H2  # no passwd entry on this machine: "#1002" on both hosts
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(two_hosts(etcd, prefix, tmp_path))
        h1, h2 = fleet.hosts
        # The job's rank on h2, dumped by its peer policy when h1's incident
        # arrives there.
        remote = stack.enter_context(forked_as(uid, arms(h2.socket_path, 120, "log")))
        assert remote.line() == "ready"
        wait_until(lambda: [f"#{uid}", "j6"] in host_key(fleet, "h2"), what="h2's jobs")
        dropped = stack.enter_context(forked_as(uid, dropped_privileges, saved_uid=0))
        assert dropped.line() == "ready"
        assert uids_of(dropped.pid)[:3] == [uid, uid, 0]
        # Not dumpable: the kernel gives its /proc files to root.
        assert os.stat(f"/proc/{dropped.pid}/status").st_uid == 0
        # uid 1002 may signal it (its real uid), so it may arm it: the built-in
        # peer_dump dumps it when due. Its own process, beside, is dumped too.
        armer = stack.enter_context(
            forked_as(uid, arms(h1.socket_path, 0.5, "peer_dump", dropped.pid))
        )
        assert armer.line() == "ready"
        own = stack.enter_context(forked_as(uid, arms(h1.socket_path, 0.5, "peer_dump")))
        assert own.line() == "ready"
        with h1.client() as client:
            wait_until(lambda: bool(client.incidents()), what="the incident")
            [opened] = client.incidents()
        for daemon in (h1, h2):
            wait_until(
                lambda d=daemon: (
                    settled(0, d, opened.id, {"h1", "h2"})
                    and len(whole_as(0, d, opened.id).ranks) == 3
                    and all(r.state == "done" for r in whole_as(0, d, opened.id).ranks)
                ),
                what="every rank dumped",
                timeout=PATIENCE * 2,
            )
        for daemon in (h1, h2):
            by_pid = {(r.host, r.pid): r for r in whole_as(0, daemon, opened.id).ranks}
            assert "holding_a_secret" in by_pid["h1", dropped.pid].stack
            by_pid = {(r.host, r.pid): r for r in whole_as(uid, daemon, opened.id).ranks}
            target = by_pid["h1", dropped.pid]
            assert (target.state, target.stack, target.frame) == ("done", "", "")
            assert "ptrace" in target.note
            assert "waiting_openly" in by_pid["h1", own.pid].stack
            assert "waiting_openly" in by_pid["h2", remote.pid].stack
        # Nor in its words, nor in the dump step of its event.
        code, text, err = ctl_as(uid, h1, "incident", opened.id)
        assert code == 0, err
        assert f"pid {dropped.pid}: expired, its policy done" in text
        assert "holding_a_secret" not in text
        assert "waiting_openly" in text
        code, events, err = ctl_as(uid, h1, "events", "--json")
        assert code == 0, err
        assert f'"pid":{dropped.pid}' in events.replace(" ", "")
        assert "holding_a_secret" not in events
        assert_unharmed(fleet)
        fresh_incident(fleet, "after-stacks")


def whole_as(uid: int, daemon: RunningDaemon, incident: str) -> IncidentInfo:
    seen = incident_as(uid, daemon, incident)
    assert isinstance(seen, IncidentInfo), seen
    return seen
