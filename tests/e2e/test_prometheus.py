"""A real Prometheus scraping a live daemon's ``--metrics-listen``, and a real
node_exporter reading its ``--metrics-textfile``: one expiry's counter, queried
back through Prometheus's HTTP API from both."""

from __future__ import annotations

from pathlib import Path

from helpers.daemon import RunningDaemon
from helpers.disks import require
from helpers.etcd import free_ports
from helpers.processes import sleeper
from helpers.prometheus import INSTALL, prometheus, query, running
from helpers.waiting import PATIENCE, wait_until

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
    server = prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", prometheus_port)
    url = f"http://127.0.0.1:{prometheus_port}"
    daemon.start()
    victim = sleeper()
    try:
        with (
            running(node, tmp_path / "node.log"),
            running(server, tmp_path / "prometheus.log"),
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
