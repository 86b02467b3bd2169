"""The core's counters (`watchdogd.core.counters`) in the Prometheus text format,
made only when asked (``watchdogctl metrics``, ``--metrics-textfile``,
``--metrics-listen``).

Incrementing a prometheus_client metric takes a lock and a label lookup on every
request; the core's counters cost one dict increment, and prometheus_client's own
exposition code turns them into text at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..core import Counters


def exposition(counters: Counters, gauges: Mapping[str, tuple[str, float]]) -> str:
    """The Prometheus text format of ``counters``, with ``gauges`` (name -> (help,
    value)) added."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(counters, gauges))
    return generate_latest(registry).decode()


#: A family of the exposition: its type, name, help and labels, and what it holds,
#: read from the counters at each scrape (label values -> value for a labelled
#: family, the value itself for one without labels). The order is the exposition's.
_Family = tuple[
    type[CounterMetricFamily] | type[GaugeMetricFamily],
    str,
    str,
    tuple[str, ...],
    Callable[[Counters], float | Iterable[tuple[Sequence[object], float]]],
]


def _keyed(items: Mapping[Any, int]) -> Iterable[tuple[Sequence[object], float]]:
    """A labelled family's values from a dict keyed by its label value (or tuple of
    them), in sorted order."""
    for key, count in sorted(items.items()):
        yield (key if isinstance(key, tuple) else (key,)), count


def _slot_outcomes(m: Counters) -> Iterable[tuple[Sequence[object], float]]:
    yield ("clamped",), m.slots_clamped
    yield ("scribbled",), m.slots_scribbled
    yield ("deferred",), m.slots_deferred
    yield ("lost",), m.slots_lost
    yield ("reclaimed",), m.slots_reclaimed
    yield ("retired",), m.slots_retired


_COUNTER, _GAUGE = CounterMetricFamily, GaugeMetricFamily

_FAMILIES: tuple[_Family, ...] = (
    (_COUNTER, "requests", "Requests handled, by op and result.", ("op", "result"),
     lambda m: _keyed(m.requests)),
    (_COUNTER, "expiries", "Timers that expired, by policy and outcome.",
     ("policy", "outcome"), lambda m: _keyed(m.expiries)),
    (_COUNTER, "extensions",
     "Timers given more time, once, because their process was starved, by policy.",
     ("policy",), lambda m: _keyed(m.extensions)),
    (_COUNTER, "incidents", "Incidents this host opened for a job.", (),
     lambda m: m.incidents),
    (_COUNTER, "incident_verdicts",
     "Verdicts of incidents kept here, by kind, counted once each when it settles "
     "(every host of the job reported, or the incident's window closed).",
     ("kind",), lambda m: _keyed(m.verdicts)),
    (_COUNTER, "unblocks",
     "Ranks asked to be cut out of the collective they wait in, by why (host_lost, "
     "peers) and what their responder did (unblocked, not_waiting, too_soon, ...).",
     ("cause", "outcome"), lambda m: _keyed(m.unblocks)),
    (_GAUGE, "job_processes",
     "Processes holding timers of a job, by its owner's uid and job: the "
     f'{Counters.JOB_LABELS} with the most processes, the rest as job="(other)".',
     ("uid", "job"), lambda m: _keyed(m.job_processes)),
    (_GAUGE, "jobs_repeating",
     "Jobs marked repeating now: their hang repeated repeat_limit times within "
     "repeat_window, and watchdogctl job exits 3 for each until --reset.",
     (), lambda m: m.repeating),
    (_GAUGE, "job_repeating",
     "1 for a job whose hang repeated repeat_limit times within repeat_window "
     "(watchdogctl job exits 3 for it until --reset), by its owner's uid and job: "
     f'the first {Counters.JOB_LABELS}, the count of the rest as job="(other)".',
     ("uid", "job"), lambda m: _keyed(m.jobs_repeating)),
    (_COUNTER, "exits", "Processes that exited with timers armed.", (), lambda m: m.exited),
    (_COUNTER, "unkillable", "Targets still alive after SIGKILL.", (),
     lambda m: m.unkillable),
    (_COUNTER, "dumps_not_run",
     "Dump steps that got no turn among max_dumps within their timeout.", (),
     lambda m: m.dumps_not_run),
    (_COUNTER, "evidence_trimmed_bytes",
     "Bytes of incidents' evidence trimmed to their owners' budgets "
     "(incident_bytes_per_uid, incident_bytes), stacks first.",
     (), lambda m: m.evidence_trimmed),
    (_GAUGE, "record_left_off_bytes",
     "Bytes of the events and incidents in memory that the record file left off at "
     "its last whole write, to keep within record_bytes and out of the room the "
     "timers' state needs (stacks cut first).",
     (), lambda m: m.record_left_off),
    (_COUNTER, "slot_outcomes",
     "Slots of the fast path, by what became of them: deadlines past max_timeout a "
     "look clamped (clamped), counts refused as scribbled (scribbled), harvests "
     "left for later past their uid's share of rows (deferred), "
     "registrations dropped for a page lost or uids changed (lost), reclaimed at "
     "a uid's limit (reclaimed), retired after closing (retired).",
     ("outcome",), _slot_outcomes),
    (_COUNTER, "connections", "Connections accepted.", (), lambda m: m.connections_total),
    (_COUNTER, "reloads", "Config reloads, by result.", ("result",),
     lambda m: _keyed(m.reloads)),
)  # fmt: skip

#: Shown only once a key was refused: a daemon outside a fleet has no such family.
_FLEET_REJECTED: _Family = (
    _COUNTER, "fleet_rejected", "Keys read from the fleet's store that were not taken, by reason.",
    ("reason",), lambda m: _keyed(m.fleet_rejected),
)  # fmt: skip


def _family(family: _Family, counters: Counters) -> Metric:
    kind, name, help_text, labels, read = family
    held = read(counters)
    if not labels:
        assert isinstance(held, int | float)
        return kind(f"watchdogd_{name}", help_text, value=held)
    assert not isinstance(held, int | float)
    metric = kind(f"watchdogd_{name}", help_text, labels=list(labels))
    for values, value in held:
        metric.add_metric([str(v) for v in values], value)
    return metric


class _Collector(Collector):
    def __init__(self, metrics: Counters, gauges: Mapping[str, tuple[str, float]]) -> None:
        self._metrics = metrics
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        for name, (help_text, value) in self._gauges.items():
            yield GaugeMetricFamily(f"watchdogd_{name}", help_text, value=value)
        for family in _FAMILIES:
            yield _family(family, m)
        if m.fleet_rejected:
            yield _family(_FLEET_REJECTED, m)
        yield HistogramMetricFamily(
            "watchdogd_lateness_seconds",
            "Time from a deadline to the first signal of its policy.",
            buckets=m.lateness_buckets(),
            sum_value=m._lateness_sum,
        )
