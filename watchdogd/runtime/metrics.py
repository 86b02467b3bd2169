"""The core's counters (`watchdogd.core.counters`) in the Prometheus text format,
made only when asked (``watchdogctl metrics``, ``--metrics-textfile``,
``--metrics-listen``).

Incrementing a prometheus_client metric takes a lock and a label lookup on every
request; the core's counters cost one dict increment, and prometheus_client's own
exposition code turns them into text at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..core.counters import Counters


def exposition(counters: Counters, gauges: Mapping[str, tuple[str, float]]) -> str:
    """The Prometheus text format of ``counters``, with ``gauges`` (name -> (help,
    value)) added."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(counters, gauges))
    return generate_latest(registry).decode()


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
        extensions = CounterMetricFamily(
            "watchdogd_extensions",
            "Timers given more time, once, because their process was starved, by policy.",
            labels=["policy"],
        )
        for policy, count in sorted(m.extensions.items()):
            extensions.add_metric([policy], count)
        yield extensions
        yield CounterMetricFamily(
            "watchdogd_incidents", "Incidents this host opened for a job.", value=m.incidents
        )
        verdicts = CounterMetricFamily(
            "watchdogd_incident_verdicts",
            "Verdicts of incidents kept here, by kind, counted once each when it settles "
            "(every host of the job reported, or the incident's window closed).",
            labels=["kind"],
        )
        for kind, count in sorted(m.verdicts.items()):
            verdicts.add_metric([kind], count)
        yield verdicts
        unblocks = CounterMetricFamily(
            "watchdogd_unblocks",
            "Ranks asked to be cut out of the collective they wait in, by why (host_lost, "
            "peers) and what their responder did (unblocked, not_waiting, too_soon, ...).",
            labels=["cause", "outcome"],
        )
        for (cause, outcome), count in sorted(m.unblocks.items()):
            unblocks.add_metric([cause, outcome], count)
        yield unblocks
        jobs = GaugeMetricFamily(
            "watchdogd_job_processes",
            "Processes holding timers of a job, by its owner's uid and job: the "
            f'{m.JOB_LABELS} with the most processes, the rest as job="(other)".',
            labels=["uid", "job"],
        )
        for (uid, job), count in sorted(m.job_processes.items()):
            jobs.add_metric([str(uid), job], count)
        yield jobs
        yield GaugeMetricFamily(
            "watchdogd_jobs_repeating",
            "Jobs marked repeating now: their hang repeated repeat_limit times within "
            "repeat_window, and watchdogctl job exits 3 for each until --reset.",
            value=m.repeating,
        )
        repeating = GaugeMetricFamily(
            "watchdogd_job_repeating",
            "1 for a job whose hang repeated repeat_limit times within repeat_window "
            "(watchdogctl job exits 3 for it until --reset), by its owner's uid and job: "
            f'the first {m.JOB_LABELS}, the count of the rest as job="(other)".',
            labels=["uid", "job"],
        )
        for (uid, job), count in sorted(m.jobs_repeating.items()):
            repeating.add_metric([str(uid), job], count)
        yield repeating
        yield CounterMetricFamily(
            "watchdogd_exits", "Processes that exited with timers armed.", value=m.exited
        )
        yield CounterMetricFamily(
            "watchdogd_unkillable", "Targets still alive after SIGKILL.", value=m.unkillable
        )
        yield CounterMetricFamily(
            "watchdogd_dumps_not_run",
            "Dump steps that got no turn among max_dumps within their timeout.",
            value=m.dumps_not_run,
        )
        yield CounterMetricFamily(
            "watchdogd_evidence_trimmed_bytes",
            "Bytes of incidents' evidence trimmed to their owners' budgets "
            "(incident_bytes_per_uid, incident_bytes), stacks first.",
            value=m.evidence_trimmed,
        )
        yield GaugeMetricFamily(
            "watchdogd_record_left_off_bytes",
            "Bytes of the events and incidents in memory that the record file left off at "
            "its last whole write, to keep within record_bytes and out of the room the "
            "timers' state needs (stacks cut first).",
            value=m.record_left_off,
        )
        slots = CounterMetricFamily(
            "watchdogd_slot_outcomes",
            "Slots of the fast path, by what became of them: deadlines past max_timeout a "
            "look clamped (clamped), counts refused as scribbled (scribbled), "
            "registrations dropped for a page lost or uids changed (lost), reclaimed at "
            "a uid's limit (reclaimed), retired after closing (retired).",
            labels=["outcome"],
        )
        for outcome, count in (
            ("clamped", m.slots_clamped),
            ("scribbled", m.slots_scribbled),
            ("lost", m.slots_lost),
            ("reclaimed", m.slots_reclaimed),
            ("retired", m.slots_retired),
        ):
            slots.add_metric([outcome], count)
        yield slots
        yield CounterMetricFamily(
            "watchdogd_connections", "Connections accepted.", value=m.connections_total
        )
        reloads = CounterMetricFamily(
            "watchdogd_reloads", "Config reloads, by result.", labels=["result"]
        )
        for result, count in sorted(m.reloads.items()):
            reloads.add_metric([result], count)
        yield reloads
        if m.fleet_rejected:
            rejected = CounterMetricFamily(
                "watchdogd_fleet_rejected",
                "Keys read from the fleet's store that were not taken, by reason.",
                labels=["reason"],
            )
            for reason, count in sorted(m.fleet_rejected.items()):
                rejected.add_metric([reason], count)
            yield rejected
        yield HistogramMetricFamily(
            "watchdogd_lateness_seconds",
            "Time from a deadline to the first signal of its policy.",
            buckets=m.lateness_buckets(),
            sum_value=m._lateness_sum,
        )
