"""The fleet bridge: what the fleet (`watchdogd.fleet.member`) asks of the core and
tells it, as named calls.

The fleet never reaches into the core's state: it learns this host's name and the
incident window here, the jobs this host holds (`held_jobs`, `jobs_changed`), and
the incidents to publish through the publisher it attaches (`attach`,
`watchdogd.fleet.publish.Publisher`); it hands in what other hosts said
(`fleet_incident`, `fleet_ranks`, `host_lost`) and its own health
(`fleet_changed`, `fleet_failed`, `fleet_rejected`, `fleet_dropped`).
Invariants:

- An incident from another host is kept here only when this host holds timers of
  its job; each local process of that job then gets the peer policy of its own
  timer's policy, once (an incident already known brings nothing); what is due
  here fires first, so a process whose own deadline has passed is listed as
  expired, not as a peer.
- One uid's many jobs never crowd another's out of what this host registers.
- Without a fleet the state is "", and no fleet gauge is shown.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, Generic, Protocol

import msgspec

from watchdogd_protocol import IncidentInfo, RankInfo

from .firing import Firing
from .identity import ROOT
from .ports import P
from .timers import Expired
from .unblocks import PEERS, Unblocks

if TYPE_CHECKING:
    from .context import CoreContext


#: The most timers due that fire before another host's incident is taken in
#: (`FleetBridge.fleet_incident`): on a loaded host the fleet's news can be taken
#: a moment before the expiry of a rank whose deadline has passed too, which is
#: then an expired rank of the incident, not a peer dumped in its stead. A burst's
#: rest fires in the daemon's passes, as it would have.
DUE_FIRST: Final = 256


class IncidentListener(Protocol):
    """The fleet's side: told of each incident this host opened or added to."""

    def incident_changed(self, incident: IncidentInfo) -> None: ...


class FleetBridge(Generic[P]):
    """The core as the fleet sees it."""

    def __init__(self, context: CoreContext[P], firing: Firing[P], *, unblocks: Unblocks) -> None:
        self._table = context.table
        self._responders = context.responders
        self._unblocks = unblocks
        self._firing = firing
        self._incidents = context.incidents
        self._events = context.events
        self._metrics = context.metrics
        self._wall = context.wall
        self._daemon_pid = context.daemon_pid
        #: The fleet as this host sees it: "" without one (`fleet_changed`).
        self.state = ""

    # What the fleet asks.

    @property
    def host(self) -> str:
        """This host's name in the fleet."""
        return self._incidents.host

    @property
    def incident_window(self) -> float:
        """Seconds during which more expiries of a job join its incident."""
        return self._incidents.window

    def attach(self, publisher: IncidentListener) -> None:
        """Tell ``publisher`` of each incident this host opens or adds to."""
        self._incidents.subscribe(publisher.incident_changed)

    def knows(self, incident_id: str) -> bool:
        """Whether the incident is kept here."""
        return incident_id in self._incidents

    def own_ranks(self, incident: IncidentInfo) -> list[RankInfo]:
        """This host's ranks of ``incident``."""
        return [rank for rank in incident.ranks if rank.host == self._incidents.host]

    def settled_hosts(self, incident_id: str) -> set[str]:
        """The hosts whose ranks of the incident have all settled."""
        return self._incidents.settled_hosts(incident_id)

    def expect(self, incident_id: str, hosts: frozenset[str]) -> None:
        """``hosts`` hold the incident's job: its verdict settles once each has
        reported, or its window has closed."""
        self._incidents.expect(self._incidents.resolve(incident_id), hosts)

    def held_jobs(self, limit: int, per_uid: int) -> list[tuple[int, str]]:
        """The jobs this host holds (`holds`: timers, firing, responders, an open
        incident), as (the uid that armed them, the job), at most ``limit``:
        root's first, then each other uid's, at most ``per_uid`` of each, in the
        order they came, a uid at a time in turn; so that one user's many jobs
        never crowd out another's."""
        root: list[tuple[int, str]] = []
        others: dict[int, list[tuple[int, str]]] = {}
        keys = dict.fromkeys(self._table.job_keys())
        keys.update(dict.fromkeys(sorted(self._responders.jobs())))
        keys.update(dict.fromkeys(self._firing.jobs()))
        keys.update(dict.fromkeys(self._incidents.open_jobs(self._wall())))
        for key in keys:
            if key[0] == ROOT:
                if len(root) < limit:
                    root.append(key)
                continue
            held = others.get(key[0])
            if held is None:
                others[key[0]] = [key]
            elif len(held) < per_uid:
                held.append(key)
        turns = itertools.zip_longest(*(others[uid] for uid in sorted(others)))
        rest = (key for turn in turns for key in turn if key is not None)
        return root + list(itertools.islice(rest, max(0, limit - len(root))))

    def jobs_changed(self) -> int:
        """A number that changes whenever a job came or went (an incident's window
        closing aside: a job held a while longer is one whose incidents
        `fleet_incident` still checks with `holds`)."""
        return (
            self._table.jobs_changed
            + self._responders.changed
            + self._firing.jobs_changed
            + self._incidents.windows_opened
        )

    # What the fleet tells.

    def fleet_incident(self, incident: IncidentInfo, uid: int, now: float) -> list[Expired[P]]:
        """An incident another host opened, of a job of the user this host knows as
        ``uid`` (the fleet maps the incident's user *name* to it): when this host
        holds timers of the job, the incident is kept here too, as ``uid``'s, and
        each local process of the job gets the peer policy of its own timer's
        policy (runs for the caller to carry out). Otherwise, or when it is known
        already, nothing."""
        if incident.id in self._incidents:
            return []
        job = (uid, incident.job)
        if not self.holds(job):
            return []
        due = self._firing.expire_due(now, DUE_FIRST)
        kept = self._incidents.merge(msgspec.structs.replace(incident, uid=uid))
        return due + self._firing.peers(kept, job, None, self._incidents.pids(kept), now)

    def holds(self, job: tuple[int, str]) -> bool:
        """Whether this host holds ``job``: a process of it holds a timer, one's
        expiry is still in progress, one responds, or an incident of it is open."""
        return (
            bool(self._table.job_pids(*job))
            or self._firing.holds(job)
            or bool(self._responders.of_job(*job))
            or self._incidents.open_for(job, self._wall())
        )

    def fleet_ranks(
        self, incident_id: str, host: str, ranks: list[RankInfo], now: float
    ) -> list[Expired[P]]:
        """The ranks ``host`` found of an incident kept here, their readers mapped
        to local uids already. When a new expired rank came with them (an expiry there
        joined the incident: a job restarted within the window hung again), the
        job's local processes the incident does not list yet get the peer policy,
        as a local expiry would give them. When one of them asks for its peers to
        be unblocked, this host's ranks are owed it once the verdict here names
        their collective (`watchdogd.core.unblocks`)."""
        joined = self._incidents.merge_ranks(incident_id, host, ranks)
        kept = self._incidents.resolve(incident_id)
        if kept in self._incidents and any(rank.unblock == PEERS for rank in ranks):
            # Only a reason to look: each rank's own Flight Recorder decides.
            self._unblocks.want_remote(kept, now)
        if not joined:
            return []
        head = self._incidents.head(kept)
        if head is None:
            return []
        listed = self._incidents.pids(kept)
        return self._firing.peers(kept, (head.uid, head.job), None, listed, now)

    def host_lost(self, host: str, user: str, jobs: Iterable[tuple[int, str]], now: float) -> None:
        """``host`` left the fleet without stopping (its lease lapsed), seen at
        ``now`` (the daemon's clock): an incident of kind ``host_lost`` for each of
        its jobs a process here holds a timer of or responds for, as (local uid,
        job), whose ranks here are owed a cut out of the collective they wait in
        (`watchdogd.core.unblocks`: their own Flight Recorders decide); ``user``
        names each uid as the fleet does."""
        for uid, job in sorted(jobs):
            if not (self._table.job_pids(uid, job) or self._responders.of_job(uid, job)):
                continue
            note = f"host {host} left the fleet (its lease lapsed: the daemon or the host is gone)"
            incident = self._incidents.opened("host_lost", (uid, job), user, note, self._wall())
            self._metrics.incidents += 1
            self._unblocks.host_lost(incident, (uid, job), host, now)

    def fleet_rejected(self, reason: str) -> None:
        """A key read from the fleet was not taken (`watchdogd.fleet.records`)."""
        self._metrics.fleet_rejected[reason] += 1

    def fleet_failed(self, *, unexpected: bool = False) -> None:
        """A call to the fleet's store failed (``unexpected``: the fleet's task met
        an error nothing expected, and starts again)."""
        if unexpected:
            self._metrics.fleet_unexpected += 1
        else:
            self._metrics.fleet_errors += 1

    def fleet_dropped(self) -> None:
        """An incident change was not published: its user's share of the queue
        was full."""
        self._metrics.fleet_dropped += 1

    def fleet_changed(self, connected: bool, note: str) -> None:
        """The fleet's store became unreachable, or reachable again."""
        self.state = "connected" if connected else f"disconnected: {note}"
        self._events.record_daemon(
            "fleet_restored" if connected else "fleet_degraded",
            note
            if connected
            else f"the fleet is unreachable ({note}); local timers "
            "protect as ever, incidents stay on this host until it is back",
            pid=self._daemon_pid,
            time=self._wall(),
        )

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The fleet's gauges for the metrics page (none without a fleet)."""
        if not self.state:
            return {}
        return {
            "fleet_connected": (
                "1 while the fleet's store (etcd) answers.",
                int(self.state == "connected"),
            ),
            "fleet_errors": ("Calls to the fleet's store that failed.", self._metrics.fleet_errors),
            "fleet_dropped": (
                "Incident changes not published: more of their user's waited than its share.",
                self._metrics.fleet_dropped,
            ),
            "fleet_unexpected_errors": (
                "Errors of the fleet's task that nothing expected; it starts again.",
                self._metrics.fleet_unexpected,
            ),
        }
