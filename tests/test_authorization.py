"""Who may arm and release timers on whom, with real callers of uid 65534.

A caller "as nobody" is a fork of the test process that has dropped to uid/gid
65534 before connecting, so the daemon sees exactly what it would see from an
unprivileged worker: the kernel's SO_PEERCRED credentials.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from watchdogd_client import Client, RequestRefused, WatchdogdError
from watchdogd_client.trio import open_client

from conftest import PATIENCE, RunningDaemon, configured_daemon, reap, sleeper, wait_until

NOBODY = 65534

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


def as_nobody(action: Callable[[Client], Any], socket: Path) -> dict[str, Any]:
    """Run ``action`` with a client in a child running as uid/gid 65534; returns
    ``{"ok": result}``, ``{"refused": code}`` or ``{"error": text}``."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - reports through the pipe
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with Client(socket) as client:
                outcome: dict[str, Any] = {"ok": action(client)}
        except RequestRefused as exc:
            outcome = {"refused": exc.code, "message": exc.message}
        except BaseException as exc:
            outcome = {"error": repr(exc)}
        os.write(write_end, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        outcome = json.loads(pipe.read())
    os.waitpid(child, 0)
    return outcome


def nobody_sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], user=NOBODY, group=NOBODY, extra_groups=[])


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
