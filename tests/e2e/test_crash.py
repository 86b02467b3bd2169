"""The daemon killed at bad instants: no kill lost, no release forgotten.

Real daemons are SIGKILLed and restarted; the victims are real processes. The
counts here keep `make test` short; `make soak` runs the same tests at full scale
(``WATCHDOGD_SOAK=1``: 100 random kills under churn, 200 under a tight block loop,
20 s of restarts every 0.7 s, 200 kills and 20 stops under loops of fast-path
blocks and 40 kills under torch's, which only the soak runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import select
import signal
import socket
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import pytest

from watchdogd.runtime.daemon import restart_estimate
from watchdogd_client import DaemonUnavailable
from watchdogd_protocol import (
    MAX_REPLY_FRAME,
    PROTOCOL_VERSION,
    RESTART_GRACE,
    FrameReader,
    Hello,
    Welcome,
    decode_reply,
    encode_frame,
)

from helpers.daemon import RunningDaemon, expired_event
from helpers.processes import Death, death_time, python_worker, reap, sleeper, wait_ready
from helpers.waiting import PATIENCE, wait_until

SOAK = os.environ.get("WATCHDOGD_SOAK", "") == "1"


@pytest.fixture
def restartable(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    running = RunningDaemon(socket_path, tmp_path / "watchdogd.log", [])
    running.start()
    yield running
    running.stop(signal.SIGKILL)


def hung_workers(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sleep", "600"]) for _ in range(count)]


@pytest.mark.parametrize("after_ms", [0, 2, 5, 10, 20])
def test_a_daemon_killed_right_after_a_deadline_still_kills_every_worker(
    restartable: RunningDaemon, after_ms: int
) -> None:
    """500 workers share one deadline; the daemon dies ``after_ms`` after it, in
    the middle of carrying out their policies, and is started again."""
    workers = hung_workers(500)
    try:
        # 500 round trips take well under a second, and three beside a CPU hog and
        # the rest of the suite.
        timeout = 3.0
        with restartable.client(timeout=PATIENCE) as client:
            start = time.monotonic()
            deadline = start + timeout
            for worker in workers:
                client.acquire("step", max(0.001, deadline - time.monotonic()), pid=worker.pid)
        assert time.monotonic() < deadline, "arming took longer than the timeout"
        time.sleep(max(0.0, deadline + after_ms / 1000 - time.monotonic()))
        restartable.stop(signal.SIGKILL)
        restartable.start()
        for worker in workers:
            assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        for worker in workers:
            reap(worker)


def test_a_sigterm_during_a_term_policy_leaves_it_for_the_next_start(
    restartable: RunningDaemon,
) -> None:
    """SIGTERM while the ``term`` policy waits: the next start resumes the wait
    where it stood and sends SIGKILL at its original end."""
    ignores_term = subprocess.Popen(
        ["python3", "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert ignores_term.stdout is not None
        assert ignores_term.stdout.readline() == b"ready\n"
        with restartable.client() as client:
            client.acquire("epoch", 0.2, policy="term", pid=ignores_term.pid)
        time.sleep(1.0)  # SIGTERM sent and ignored; the 10 s wait has begun
        assert restartable.stop(signal.SIGTERM) == 0
        assert ignores_term.poll() is None
        restartable.start()
        with restartable.client() as client:
            assert client.status().daemon.timers == 0  # firing, not armed again
        status = ignores_term.wait(timeout=PATIENCE + 10)
        assert status == -signal.SIGKILL
        with restartable.client() as client:
            event = expired_event(client, ignores_term.pid)
        assert event.outcome == "exited"
        assert "resumed at step 2" in event.note
        # The wait kept its end: SIGKILL came about 10 s after the SIGTERM.
        assert event.fired_at is not None
        assert event.time - event.fired_at == pytest.approx(10.0, abs=1.5)
    finally:
        reap(ignores_term)


def test_random_kills_under_churn_lose_no_acknowledged_change(
    restartable: RunningDaemon,
) -> None:
    """Timers armed and released as fast as one client can while the daemon is
    SIGKILLed at random instants: every acknowledged arm still fires, and no
    worker dies after its release was acknowledged."""
    kills = 100 if SOAK else 12
    rng = random.Random(9)
    workers = hung_workers(24)
    #: pid -> (acknowledged op, its deadline); None: the outcome is not known.
    model: dict[int, tuple[str, float] | None] = {w.pid: ("released", 0.0) for w in workers}
    by_pid = {w.pid: w for w in workers}
    violations: list[str] = []
    armed_and_fired = 0
    client = restartable.client(timeout=PATIENCE)
    #: When the daemon was last ready: a timer due while it was down fires after.
    ready = time.monotonic()

    def settle() -> None:
        """Check every worker against what the daemon acknowledged."""
        nonlocal armed_and_fired
        now = time.monotonic()
        # A busy machine restarts the daemon slowly: a timer is late only 3 s
        # past its deadline and past the start that should fire it.
        for pid, worker in list(by_pid.items()):
            state = model[pid]
            dead = worker.poll() is not None
            if state is not None and state[0] == "released" and dead:
                violations.append(f"pid {pid} was killed after its release was acknowledged")
            late = state is not None and now > max(state[1], ready) + 3
            if state is not None and state[0] == "armed" and not dead and late:
                violations.append(f"pid {pid}: an acknowledged timer did not fire")
            if dead:
                if state is not None and state[0] == "armed":
                    armed_and_fired += 1
                worker.wait()
                del by_pid[pid]
                replacement = subprocess.Popen(["sleep", "600"])
                by_pid[replacement.pid] = replacement
                model[replacement.pid] = ("released", 0.0)

    try:
        for _ in range(kills):
            kill_at = time.monotonic() + rng.uniform(0.05, 0.4)
            while time.monotonic() < kill_at:
                pid = rng.choice(list(by_pid))
                state = model[pid]
                try:
                    if state is not None and state[0] == "armed":
                        if state[1] - time.monotonic() < 0.25:
                            continue  # about to fire: leave it to the daemon
                        found = client.release("churn", pid=pid)
                        model[pid] = ("released", 0.0) if found else None
                    else:
                        timeout = rng.uniform(0.3, 1.2)
                        sent = time.monotonic()
                        client.acquire("churn", timeout, pid=pid)
                        model[pid] = ("armed", sent + timeout)
                except DaemonUnavailable:
                    model[pid] = None
            restartable.stop(signal.SIGKILL)
            restartable.start()
            ready = time.monotonic()
            settle()
        time.sleep(2.0)
        settle()
        time.sleep(2.0)
        settle()
    finally:
        client.close()
        for worker in by_pid.values():
            reap(worker)
    assert violations == []
    assert armed_and_fired > 0  # the check above had something to check


#: A worker that runs short protected blocks in a tight loop, counting them in a
#: file, until a file named ``hang`` appears: then it hangs inside its next block.
TIGHT_LOOP = """
import os, sys, time
from watchdogd_client import expires
count, hang = sys.argv[1], sys.argv[2]
print("ready", flush=True)
blocks = 0
while True:
    with expires(after=0.5, scope="tight"):
        if os.path.exists(hang):
            time.sleep(600)
        time.sleep(0.002)
    blocks += 1
    if blocks % 100 == 0:
        with open(count + ".new", "w") as out:
            out.write(str(blocks))
        os.replace(count + ".new", count)
"""


def test_kills_of_the_daemon_longer_than_a_timeout_never_fire_a_released_timer(
    restartable: RunningDaemon, tmp_path: Path
) -> None:
    """Workers run 2 ms blocks under 0.5 s timers while the daemon is SIGKILLed at
    random instants, every other time left down 0.8 s: a block that ended while
    the daemon was down has its release sent again once the client reconnects,
    and the restart grace holds the overdue timer until it lands. No worker is
    killed; then each hangs in a block, and is killed: its acquires were in force."""
    rng = random.Random(25)
    kills = 200 if SOAK else 8
    workers = [
        python_worker(
            TIGHT_LOOP,
            str(tmp_path / f"count{i}"),
            str(tmp_path / "hang"),
            socket=restartable.socket_path,
        )
        for i in range(2)
    ]
    try:
        for worker in workers:
            wait_ready(worker)
        for kill in range(kills):
            # Longer than the client's longest pause between reconnects (`RECONNECT_PAUSE`):
            # a request lost to one kill is sent again before the next one (lost
            # twice, it raises DaemonUnavailable, by design).
            time.sleep(rng.uniform(0.3, 0.6))
            restartable.stop(signal.SIGKILL)
            time.sleep(0.8 if kill % 2 else 0.0)
            restartable.start()
            for worker in workers:
                if worker.poll() is not None:
                    _, stderr = worker.communicate()
                    raise AssertionError(f"worker {worker.pid} died at kill {kill + 1}: {stderr}")
        time.sleep(1.0)  # the last start's grace, and the blocks go on
        for i, worker in enumerate(workers):
            assert worker.poll() is None, f"worker {worker.pid} died after the last kill"
            assert int((tmp_path / f"count{i}").read_text()) >= 100
        (tmp_path / "hang").touch()
        for worker in workers:
            assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        for worker in workers:
            reap(worker)


#: A worker hung in its block: it prints when it entered it, its deadline
#: ``after`` seconds on, and never leaves.
HUNG_IN_ITS_BLOCK = """
import sys, time
from watchdogd_client import expires
with expires(after=float(sys.argv[1]), scope="hung"):
    print(time.monotonic(), flush=True)
    time.sleep(600)
"""


def test_a_daemon_restarted_in_a_loop_still_kills_a_hung_worker_and_a_canary(
    restartable: RunningDaemon,
) -> None:
    """The daemon is SIGKILLed and started again every 0.7 s, for 6 s (20 s under
    soak): a hung worker and a root canary fall due early in it, and each start
    finds them restored and due. The restart grace is the arming's, not the
    start's: each dies by the end of the grace the first start that found it
    due gave it, or at the first start after that, so within the grace and two
    restarts of its deadline (one for the start that found it due, one after its
    grace), well before the loop ends. (A grace given anew at every start kept
    both alive until the loop stopped: 19.1 s late at the soak's size.)"""
    period, loop = 0.7, 20.0 if SOAK else 6.0
    worker = python_worker(HUNG_IN_ITS_BLOCK, "1.0", socket=restartable.socket_path)
    canary = sleeper()
    try:
        assert worker.stdout is not None
        deaths = [Death(worker), Death(canary)]
        deadlines = [float(worker.stdout.readline()) + 1.0]
        with restartable.client() as client:
            sent = time.monotonic()
            remaining = client.acquire("canary", 1.2, pid=canary.pid)
            deadlines.append(sent + remaining)
        began = killed = time.monotonic()
        longest = 0.0  # from a kill to the next daemon's first answer
        while time.monotonic() - began < loop:
            time.sleep(max(0.0, killed + period - time.monotonic()))
            restartable.stop(signal.SIGKILL)
            killed = time.monotonic()
            restartable.start()
            longest = max(longest, time.monotonic() - killed)
        ended = time.monotonic()
        victims: list[subprocess.Popen[str] | subprocess.Popen[bytes]] = [worker, canary]
        for death, deadline, victim in zip(deaths, deadlines, victims, strict=True):
            died = death.wait()
            assert victim.wait() == -signal.SIGKILL
            assert died < ended, f"pid {victim.pid} outlived the restart loop"
            late = died - deadline
            assert late < RESTART_GRACE + 2 * longest + 0.5, (late, longest)
    finally:
        reap(worker)
        reap(canary)


#: A worker with one block: armed, it waits for a file named ``go``, ends its
#: block (its release sent, not waited for), says so, and then works unprotected
#: for a long while, making no request.
ONE_BLOCK_THEN_IDLE = """
import os, sys, time
from watchdogd_client import expires
from watchdogd_client.paths import client_socket_path
from watchdogd_client.responder import process_responder
go = sys.argv[1]
with expires(after=0.5, scope="once"):
    # The responder connects on its own thread; until it has, a release waits
    # for its answer, which is not the path under test.
    while not process_responder().carries(client_socket_path()):
        time.sleep(0.005)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.005)
print("released", flush=True)
time.sleep(600)
"""

#: The same in a trio program: its block's release does not wait either.
ONE_TRIO_BLOCK_THEN_IDLE = """
import os, sys
import trio
from watchdogd_client.paths import client_socket_path
from watchdogd_client.responder import process_responder
from watchdogd_client.trio import open_client
go = sys.argv[1]

async def main():
    async with open_client() as client:
        async with client.expires(after=0.5, scope="once"):
            while not process_responder().carries(client_socket_path()):
                await trio.sleep(0.005)
            print("ready", flush=True)
            while not os.path.exists(go):
                await trio.sleep(0.005)
        print("released", flush=True)
        await trio.sleep(600)

trio.run(main)
"""


@pytest.mark.parametrize(
    "program", [ONE_BLOCK_THEN_IDLE, ONE_TRIO_BLOCK_THEN_IDLE], ids=["blocking", "trio"]
)
def test_a_release_the_daemon_never_read_is_sent_again_without_the_worker(
    restartable: RunningDaemon, tmp_path: Path, program: str
) -> None:
    """The daemon is frozen while a worker's block ends, so the release sits unread
    in its socket, and then killed: the release is gone with it. It stays down
    longer than the timeout, so its restart finds the timer overdue. The worker
    makes no request after its block; its responder sends the release again on
    its new connection, within the restart grace, and the worker lives."""
    go = tmp_path / "go"
    worker = python_worker(program, str(go), socket=restartable.socket_path)
    try:
        assert worker.stdout is not None
        wait_ready(worker)
        os.kill(restartable.pid, signal.SIGSTOP)
        go.touch()
        assert worker.stdout.readline().strip() == "released"
        restartable.stop(signal.SIGKILL)
        time.sleep(0.8)
        restartable.start()
        with restartable.client() as client:
            wait_until(
                lambda: not [t for t in client.status().timers if t.pid == worker.pid],
                what="the release sent again",
            )
            time.sleep(1.5)  # past the restart grace: a timer held for it fires by then
            assert worker.poll() is None
            assert [e.kind for e in client.events(limit=1000).events if e.pid == worker.pid] == []
    finally:
        reap(worker)


def test_a_restart_keeps_timers_armed_while_the_daemon_is_loaded(
    restartable: RunningDaemon,
) -> None:
    """Every acknowledged timer is in the state the moment its reply arrives."""
    worker = subprocess.Popen(["sleep", "600"])
    try:
        with restartable.client() as client:
            for index in range(200):
                client.acquire(f"scope-{index}", 300, pid=worker.pid)
        restartable.stop(signal.SIGKILL)
        restartable.start()
        with restartable.client() as client:
            assert client.status().daemon.timers == 200
        wait_until(lambda: worker.poll() is None, what="the worker to stay alive")
    finally:
        reap(worker)


def test_the_daemon_says_how_long_a_restart_of_it_may_take(restartable: RunningDaemon) -> None:
    """Clients wait out at least that long when their connection breaks."""
    with restartable.client() as client:
        client.ping()
        window = client._engine.restart
    # The default cap of 1,000,000 timers loads in a few seconds on these machines.
    assert 2.0 <= window <= 60.0
    assert restart_estimate(2.9, 1_000_000, 1_000_000) == pytest.approx(6.8)
    assert restart_estimate(0.01, 10, 1_000_000) == pytest.approx(7.0)


@pytest.mark.skipif(not SOAK, reason="a million timers: make soak")
def test_a_million_timers_survive_a_kill(socket_path: Path, tmp_path: Path) -> None:
    """A state of 1,000,000 timers on 100 processes; 100 more are armed through the
    socket due a little later than the daemon says a restart of it takes, the
    daemon is killed and restarted: those 100 die on time. How long to wait for the
    restart is the daemon's own measure of loading this state, not a constant."""
    from watchdogd.core.timers import Timer
    from watchdogd.host.process import read_start_time
    from watchdogd.storage.store import Store

    state = tmp_path / "state.db"
    holders = hung_workers(100)
    daemon = RunningDaemon(socket_path, tmp_path / "watchdogd.log", ["--state", str(state)])
    try:
        starts = [read_start_time(holder.pid) for holder in holders]
        store, _ = Store.open(str(state))
        now = time.monotonic()
        for index in range(1_000_000 - 100):
            slot = index % 100
            store.put(
                Timer(pid=holders[slot].pid, scope=f"s{index}", policy="kill", uid=0, owner=0,
                      timeout=3600.0, armed_at=now, deadline=now + 3600, start_time=starts[slot],
                      seq=index)
            )  # fmt: skip
        store.write_now()
        store.close()
        began = time.monotonic()
        daemon.start(timeout=PATIENCE * 30)
        loaded = time.monotonic() - began
        restart = restart_window(socket_path)
        # Due once a restart is surely over: the daemon's own estimate, or what
        # this start took if that was longer (a busy machine).
        due = time.monotonic() + 2 * max(restart, loaded) + 2.0
        with daemon.client() as client:
            for index, holder in enumerate(holders):
                client.acquire(f"due{index}", due - time.monotonic(), pid=holder.pid)
        daemon.stop(signal.SIGKILL)
        daemon.start(timeout=2 * max(restart, loaded) + PATIENCE)
        with daemon.client() as client:
            assert client.status_page(limit=1).daemon.timers == 1_000_000
        for holder in holders:
            assert holder.wait(timeout=due - time.monotonic() + PATIENCE) == -signal.SIGKILL
        assert time.monotonic() - due < 2.0
    finally:
        daemon.stop(signal.SIGKILL)
        for holder in holders:
            reap(holder)


#: The timers of a state whose load takes a while (seconds: at full size under soak).
LOADED = 200_000 if SOAK else 50_000


def test_a_start_fires_what_is_due_before_it_has_loaded_the_rest(
    socket_path: Path, tmp_path: Path
) -> None:
    """A state of `LOADED` timers due in an hour, folded into the database, and
    one whose policy was in progress when the daemon died: its worker is killed
    while the daemon still loads the others (the ``event=expired`` line comes
    before the ``event=state`` one, which says the load is whole), and then every
    timer is armed. (A policy in progress resumes at once; an armed timer that fell
    due waits out the restart grace, as test_durability shows.)"""
    from watchdogd.core.timers import Course, Timer
    from watchdogd.host.process import read_start_time
    from watchdogd.storage.store import Store

    state = tmp_path / "state.db"
    holders = hung_workers(10)
    [victim] = hung_workers(1)
    daemon = RunningDaemon(socket_path, tmp_path / "watchdogd.log", ["--state", str(state)])
    try:
        store, _ = Store.open(str(state))
        now = time.monotonic()

        def stored(holder: subprocess.Popen[bytes], scope: str, deadline: float) -> Timer:
            return Timer(
                pid=holder.pid, scope=scope, policy="kill", uid=0, owner=0, timeout=3600.0,
                armed_at=now, deadline=deadline, start_time=read_start_time(holder.pid),
            )  # fmt: skip

        timers = [stored(holders[i % 10], f"s{i}", now + 3600 + i / 1000) for i in range(LOADED)]
        due = stored(victim, "due-while-down", now - 1)
        timers.append(msgspec.structs.replace(due, firing=1, run=Course(fired_at=now - 1)))
        store._write_database({timer.store_key: timer for timer in timers}, reset=True)
        store.close()
        for name in os.listdir(tmp_path):
            if ".journal." in name:
                os.unlink(tmp_path / name)
        daemon.start(timeout=PATIENCE * 4)
        assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
        log = daemon.log()
        expired = log.index(f"event=expired pid={victim.pid}")
        assert log.index("event=state_first") < expired < log.index("event=state path=")
        assert f"restored={LOADED} dropped=0 resumed=1" in log
        with daemon.client() as client:
            assert client.status_page(limit=1).daemon.timers == LOADED
    finally:
        daemon.stop(signal.SIGKILL)
        for holder in [*holders, victim]:
            reap(holder)


def restart_window(socket_path: Path) -> float:
    """How long the daemon at ``socket_path`` says a restart of it may take (its
    ``Welcome``)."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(socket_path))
        conn.sendall(encode_frame(Hello(id=1, version=PROTOCOL_VERSION)))
        reader = FrameReader(MAX_REPLY_FRAME)
        while not (frames := reader.feed(conn.recv(65536))):
            pass
    welcome = decode_reply(frames[0])
    assert isinstance(welcome, Welcome)
    return welcome.restart


def test_a_policy_removed_across_a_restart_starts_the_default_from_its_first_step(
    socket_path: Path, tmp_path: Path
) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text(
        '[policies.slow]\nsteps = [{ signal = "SIGCONT" }, { wait = 30 }, { signal = "SIGKILL" }]\n'
    )
    daemon = RunningDaemon(socket_path, tmp_path / "log", ["--config", str(config)])
    worker = subprocess.Popen(["sleep", "600"])
    try:
        daemon.start()
        with daemon.client() as client:
            client.acquire("slow", 0.1, policy="slow", pid=worker.pid)
        time.sleep(0.5)  # its wait has begun
        daemon.stop(signal.SIGTERM)
        config.write_text("")
        started = time.monotonic()
        daemon.start()
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        assert time.monotonic() - started < PATIENCE  # not after the old 30 s wait
        with daemon.client() as client:
            event = expired_event(client, worker.pid)
        assert event.policy == "kill"
        assert "started again from its first step" in event.note
    finally:
        daemon.stop(signal.SIGKILL)
        reap(worker)


#: The timeout of the fast-path blocks under outages of the daemon.
BLOCK_TIMEOUT = 0.5

#: A worker of tight loops of ~1 ms blocks under 0.5 s timers until a file named
#: ``stop`` appears. Most blocks are of four scopes registered before it says
#: "ready", through the client ``pre``, which must send no request after that;
#: every eighth is of one of the scopes registered since, one more every ``every``
#: seconds, through ``fresh`` (its first block a request, the next ones stores).
#: Its blocks are the client's ``expires()``, or torch's own (``via`` "torch")
#: with the adapter over each client. Then it prints what it ran (JSON) and exits
#: 0 once its stdin closes.
BLOCKING_LOOP = """
import json, os, sys, time
from watchdogd_client import Client
stop, every, via = sys.argv[1], float(sys.argv[2]), sys.argv[3]
pre, fresh = Client(timeout=5.0), Client(timeout=5.0)
if via == "torch":
    import torch.distributed.elastic.timer as timer
    from watchdogd_client.torch import WatchdogdTimerClient
    adapters = {pre: WatchdogdTimerClient(pre), fresh: WatchdogdTimerClient(fresh)}
    def block(client, scope):
        return timer.expires(after=0.5, scope=scope, client=adapters[client])
else:
    def block(client, scope):
        return client.expires(0.5, scope=scope)
registered = [f"pre-{i}" for i in range(4)]
for scope in registered:
    with block(pre, scope):
        pass
fresh.ping()
sent = pre._engine.next_id()
new, longest, blocks, last_new = [], 0.0, 0, time.monotonic()
print("ready", flush=True)
while not os.path.exists(stop):
    if time.monotonic() >= last_new + every:
        new.append(f"new-{len(new)}")
        last_new = time.monotonic()
    began = time.perf_counter()
    with block(pre, registered[blocks % 4]):
        entered = time.perf_counter()
        time.sleep(0.001)
        leaving = time.perf_counter()
    longest = max(longest, entered - began + time.perf_counter() - leaving)
    if new and blocks % 8 == 0:
        with block(fresh, new[-1 - blocks // 8 % min(len(new), 8)]):
            time.sleep(0.001)
    blocks += 1
requests = pre._engine.next_id() - sent - 1
print(json.dumps(dict(blocks=blocks, requests=requests, longest=longest, new=len(new))), flush=True)
sys.stdin.read()
"""

#: The same in a trio program.
TRIO_LOOP = """
import json, os, sys, time
import trio
from watchdogd_client.trio import open_client
stop, every = sys.argv[1], float(sys.argv[2])

async def main():
    async with open_client(timeout=5.0) as pre, open_client(timeout=5.0) as fresh:
        registered = [f"pre-{i}" for i in range(4)]
        for scope in registered:
            async with pre.expires(0.5, scope=scope):
                pass
        await fresh.ping()
        sent = pre._engine.next_id()
        new, longest, blocks, last_new = [], 0.0, 0, time.monotonic()
        print("ready", flush=True)
        while not os.path.exists(stop):
            if time.monotonic() >= last_new + every:
                new.append(f"new-{len(new)}")
                last_new = time.monotonic()
            began = time.perf_counter()
            async with pre.expires(0.5, scope=registered[blocks % 4]):
                entered = time.perf_counter()
                await trio.sleep(0.001)
                leaving = time.perf_counter()
            longest = max(longest, entered - began + time.perf_counter() - leaving)
            if new and blocks % 8 == 0:
                async with fresh.expires(0.5, scope=new[-1 - blocks // 8 % min(len(new), 8)]):
                    await trio.sleep(0.001)
            blocks += 1
        requests = pre._engine.next_id() - sent - 1
        figures = dict(blocks=blocks, requests=requests, longest=longest, new=len(new))
        print(json.dumps(figures), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)

trio.run(main)
"""

#: A worker that registers the scope ``hang`` and keeps running empty blocks of it
#: every 20 ms until a file named ``hang`` appears: then it enters one more, prints
#: when (CLOCK_MONOTONIC) and sleeps in it.
HANGS_ON_CUE = """
import os, sys, time
from watchdogd_client import Client
cue = sys.argv[1]
client = Client(timeout=5.0)
with client.expires(0.5, scope="hang"):
    pass
print("ready", flush=True)
while not os.path.exists(cue):
    with client.expires(0.5, scope="hang"):
        pass
    time.sleep(0.02)
with client.expires(0.5, scope="hang"):
    print(time.monotonic(), flush=True)
    time.sleep(600)
"""


class HungOnCue:
    """A `HANGS_ON_CUE` worker, its scope registered while the daemon runs."""

    def __init__(self, daemon: RunningDaemon, cue: Path) -> None:
        self.cue = cue
        self.process = python_worker(HANGS_ON_CUE, str(cue), socket=daemon.socket_path)

    def hang(self) -> float:
        """Make it hang in a block, the daemon being out: the block's deadline. Its
        entry is a store, so it comes at once; one that waited on the daemon would
        come only once the daemon is back, which the caller has not done yet."""
        self.cue.touch()
        assert self.process.stdout is not None
        entered, _, _ = select.select([self.process.stdout], [], [], PATIENCE)
        assert entered, "a block entered while the daemon was out waited on it"
        return float(self.process.stdout.readline()) + BLOCK_TIMEOUT


@dataclass(frozen=True)
class Outage:
    """One outage of the daemon: SIGKILL (and a start after ``pause`` seconds) or
    SIGSTOP (and SIGCONT after ``pause``); ``hangs``: a worker enters a block
    meanwhile and hangs in it."""

    kind: Literal["kill", "stop"]
    pause: float
    hangs: bool = False

    @property
    def sort(self) -> str:
        return "stop" if self.kind == "stop" else "paused kill" if self.pause else "kill"


def outage_plan(rng: random.Random, kills: int, stops: int, hung: int) -> list[Outage]:
    """``kills`` SIGKILLs, every other one followed by a pause longer than a block's
    timeout, and ``stops`` SIGSTOPs as long, in a random order; ``hung`` of each
    sort with a block hung meanwhile."""
    kill: list[Literal["kill", "stop"]] = ["kill"]
    stop: list[Literal["kill", "stop"]] = ["stop"]
    kinds = kill * kills + stop * stops
    rng.shuffle(kinds)
    plan: list[Outage] = []
    for kind in kinds:
        paused = kind == "stop" or sum(o.kind == "kill" for o in plan) % 2 == 1
        pause = rng.uniform(BLOCK_TIMEOUT + 0.05, BLOCK_TIMEOUT + 0.2) if paused else 0.0
        plan.append(Outage(kind, pause))
    for sort in ("paused kill", "kill", "stop"):
        of_sort = [index for index, outage in enumerate(plan) if outage.sort == sort]
        for index in rng.sample(of_sort, min(hung, len(of_sort))):
            plan[index] = dataclasses.replace(plan[index], hangs=True)
    return plan


@dataclass
class Figures:
    """What a run of outages did."""

    outages: Counter[str] = dataclasses.field(default_factory=Counter)
    #: How long each start took, from its launch until the daemon answered.
    starts: list[float] = dataclasses.field(default_factory=list)
    #: Of each hung block: (its sort of outage, how late it died after its
    #: deadline, how long after the daemon was back (started or continued)).
    hung: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)


def outages_under_blocks(
    daemon: RunningDaemon,
    plan: list[Outage],
    rng: random.Random,
    workers: list[subprocess.Popen[str]],
    victims: list[HungOnCue],
) -> Figures:
    """Carry out ``plan`` while ``workers`` run their loops; after each outage,
    each worker must still run and each hung victim must have been killed (the
    start, or the SIGCONT, brought it back within a look, or within a start when
    its deadline passed meanwhile)."""
    figures = Figures()
    for number, outage in enumerate(plan, 1):
        # Longer than a client's longest pause between reconnects (`RECONNECT_PAUSE`): a
        # scope's first arm, lost to one kill, is sent again before the next one
        # (lost twice, it raises DaemonUnavailable, by design).
        time.sleep(rng.uniform(0.3, 0.45))
        if outage.kind == "kill":
            daemon.stop(signal.SIGKILL)
        else:
            os.kill(daemon.pid, signal.SIGSTOP)
        out = time.monotonic()
        victim = victims.pop() if outage.hangs else None
        deadline = None if victim is None else victim.hang()
        pause = (
            outage.pause
            if deadline is None or not outage.pause
            else max(outage.pause, deadline + 0.05 - out)
        )
        time.sleep(max(0.0, out + pause - time.monotonic()))
        back = time.monotonic()
        if outage.kind == "kill":
            daemon.start()
            figures.starts.append(time.monotonic() - back)
        else:
            os.kill(daemon.pid, signal.SIGCONT)
        figures.outages[outage.sort] += 1
        if victim is not None and deadline is not None:
            died = death_time(victim.process)
            assert victim.process.wait() == -signal.SIGKILL
            figures.hung.append((outage.sort, died - deadline, died - back))
            # Never before its deadline (it printed it a little after its store).
            assert died > deadline - 0.01, (outage, died - deadline)
            started = figures.starts[-1] if outage.kind == "kill" else 0.0
            assert died - max(deadline, back) < started + 0.3, (outage, figures.hung[-1])
        for worker in workers:
            if worker.poll() is not None:
                _, stderr = worker.communicate()
                raise AssertionError(f"worker {worker.pid} died at outage {number}: {stderr}")
    return figures


def test_kills_and_stops_of_the_daemon_under_fast_blocks_kill_only_the_hung_ones(
    restartable: RunningDaemon, tmp_path: Path
) -> None:
    """A blocking and a trio worker run tight loops of ~1 ms blocks under 0.5 s
    timers, mostly of scopes registered before the outages begin, some of scopes
    registered during them, while the daemon is SIGKILLed at random instants
    (restarted at once or, every other time, after a pause longer than the
    timeout) and now and then SIGSTOPped as long. No block of a registered scope
    makes a request or fails; no worker is killed; none has a timer left armed
    once its loop ends; and a block entered while the daemon is out, and hung,
    is killed once it is back: within a start of it after a kill, within a look
    after a SIGCONT. The seed is printed (``WATCHDOGD_SEED`` sets it)."""
    rng = seeded()
    kills, stops, hung = (200, 20, 6) if SOAK else (14, 2, 1)
    plan = outage_plan(rng, kills, stops, hung)
    victims: list[HungOnCue] = []
    try:
        # One at a time: a first block, which maps its page, can take half a
        # second beside a dozen interpreters starting at once on a busy machine.
        for index in range(sum(outage.hangs for outage in plan)):
            victims.append(HungOnCue(restartable, tmp_path / f"hang{index}"))
            wait_ready(victims[-1].process)
        loops = ["client", "trio"]
        loops_under_outages(restartable, tmp_path, loops, plan, rng, victims=victims)
    finally:
        for victim in victims:
            reap(victim.process)


@pytest.mark.skipif(not SOAK, reason="torch's import alone is past the share: make soak")
def test_kills_of_the_daemon_under_torchs_own_blocks_kill_no_worker(
    restartable: RunningDaemon, tmp_path: Path
) -> None:
    """The same through torch's own ``expires()`` with the adapter as its client.
    Under soak only: torch alone takes longer to import than the suite's share
    for these tests."""
    pytest.importorskip("torch")
    rng = seeded()
    plan = outage_plan(rng, 40, 0, 0)
    loops_under_outages(restartable, tmp_path, ["torch"], plan, rng, victims=[])


def seeded() -> random.Random:
    """A random generator whose seed is printed (``WATCHDOGD_SEED`` sets it)."""
    seed = int(os.environ.get("WATCHDOGD_SEED") or random.randrange(2**32))
    print(f"seed {seed}")
    return random.Random(seed)


def loops_under_outages(
    daemon: RunningDaemon,
    tmp_path: Path,
    loops: list[str],
    plan: list[Outage],
    rng: random.Random,
    *,
    victims: list[HungOnCue],
) -> None:
    """Run ``loops`` of blocks (`TRIO_LOOP` for "trio", `BLOCKING_LOOP` through
    "client" or "torch") through the outages of ``plan`` (`outages_under_blocks`),
    then end them: no block of a scope registered before the outages made a
    request, no timer of theirs is left armed, fires, or is found armed at their
    exit, and the daemon logged no error."""
    stop = tmp_path / "stop"
    socket = daemon.socket_path
    sources = {"trio": TRIO_LOOP}
    workers = [
        python_worker(sources.get(via, BLOCKING_LOOP), str(stop), "0.3", via, socket=socket)
        for via in loops
    ]
    try:
        for worker in workers:
            wait_ready(worker)
        figures = outages_under_blocks(daemon, plan, rng, workers, list(victims))
        stop.touch()
        ran = [ended_loop(worker) for worker in workers]
        print(f"outages {dict(figures.outages)}; starts took {summary(figures.starts)}")
        print(f"blocks ran {ran}")
        print(
            f"hung blocks died, after their deadline and after the daemon was back: "
            f"{[(sort, round(late, 3), round(after, 3)) for sort, late, after in figures.hung]}"
        )
        assert [loop["requests"] for loop in ran] == [0] * len(workers), ran
        assert min(loop["new"] for loop in ran) >= 2  # scopes registered during the outages
        pids = {worker.pid for worker in workers}
        time.sleep(BLOCK_TIMEOUT + 0.3)  # a timer left armed would fall due meanwhile
        with daemon.client(fast=False) as client:
            assert [t for t in client.status().timers if t.pid in pids] == []
            for worker in workers:
                assert worker.stdin is not None
                worker.stdin.close()
                assert worker.wait(timeout=PATIENCE) == 0
            wait_until(
                lambda: client.status_page(limit=1).daemon.processes == 0,
                what="the workers' exits",
            )
            events = [e for e in client.events(limit=1000).events if e.pid in pids]
        assert [(e.kind, e.pid, e.note) for e in events] == []
        assert "Traceback" not in daemon.log()
    finally:
        for worker in workers:
            reap(worker)


def ended_loop(worker: subprocess.Popen[str]) -> dict[str, float]:
    """What a worker's loop ran, as it printed it once it saw its ``stop`` file."""
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line:
        _, stderr = worker.communicate()
        raise AssertionError(f"worker {worker.pid} ended: {stderr}")
    ran: dict[str, float] = json.loads(line)
    return ran


def summary(seconds: list[float]) -> str:
    """Median and largest of ``seconds``."""
    if not seconds:
        return "none"
    return f"median {statistics.median(seconds):.3f}s, largest {max(seconds):.3f}s"


#: A worker whose first block of a scope is acknowledged by a daemon that dies
#: before the worker has its slot page: the worker asks for the page only once the
#: daemon that granted it has exited (it SIGKILLs it at that instant itself, the
#: one instant a random kill would rarely hit), and then hangs in the block.
FIRST_ARM_THEN_CRASH = """
import os, select, signal, sys, time
import watchdogd_client.client
from watchdogd_client import Client
daemon = os.pidfd_open(int(sys.argv[1]))
map_page = watchdogd_client.client.map_page

def after_the_crash(place, page, *, timeout):
    signal.pidfd_send_signal(daemon, signal.SIGKILL)
    select.select([daemon], [], [])
    return map_page(place, page, timeout=timeout)

watchdogd_client.client.map_page = after_the_crash
with Client(timeout=2.0).expires(0.5, scope="first"):
    print(time.monotonic(), flush=True)
    time.sleep(600)
"""


def test_an_acknowledged_first_arm_whose_page_died_with_the_daemon_still_fires(
    restartable: RunningDaemon,
) -> None:
    """The arm was acknowledged, so its block is protected across the crash, page
    or no page: once the daemon is back, the hung worker is killed, at most a
    restart grace after its deadline or the start. (Its entry may wait for the
    daemon's start: the block's first arm is a request.)"""
    socket = restartable.socket_path
    worker = python_worker(FIRST_ARM_THEN_CRASH, str(restartable.pid), socket=socket)
    try:
        assert restartable.process is not None
        assert restartable.process.wait(timeout=PATIENCE) == -signal.SIGKILL  # by the worker
        time.sleep(0.3)
        started = time.monotonic()
        restartable.start()
        assert worker.stdout is not None
        deadline = float(worker.stdout.readline()) + BLOCK_TIMEOUT
        died = death_time(worker)
        assert worker.wait() == -signal.SIGKILL
        assert died - max(deadline, started) < RESTART_GRACE + 1.0
    finally:
        reap(worker)
