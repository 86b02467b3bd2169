"""Metrics: the exposition parses with prometheus-client's own parser."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from watchdogd.core.counters import Counters
from watchdogd.runtime.metrics import exposition
from watchdogd.runtime.textfile import write_textfile


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


def test_exposition_parses_and_counts() -> None:
    counters = Counters()
    counters.count_request("acquire", "ok")
    counters.count_request("acquire", "ok")
    counters.count_request("acquire", "permission_denied")
    counters.expiries[("term", "exited")] += 1
    for seconds in (0.00005, 0.0003, 0.0003, 7.0):
        counters.observe_lateness(seconds)
    parsed = families(exposition(counters, {"timers_armed": ("Timers armed now.", 4)}))
    assert parsed["watchdogd_timers_armed"] == [({}, 4.0)]
    assert ({"op": "acquire", "result": "ok"}, 2.0) in parsed["watchdogd_requests"]
    assert ({"policy": "term", "outcome": "exited"}, 1.0) in parsed["watchdogd_expiries"]
    buckets = {
        labels["le"]: value
        for labels, value in parsed["watchdogd_lateness_seconds"]
        if "le" in labels
    }
    assert buckets["0.0001"] == 1
    assert buckets["0.0005"] == 3  # cumulative
    assert buckets["5.0"] == 3
    assert buckets["+Inf"] == 4


def test_textfile_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "watchdogd.prom"
    write_textfile(str(path), "first 1\n")
    write_textfile(str(path), "second 2\n")
    assert path.read_text() == "second 2\n"
    assert os.listdir(tmp_path) == ["watchdogd.prom"]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o644
