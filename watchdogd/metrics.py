"""Counters kept in the hot path as plain integers, exposed in the Prometheus text
format only when asked (``watchdogctl metrics``, ``--metrics-textfile``).

Incrementing a prometheus_client metric takes a lock and a label lookup on every
request; here a request costs one dict increment, and prometheus_client's own
exposition code turns the counters into text at scrape time.
"""

from __future__ import annotations

import bisect
import os
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

#: Upper bounds (seconds) of the deadline-to-first-signal histogram.
LATENESS_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0
)  # fmt: skip


class Counters:
    """Everything counted since the daemon started."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.expiries: Counter[tuple[str, str]] = Counter()
        self.reloads: Counter[str] = Counter()
        self.connections_total = 0
        self.exited = 0
        self.unkillable = 0
        self._lateness = [0] * (len(LATENESS_BUCKETS) + 1)
        self._lateness_sum = 0.0

    @property
    def requests_total(self) -> int:
        return self.requests.total()

    @property
    def expired(self) -> int:
        return self.expiries.total()

    def count_request(self, op: str, result: str) -> None:
        self.requests[(op, result)] += 1

    def observe_lateness(self, seconds: float) -> None:
        """One deadline-to-first-signal time."""
        self._lateness[bisect.bisect_left(LATENESS_BUCKETS, seconds)] += 1
        self._lateness_sum += seconds

    def exposition(self, gauges: Mapping[str, tuple[str, float]]) -> str:
        """The text format, with ``gauges`` (name -> (help, value)) added."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, gauges))
        return generate_latest(registry).decode()

    def lateness_buckets(self) -> list[tuple[str, float]]:
        cumulative = 0
        buckets = []
        for bound, count in zip((*LATENESS_BUCKETS, float("inf")), self._lateness, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        return buckets


class _Collector(Collector):
    def __init__(self, metrics: Counters, gauges: Mapping[str, tuple[str, float]]) -> None:
        self._metrics = metrics
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        for name, (help_text, value) in self._gauges.items():
            yield GaugeMetricFamily(f"watchdogd_{name}", help_text, value=value)
        requests = CounterMetricFamily(
            "watchdogd_requests", "Requests handled, by op and result.", labels=["op", "result"]
        )
        for (op, result), count in sorted(m.requests.items()):
            requests.add_metric([op, result], count)
        yield requests
        expiries = CounterMetricFamily(
            "watchdogd_expiries",
            "Timers that expired, by policy and outcome.",
            labels=["policy", "outcome"],
        )
        for (policy, outcome), count in sorted(m.expiries.items()):
            expiries.add_metric([policy, outcome], count)
        yield expiries
        yield CounterMetricFamily(
            "watchdogd_exits", "Processes that exited with timers armed.", value=m.exited
        )
        yield CounterMetricFamily(
            "watchdogd_unkillable", "Targets still alive after SIGKILL.", value=m.unkillable
        )
        yield CounterMetricFamily(
            "watchdogd_connections", "Connections accepted.", value=m.connections_total
        )
        reloads = CounterMetricFamily(
            "watchdogd_reloads", "Config reloads, by result.", labels=["result"]
        )
        for result, count in sorted(m.reloads.items()):
            reloads.add_metric([result], count)
        yield reloads
        yield HistogramMetricFamily(
            "watchdogd_lateness_seconds",
            "Time from a deadline to the first signal of its policy.",
            buckets=m.lateness_buckets(),
            sum_value=m._lateness_sum,
        )


def write_textfile(path: str, text: str) -> None:
    """Replace ``path`` atomically (node_exporter never reads half a file)."""
    directory = os.path.dirname(path) or "."
    fd, temporary = tempfile.mkstemp(prefix=".watchdogd-", suffix=".prom", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
