"""Counters kept in the hot path as plain integers: a request costs one dict
increment. `watchdogd.runtime.metrics` renders them in the Prometheus text format when
asked."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Final

#: Upper bounds (seconds) of the deadline-to-first-signal histogram.
LATENESS_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0
)  # fmt: skip


class Counters:
    """Everything counted since the daemon started."""

    #: The most jobs the metrics label one by one: a label set stays bounded.
    JOB_LABELS: Final = 50

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.expiries: Counter[tuple[str, str]] = Counter()
        self.reloads: Counter[str] = Counter()
        #: Timers given more time because their process was starved, by policy.
        self.extensions: Counter[str] = Counter()
        self.connections_total = 0
        #: Incidents this host opened (the first expiry of a job's timer).
        self.incidents = 0
        #: Verdicts of incidents, by kind, counted once each when it settles.
        self.verdicts: Counter[str] = Counter()
        #: Ranks asked to be unblocked, by why (``host_lost``, ``peers``) and what
        #: their responder did (`watchdogd_protocol.UnblockOutcome`, or
        #: ``no_answer``, ``dropped``).
        self.unblocks: Counter[tuple[str, str]] = Counter()
        #: Calls to the fleet's store that failed; incidents it could not keep up with.
        self.fleet_errors = 0
        self.fleet_dropped = 0
        #: Keys read from the fleet that were not taken, by reason
        #: (`watchdogd.fleet.records.REASONS`).
        self.fleet_rejected: Counter[str] = Counter()
        #: Errors of the fleet's task that nothing expected (a bug): it restarts.
        self.fleet_unexpected = 0
        #: Processes with timers of each (owner uid, job), as last rendered.
        self.job_processes: dict[tuple[int, str], int] = {}
        #: The jobs marked repeating (owner uid, job) a reader may see, and how
        #: many are marked in all, as last rendered.
        self.jobs_repeating: dict[tuple[int, str], int] = {}
        self.repeating = 0
        self.exited = 0
        self.unkillable = 0
        #: Slots of the fast path: deadlines past the bound a look clamped, counts
        #: a harvest refused as scribbled, harvests left for later past their uid's
        #: share of rows, registrations dropped for a page lost or uids changed,
        #: reclaimed at a uid's limit, retired after closing.
        self.slots_clamped = 0
        self.slots_scribbled = 0
        self.slots_deferred = 0
        self.slots_lost = 0
        self.slots_reclaimed = 0
        self.slots_retired = 0
        #: Dump steps running and waiting for a turn now (`watchdogd.runtime.hooks.DumpPool`),
        #: and those that got no turn within their timeout.
        self.dumps_running = 0
        self.dumps_waiting = 0
        self.dumps_not_run = 0
        #: Bytes of incidents' evidence trimmed to their owners' budgets
        #: (`watchdogd.core.incidents`); and bytes of the events and incidents in
        #: memory that the record's file left off at its last whole write, to keep
        #: within its bound and out of the room the state needs
        #: (`watchdogd.storage.record_file`).
        self.evidence_trimmed = 0
        self.record_left_off = 0
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

    def lateness_buckets(self) -> list[tuple[str, float]]:
        cumulative = 0
        buckets = []
        for bound, count in zip((*LATENESS_BUCKETS, float("inf")), self._lateness, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        return buckets
