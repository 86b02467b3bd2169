"""The Grafana dashboard and the Prometheus alerting rules of deploy/: the rules
pass promtool's checks and their own unit tests, and their texts give whole counts;
the dashboard is JSON of the shape Grafana's provisioning loads, whose every
coloured panel shows a fault red and health green (its colours resolved from the
JSON as Grafana resolves them); and against a live daemon driven through an expiry
with an incident, a degraded disk and a fleet disconnect, scraped by a real
Prometheus, every metric and label they name exists and every panel's query
returns data."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from helpers.daemon import RunningDaemon
from helpers.disks import degraded, fill_space, require, tmpfs
from helpers.etcd import EtcdServer, free_ports
from helpers.processes import sleeper
from helpers.prometheus import INSTALL, prometheus, running, series
from helpers.waiting import PATIENCE, wait_until

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "watchdogd-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "watchdogd-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "watchdogd-dashboard.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning.yaml"
#: Grafana's built-in panel types the dashboard may use.
PANEL_TYPES = {"timeseries", "stat", "heatmap", "gauge", "table", "bargauge"}
#: For each metric a coloured panel shows, its value in a fault and when healthy:
#: the first must show red, the second green.
FAULTS = {"watchdogd_state_degraded": (1, 0), "watchdogd_fleet_connected": (0, 1)}
#: The thresholds Grafana gives a panel that sets none: green, and red from 80.
GRAFANA_THRESHOLDS = [{"color": "green", "value": None}, {"color": "red", "value": 80}]

CONFIG = """\
[policies.rank]
steps = [ {{ signal = "SIGKILL" }} ]
starvation_grace = 5

[fleet]
etcd = ["{etcd}"]
host = "host-a"
prefix = "/watchdogd-dashboards"
lease = 2
"""

SCRAPE = """\
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: watchdogd
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of each target, with Grafana's variables as a scrape
    of a few seconds gives them."""
    return [
        (panel["title"], target["expr"].replace("$__rate_interval", "1m").replace(
            '"$instance"', '".*"'))
        for panel in dashboard()["panels"]
        for target in panel["targets"]
    ]  # fmt: skip


def coloured(panel: dict[str, Any]) -> bool:
    """Whether Grafana colours ``panel`` by its value: a gauge, a bar gauge, or a
    stat unless its colour mode is "none" (Grafana's default is "value")."""
    if panel["type"] == "stat":
        return bool(panel.get("options", {}).get("colorMode", "value") != "none")
    return panel["type"] in {"gauge", "bargauge"}


def colour(field: dict[str, Any], value: float) -> str:
    """The colour Grafana gives ``value`` under a field's config: the first value
    mapping that matches it and names a colour, else the last threshold step it
    reaches (the base step's value is null: minus infinity)."""
    assert field.get("color", {"mode": "thresholds"})["mode"] == "thresholds"
    for mapping in field.get("mappings", []):
        options = mapping["options"]
        match mapping["type"]:
            case "value":
                result = options.get(f"{value:g}")
            case "range":
                low, high = options.get("from"), options.get("to")
                inside = (low is None or low <= value) and (high is None or value <= high)
                result = options["result"] if inside else None
            case other:
                raise AssertionError(f"a mapping of type {other!r} this test cannot resolve")
        if result and "color" in result:
            return str(result["color"])
    thresholds = field.get("thresholds", {"mode": "absolute", "steps": GRAFANA_THRESHOLDS})
    assert thresholds["mode"] == "absolute"
    steps = thresholds["steps"]
    reached = [step for step in steps if step["value"] is None or step["value"] <= value]
    return str(reached[-1]["color"])


def rule_expressions() -> list[str]:
    """Each alert's expression, as promtool reads the rules (its own YAML reader)."""
    text = RULES.read_text()
    found = re.findall(r"^\s+expr: >\n((?:\s{10,}.*\n)+)|^\s+expr: (.+)$", text, re.MULTILINE)
    return [" ".join((folded or plain).split()) for folded, plain in found]


def names_and_labels(promql: str) -> list[tuple[str, set[str]]]:
    """The watchdogd metrics ``promql`` reads, each with the labels it groups or
    matches them by."""
    grouped = set()
    for labels in re.findall(r"\bby \(([^)]*)\)", promql):
        grouped |= {label.strip() for label in labels.split(",")} - {"instance", "le", "job"}
    return [
        (name, grouped | set(re.findall(r"(\w+)=~?\"", matchers or "")) - {"instance", "job"})
        for name, matchers in re.findall(r"\b(watchdogd_\w+)(?:\{([^}]*)\})?", promql)
    ]


def fleet(daemon: RunningDaemon) -> str:
    with daemon.client() as client:
        return client.status().daemon.fleet


def test_the_rules_pass_promtool_and_their_unit_tests() -> None:
    require("promtool", install=INSTALL)
    checked = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                             text=True, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout
    tested = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True,
                            text=True, check=False, cwd=RULE_TESTS.parent)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert has a unit test of its own.
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    assert alerts == set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))


def test_the_dashboard_is_one_grafana_provisions() -> None:
    board = dashboard()
    assert (board["uid"], board["title"]) == ("watchdogd", "watchdogd")
    assert isinstance(board["schemaVersion"], int)
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [target["refId"] for target in panel["targets"]]
        assert refs
        assert len(refs) == len(set(refs))
    kinds = {panel["type"] for panel in board["panels"]}
    assert "heatmap" in kinds
    provisioning = PROVISIONING.read_text()
    assert "apiVersion: 1" in provisioning
    assert re.search(r"^\s+type: file$", provisioning, re.MULTILINE)
    assert re.search(r"^\s+path: /\S+$", provisioning, re.MULTILINE)


def test_every_coloured_panel_shows_a_fault_red_and_health_green() -> None:
    panels = [panel for panel in dashboard()["panels"] if coloured(panel)]
    assert {panel["title"] for panel in panels} >= {"Storage degraded", "Fleet connected"}
    for panel in panels:
        shown = {name for target in panel["targets"]
                 for name in re.findall(r"\b(watchdogd_\w+)", target["expr"])}  # fmt: skip
        assert len(shown) == 1, panel["title"]
        assert shown <= FAULTS.keys(), f"{panel['title']!r} is coloured: name its fault in FAULTS"
        fault, healthy = FAULTS[shown.pop()]
        assert panel["fieldConfig"]["overrides"] == [], panel["title"]
        field = panel["fieldConfig"]["defaults"]
        assert (colour(field, fault), colour(field, healthy)) == ("red", "green"), panel["title"]


def test_alert_texts_give_durations_or_whole_numbers() -> None:
    # promtool's unit tests render them (a burst whose increase() is 15.57 reads
    # 15); this holds every other figure of an alert to the same rule.
    figures = re.findall(r"\{\{[^}]*\$value[^}]*\}\}", RULES.read_text())
    assert figures
    for figure in figures:
        assert "humanizeDuration" in figure or 'printf "%.0f"' in figure, figure


def test_what_they_name_exists_and_every_panel_has_data(
    own_etcd: EtcdServer, socket_path: Path, tmp_path: Path
) -> None:
    require("prometheus", install=INSTALL)
    daemon_port, prometheus_port = free_ports(2)
    (tmp_path / "watchdogd.toml").write_text(CONFIG.format(etcd=own_etcd.url))
    (tmp_path / "prometheus.yml").write_text(SCRAPE.format(port=daemon_port))
    url = f"http://127.0.0.1:{prometheus_port}"
    with tmpfs(size="2m", inodes=64) as disk:
        daemon = RunningDaemon(
            socket_path, tmp_path / "watchdogd.log",
            ["--state", str(disk / "state.db"), "--config", str(tmp_path / "watchdogd.toml"),
             "--metrics-listen", str(daemon_port)],
        )  # fmt: skip
        daemon.start()
        victim = sleeper()
        try:
            command = prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", prometheus_port)
            with running(command, tmp_path / "prometheus.log"):
                wait_until(lambda: fleet(daemon) == "connected", what="the fleet connected")
                # An expiry, which opens an incident of its job and its verdict.
                with daemon.client() as client:
                    client.acquire("step", 0.3, pid=victim.pid, policy="rank", job="run-1",
                                   rank=0)  # fmt: skip
                victim.wait(timeout=PATIENCE)
                # The disk fills, and etcd goes away.
                fill_space(disk)
                with daemon.client() as client:
                    armed = iter(range(10_000))

                    def refused() -> bool:  # a page of the journal may take a few
                        client.acquire(f"more-{next(armed)}", 60, policy="rank")
                        return degraded(daemon)

                    wait_until(refused, what="the state degraded")
                own_etcd.stop()
                wait_until(lambda: fleet(daemon) != "connected", what="the fleet disconnected")
                # The expiry is counted once its policy has run, a moment after the kill,
                # and its incident's verdict a moment later; a page is served again to
                # every scrape for a while (Prometheus's may have come in between).
                pages: list[str] = []

                def counted() -> bool:
                    address = f"http://127.0.0.1:{daemon_port}/metrics"
                    with urllib.request.urlopen(address) as reply:
                        pages[:] = [reply.read().decode()]
                    return all(
                        f"watchdogd_{name}_total{{" in pages[0]
                        for name in ("expiries", "incident_verdicts")
                    )

                wait_until(counted, what="the expiry and its verdict counted")
                [page] = pages
                # What the rules and the panels name is on the daemon's page.
                for promql in [query for _, query in panel_queries()] + rule_expressions():
                    for name, labels in names_and_labels(promql):
                        family = re.sub(r"_(bucket|count|sum)$", "", name)
                        assert f"# TYPE {family.removesuffix('_total')} " in page or (
                            f"# TYPE {family} " in page
                        ), f"{name}, named by {promql!r}, is not on the page"
                        lines = [line for line in page.splitlines() if line.startswith(name)]
                        for label in labels:
                            assert any(f'{label}="' in line for line in lines), (name, label)
                # Prometheus has scraped it all; every panel's query has data.
                connected = "watchdogd_fleet_connected"
                wait_until(
                    lambda: [found["value"][1] for found in series(url, connected)] == ["0"],
                    what="Prometheus to see the fleet disconnected",
                    timeout=PATIENCE * 3,
                )
                for title, promql in panel_queries():
                    wait_until(lambda q=promql: bool(series(url, q)),
                               what=f"data for the panel {title!r}: {promql}",
                               timeout=PATIENCE * 3)  # fmt: skip
                assert [s["value"][1] for s in series(url, "watchdogd_state_degraded")] == ["1"]
        finally:
            if victim.poll() is None:
                victim.kill()
            victim.wait()
            daemon.stop()
