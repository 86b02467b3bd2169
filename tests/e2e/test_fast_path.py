"""The fast path against a real daemon and real workers: after a scope's first
acknowledged arm its blocks are stores into the process's slot page, which send no
frame, wait for nothing, survive the daemon's stops and crashes, and still kill a
hung block on time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from watchdogd.host.slot_pages import MEMFD_NAME

from helpers.daemon import RunningDaemon, configured_daemon, ctl
from helpers.metrics import sample
from helpers.processes import (
    at_timing_priority,
    at_units_priority_all,
    death_time,
    python_worker,
    reap,
    wait_ready,
)
from helpers.waiting import PATIENCE, wait_until

#: A worker that does what its stdin says, one command a line, and answers each
#: with a line of JSON: ``blocks N AFTER SCOPE`` runs N empty blocks; ``hang AFTER
#: SCOPE`` enters a block, prints its entry time on CLOCK_MONOTONIC and sleeps in it;
#: ``arm``/``release SCOPE`` go through the client's acquire and release;
#: ``fork SCOPE`` forks a child that runs a block of SCOPE and exits 0; ``hold N``
#: opens N more descriptors and keeps them.
WORKER = """
import json, os, resource, sys, time
from watchdogd_client import Client
from watchdogd_client.responder import process_responder
client = Client(timeout=2.0, reconnect_timeout=1.0, on_unavailable=os.environ.get("ON", "raise"))
print("ready", flush=True)
for line in sys.stdin:
    command, *args = line.split()
    out = None
    try:
        if command == "blocks":
            count, after, scope = int(args[0]), float(args[1]), args[2]
            began = time.monotonic()
            for _ in range(count):
                with client.expires(after, scope=scope):
                    pass
            out = (time.monotonic() - began) / count
        elif command == "hang":
            with client.expires(float(args[0]), scope=args[1]):
                print(json.dumps(time.monotonic()), flush=True)
                time.sleep(600)
        elif command == "enter":
            timer = client.expires(float(args[0]), scope=args[1])
            timer.__enter__()
        elif command == "exit":
            timer.__exit__(None, None, None)
        elif command == "fork":
            pid = os.fork()
            if pid == 0:
                with client.expires(60, scope=args[0]):
                    pass
                os._exit(0)
            out = os.waitpid(pid, 0)[1]
        elif command == "responder":
            responder = process_responder()
            until = time.monotonic() + float(args[0])
            while not (responder and responder.registered) and time.monotonic() < until:
                time.sleep(0.01)
            out = bool(responder and responder.registered)
        elif command == "setresuid":
            os.setresuid(*map(int, args))
        elif command == "hold":
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            held = [os.open(os.devnull, os.O_RDONLY) for _ in range(int(args[0]))]
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)
"""


class Worker:
    """A worker process driven line by line."""

    def __init__(self, socket: Path, env: dict[str, str] | None = None) -> None:
        self.process = python_worker(WORKER, socket=socket, env=env)
        wait_ready(self.process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, line: str) -> object:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the worker ended: {self.process.stderr and self.process.stderr.read()}"
        return json.loads(answer)

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        reap(self.process)


def requests_seen(daemon: RunningDaemon) -> int:
    """How many requests the daemon answered before this count's own two (the
    hello of its connection and its status, counted once answered)."""
    with daemon.client(fast=False) as client:
        return client.status_page(limit=1).daemon.requests - 1


def slots_lost(daemon: RunningDaemon) -> float:
    """How many registrations the daemon let go without a block to fire (a
    process whose uids changed among them)."""
    with daemon.client(fast=False) as client:
        text = client.metrics()
    return sample(text, "watchdogd_slot_outcomes_total", outcome="lost") or 0.0


#: What one `requests_seen` adds to the next one's count: its hello and its status.
COUNTING = 2


def requests_settled(daemon: RunningDaemon, worker: Worker) -> int:
    """`requests_seen` once ``worker``'s responder, which connects on a thread of
    its own after the first arm and then sends two requests, says the daemon took
    the second, and no request came between two counts: what the worker's blocks
    are counted from."""
    assert worker.ask(f"responder {PATIENCE}") is True
    seen = [requests_seen(daemon)]

    def settled() -> bool:
        seen.append(requests_seen(daemon))
        return seen[-1] - seen[-2] == COUNTING

    wait_until(settled, what="no request but the count's own between two counts")
    return seen[-1]


def my_scopes(daemon: RunningDaemon, pid: int) -> dict[str, float]:
    with daemon.client(fast=False) as client:
        return {t.scope: t.remaining for t in client.status().timers if t.pid == pid}


def test_blocks_after_the_first_arm_send_no_frame(daemon: RunningDaemon) -> None:
    worker = Worker(daemon.socket_path)
    try:
        assert isinstance(worker.ask("blocks 1 60 step"), float)
        before = requests_settled(daemon, worker)
        assert isinstance(worker.ask("blocks 2000 60 step"), float)
        assert requests_seen(daemon) - before == COUNTING
        assert my_scopes(daemon, worker.pid) == {}
    finally:
        worker.close()


def test_a_block_hung_after_hundreds_of_fast_ones_dies_on_time_and_is_listed(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        # Timed as a canary is (`helpers.canaries`): the daemon at the shipped
        # unit's priority, the worker and the thread that sees its death with it.
        at_units_priority_all(daemon.pid)
        at_units_priority_all(worker.pid)
        worker.ask("blocks 500 0.5 step")
        worker.tell("hang 0.5 step")
        assert worker.process.stdout is not None
        entered = json.loads(worker.process.stdout.readline())
        listed = my_scopes(daemon, worker.pid)
        assert 0 < listed["step"] <= 0.5
        with at_timing_priority():
            died = death_time(worker.process)
        assert worker.process.wait() == -signal.SIGKILL
        assert 0.5 <= died - entered < 0.5 + 0.1
    finally:
        worker.close()


def test_the_seconds_a_block_is_held_are_learned_from_every_fast_block(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        worker.ask("blocks 30 60 learned")
        with daemon.client(fast=False) as client:
            [row] = [row for row in client.suggest() if row.scope == "learned"]
        assert row.count == 30
    finally:
        worker.close()


def test_the_blocks_of_a_worker_gone_before_the_daemons_next_look_are_learned(
    daemon: RunningDaemon,
) -> None:
    """Its exit reads its slots once more: every block counts, under the
    executable it ran, and its exit is handled whole (its process let go)."""
    source = """
from watchdogd_client import Client
client = Client()
for _ in range(30):
    with client.expires(60, scope="short-lived"):
        pass
"""
    worker = python_worker(source, socket=daemon.socket_path)
    try:
        assert worker.wait(timeout=PATIENCE) == 0, worker.communicate()
        with daemon.client(fast=False) as client:
            wait_until(
                lambda: client.status_page(limit=1).daemon.processes == 0,
                what="the worker's exit, handled",
            )
            rows = [row for row in client.suggest() if row.scope == "short-lived"]
        ran = os.path.realpath(sys.executable)
        assert [(row.count, row.executable) for row in rows] == [(30, ran)]
        assert "Traceback" not in daemon.log()
    finally:
        reap(worker)


def test_a_child_of_a_fork_registers_its_own_and_never_touches_its_parents_slot(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        worker.ask("blocks 3 60 shared")
        worker.ask("enter 60 shared")
        assert worker.ask("fork shared") == 0  # the child's block, armed and released
        assert "shared" in my_scopes(daemon, worker.pid)  # the parent's stays armed
        worker.ask("exit")
        assert my_scopes(daemon, worker.pid) == {}
    finally:
        worker.close()


def test_a_stopped_daemon_costs_a_registered_block_nothing_and_its_hang_dies_after(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        worker.ask("blocks 3 0.5 step")
        daemon.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            took = worker.ask("blocks 200 0.5 step")
            assert isinstance(took, float)
            assert took < 0.01  # no request, no wait
            worker.tell("hang 0.5 step")
            time.sleep(1.0)
            assert worker.process.poll() is None
        finally:
            daemon.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        woke = time.monotonic()
        died = death_time(worker.process)
        assert died - woke < 0.5
    finally:
        worker.close()


def test_a_block_entered_while_the_daemon_is_down_is_killed_after_its_restart(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        worker.ask("blocks 3 0.5 step")
        daemon.stop(signal.SIGKILL)
        worker.ask("blocks 100 0.5 step")  # released while it was down: nothing fires
        worker.tell("hang 0.5 step")
        time.sleep(0.8)
        daemon.start()
        started = time.monotonic()
        died = death_time(worker.process)
        assert died - started < 1.0
    finally:
        worker.close()


#: Restarts under which a worker registers a scope each: each begins a page.
RESTARTS = 6
#: Descriptors the worker holds besides its pages: each search reads them all.
CROWD = 2000


def slot_pages_held(pid: int) -> int:
    """How many slot pages process ``pid`` holds descriptors of."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return sum(link == f"/memfd:{MEMFD_NAME} (deleted)" for link in links)


def test_after_restarts_that_each_began_a_page_no_released_block_is_listed_as_armed(
    daemon: RunningDaemon,
) -> None:
    """A worker that registers a scope between restarts holds a page for each
    (and a crowd of other descriptors). From the first status after the next
    restart, none of its registrations, all released, is listed as armed; a
    block it entered in the oldest while the daemon was down still dies."""
    worker = Worker(daemon.socket_path)
    try:
        worker.ask(f"hold {CROWD}")
        for number in range(RESTARTS):
            worker.ask(f"blocks 2 0.5 s{number}")
            daemon.stop(signal.SIGKILL)
            daemon.start()
        assert slot_pages_held(worker.pid) == RESTARTS
        daemon.stop(signal.SIGKILL)
        daemon.start()
        started = time.monotonic()
        with daemon.client(fast=False) as client:
            while time.monotonic() < started + 0.3:
                assert [t for t in client.status().timers if t.pid == worker.pid] == []
        daemon.stop(signal.SIGKILL)
        worker.tell("hang 0.5 s0")
        time.sleep(0.8)
        daemon.start()
        back = time.monotonic()
        assert death_time(worker.process) - back < 1.0
    finally:
        worker.close()


def test_a_sigterm_closes_every_slot_and_a_block_then_finds_the_daemon_gone(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        worker.ask("blocks 3 60 step")
        assert daemon.stop(signal.SIGTERM) == 0
        outcome = worker.ask("blocks 1 60 step")
        assert isinstance(outcome, dict)
        assert outcome["error"] == "DaemonUnavailable"
    finally:
        worker.close()


def test_roots_arming_of_a_workers_scope_is_never_disarmed_by_its_stores(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        worker.ask("blocks 3 60 S2")
        worker.ask("enter 60 S2")
        armed = ctl(
            daemon.socket_path,
            "arm", "--pid", str(worker.pid), "--scope", "S2", "--timeout", "600",
            "--policy", "term",
        )  # fmt: skip
        assert armed.returncode == 0, armed.stderr
        worker.ask("exit")  # the worker's release, a store into its old slot
        remaining = my_scopes(daemon, worker.pid)
        assert 590 < remaining["S2"] <= 600
        with daemon.client(fast=False) as client:
            assert [t.policy for t in client.status().timers if t.pid == worker.pid] == ["term"]
    finally:
        worker.close()


def test_a_process_whose_uids_changed_loses_its_slot_and_arms_over_the_socket(
    daemon: RunningDaemon,
) -> None:
    worker = Worker(daemon.socket_path)
    try:
        # Blocks of a second: a look at its slot comes a second after its first,
        # and a worker held off the CPU by a loaded machine is not taken for hung.
        worker.ask("blocks 3 1 step")
        worker.ask("setresuid 65534 65534 0")
        wait_until(
            lambda: slots_lost(daemon) == 1,
            what="a look that finds its uids changed and lets its slot go",
        )
        before = requests_seen(daemon)
        # Blocks of seconds: over the socket, a release late on a loaded machine
        # must not be taken for a hang.
        worker.ask("blocks 3 5 step")
        # Its next block was armed over the socket, judged as uid 65534 now.
        assert requests_seen(daemon) - before > COUNTING
        worker.ask("enter 60 step")
        with daemon.client(fast=False) as client:
            assert [t.uid for t in client.status().timers if t.pid == worker.pid] == [65534]
    finally:
        worker.close()


def test_the_fast_path_is_off_for_a_worker_that_says_so(daemon: RunningDaemon) -> None:
    worker = Worker(daemon.socket_path, env={"WATCHDOGD_FAST": "0"})
    try:
        worker.ask("blocks 1 60 step")
        before = requests_seen(daemon)
        worker.ask("blocks 50 60 step")
        assert requests_seen(daemon) - before >= COUNTING + 50
    finally:
        worker.close()


def test_a_worker_in_another_time_namespace_arms_over_the_socket_and_is_protected(
    daemon: RunningDaemon,
) -> None:
    source = """
import sys, time
from watchdogd_client import Client
client = Client()
for _ in range(20):
    with client.expires(60, scope="step"):
        pass
print("ready", flush=True)
with client.expires(0.5, scope="step"):
    time.sleep(60)
"""
    command = ["unshare", "--time", "--monotonic", "86400", "--kill-child"]
    worker = subprocess.Popen(
        [*command, sys.executable, "-c", source],
        env={**os.environ, "WATCHDOGD_SOCKET": str(daemon.socket_path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "ready"
        with daemon.client(fast=False) as client:
            # Every block went over the socket: none could be stored.
            assert client.status_page(limit=1).daemon.requests >= 40
        assert worker.wait(timeout=PATIENCE) != 0
    finally:
        reap(worker)


IDLE = "[daemon]\nslot_idle = 0.3\n"


def test_a_registration_left_idle_is_reclaimed_and_the_next_block_registers_again(
    socket_path: Path, tmp_path: Path
) -> None:
    with configured_daemon(socket_path, tmp_path, IDLE) as daemon:
        worker = Worker(daemon.socket_path)
        try:
            worker.ask("blocks 3 0.5 step")
            with daemon.client(fast=False) as client:
                wait_until(
                    lambda: client.status_page(limit=1).daemon.processes == 0,
                    what="the idle registration to be retired",
                )
            before = requests_seen(daemon)
            worker.ask("blocks 20 0.5 step")
            assert 1 <= requests_seen(daemon) - before - COUNTING <= 3
        finally:
            worker.close()
