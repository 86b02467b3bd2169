"""The trio client: one pipelined connection for many tasks, async expires(), and
every request the blocking client makes, answered as the blocking client's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from watchdogd_client import DaemonUnavailable, ErrorCode, RequestRefused
from watchdogd_client.trio import AsyncClient, open_client

from helpers.daemon import RunningDaemon
from helpers.fake_daemon import fake_daemon_as
from helpers.namespaces import in_private_mounts
from helpers.per_user import AFTER, HUNG, IMPOSTOR, PER_USER, worker_of_other
from helpers.processes import python_worker, reap, released_while_frozen, sleeper, wait_ready
from helpers.users import NOBODY
from helpers.waiting import PATIENCE


async def mine(client: AsyncClient) -> dict[str, float]:
    return {t.scope: t.remaining for t in (await client.status()).timers if t.pid == os.getpid()}


async def test_requests(daemon: RunningDaemon) -> None:
    async with open_client(str(daemon.socket_path)) as client:
        assert await client.ping() >= 0
        assert await client.acquire("a", 60) == 60
        assert await client.release("a") is True
        assert await client.release("a") is False
        with pytest.raises(RequestRefused) as caught:
            await client.acquire("a", 60, policy="nope")
        assert caught.value.code == ErrorCode.UNKNOWN_POLICY
        assert await mine(client) == {}


async def test_many_tasks_share_one_pipelined_connection(daemon: RunningDaemon) -> None:
    # Every request over the socket: the fast path would store most of them.
    async with open_client(str(daemon.socket_path), fast=False) as client:

        async def work(n: int) -> None:
            for i in range(20):
                scope = f"task{n}-{i % 3}"
                assert await client.acquire(scope, 60) == 60
                assert await client.release(scope) is True

        async with trio.open_nursery() as nursery:
            for n in range(50):
                nursery.start_soon(work, n)
        status = await client.status()
        assert status.daemon.connections == 1
        assert status.daemon.requests >= 50 * 20 * 2
        assert await mine(client) == {}


async def test_expires_release_renew_and_default_scopes(daemon: RunningDaemon) -> None:
    async with open_client(str(daemon.socket_path)) as client:
        scopes: list[str] = []

        async def guarded() -> None:
            async with client.expires(30) as timer:
                scopes.append(timer.scope)
                await timer.renew(60)
                assert (await mine(client))[timer.scope] > 50
                await timer.release()
                await timer.release()
                assert timer.scope not in await mine(client)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(guarded, name="loader")
            nursery.start_soon(guarded, name="loader")
        # The same line in two tasks of the same name: two timers, never one.
        assert len(set(scopes)) == 2
        assert all(scope.startswith(f"{__file__}:") for scope in scopes)
        assert {scope.rsplit("@", 1)[1].split("#")[0] for scope in scopes} == {"loader"}
        assert await mine(client) == {}


async def test_progress_and_learned_timeouts(daemon: RunningDaemon) -> None:
    """The trio client carries progress and asks for learned timeouts as the
    blocking one does."""
    async with open_client(str(daemon.socket_path)) as client:
        with pytest.raises(ValueError, match="needs a ceiling"):
            client.expires("auto")
        async with client.expires("auto", "learned", ceiling=20, floor=1) as timer:
            await timer.renew(progress=3)
            assert (await mine(client))["learned"] > 19
            await timer.renew(progress=4)
        with daemon.client() as blocking:
            [learned] = [row for row in blocking.suggest() if row.scope == "learned"]
        assert (learned.scope, learned.count) == ("learned", 1)
        assert await client.acquire("other", 5, progress=1) == 5


async def test_an_exception_or_a_cancellation_releases(daemon: RunningDaemon) -> None:
    async with open_client(str(daemon.socket_path)) as client:
        with pytest.raises(KeyError, match="boom"):
            async with client.expires(30, "raises"):
                raise KeyError("boom")
        with trio.move_on_after(0.1):
            async with client.expires(30, "cancelled"):
                await trio.sleep_forever()
        assert await mine(client) == {}


async def test_no_daemon(tmp_path: Path) -> None:
    async with open_client(str(tmp_path / "none.sock")) as client:
        with pytest.raises(DaemonUnavailable, match="no socket there"):
            await client.ping()


async def test_a_frame_over_the_bound_is_refused_not_unreachable(daemon: RunningDaemon) -> None:
    # The daemon refuses while the client is still sending the frame. Were it to
    # close with the rest unread, the client could now and then see the reset
    # before the refusal: 200 tries show it.
    for _ in range(200):
        async with open_client(str(daemon.socket_path)) as client:
            await client.ping()
            with pytest.raises(RequestRefused) as caught:
                await client.acquire("x" * (4 * 1024 * 1024), 5)
            assert caught.value.code == ErrorCode.FRAME_TOO_LARGE
            await client.ping()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: other users, mounts")
def test_a_trio_worker_never_speaks_to_another_users_socket_at_its_own_path() -> None:
    # As tests/e2e/test_client.py's worker of uid 4321, on trio.
    async def hung_block() -> None:
        async with open_client() as client, client.expires(after=AFTER):
            await trio.sleep(HUNG)

    def scenario() -> Any:
        with fake_daemon_as(NOBODY, PER_USER, directory_mode=0o755) as impostor:
            return worker_of_other(lambda: trio.run(hung_block)), impostor()

    outcome, seen = in_private_mounts(scenario)
    assert outcome["raised"].startswith(IMPOSTOR), outcome
    assert outcome["seconds"] < AFTER
    assert seen["connections"] == 0


def test_a_trio_program_releases_early_survives_then_hangs_and_is_killed(
    daemon: RunningDaemon,
) -> None:
    worker = python_worker(
        """
        import trio
        from watchdogd_client.trio import open_client

        async def main():
            async with open_client() as client:
                async with client.expires(after=0.5) as timer:
                    await timer.release()
                    await trio.sleep(1.0)  # unprotected: outlives the timeout
                print("ready", flush=True)
                async with client.expires(after=0.5):
                    await trio.sleep(30)

        trio.run(main)
        """,
        socket=daemon.socket_path,
    )
    try:
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        reap(worker)


FROZEN_EXIT = """
import sys, time
import trio
from watchdogd_client.paths import client_socket_path
from watchdogd_client.responder import process_responder
from watchdogd_client.trio import open_client

async def main():
    async with open_client(timeout=5.0, fast=False) as client:
        async with client.expires(after=60, scope="frozen"):
            while not process_responder().carries(client_socket_path()):
                await trio.sleep(0.005)
            print("ready", flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)
            ended = time.monotonic()
        print(time.monotonic() - ended, flush=True)
    print(time.monotonic() - ended, flush=True)
    await trio.sleep(600)

trio.run(main)
"""


def test_a_blocks_exit_does_not_wait_for_the_daemon(daemon: RunningDaemon) -> None:
    """The release of an ``async with`` block is sent and read by the connection's
    reader: a daemon that answers nothing for a while (frozen here) costs the block's
    exit nothing, the client's close waits at most 2 s for the answer, and the
    release lands once the daemon runs again."""
    block_exit, close = released_while_frozen(daemon, FROZEN_EXIT, 2)
    # A release that waited would wait out the client's 5 s timeout and raise.
    assert block_exit < 1.0
    assert 1.5 < close < 4.0  # the close's bounded wait


async def test_reconnects_after_a_daemon_restart(daemon: RunningDaemon) -> None:
    async with open_client(str(daemon.socket_path)) as client:
        await client.acquire("kept", 60)
        await trio.to_thread.run_sync(daemon.stop, signal.SIGKILL)
        await trio.to_thread.run_sync(daemon.start)
        assert await client.release("kept") is True  # the timer survived, the client reconnected


def test_without_trio_the_import_error_says_what_to_install() -> None:
    # None in sys.modules makes `import trio` fail as it does where trio is absent.
    code = (
        "import sys\n"
        "sys.modules['trio'] = None\n"
        "try:\n"
        "    import watchdogd_client.trio\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("ImportError watchdogd_client.trio needs trio")
    assert "pip install './client[trio]'" in result.stdout
    assert ".whl[trio]'" in result.stdout


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    with trio.move_on_after(PATIENCE):
        while not await check():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"no {what} within {PATIENCE} s")


async def test_events_are_read_and_waited_for_as_the_blocking_client_reads_them(
    daemon: RunningDaemon,
) -> None:
    victim = sleeper()
    try:
        async with open_client(str(daemon.socket_path)) as client:
            last = (await client.events()).last
            assert await client.acquire("doomed", 0.2, pid=victim.pid) == 0.2
            # The daemon holds the reply until an event comes: the expiry.
            seen = await client.events(after=last, wait=PATIENCE)
            assert seen.events
            assert seen.events[0].seq > last
            await eventually(
                lambda: _expired(client, victim.pid, last), "the expiry among the events"
            )
            mine = (await client.events(after=last)).events
        with daemon.client() as blocking:
            assert blocking.events(after=last).events[: len(mine)] == mine
    finally:
        reap(victim)


async def _expired(client: AsyncClient, pid: int, after: int) -> bool:
    events = (await client.events(after=after, limit=1000)).events
    return any(e.kind == "expired" and e.pid == pid for e in events)


async def test_status_is_read_a_page_at_a_time(daemon: RunningDaemon) -> None:
    async with open_client(str(daemon.socket_path), fast=False) as client:
        for n in range(3):
            await client.acquire(f"paged-{n}", 60)
        scopes, cursor, pages = [], None, 0
        while True:
            page = await client.status_page(limit=1, cursor=cursor)
            assert len(page.timers) == 1
            scopes += [timer.scope for timer in page.timers_with_commands()]
            pages += 1
            cursor = page.cursor
            if cursor is None:
                break
        assert sorted(scopes) == ["paged-0", "paged-1", "paged-2"]
        assert pages == 3
        assert page.daemon.timers == 3


async def test_policies_and_metrics_are_the_daemons(daemon: RunningDaemon) -> None:
    async with open_client(str(daemon.socket_path)) as client:
        policies = await client.policies()
        metrics = await client.metrics()
    with daemon.client() as blocking:
        expected = blocking.policies()
        families = {line for line in blocking.metrics().splitlines() if line.startswith("# TYPE")}
    assert (policies.default, policies.policies) == (expected.default, expected.policies)
    assert "kill" in {policy.name for policy in policies.policies}
    assert {line for line in metrics.splitlines() if line.startswith("# TYPE")} == families
    assert "watchdogd_requests_total" in metrics


async def test_suggest_reads_what_the_daemon_learned(daemon: RunningDaemon) -> None:
    async with open_client(str(daemon.socket_path)) as client:
        async with client.expires("auto", "learning", ceiling=20):
            pass
        [learned] = [row for row in await client.suggest() if row.scope == "learning"]
        assert learned.count == 1
    with daemon.client() as blocking:
        assert [row for row in blocking.suggest() if row.scope == "learning"] == [learned]


async def test_an_expired_ranks_incident_hangs_and_why_are_read(daemon: RunningDaemon) -> None:
    victim = sleeper()
    try:
        async with open_client(str(daemon.socket_path)) as client:
            await client.acquire("step", 0.2, pid=victim.pid, job="trio-job", rank=3)
            await trio.to_thread.run_sync(victim.wait)

            async def listed() -> bool:
                return any(i.job == "trio-job" for i in await client.incidents())

            await eventually(listed, "the rank's incident")
            [summary] = [i for i in await client.incidents(limit=10) if i.job == "trio-job"]

            async def settled() -> bool:
                verdict = (await client.incident(summary.id)).verdict
                return verdict is not None and verdict.settled

            # Read once it no longer changes: the blocking client reads it again below.
            await eventually(settled, "the incident's verdict")
            incident = await client.incident(summary.id)
            why = await client.why(victim.pid)
            hangs = await client.hangs("trio-job")
        assert (incident.job, incident.rank, incident.scope) == ("trio-job", 3, "step")
        assert [(rank.rank, rank.role) for rank in incident.ranks] == [(3, "expired")]
        assert summary.id in {i.id for i in why.incidents}
        assert why.pid == victim.pid
        assert hangs.job == "trio-job"
        with daemon.client() as blocking:
            assert blocking.incident(summary.id) == incident
            same = blocking.hangs("trio-job")
        assert (hangs.uid, hangs.hangs) == (same.uid, same.hangs)
    finally:
        reap(victim)


async def test_a_timer_its_process_exit_releases_leaves_no_exited_event(
    daemon: RunningDaemon,
) -> None:
    command, other = sleeper(), sleeper()
    try:
        async with open_client(str(daemon.socket_path)) as client:
            last = (await client.events()).last
            await client.acquire("command", 60, pid=command.pid, exit_releases=True)
            await client.acquire("other", 60, pid=other.pid)
            for victim in (command, other):
                victim.terminate()
                await trio.to_thread.run_sync(victim.wait)

            async def released() -> bool:
                timers = (await client.status()).timers
                return not [t for t in timers if t.pid in (command.pid, other.pid)]

            await eventually(released, "the exits' releases")
            events = (await client.events(after=last)).events
        # The process whose timer was armed without exit_releases exited; the other
        # ended as a command is expected to.
        exited = {e.pid for e in events if e.kind == "exited"}
        assert (other.pid in exited, command.pid in exited) == (True, False)
    finally:
        reap(command)
        reap(other)
