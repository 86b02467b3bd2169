"""A real Prometheus (and node_exporter) for tests: Debian's packages, started on
free loopback ports, and its HTTP API's answers."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from helpers.waiting import PATIENCE

INSTALL = "Debian's prometheus and prometheus-node-exporter (.ci/run installs them)"


@contextlib.contextmanager
def running(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running, its output in ``log``; stopped and reaped at the end."""
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def prometheus(config: Path, data: Path, port: int) -> list[str]:
    """The command of a Prometheus on ``port`` with ``config``, its data in ``data``."""
    return [
        "prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]  # fmt: skip


def series(url: str, promql: str) -> list[dict[str, Any]]:
    """What ``promql`` gives now, from the Prometheus at ``url`` (none while it does
    not answer)."""
    address = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(address, timeout=5) as reply:
            result: list[dict[str, Any]] = json.load(reply)["data"]["result"]
    except OSError:
        return []
    return result


def query(url: str, promql: str) -> float:
    """The sum of what ``promql`` gives now (0 for nothing)."""
    return sum(float(found["value"][1]) for found in series(url, promql))
