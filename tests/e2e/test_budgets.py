"""What one user can make the daemon hold or do, end to end, with callers of uid 65534.

Counts are scaled down to keep the suite short; ``bench/budgets.py`` runs the same
scenarios at full scale (256 connections, 10,000 timers, 20,000 requests).
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from watchdogd_client import Client, RequestRefused
from watchdogd_protocol import MAX_REPLY_BYTES, Hello, Status, encode_frame

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.processes import at_units_priority_all, reap, rss_mib, sleeper
from helpers.users import NOBODY, as_nobody
from helpers.waiting import wait_until

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as uid 65534")

CONFIG = """
[daemon]
send_timeout = 2
events = 100
events_per_uid = 100
max_scope_bytes = 1024
"""

CONNECTIONS = 128
TIMERS = 2000
WORKERS = 20
POLL_SECONDS = 5.0


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as running:
        yield running


def nobody_workers(count: int) -> list[subprocess.Popen[bytes]]:
    """Processes of uid 65534 with 4 KiB command lines, each the leader of a
    process group of its own, which `end_workers` kills whole (the shell's
    ``sleep`` too)."""
    padding = ["x" * 63] * 64
    return [
        subprocess.Popen(
            ["sh", "-c", "sleep 300; :", *padding],
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            process_group=0,
        )
        for _ in range(count)
    ]


def end_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        reap(worker)


async def _pollers(path: str, seconds: float) -> list[int]:
    """Connections asking for the largest status pages; a quarter read every reply
    (and return the longest frame they saw), the rest never read. Those begin once
    a reader has read a page: once they fill the uid's budget, a reader waits for
    room as they do and may never be the one that gets it."""
    hello = encode_frame(Hello(id=0, version=1))
    burst = b"".join(encode_frame(Status(id=i, limit=10_000)) for i in range(1, 5))
    stop = trio.current_time() + seconds
    longest = [0]
    page_read = trio.Event()

    async def poller(reads: bool) -> None:
        if not reads:
            with trio.move_on_at(stop):
                await page_read.wait()
        while trio.current_time() < stop:
            try:
                stream = await trio.open_unix_socket(path)
            except OSError:
                await trio.sleep(0.05)
                continue
            async with stream:
                with (
                    trio.move_on_at(stop),
                    contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
                ):
                    await stream.send_all(hello)
                    pending = b""
                    while True:
                        await stream.send_all(burst)
                        if not reads:
                            await trio.sleep(0.01)
                            continue
                        frames = 0
                        while frames < 5:  # the welcome first, then four pages
                            data = await stream.receive_some(1 << 20)
                            if not data:
                                return
                            pending += data
                            while len(pending) >= 4:
                                (length,) = struct.unpack_from(">I", pending)
                                if len(pending) < 4 + length:
                                    break
                                longest[0] = max(longest[0], length)
                                if length > MAX_REPLY_BYTES // 2:  # a page
                                    page_read.set()
                                pending = pending[4 + length :]
                                frames += 1
                        hello_seen = frames - 4
                        assert hello_seen in (0, 1)

    async with trio.open_nursery() as nursery:
        for index in range(CONNECTIONS):
            nursery.start_soon(poller, index % 4 == 0)
    return longest


def test_many_connections_asking_for_big_pages_hold_little_and_delay_nothing(
    daemon: RunningDaemon,
) -> None:
    """Root's timers stay on time while uid 65534's connections ask for pages as
    large as a reply may be and never read them; the daemon runs at the shipped
    unit's priority, as deployed."""
    at_units_priority_all(daemon.pid)
    workers = nobody_workers(WORKERS)
    victims: list[subprocess.Popen[bytes]] = []
    read_end, write_end = os.pipe()
    try:
        with daemon.client() as client:
            for index in range(TIMERS):
                # Long scopes make each page as large as a reply may be.
                scope = f"step-{index:05d}-" + "s" * 500
                client.acquire(scope, 300, pid=workers[index % WORKERS].pid)
        baseline = rss_mib(daemon.pid)
        flooder = os.fork()
        if flooder == 0:  # pragma: no cover - the hostile user
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                frames = trio.run(_pollers, str(daemon.socket_path), POLL_SECONDS)
                os.write(write_end, str(frames[0]).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        peak = 0.0
        started = time.monotonic()
        with daemon.client() as client:
            time.sleep(1.0)  # let the pollers pile up
            while time.monotonic() - started < POLL_SECONDS - 1.5:
                victim = sleeper()
                victims.append(victim)
                client.acquire("root-timer", 0.3, pid=victim.pid)
                until = time.monotonic() + 0.6
                while time.monotonic() < until:
                    peak = max(peak, rss_mib(daemon.pid))
                    time.sleep(0.02)
            with os.fdopen(read_end) as pipe:
                longest = int(pipe.read() or 0)
            os.waitpid(flooder, 0)
            pids = {victim.pid for victim in victims}
            late = [
                event.late
                for event in client.events(after=0, limit=1000).events
                if event.kind == "expired" and event.pid in pids and event.late is not None
            ]
            status = client.status()
    finally:
        end_workers(workers)
        for victim in victims:
            reap(victim)
    assert len(late) == len(victims) >= 3
    assert max(late) < 0.1, f"a root timer fired {max(late) * 1000:.1f} ms late"
    assert peak < 256, f"daemon RSS peaked at {peak:.0f} MiB"
    # Unbounded, each connection that never reads holds a page and more (~1.3 MiB).
    assert peak - baseline < 64, f"daemon RSS grew from {baseline:.0f} to {peak:.0f} MiB"
    # Pages as large as a reply may be were served, and none larger.
    assert MAX_REPLY_BYTES * 0.9 < longest <= MAX_REPLY_BYTES
    assert len(status.timers) == TIMERS
    commands = {t.command for t in status.timers}
    assert len(commands) == 1
    [command] = commands
    assert command.startswith("sh -c sleep 300; : xxx")
    assert len(command.encode()) <= 1024
    assert command.endswith("…")


def test_thread_ids_are_refused_without_a_traceback(daemon: RunningDaemon) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    requests = 2000
    try:
        tid = thread.native_id
        assert tid is not None
        before = daemon.log_path.stat().st_size
        codes: dict[str, int] = {}
        with daemon.client() as client:
            for _ in range(requests):
                try:
                    client.acquire("x", 60, pid=tid)
                    code = "ok"
                except RequestRefused as exc:
                    code = exc.code
                    message = exc.message
                codes[code] = codes.get(code, 0) + 1
            client.ping()
        added = daemon.log_path.stat().st_size - before
    finally:
        stop.set()
        thread.join()
    assert codes == {"not_a_process": requests}
    assert message == f"pid {tid} is a thread of process {os.getpid()}; name the process"
    assert added < 10 * 1024, daemon.log()[-2000:]
    assert "Traceback" not in daemon.log()


def test_a_flood_of_events_leaves_roots_events_readable(daemon: RunningDaemon) -> None:
    root_victim = sleeper()
    try:
        with daemon.client() as client:
            for index in range(5):
                client.acquire(f"root-{index}", 0.001, policy="log", pid=root_victim.pid)
            wait_until(lambda: len(client.events(after=0).events) == 5, what="root's five expiries")
        flood = 2000

        def expire_many(client: Client) -> int:
            for index in range(flood):
                client.acquire(f"flood-{index}", 0.001, policy="log")
            time.sleep(1.1)  # a token back: the next line is let through
            client.acquire("flood-last", 0.001, policy="log")
            time.sleep(0.2)
            return len(client.events(after=0, limit=10_000).events)

        nobody_sees = as_nobody(expire_many, daemon.socket_path)["ok"]
        with daemon.client() as client:
            wait_until(
                lambda: client.events(limit=1).last >= 6 + flood, what="every expiry recorded"
            )
            seen = client.events(after=0, limit=10_000).events
    finally:
        reap(root_victim)
    roots = sorted(e.scope for e in seen if e.uid == 0 and e.kind == "expired")
    assert roots == [f"root-{index}" for index in range(5)]
    assert nobody_sees <= 100
    assert len([e for e in seen if e.uid == NOBODY]) == 100
    # The log names the flood's lines it held back instead of writing each one.
    log = daemon.log()
    assert "suppressed=" in log
    assert log.count("event=expired") < 200
