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

from watchdogd.runtime.scrape import MAX_CONNECTIONS

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


def test_idle_connections_are_bounded_and_the_page_comes_back(
    socket_path: Path, tmp_path: Path
) -> None:
    extra = 4
    with scraped_daemon(socket_path, tmp_path) as url:
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        with contextlib.ExitStack() as stack:
            idle = [
                stack.enter_context(socket.create_connection((host, int(port))))
                for _ in range(MAX_CONNECTIONS + extra)
            ]
            # The daemon holds as many as it serves at once, and closes the rest.
            closed: set[int] = set()

            def extras_closed() -> bool:
                for index, held in enumerate(idle):
                    held.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        if held.recv(1) == b"":
                            closed.add(index)
                return len(closed) >= extra

            wait_until(extras_closed, what="the connections past the bound closed")
            time.sleep(0.2)
            extras_closed()
            assert len(closed) == extra
        assert fetch(url)[0] == 200  # their slots came back


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
