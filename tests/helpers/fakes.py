"""Fakes for the service's process port, and a service built on them."""

from __future__ import annotations

from dataclasses import dataclass, field

from watchdogd.core.config import Config, DaemonConfig, PolicyConfig
from watchdogd.core.identity import Peer
from watchdogd.core.ports import Journal
from watchdogd.core.service import Caller, Service
from watchdogd.core.starvation import Sample
from watchdogd.core.timers import StoreKey, Timer
from watchdogd.errors import Refusal
from watchdogd.host.users import UserNames
from watchdogd.runtime.metrics import exposition
from watchdogd_protocol import ErrorCode

DAEMON_PID = 50
USERS = {0: "root", 1000: "alice", 2000: "bob"}
# As on kernels with SO_PEERPIDFD (the number stands for a pidfd; the fake host
# never uses it).
ROOT = Peer(pid=100, uid=0, gid=0, pidfd=-1)
ALICE = Peer(pid=200, uid=1000, gid=1000, pidfd=-1)
BOB = Peer(pid=300, uid=2000, gid=2000, pidfd=-1)


@dataclass(eq=False)
class FakeProcess:
    pid: int
    uid: int
    saved_uid: int
    refs: int = 1
    exited: bool = False
    start_time: int = 1000

    def retain(self) -> FakeProcess:
        self.refs += 1
        return self

    def close(self) -> None:
        assert self.refs > 0, "closed more often than retained"
        self.refs -= 1


@dataclass
class FakeHost:
    """pid -> (real uid, saved uid); pids in ``dead`` are gone."""

    processes: dict[int, tuple[int, int]]
    dead: set[int] = field(default_factory=set)
    tracked: set[int] = field(default_factory=set)
    opened: list[FakeProcess] = field(default_factory=list)
    #: Command lines other than the default ``cmd-PID``.
    command_lines: dict[int, str] = field(default_factory=dict)
    #: What `sample` says of each pid (an idle process at time 0 otherwise), and
    #: the pids it was asked about, in turn.
    samples: dict[int, Sample] = field(default_factory=dict)
    sampled: list[int] = field(default_factory=list)
    #: Executables other than the default ``/usr/bin/prog-PID`` (one that exec'd).
    executables: dict[int, str] = field(default_factory=dict)

    def open(self, pid: int, peer: Peer) -> FakeProcess:
        if pid not in self.processes or pid in self.dead:
            raise Refusal(ErrorCode.NO_SUCH_PROCESS, f"no process with pid {pid}")
        uid, saved = self.processes[pid]
        # A pid opened again is taken to be a new process holding it, unless the
        # handle before it is still alive (the same process).
        earlier = [p for p in self.opened if p.pid == pid]
        start = (
            earlier[-1].start_time
            if earlier and self.alive(earlier[-1])
            else 1000 + len(self.opened)
        )
        process = FakeProcess(pid, uid, saved, start_time=start)
        self.opened.append(process)
        return process

    def alive(self, process: FakeProcess) -> bool:
        return not process.exited and process.pid not in self.dead

    def exited(self, process: FakeProcess) -> bool:
        return not self.alive(process)

    def refresh(self, process: FakeProcess) -> bool:
        if not self.alive(process):
            return False
        process.uid, process.saved_uid = self.processes[process.pid]
        return True

    def command(self, process: FakeProcess) -> str:
        return self.command_lines.get(process.pid, f"cmd-{process.pid}")

    def user_name(self, uid: int) -> str:
        return USERS.get(uid, f"#{uid}")

    def executable(self, process: FakeProcess) -> str:
        return self.executables.get(process.pid, f"/usr/bin/prog-{process.pid}")

    def track(self, process: FakeProcess) -> None:
        assert process.pid not in self.tracked
        self.tracked.add(process.pid)

    def untrack(self, process: FakeProcess) -> None:
        self.tracked.remove(process.pid)
        process.close()

    def sample(self, process: FakeProcess) -> Sample | None:
        self.sampled.append(process.pid)
        if not self.alive(process):
            return None
        return self.samples.get(process.pid, Sample(at=0.0, cpu=0.0))


@dataclass
class RecordingJournal:
    """The changes a store would write, by store key (None: dropped)."""

    changes: dict[StoreKey, Timer | None] = field(default_factory=dict)
    generation: int = 0
    errors: int = 0
    degraded: bool = False

    def put(self, timer: Timer, *, replacing: Timer | None = None, soon: bool = False) -> None:
        if replacing is not None:
            self.drop(replacing)
        self.changes[timer.store_key] = timer
        self.generation += 1

    def drop(self, *timers: Timer, soon: bool = False) -> None:
        for timer in timers:
            self.changes[timer.store_key] = None
            self.generation += 1

    def commit(self, generation: int) -> bool:
        return True

    def commit_soon(self) -> None:
        pass

    def held(self) -> set[StoreKey]:
        return {key for key, timer in self.changes.items() if timer is not None}

    def state(self) -> list[Timer]:
        """What a start after a crash would restore."""
        return [timer for timer in self.changes.values() if timer is not None]


def make_service(
    journal: Journal | None = None, now: float = 0.0, **limits: object
) -> tuple[Service[FakeProcess], FakeHost, list[float]]:
    """A service started at ``now`` on the fake host, its changes told to
    ``journal``, with the daemon ``limits`` given."""
    host = FakeHost(
        {
            100: (0, 0),
            200: (1000, 1000),
            201: (1000, 1000),
            202: (3000, 1000),  # setuid: saved uid is alice's
            300: (2000, 2000),
            DAEMON_PID: (0, 0),
            1: (0, 0),
        }
    )
    notified: list[float] = []
    service = Service(
        Config(
            daemon=DaemonConfig(**limits),  # type: ignore[arg-type]
            policies={"ops": PolicyConfig(steps=[], root_only=True)},
        ),
        host,
        daemon_pid=DAEMON_PID,
        now=now,
        journal=journal,
        on_deadline=notified.append,
        wall=lambda: 1_700_000_000.0,
        clock=lambda: 0.0,
        render_metrics=exposition,
    )
    return service, host, notified


@dataclass
class World:
    """A service on a fake host, with one open connection each for alice, bob and root."""

    service: Service[FakeProcess]
    host: FakeHost
    notified: list[float]
    alice: Caller[FakeProcess]
    bob: Caller[FakeProcess]
    root: Caller[FakeProcess]


def make_world(journal: Journal | None = None, now: float = 0.0, **limits: object) -> World:
    service, host, notified = make_service(journal, now, **limits)
    alice, bob, root = (service.arming.open_connection(peer) for peer in (ALICE, BOB, ROOT))
    return World(service, host, notified, alice, bob, root)


def fake_names() -> UserNames:
    """The fleet names of `USERS`, without passwd lookups."""
    return UserNames(
        name_of_uid=lambda uid: USERS.get(uid, f"#{uid}"),
        uid_of_name=lambda name: next((uid for uid, known in USERS.items() if known == name), None),
    )
