"""The per-uid budgets at full scale, as issue 10 states them; needs root.

Scenarios, each against a fresh daemon started as a user would start it:

- reply memory: 10,000 timers on 100 processes of uid 65534 whose command lines are
  4 KiB each; 256 connections of uid 65534 ask for status pages of up to 10,000
  timers (half read their replies, half never do) while root timers expire. Prints
  the daemon's peak RSS and the latest root expiry, with the reply budget at its
  defaults and, for comparison, with it set out of reach;
- 20,000 acquire requests naming a thread id: the replies' codes and the bytes they
  added to the daemon's log;
- a flood of expiry events by uid 65534: whether root still reads its own latest
  expiry events;
- connections over the per-uid limit: how many of 1,000 got ``limit_exceeded``.

Run with ``.venv/bin/python bench/budgets.py`` (``--quick`` divides the counts by 10).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from watchdogd_client import Client, RequestRefused, WatchdogdError
from watchdogd_protocol import Hello, Status, encode_frame

NOBODY = 65534


@contextlib.contextmanager
def daemon(config: str) -> Iterator[tuple[Path, subprocess.Popen[bytes], Path]]:
    directory = Path(tempfile.mkdtemp(prefix="wd-bench-", dir="/tmp"))
    os.chmod(directory, 0o755)
    socket_path = directory / "watchdogd.sock"
    (directory / "watchdogd.toml").write_text(config)
    log_path = directory / "log"
    command = [sys.executable, "-m", "watchdogd", "--socket", str(socket_path), "--no-state"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, "--config", str(directory / "watchdogd.toml")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 10
    while True:
        try:
            with Client(socket_path, timeout=1) as client:
                client.ping()
            break
        except WatchdogdError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield socket_path, process, log_path
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def as_nobody(action: Callable[[], Any]) -> Any:
    """Run ``action`` in a child of uid 65534; returns what it returned."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = action()
        except BaseException as exc:
            result = {"error": repr(exc)}
        os.write(write_end, json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    os.waitpid(child, 0)
    return json.loads(text)


def nobody_workers(count: int) -> list[subprocess.Popen[bytes]]:
    """Processes of uid 65534 whose command lines are 4 KiB long."""
    padding = ["x" * 63] * 64  # 64 words of 64 bytes with their separators
    return [
        subprocess.Popen(
            ["sh", "-c", "sleep 3600; :", *padding],
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
        )
        for _ in range(count)
    ]


async def _pollers(path: str, connections: int, seconds: float, page: int) -> None:
    hello = encode_frame(Hello(id=0, version=1))
    burst = b"".join(encode_frame(Status(id=i, limit=page)) for i in range(1, 5))
    stop = trio.current_time() + seconds

    async def poller(reads: bool) -> None:
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
                    while True:
                        await stream.send_all(burst)
                        if reads:
                            got = 0
                            while got < 4 * 1024 * 1024 // 2 and (
                                data := await stream.receive_some(1 << 20)
                            ):
                                got += len(data)
                        else:
                            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        for index in range(connections):
            nursery.start_soon(poller, index % 2 == 0)


def reply_memory(scale: int, budget: bool) -> dict[str, float]:
    config = "[daemon]\nsend_timeout = 2\n"
    if not budget:
        config += "reply_bytes_per_uid = 1073741824\nreply_bytes = 17179869184\n"
    timers = 10_000 // scale
    workers = nobody_workers(max(1, 100 // scale))
    victims: list[subprocess.Popen[bytes]] = []
    try:
        with daemon(config) as (socket_path, process, _):
            with Client(socket_path) as client:
                for index in range(timers):
                    worker = workers[index % len(workers)]
                    client.acquire(f"worker/step-{index:05d}", 3600, pid=worker.pid)
            baseline = rss_mib(process.pid)
            seconds = 12.0
            flooder = os.fork()
            if flooder == 0:
                try:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                    trio.run(_pollers, str(socket_path), 256 // scale, seconds, 10_000)
                finally:
                    os._exit(0)
            peak = baseline
            started = time.monotonic()
            with Client(socket_path, timeout=30) as client:
                time.sleep(1.0)
                while time.monotonic() - started < seconds - 2:
                    victim = subprocess.Popen(["sleep", "300"])
                    victims.append(victim)
                    client.acquire("root-timer", 0.5, pid=victim.pid)
                    until = time.monotonic() + 1.0
                    while time.monotonic() < until:
                        peak = max(peak, rss_mib(process.pid))
                        time.sleep(0.02)
                while os.waitpid(flooder, os.WNOHANG) == (0, 0):
                    peak = max(peak, rss_mib(process.pid))
                    time.sleep(0.02)
                pids = {victim.pid for victim in victims}
                late = [
                    event.late
                    for event in client.events(after=0, limit=10_000).events
                    if event.kind == "expired" and event.pid in pids and event.late is not None
                ]
            return {
                "timers": timers,
                "connections": 256 // scale,
                "baseline_rss_mib": baseline,
                "peak_rss_mib": peak,
                "root_expiries": len(late),
                "root_expiries_expected": len(victims),
                "max_late_ms": max(late) * 1000 if late else float("nan"),
            }
    finally:
        for child in workers + victims:
            child.kill()
            child.wait()


def thread_ids(scale: int) -> dict[str, Any]:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with daemon("") as (socket_path, _, log_path):
            before = log_path.stat().st_size
            codes: dict[str, int] = {}
            tid = thread.native_id
            assert tid is not None
            with Client(socket_path) as client:
                for _ in range(20_000 // scale):
                    try:
                        client.acquire("x", 60, pid=tid)
                        code = "ok"
                    except RequestRefused as exc:
                        code = exc.code
                    codes[code] = codes.get(code, 0) + 1
            added = log_path.stat().st_size - before
            return {"requests": 20_000 // scale, "codes": codes, "log_bytes_added": added}
    finally:
        stop.set()
        thread.join()


def event_flood(scale: int) -> dict[str, Any]:
    root_victim = subprocess.Popen(["sleep", "300"])
    try:
        with daemon("") as (socket_path, _, log_path):
            with Client(socket_path) as client:
                for index in range(10):
                    client.acquire(f"root-{index}", 0.001, policy="log", pid=root_victim.pid)
                time.sleep(0.5)
            count = 20_000 // scale

            def flood() -> int:
                with Client(socket_path) as client:
                    for index in range(count):
                        client.acquire(f"flood-{index}", 0.001, policy="log")
                    time.sleep(0.5)
                    return len(client.events(after=0, limit=10_000).events)

            nobody_sees = as_nobody(flood)
            with Client(socket_path) as client:
                latest = client.events(after=0, limit=10_000).events
                roots = [e.scope for e in latest if e.uid == 0 and e.kind == "expired"]
                last = client.events(limit=1).last
            return {
                "nobody_expiries": count,
                "events_numbered": last,
                "nobody_still_sees": nobody_sees,
                "root_expiries_readable_by_root": len(roots),
                "log_lines": len(log_path.read_text().splitlines()),
            }
    finally:
        root_victim.kill()
        root_victim.wait()


def over_the_limit(scale: int) -> dict[str, Any]:
    config = "[daemon]\nmax_connections_per_uid = 4\n"
    rounds = 1000 // scale
    with daemon(config) as (socket_path, _, _):

        def attempt() -> dict[str, int]:
            held = [Client(socket_path) for _ in range(4)]
            for client in held:
                client.ping()
            seen: dict[str, int] = {}
            for _ in range(rounds):
                with Client(socket_path) as extra:
                    try:
                        extra.ping()
                        code = "ok"
                    except WatchdogdError as exc:
                        code = getattr(exc, "code", type(exc).__name__)
                seen[code] = seen.get(code, 0) + 1
            return seen

        return {"rounds": rounds, "outcomes": as_nobody(attempt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of every count")
    args = parser.parse_args()
    if os.getuid() != 0:
        sys.exit("run as root: the scenarios act as uid 65534")
    scale = 10 if args.quick else 1
    figures = {
        "reply memory, budget on": reply_memory(scale, budget=True),
        "reply memory, budget out of reach": reply_memory(scale, budget=False),
        "thread ids": thread_ids(scale),
        "event flood": event_flood(scale),
        "over the connection limit": over_the_limit(scale),
    }
    for name, values in figures.items():
        print(f"{name}: {json.dumps(values)}")


if __name__ == "__main__":
    main()
