"""A real Prometheus scraping a live daemon's ``--metrics-listen``, and a real
node_exporter reading its ``--metrics-textfile``: one expiry's counter, queried
back through Prometheus's HTTP API from both."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from helpers.daemon import RunningDaemon
from helpers.disks import require
from helpers.etcd import free_ports
from helpers.processes import sleeper
from helpers.waiting import PATIENCE, wait_until

INSTALL = "Debian's prometheus and prometheus-node-exporter (.ci/run installs them)"

PROMETHEUS_CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: watchdogd
    static_configs: [{{targets: ["127.0.0.1:{daemon}"]}}]
  - job_name: node
    static_configs: [{{targets: ["127.0.0.1:{node}"]}}]
"""


@contextlib.contextmanager
def running(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
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


def query(url: str, promql: str) -> float:
    """The sum of what ``promql`` gives now (0 for nothing)."""
    address = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(address, timeout=5) as reply:
            result = json.load(reply)["data"]["result"]
    except OSError:
        return 0.0
    return sum(float(series["value"][1]) for series in result)


def test_prometheus_reads_an_expiry_from_the_endpoint_and_the_textfile(
    socket_path: Path, tmp_path: Path
) -> None:
    require("prometheus", "prometheus-node-exporter", install=INSTALL)
    daemon_port, node_port, prometheus_port = free_ports(3)
    textfiles = tmp_path / "textfiles"
    textfiles.mkdir()
    config = tmp_path / "watchdogd.toml"
    config.write_text("[daemon]\nmetrics_interval = 1\n")
    daemon = RunningDaemon(
        socket_path,
        tmp_path / "watchdogd.log",
        ["--no-state", "--config", str(config), "--metrics-listen", str(daemon_port),
         "--metrics-textfile", str(textfiles / "watchdogd.prom")],
    )  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(
        PROMETHEUS_CONFIG.format(daemon=daemon_port, node=node_port)
    )
    node = [
        "prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{node_port}",
        "--collector.disable-defaults", "--collector.textfile",
        f"--collector.textfile.directory={textfiles}",
    ]  # fmt: skip
    prometheus = [
        "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{prometheus_port}",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{prometheus_port}"
    daemon.start()
    victim = sleeper()
    try:
        with (
            running(node, tmp_path / "node.log"),
            running(prometheus, tmp_path / "prometheus.log"),
        ):
            with daemon.client() as client:
                client.acquire("scraped", 0.2, pid=victim.pid)
            victim.wait(timeout=PATIENCE)
            for job in ("watchdogd", "node"):
                expiries = f'watchdogd_expiries_total{{job="{job}",policy="kill"}}'
                wait_until(
                    lambda q=expiries: query(url, q) >= 1,
                    what=f"Prometheus to have the expiry from {job}",
                    timeout=PATIENCE * 6,
                )
            assert query(url, 'up{job="watchdogd"}') == 1
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()
        assert daemon.stop() == 0, daemon.log()
