"""The other hosts of the fleet as this host last saw them: each host's state and
jobs, from its key, and the size of its ranks of each incident kept here.

All of it came from etcd, where any writer may put anything, so all of it is
bounded: at most `MAX_HOSTS` hosts and `MAX_FLEET_JOBS` jobs of theirs in all, and
at most `MAX_INCIDENT_BYTES` of ranks of one incident, `MAX_FLEET_RANK_BYTES` in
all. A key past a bound raises `Rejected` (``budget``) and nothing of it is kept.

Sync and without I/O: the member (`watchdogd.fleet.member`) decodes each key
(`watchdogd.fleet.records`) and hands what it says here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from .records import HostRecord, Rejected

#: Other hosts kept, at most, and their jobs in all.
MAX_HOSTS: Final = 1024
MAX_FLEET_JOBS: Final = 65_536
#: What other hosts' ranks may hold, in bytes: of one incident, and in all.
MAX_INCIDENT_BYTES: Final = 8 * 1024 * 1024
MAX_FLEET_RANK_BYTES: Final = 64 * 1024 * 1024

#: A job as the fleet names it: (user name, job).
Job = tuple[str, str]


class FleetView:
    """The other hosts, each with its state and jobs as its key last said, and
    the bytes of their ranks taken, within the bounds."""

    def __init__(self) -> None:
        #: Every other host as last seen, with its jobs; how many jobs in all.
        self._hosts: dict[str, tuple[str, frozenset[Job]]] = {}
        self._host_jobs = 0
        #: The hosts of each job, as their keys last said: asked at each ranks
        #: event of a job followed, so never a walk over every host.
        self._holders: dict[Job, set[str]] = {}
        #: The bytes of other hosts' ranks taken, by (incident, host); their sums,
        #: by incident and in all, asked at each ranks event.
        self._rank_bytes: dict[tuple[str, str], int] = {}
        self._incident_bytes: dict[str, int] = {}
        self._all_bytes = 0

    def holders(self, user: str, job: str) -> set[str]:
        """The other hosts that hold timers of ``job`` (of the user named ``user``),
        as their keys last said."""
        return set(self._holders.get((user, job), ()))

    def host_seen(self, host: str, record: HostRecord) -> None:
        """``host``'s key says ``record``, in place of what it said before; raises
        `Rejected` past the bounds of hosts or jobs."""
        before = self._hosts.get(host)
        jobs = frozenset(record.jobs)
        kept = self._host_jobs - (0 if before is None else len(before[1]))
        if before is None and len(self._hosts) >= MAX_HOSTS:
            raise Rejected("budget", f"more than {MAX_HOSTS} hosts")
        if kept + len(jobs) > MAX_FLEET_JOBS:
            raise Rejected("budget", f"more than {MAX_FLEET_JOBS} jobs of other hosts")
        self._hosts[host] = (record.state, jobs)
        self._host_jobs = kept + len(jobs)
        self._index(host, frozenset() if before is None else before[1], jobs)

    def host_gone(self, host: str) -> frozenset[Job] | None:
        """Forget ``host``, whose key was deleted. The jobs it held if it was lost
        (its key went without its saying it stopped); None if it stopped, or was
        not kept."""
        gone = self._hosts.pop(host, None)
        if gone is None:
            return None
        state, jobs = gone
        self._host_jobs -= len(jobs)
        self._index(host, jobs, frozenset())
        return None if state == "stopped" else jobs

    def _index(self, host: str, before: frozenset[Job], after: frozenset[Job]) -> None:
        for job in before - after:
            holders = self._holders[job]
            holders.discard(host)
            if not holders:
                del self._holders[job]
        for job in after:
            self._holders.setdefault(job, set()).add(host)

    def take_ranks(
        self, incident_id: str, host: str, size: int, kept: Callable[[str], bool]
    ) -> None:
        """Count ``size`` bytes of ``host``'s ranks of an incident, in place of what
        they were before, or raise `Rejected` past the bounds. ``kept`` says whether
        an incident is still kept here: those that are not are forgotten when the
        bytes in all would be over their bound."""
        self._forget((incident_id, host))
        if self._all_bytes + size > MAX_FLEET_RANK_BYTES:
            for key in [key for key in self._rank_bytes if not kept(key[0])]:
                self._forget(key)
        if self._incident_bytes.get(incident_id, 0) + size > MAX_INCIDENT_BYTES:
            raise Rejected("budget", f"ranks of one incident over {MAX_INCIDENT_BYTES} bytes")
        if self._all_bytes + size > MAX_FLEET_RANK_BYTES:
            raise Rejected("budget", f"ranks of other hosts over {MAX_FLEET_RANK_BYTES} bytes")
        self._rank_bytes[(incident_id, host)] = size
        self._incident_bytes[incident_id] = self._incident_bytes.get(incident_id, 0) + size
        self._all_bytes += size

    def _forget(self, key: tuple[str, str]) -> None:
        size = self._rank_bytes.pop(key, None)
        if size is None:
            return
        incident = key[0]
        self._all_bytes -= size
        left = self._incident_bytes.pop(incident, 0) - size
        if left > 0:
            self._incident_bytes[incident] = left


__all__ = ["MAX_FLEET_JOBS", "MAX_FLEET_RANK_BYTES", "MAX_HOSTS", "MAX_INCIDENT_BYTES", "FleetView"]
