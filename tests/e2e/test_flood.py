"""A local user floods the daemon with hostile connections; a legitimate timer of
another user still fires on time, and the daemon's memory stays bounded."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from watchdogd_protocol import Acquire, Hello, Ping, Status, encode_frame

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.processes import reap, rss_mib, sleeper
from helpers.users import NOBODY
from helpers.waiting import PATIENCE, wait_until

#: How long the flood goes on at least, and at most: past the least, until the
#: daemon has logged the limits it reached (a loaded machine gets there later).
FLOOD_SECONDS = 5.0
MOST_FLOOD_SECONDS = 60.0
#: What the daemon logs of the flood: replies left unread past `send_timeout`, a
#: frame left partial past `partial_frame_timeout`.
FLOOD_EVENTS = ("event=unread_replies", "event=partial_frame_timeout")
CONNECTIONS_PER_KIND = 40

CONFIG = """
[daemon]
send_timeout = 1
partial_frame_timeout = 1
"""


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as running:
        yield running


HELLO = encode_frame(Hello(id=0, version=1))


async def _garbage(stream: trio.SocketStream, rng: random.Random) -> None:
    while True:
        await stream.send_all(rng.randbytes(512))
        await stream.receive_some(65536)


async def _huge_header(stream: trio.SocketStream, rng: random.Random) -> None:
    await stream.send_all(HELLO + struct.pack(">I", 2**32 - 1))
    while await stream.receive_some(65536):
        pass


async def _deep_nesting(stream: trio.SocketStream, rng: random.Random) -> None:
    body = b"\x91" * 60_000 + b"\x00"
    await stream.send_all(HELLO + struct.pack(">I", len(body)) + body)
    while await stream.receive_some(65536):
        pass


async def _never_reads(stream: trio.SocketStream, rng: random.Random) -> None:
    burst = b"".join(encode_frame(Status(id=i)) for i in range(200))
    await stream.send_all(HELLO)
    while True:
        await stream.send_all(burst)


async def _slowloris(stream: trio.SocketStream, rng: random.Random) -> None:
    for byte in encode_frame(Ping(id=1)) * 100:
        await stream.send_all(bytes([byte]))
        await trio.sleep(0.2)


async def _idle(stream: trio.SocketStream, rng: random.Random) -> None:
    await trio.sleep_forever()


async def _spam(stream: trio.SocketStream, rng: random.Random) -> None:
    await stream.send_all(HELLO)
    for i in range(1_000_000):
        scope = f"spam-{rng.random()}-{i}"
        await stream.send_all(encode_frame(Acquire(id=i, scope=scope, timeout=3600)))
        await stream.receive_some(65536)


BEHAVIOURS = [_garbage, _huge_header, _deep_nesting, _never_reads, _slowloris, _idle, _spam]


async def _hostile(path: str, behaviour: Any, stop: float) -> None:
    """One misbehaving client, reconnecting whenever the daemon drops it."""
    rng = random.Random(behaviour.__name__)
    while trio.current_time() < stop:
        try:
            stream = await trio.open_unix_socket(path)
        except OSError:
            await trio.sleep(0.05)
            continue
        async with stream:
            with (
                trio.move_on_at(stop),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
            ):
                await behaviour(stream, rng)


async def _flood(path: str) -> None:
    stop = trio.current_time() + MOST_FLOOD_SECONDS
    async with trio.open_nursery() as nursery:
        for behaviour in BEHAVIOURS:
            for _ in range(CONNECTIONS_PER_KIND):
                nursery.start_soon(_hostile, path, behaviour, stop)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as uid 65534")
def test_a_flood_of_hostile_clients_does_not_delay_a_legitimate_timer(
    daemon: RunningDaemon,
) -> None:
    flooder = os.fork()
    if flooder == 0:  # pragma: no cover - the hostile user
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            trio.run(_flood, str(daemon.socket_path))
        finally:
            os._exit(0)
    began = time.monotonic()
    victim = sleeper()
    try:
        time.sleep(1.0)  # let the flood build up
        with daemon.client() as client:
            client.acquire("legitimate", 1.5, pid=victim.pid)
            peak_rss = 0.0
            while victim.poll() is None:
                peak_rss = max(peak_rss, rss_mib(daemon.pid))
                time.sleep(0.05)
            assert victim.returncode == -signal.SIGKILL

            def expired() -> bool:
                return any(
                    e.kind == "expired" and e.pid == victim.pid for e in client.events().events
                )

            wait_until(expired, what="the legitimate expiry", timeout=PATIENCE)
            [event] = [e for e in client.events(limit=1000).events if e.pid == victim.pid]

            def flooded() -> bool:
                nonlocal peak_rss
                peak_rss = max(peak_rss, rss_mib(daemon.pid))
                log = daemon.log()
                return time.monotonic() >= began + FLOOD_SECONDS and all(
                    logged in log for logged in FLOOD_EVENTS
                )

            wait_until(flooded, what=f"the flood's {FLOOD_EVENTS} in the log", timeout=60)
            os.kill(flooder, signal.SIGKILL)
            os.waitpid(flooder, 0)
            flooder = 0
            client.ping()  # still serving
            status = client.status().daemon
    finally:
        reap(victim)
        # (0 once reaped: its pid may be another process's by then.)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            if flooder > 0:
                os.kill(flooder, signal.SIGKILL)
                os.waitpid(flooder, 0)
    assert event.late is not None
    assert event.late < 0.1, f"{event.late * 1000:.1f} ms late under the flood"
    assert peak_rss < 100, f"daemon RSS peaked at {peak_rss:.0f} MiB"
    # The flood's timers were bounded by the per-uid limit, and were all on
    # processes of uid 65534.
    assert status.timers <= 10_000
