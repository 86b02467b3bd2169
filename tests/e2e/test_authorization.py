"""Who may arm and release timers on whom, with real callers of uid 65534.

A caller "as nobody" is a fork of the test process that has dropped to uid/gid
65534 before connecting, so the daemon sees exactly what it would see from an
unprivileged worker: the kernel's SO_PEERCRED credentials.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from watchdogd_client import Client, RequestRefused, WatchdogdError
from watchdogd_client.trio import open_client
from watchdogd_protocol import EventInfo

from helpers.canaries import Canary
from helpers.daemon import RunningDaemon, configured_daemon, ctl
from helpers.processes import (
    at_units_priority_all,
    gone,
    python_worker,
    reap,
    sleeper,
    wait_ready,
)
from helpers.users import NOBODY, as_nobody, mixed_family, nobody_sleeper
from helpers.waiting import PATIENCE, wait_until

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as uid 65534")

CONFIG = """
[daemon]
max_timers_per_uid = 3
max_connections_per_uid = 4

[policies.privileged]
root_only = true
steps = [ { signal = "SIGKILL" } ]
"""


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as running:
        yield running


def test_nobody_may_arm_on_itself(daemon: RunningDaemon) -> None:
    def arm_self(client: Client) -> list[float]:
        return [client.acquire("mine", 60), client.acquire("explicit", 60, pid=os.getpid())]

    assert as_nobody(arm_self, daemon.socket_path) == {"ok": [60, 60]}


def test_nobody_may_not_touch_a_root_process(daemon: RunningDaemon) -> None:
    root_victim = sleeper()
    try:
        pid = root_victim.pid
        outcome = as_nobody(lambda c: c.acquire("x", 0.1, pid=pid), daemon.socket_path)
        assert outcome["refused"] == "permission_denied"
        assert f"uid {NOBODY} may not signal pid {pid}" in outcome["message"]
        # Root arms one; nobody may not release it either.
        with daemon.client() as client:
            client.acquire("roots", 60, pid=pid)
        outcome = as_nobody(lambda c: c.release("roots", pid=pid), daemon.socket_path)
        assert outcome["refused"] == "permission_denied"
        with daemon.client() as client:
            assert [t.scope for t in client.status().timers if t.pid == pid] == ["roots"]
            assert client.release("roots", pid=pid)
        with pytest.raises(subprocess.TimeoutExpired):
            root_victim.wait(timeout=0.5)  # never signalled
    finally:
        reap(root_victim)


def test_nobody_may_arm_on_another_nobody_process(daemon: RunningDaemon) -> None:
    victim = nobody_sleeper()
    try:
        pid = victim.pid
        assert as_nobody(lambda c: c.acquire("theirs", 0.2, pid=pid), daemon.socket_path) == {
            "ok": 0.2
        }
        assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        reap(victim)


def test_root_may_arm_on_anyone(daemon: RunningDaemon) -> None:
    victims = [nobody_sleeper(), sleeper()]
    try:
        with daemon.client() as client:
            for victim in victims:
                client.acquire("root's", 0.2, pid=victim.pid)
        for victim in victims:
            assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        for victim in victims:
            reap(victim)


def test_nobody_may_target_neither_init_nor_the_daemon(daemon: RunningDaemon) -> None:
    for pid in (1, daemon.pid):
        outcome = as_nobody(functools.partial(_arm_on, pid), daemon.socket_path)
        assert outcome["refused"] == "permission_denied"
        with daemon.client() as client, pytest.raises(RequestRefused) as caught:
            client.acquire("x", 60, pid=pid)
        assert caught.value.code == "permission_denied"


def _arm_on(pid: int, client: Client) -> float:
    return client.acquire("x", 60, pid=pid)


def test_missing_pid(daemon: RunningDaemon) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    outcome = as_nobody(lambda c: c.acquire("x", 60, pid=gone.pid), daemon.socket_path)
    assert outcome["refused"] == "no_such_process"


def test_root_only_policies_are_for_root(daemon: RunningDaemon) -> None:
    outcome = as_nobody(lambda c: c.acquire("x", 60, policy="privileged"), daemon.socket_path)
    assert outcome["refused"] == "permission_denied"
    assert "root only" in outcome["message"]
    with daemon.client() as client:
        client.acquire("x", 60, policy="privileged")
        client.release("x")


def test_root_only_policies_stay_root_only_on_another_target(daemon: RunningDaemon) -> None:
    for name in ("group:privileged", "tree:privileged", "process:privileged"):
        arm = functools.partial(Client.acquire, scope="x", timeout=60, policy=name)
        assert as_nobody(arm, daemon.socket_path)["refused"] == "permission_denied", name


@pytest.mark.parametrize("policy", ["group:kill", "tree:kill"])
def test_a_built_in_group_or_tree_policy_signals_only_what_its_owner_could_kill(
    daemon: RunningDaemon, policy: str
) -> None:
    """As ``watchdogctl run`` arms them: uid 65534 arms on its own process, whose
    group and tree hold a root process; that one is left alone."""
    family, root_child = mixed_family()
    try:
        outcome = as_nobody(
            lambda c: c.acquire("run", 0.2, policy=policy, pid=family.pid), daemon.socket_path
        )
        assert outcome == {"ok": 0.2}
        assert family.wait(timeout=PATIENCE) == -signal.SIGKILL
        with daemon.client() as client:
            wait_until(
                lambda: any(e.kind == "expired" for e in client.events().events),
                what="the expiry",
            )
            [event] = [e for e in client.events().events if e.kind == "expired"]
        assert event.policy == policy
        assert [step.result for step in event.steps] == ["sent SIGKILL to 1 process"]
        assert not gone(root_child)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(root_child, signal.SIGKILL)
        reap(family)


def test_nobody_sees_only_its_own_timers_and_events(daemon: RunningDaemon) -> None:
    root_victim, nobody_victim = sleeper(), nobody_sleeper()
    try:
        with daemon.client() as client:
            client.acquire("root-timer", 60, pid=root_victim.pid)
            client.acquire("root-expiry", 0.1, pid=root_victim.pid)
            client.acquire("nobody-expiry", 0.1, pid=nobody_victim.pid)
            wait_until(
                lambda: len([e for e in client.events().events if e.kind == "expired"]) == 2,
                what="both expiries",
            )

        def look(client: Client) -> dict[str, Any]:
            client.acquire("nobody-timer", 60)
            return {
                "timers": [(t.scope, t.uid) for t in client.status().timers],
                "events": [(e.kind, e.scope) for e in client.events().events],
            }

        seen = as_nobody(look, daemon.socket_path)["ok"]
        assert seen["timers"] == [["nobody-timer", NOBODY]]
        assert seen["events"] == [["expired", "nobody-expiry"]]
    finally:
        reap(root_victim)
        reap(nobody_victim)


def test_per_uid_limits_bind_nobody_not_root(daemon: RunningDaemon) -> None:
    def fill(client: Client) -> list[str]:
        results = []
        for i in range(4):
            try:
                client.acquire(f"t{i}", 60)
                results.append("ok")
            except RequestRefused as exc:
                results.append(exc.code)
        return results

    assert as_nobody(fill, daemon.socket_path) == {"ok": ["ok", "ok", "ok", "limit_exceeded"]}
    with daemon.client() as client:
        for i in range(10):
            client.acquire(f"root-{i}", 60)

    def connect_many(_: Client) -> list[str]:
        results = []
        clients = [Client(daemon.socket_path) for _ in range(5)]
        for extra in clients:
            try:
                extra.ping()
                results.append("ok")
            except RequestRefused as exc:
                results.append(exc.code)
        for extra in clients:
            extra.close()
        return results

    outcome = as_nobody(connect_many, daemon.socket_path)
    assert outcome == {"ok": ["ok", "ok", "ok", "ok", "limit_exceeded"]}
    with daemon.client() as client:
        client.ping()  # root is not affected


#: A root worker that arms timers on itself and changes its uids when told to.
CHANGING = """
    import os, sys
    from watchdogd_client import Client
    client = Client()
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "arm":
            client.acquire(args[0], float(args[1]))
        elif command == "setresuid":
            os.setresuid(*map(int, args))
        print("done", flush=True)
    """


def tell(worker: subprocess.Popen[str], command: str) -> None:
    assert worker.stdin is not None
    assert worker.stdout is not None
    worker.stdin.write(command + "\n")
    worker.stdin.flush()
    assert worker.stdout.readline() == "done\n"


def uids_of(pid: int) -> list[int]:
    line = next(
        line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line[:4] == "Uid:"
    )
    return [int(field) for field in line.split()[1:]]


def test_a_process_that_dropped_privileges_is_judged_by_its_uids_now(
    daemon: RunningDaemon,
) -> None:
    worker = python_worker(CHANGING, socket=daemon.socket_path)
    try:
        wait_ready(worker)
        tell(worker, "arm while-root 60")  # armed while root: the daemon read uid 0
        tell(worker, "arm root-fires 3")
        tell(worker, f"setresuid {NOBODY} {NOBODY} {NOBODY}")
        assert uids_of(worker.pid) == [NOBODY] * 4
        pid = worker.pid
        # uid 65534 may signal it now, so it may arm and release its timers.
        assert as_nobody(lambda c: c.acquire("nobody's", 60, pid=pid), daemon.socket_path) == {
            "ok": 60
        }
        assert as_nobody(lambda c: c.release("while-root", pid=pid), daemon.socket_path) == {
            "ok": True
        }
        with daemon.client() as client:
            scopes = {(t.scope, t.uid) for t in client.status().timers if t.pid == pid}
        assert scopes == {("nobody's", NOBODY), ("root-fires", 0)}
        # A timer root armed acts on the process whatever its uids have become.
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        reap(worker)


def test_a_process_that_regained_root_is_out_of_reach_of_its_former_uid(
    daemon: RunningDaemon,
) -> None:
    worker = python_worker(CHANGING, socket=daemon.socket_path)
    try:
        wait_ready(worker)
        # Real and effective uid 65534, saved uid 0: as a setuid-root program that
        # has set its effective uid back to the user's, and may take root again.
        tell(worker, f"setresuid {NOBODY} {NOBODY} 0")
        pid = worker.pid

        def arm_two(client: Client) -> list[float]:
            return [client.acquire("fires", 3.0, pid=pid), client.acquire("held", 60, pid=pid)]

        assert as_nobody(arm_two, daemon.socket_path) == {"ok": [3.0, 60]}
        tell(worker, "setresuid 0 0 0")
        for action in (
            lambda c: c.acquire("more", 60, pid=pid),
            lambda c: c.release("held", pid=pid),
        ):
            outcome = as_nobody(action, daemon.socket_path)
            assert outcome["refused"] == "permission_denied"
            assert "(real uid 0, saved uid 0)" in outcome["message"]
        # At the deadline uid 65534 may not signal it either: nothing is done to it.
        with daemon.client() as client:
            found: list[Any] = []

            def expired() -> bool:
                found[:] = [e for e in client.events().events if e.kind == "expired"]
                return bool(found)

            wait_until(expired, what="the expiry")
        [event] = found
        assert (event.pid, event.scope, event.outcome) == (pid, "fires", "alive")
        assert [(s.step, s.result) for s in event.steps] == [("SIGKILL", "skipped: not allowed")]
        assert f"uid {NOBODY} may no longer signal pid {pid}" in event.note
        assert worker.poll() is None
        tell(worker, "arm still-alive 60")
    finally:
        reap(worker)


def test_a_daemon_run_by_an_ordinary_user_cannot_act_on_anyone_else(tmp_path: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="wd-user-", dir="/tmp"))
    os.chown(directory, NOBODY, NOBODY)
    socket_path = directory / "watchdogd.sock"
    log = tmp_path / "log"
    running = RunningDaemon(
        socket_path,
        log,
        ["--no-state"],
        command=[
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--",
            *[sys.executable, "-m", "watchdogd", "--socket", str(socket_path)],
        ],
    )
    running.start()
    root_victim, own_victim = sleeper(), nobody_sleeper()
    try:
        with running.client() as client:
            # Root may ask, but this daemon has no privilege to act on root's process.
            client.acquire("out-of-reach", 0.1, pid=root_victim.pid)
            client.acquire("its-users", 0.1, pid=own_victim.pid)
            found: list[Any] = []

            def expired() -> bool:
                found[:] = [e for e in client.events().events if e.kind == "expired"]
                return len(found) == 2

            wait_until(expired, what="both expiries")
        results = {e.scope: (e.outcome, [s.result for s in e.steps]) for e in found}
        assert results == {
            "out-of-reach": ("alive", ["not permitted to send SIGKILL"]),
            "its-users": ("exited", ["sent SIGKILL"]),
        }
        assert root_victim.poll() is None
        assert own_victim.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        assert running.stop() == 0, running.log()
        reap(root_victim)
        reap(own_victim)
        shutil.rmtree(directory, ignore_errors=True)


def test_a_caller_at_its_limit_learns_nothing_of_anothers_scopes(daemon: RunningDaemon) -> None:
    root_victim = sleeper()
    try:
        pid = root_victim.pid
        with daemon.client() as client:
            client.acquire("roots", 60, pid=pid)

        def probe(client: Client) -> list[str]:
            for i in range(3):
                client.acquire(f"t{i}", 60)  # at the limit of 3 from here on
            results = []
            for scope in ("roots", "absent"):
                try:
                    client.acquire(scope, 60, pid=pid)
                    results.append("ok")
                except RequestRefused as exc:
                    results.append(exc.code)
            return results

        outcome = as_nobody(probe, daemon.socket_path)
        assert outcome == {"ok": ["permission_denied", "permission_denied"]}
    finally:
        reap(root_victim)


def test_over_the_connection_limit_the_refusal_always_arrives(daemon: RunningDaemon) -> None:
    # The daemon reads the hello before it refuses and closes, so the client never
    # writes into a closed connection and never mistakes the refusal for a daemon
    # that is down.
    rounds = 1000

    def over_the_limit(unused: Client) -> dict[str, int]:
        held = [Client(daemon.socket_path) for _ in range(4)]
        for client in held:
            client.ping()
        seen: dict[str, int] = {}
        for _ in range(rounds):
            with Client(daemon.socket_path) as extra:
                try:
                    extra.ping()
                    code = "ok"
                except WatchdogdError as exc:
                    code = getattr(exc, "code", type(exc).__name__)
            seen[code] = seen.get(code, 0) + 1

        async def trio_rounds() -> None:
            for _ in range(rounds // 10):
                async with open_client(str(daemon.socket_path)) as extra:
                    try:
                        await extra.ping()
                        code = "trio ok"
                    except WatchdogdError as exc:
                        code = "trio " + getattr(exc, "code", type(exc).__name__)
                seen[code] = seen.get(code, 0) + 1

        trio.run(trio_rounds)
        for client in held:
            client.close()
        return seen

    outcome = as_nobody(over_the_limit, daemon.socket_path)
    assert outcome == {"ok": {"limit_exceeded": rounds, "trio limit_exceeded": rounds // 10}}


def test_timers_of_root_and_of_nobody_falling_due_together_each_kill_once(
    daemon: RunningDaemon,
) -> None:
    """Root's timers take the short way to their first signal (`Executor._send_first`),
    nobody's the way that checks first that nobody may still signal its process:
    falling due within the same few milliseconds, each victim dies once, with
    one event each."""
    roots = [sleeper() for _ in range(12)]
    nobodys = [nobody_sleeper() for _ in range(3)]
    try:
        due = 1.0
        with daemon.client() as client:
            for victim in roots:
                client.acquire("together", due, pid=victim.pid)
            pids = [victim.pid for victim in nobodys]
            outcome = as_nobody(
                lambda c: [c.acquire("together", due, pid=pid) for pid in pids],
                daemon.socket_path,
            )
            assert outcome == {"ok": [due] * 3}
            for victim in roots + nobodys:
                assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
            events: list[EventInfo] = []

            def recorded() -> bool:
                events[:] = [e for e in client.events(limit=100).events if e.scope == "together"]
                return len(events) >= 15

            wait_until(recorded, what="an event for every victim")
    finally:
        for victim in roots + nobodys:
            reap(victim)
    assert sorted(event.pid for event in events) == sorted(v.pid for v in roots + nobodys)
    for event in events:
        assert [step.result for step in event.steps] == ["sent SIGKILL"], event
        assert event.outcome == "exited", event
        assert event.late is not None, event
        assert event.late >= 0, event
    assert {event.uid for event in events if event.pid in pids} == {NOBODY}


#: A worker of uid 65534 with one block of scope S2: armed, it waits for a line on
#: its stdin, ends its block (its release names its arming) and makes one more
#: request, whose answer comes after the release's.
ONE_BLOCK_AS_NOBODY = """
import os, sys
from watchdogd_client import Client
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
client = Client()
with client.expires(after=30, scope="S2"):
    print("ready", flush=True)
    sys.stdin.readline()
client.ping()
print("released", flush=True)
sys.stdin.readline()
"""


#: ``watchdogctl arm`` of the test, but its ``--pid``.
REARM = ("arm", "--scope", "S2", "--timeout", "600", "--policy", "term")
#: The same re-arm by another process of uid 65534.
REARM_AS_NOBODY = """
import os, sys
from watchdogd_client import Client
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
with Client() as client:
    client.acquire("S2", 600, policy="term", pid=int(sys.argv[1]))
"""


@pytest.mark.parametrize("by", ["root", "nobody"])
def test_a_workers_late_release_never_disarms_a_newer_arming_whoever_made_it(
    daemon: RunningDaemon, by: str
) -> None:
    """A worker of uid 65534 arms S2; ``watchdogctl arm --pid W --scope S2 --timeout
    600 --policy term`` re-arms it, run by root, or the same from another process
    of the worker's user; then the worker's block ends, and its release names its
    own arming. The newer arming stays: 600 s under ``term``. (When each process
    numbered its own armings, the first of each was 1, and the release disarmed
    the newer arming.)"""
    worker = python_worker(ONE_BLOCK_AS_NOBODY, socket=daemon.socket_path)
    canary_client = daemon.client()
    try:
        wait_ready(worker)
        # A root canary due while the two armings and the late release go on.
        at_units_priority_all(daemon.pid)  # as deployed, as the canary is timed
        canary = Canary(canary_client, 1.0)
        if by == "root":
            done = ctl(daemon.socket_path, *REARM, "--pid", str(worker.pid))
        else:
            done = subprocess.run(
                [sys.executable, "-c", REARM_AS_NOBODY, str(worker.pid)],
                env={**os.environ, "WATCHDOGD_SOCKET": str(daemon.socket_path)},
                capture_output=True,
                text=True,
                check=False,
            )
        assert done.returncode == 0, done.stderr
        assert worker.stdin is not None
        assert worker.stdout is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "released"
        with daemon.client() as client:
            [timer] = [t for t in client.status().timers if t.pid == worker.pid]
        assert (timer.scope, timer.policy) == ("S2", "term")
        assert timer.remaining > 500
        assert worker.poll() is None
        assert canary.lateness() < 0.1
        canary.close()
    finally:
        canary_client.close()
        reap(worker)
