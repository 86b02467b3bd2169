"""``--metrics-listen``: the Prometheus page over HTTP, bounded in what a scrape
costs, naming no job unless the operator says so; and ``watchdogctl metrics``
naming to a non-root user its own jobs alone."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdogd.runtime.scrape import HEAD_TIMEOUT, MAX_CONNECTIONS

from helpers.daemon import RunningDaemon
from helpers.etcd import free_ports
from helpers.processes import reap, sleeper
from helpers.users import NOBODY, as_nobody, nobody_sleeper
from helpers.waiting import PATIENCE, wait_until

WATCHDOGD = [sys.executable, "-m", "watchdogd"]


@contextlib.contextmanager
def scraped_daemon(socket_path: Path, tmp_path: Path, *extra: str) -> Iterator[str]:
    """A daemon serving its metrics on a free loopback port: the page's URL."""
    [port] = free_ports(1)
    running = RunningDaemon(
        socket_path, tmp_path / "log", ["--no-state", "--metrics-listen", str(port), *extra]
    )
    running.start()
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        assert running.stop() == 0, running.log()
    assert f"event=metrics_listening address=127.0.0.1:{port}" in running.log()


def fetch(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, dict(refused.headers), refused.read().decode()


def test_the_page_and_what_is_not_it(socket_path: Path, tmp_path: Path) -> None:
    with scraped_daemon(socket_path, tmp_path) as url:
        status, headers, body = fetch(url)
        assert status == 200
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "watchdogd_timers_armed 0.0" in body
        assert fetch(url, "HEAD")[0::2] == (200, "")
        assert fetch(url.replace("/metrics", "/other"))[0] == 404
        status, headers, _ = fetch(url, "POST")
        assert (status, headers["Allow"]) == (405, "GET, HEAD")
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 400 ")


def closed_by_daemon(conn: socket.socket) -> bool:
    """Whether the daemon closed ``conn`` (without a word)."""
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_past_the_bound_the_busiest_address_gives_way_and_a_scrape_is_answered(
    socket_path: Path, tmp_path: Path
) -> None:
    """One connection from 127.0.0.2, half its request sent, then more idle ones
    from 127.0.0.1 than the daemon holds: only 127.0.0.1's oldest are closed, a
    scrape is answered at once, and 127.0.0.2's request, completed, is too."""
    extra = 4
    with scraped_daemon(socket_path, tmp_path) as url:
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        with contextlib.ExitStack() as stack:
            other = stack.enter_context(
                socket.create_connection((host, int(port)), source_address=("127.0.0.2", 0))
            )
            other.sendall(b"GET /metrics HTTP/1.1\r\n")
            idle = [
                stack.enter_context(socket.create_connection((host, int(port))))
                for _ in range(MAX_CONNECTIONS + extra)
            ]
            opened = time.monotonic()
            # Room for the last `extra` and for 127.0.0.2's, which came first.
            wait_until(
                lambda: sum(map(closed_by_daemon, idle[: extra + 2])) == extra + 1,
                what="the oldest connections past the bound closed",
            )
            assert fetch(url)[0] == 200
            assert [i for i, conn in enumerate(idle) if closed_by_daemon(conn)] == [
                *range(extra + 2)  # and one more for the scrape
            ]
            assert time.monotonic() - opened < HEAD_TIMEOUT, "the machine was too slow to tell"
            other.setblocking(True)
            other.sendall(b"Host: watchdogd\r\n\r\n")
            assert other.recv(100).startswith(b"HTTP/1.1 200 ")


def test_a_request_head_must_come_whole_within_the_head_timeout(
    socket_path: Path, tmp_path: Path
) -> None:
    """A head trickled in a byte every 0.2 s is cut off `HEAD_TIMEOUT` after the
    connect, however steadily it comes, and gets no answer."""
    with scraped_daemon(socket_path, tmp_path) as url:
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        head = b"GET /metrics HTTP/1.1\r\nHost: watchdogd\r\nX-Padding: " + b"x" * 100
        with socket.create_connection((host, int(port))) as slow:
            began = time.monotonic()
            slow.setblocking(False)
            heard = None
            for byte in head:
                with contextlib.suppress(BlockingIOError):
                    try:
                        heard = slow.recv(100)
                    except ConnectionResetError:  # closed with a byte unread
                        heard = b""
                    break
                with contextlib.suppress(OSError):
                    slow.send(bytes([byte]))
                time.sleep(0.2)
            lasted = time.monotonic() - began
        assert heard == b"", heard
        assert HEAD_TIMEOUT <= lasted < HEAD_TIMEOUT + 1.0, lasted
        assert fetch(url)[0] == 200


def test_jobs_are_named_only_when_turned_on(socket_path: Path, tmp_path: Path) -> None:
    worker = sleeper()
    try:
        for extra, named in (((), False), (("--metrics-jobs",), True)):
            with scraped_daemon(socket_path, tmp_path, *extra) as url:
                client = RunningDaemon(socket_path, tmp_path / "unused", []).client()
                with client:
                    client.acquire("step", 60, pid=worker.pid, job="secret-run", rank=0)
                _, _, body = fetch(url)
                assert ('job="secret-run"' in body) is named, body
                assert "watchdogd_job_processes" in body
    finally:
        reap(worker)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as uid 65534")
def test_watchdogctl_metrics_names_to_a_user_its_own_jobs_alone(daemon: RunningDaemon) -> None:
    theirs, mine = sleeper(), nobody_sleeper()
    try:
        os.chmod(daemon.socket_path.parent, 0o755)
        with daemon.client() as client:
            client.acquire("step", 60, pid=theirs.pid, job="root-run", rank=0)
        shown = as_nobody(
            lambda client: [
                client.acquire("step", 60, pid=mine.pid, job="nobody-run", rank=0),
                client.metrics(),
            ][1],
            daemon.socket_path,
        )
        assert f'{{job="nobody-run",uid="{NOBODY}"}}' in shown["ok"]
        assert "root-run" not in shown["ok"]
        with daemon.client() as client:
            everything = client.metrics()
        assert 'job="root-run"' in everything
        assert 'job="nobody-run"' in everything
    finally:
        reap(theirs)
        reap(mine)


def test_an_address_it_cannot_listen_on_stops_the_start(socket_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for address, said in (
            (str(port), f"--metrics-listen {port}: cannot listen: Address already in use"),
            ("host:abc", "write HOST:PORT, [IPV6]:PORT or PORT (on 127.0.0.1)"),
        ):
            started = subprocess.run(
                [*WATCHDOGD, "--socket", str(socket_path), "--no-state", "--metrics-listen",
                 address],
                capture_output=True, text=True, check=False, timeout=PATIENCE,
            )  # fmt: skip
            assert started.returncode == 1
            assert said in started.stderr
            assert "Traceback" not in started.stderr
            assert not socket_path.exists()
