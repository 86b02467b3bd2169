"""This daemon as a member of a fleet: hosts whose jobs span each other, joined
through etcd.

What it keeps in etcd, under ``prefix`` (the layout of this release):

- ``PREFIX/hosts/HOST``: this host, under its lease: the jobs it holds timers of,
  as (user name, job) pairs, and its state (``up``; ``stopped`` just before a clean
  stop revokes the lease).
- ``PREFIX/jobs/USER/JOB/HOST``: one key per job it holds, under its lease, so a
  job's hosts are one range read away.
- ``PREFIX/incidents/ID``: an incident this host opened (`IncidentInfo` without
  its ranks), put once, and ``PREFIX/ranks/USER/JOB/ID/HOST``: each host's ranks of
  it, stacks included, put as they change. Each is put under a lease of its own of
  `INCIDENT_TTL`, never kept alive: etcd forgets incidents a day after they
  happened. (Each part of a key is URL-quoted.)

What it watches: every key from ``hosts/`` through ``incidents/`` (the host keys and
the incidents' heads, a fraction of a KiB each; the layout keeps nothing else
between them); and, while it keeps incidents of a job, the ranks of that job, from
the first head's revision, through each incident's window (``incident_window``: an
expiry on its host joins it until then) and until every host of the job has
published ranks of each, none of them pending (`_SETTLE` seconds past the windows at
most; `MAX_FOLLOWED` jobs at once: the others wait their turn and miss nothing).
Keys that only some hosts need are in no watch of the others: an incident's ranks
reach the hosts of its job alone, a job's keys no host (bench/fleet.py measures what
that saves).

What it does with what it sees:

- Another host's incident of a job this host holds timers of (the same user's, by
  name): the incident is kept here too, and the job's local processes get the peer
  policy of their own timers' policies (`Service.fleet_incident`); the ranks this
  host finds are published under the incident, and those of the other hosts are
  merged into it, so ``watchdogctl incident`` shows the whole job on every host.
- A host key deleted without its ``stopped`` state (its lease lapsed: the daemon or
  the host is gone, or it was frozen): a ``host_lost`` incident on this host for
  each job the two shared (`Service.host_lost`).

etcd is never on the path of local protection: expiries are decided and carried
out by the daemon alone; this task only publishes what happened and acts on what
others published. Every etcd call is bounded (`watchdogd.fleet.etcd`); a failure
marks the fleet unreachable (status, a ``fleet_degraded`` event, the
``fleet_connected`` metric) and each loop tries again with backoff until it heals.
What waits to be published is bounded (`MAX_PENDING` incidents, the latest state
of each; past it the oldest is dropped and counted), and so are the jobs a host
registers (`MAX_JOBS`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar
from urllib.parse import quote, unquote

import msgspec
import trio

from watchdogd_client.protocol import IncidentInfo, RankInfo

from ..core.config import FleetConfig
from ..core.service import Service, TargetProcess
from ..core.timers import Expired
from ..logs import logfmt
from .etcd import (
    Backoff,
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdFailure,
    Event,
    LeaseNotFound,
)

log = logging.getLogger("watchdogd")

#: Seconds etcd keeps an incident.
INCIDENT_TTL: Final = 86_400
#: Incidents waiting to be published, at most.
MAX_PENDING: Final = 256
#: Jobs one host registers, at most.
MAX_JOBS: Final = 1000
#: Jobs whose incidents' ranks are followed at once, at most: each holds one of
#: the client's 8 connections, beside the watch and the calls of registering,
#: publishing and leaving.
MAX_FOLLOWED: Final = 4
#: How long past an incident's window its ranks are followed, at most: well past
#: the end of any peer policy that reports (a dump's timeout is 10 s).
_SETTLE: Final = 120.0
#: A revision after every other.
_NEVER: Final = sys.maxsize
#: How often the jobs held are compared with those registered.
_CHECK_EVERY: Final = 0.5
#: The most one value written to etcd holds: below etcd's default request bound
#: (1.5 MiB), whatever this host's ranks of an incident dumped.
MAX_VALUE_BYTES: Final = 1024 * 1024
#: An incident older than this when first seen (after a partition, say) is kept
#: but no longer acted on: its ranks have long moved on.
_STALE: Final = 60.0


@dataclass(slots=True)
class _Position:
    """Where a watch goes on from: the revision after the last change seen (0: read
    the keys first)."""

    revision: int = 0


@dataclass(slots=True, eq=False)
class _Following:
    """The incidents of a job whose ranks are followed: the host that opened each
    and the end of its window (wall time), by id; where the watch of the job's ranks
    goes on from; and the stage of the follow in progress, which a new incident
    cancels so that its window counts and its ranks are read from its head."""

    incidents: dict[str, tuple[str, float]]
    at: _Position
    stage: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: Where the next stage's watch starts at the latest: the head of an incident
    #: added while a stage ran.
    rewind: int = _NEVER


class _Host(msgspec.Struct, frozen=True):
    """What ``PREFIX/hosts/HOST`` holds."""

    host: str
    state: str
    jobs: list[tuple[str, str]] = []


_json = msgspec.json.Encoder()
_host_decoder = msgspec.json.Decoder(_Host)
_incident_decoder = msgspec.json.Decoder(IncidentInfo)
_ranks_decoder = msgspec.json.Decoder(list[RankInfo])

P = TypeVar("P", bound=TargetProcess)


class FleetMember(Generic[P]):
    """Registers this host, publishes its incidents and acts on the fleet's.
    ``client`` stands in for the one ``config`` names (bench/fleet.py counts its
    calls)."""

    def __init__(
        self,
        config: FleetConfig,
        service: Service[P],
        carry_out: Callable[[list[Expired[P]]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        client: EtcdClient | None = None,
    ) -> None:
        self.client = client or EtcdClient(
            config.etcd, ca=config.ca, cert=config.cert, key=config.key
        )
        self.service = service
        self.host = service.incidents.host
        self.prefix = config.prefix.rstrip("/")
        self.ttl = config.lease
        self._carry_out = carry_out
        self._clock = clock
        self._wall = wall
        self._lease: int | None = None
        self._pending: OrderedDict[str, IncidentInfo] = OrderedDict()
        self._news = trio.Event()
        self._incident_leases: OrderedDict[str, int] = OrderedDict()
        #: The incidents whose ranks this host follows or followed, the latest.
        self._followed: OrderedDict[str, None] = OrderedDict()
        #: The jobs whose incidents' ranks are followed, as (user name, job).
        self._following: dict[tuple[str, str], _Following] = {}
        self._limiter = trio.CapacityLimiter(MAX_FOLLOWED)
        self._nursery: trio.Nursery | None = None
        #: Every other host as last seen, with its jobs.
        self._hosts: dict[str, _Host] = {}
        self._connected: bool | None = None
        service.incidents.on_change = self._changed

    def holders(self, user: str, job: str) -> set[str]:
        """The other hosts that hold timers of ``job`` (of the user named ``user``),
        as their keys last said."""
        return {host for host, seen in self._hosts.items() if (user, job) in seen.jobs}

    # What the service tells the fleet.

    def _changed(self, incident: IncidentInfo) -> None:
        self._pending.pop(incident.id, None)
        self._pending[incident.id] = incident
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
            self.service.metrics.fleet_dropped += 1
        self._news.set()

    # The tasks.

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.client, trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._register)
            nursery.start_soon(self._publish)
            nursery.start_soon(self._watch)
            task_status.started()

    async def leave(self) -> None:
        """Say this host stops (so its lease's end is no ``host_lost``) and give
        its keys up: the daemon stops cleanly."""
        if self._lease is None:
            return
        try:
            value = _json.encode(_Host(self.host, "stopped"))
            await self.client.put(self._key("hosts", self.host), value, lease=self._lease)
            await self.client.revoke(self._lease)
        except EtcdFailure as exc:
            log.warning(logfmt("fleet_leave_failed", error=str(exc)))

    async def _register(self) -> None:
        """Keep this host's lease alive and its keys current."""
        backoff = Backoff()
        registered: set[tuple[str, str]] | None = None
        kept_alive = 0.0
        while True:
            try:
                if self._lease is None:
                    self._lease = await self.client.grant(self.ttl)
                    registered, kept_alive = None, self._clock()
                jobs = set(sorted(self.service.held_jobs())[:MAX_JOBS])
                if jobs != registered:
                    await self._put_jobs(jobs, registered or set())
                    registered = jobs
                if self._clock() - kept_alive >= self.ttl / 3:
                    if not await self.client.keepalive_once(self._lease):
                        self._lease = None  # lapsed (this host was frozen): anew
                        continue
                    kept_alive = self._clock()
                self._up()
                backoff.reset()
                await trio.sleep(_CHECK_EVERY)
            except EtcdFailure as exc:
                self._down(exc)
                await backoff.wait()

    async def _put_jobs(self, jobs: set[tuple[str, str]], before: set[tuple[str, str]]) -> None:
        lease = self._lease
        value = _json.encode(_Host(self.host, "up", sorted(jobs)))
        await self.client.put(self._key("hosts", self.host), value, lease=lease)
        for user, job in jobs - before:
            await self.client.put(self._key("jobs", user, job, self.host), b"", lease=lease)
        for user, job in before - jobs:
            await self.client.delete(self._key("jobs", user, job, self.host))

    async def _publish(self) -> None:
        """Put each incident that changed: its head (when this host opened it) and
        this host's ranks of it."""
        backoff = Backoff()
        while True:
            await self._news.wait()
            self._news = trio.Event()
            while self._pending:
                incident_id, incident = next(iter(self._pending.items()))
                try:
                    await self._put_incident(incident)
                except LeaseNotFound:
                    self._incident_leases.pop(incident_id, None)  # etcd lost it: anew
                    continue
                except EtcdError as exc:
                    # etcd refused it (too large, say): trying again changes nothing.
                    log.warning(
                        logfmt("fleet_incident_refused", incident=incident_id, error=str(exc))
                    )
                    self.service.metrics.fleet_dropped += 1
                except EtcdFailure as exc:
                    self._down(exc)
                    await backoff.wait()
                    continue
                if self._pending.get(incident_id) is incident:
                    del self._pending[incident_id]
                backoff.reset()

    async def _put_incident(self, incident: IncidentInfo) -> None:
        """Its head once (when this host opened it: the head never changes), and
        this host's ranks of it as they are now."""
        lease = self._incident_leases.get(incident.id)
        if lease is None:
            lease = await self.client.grant(INCIDENT_TTL)
            if incident.host == self.host:
                head = _json.encode(msgspec.structs.replace(incident, ranks=[], count=0))
                key = self._key("incidents", incident.id)
                revision = await self.client.put(key, head, lease=lease)
                if incident.kind == "expired":  # the only kind other hosts act on
                    self._follow(incident, revision)
            self._incident_leases[incident.id] = lease
            while len(self._incident_leases) > MAX_PENDING:
                self._incident_leases.popitem(last=False)
        ranks = _within(self.service.incidents.own_ranks(incident), MAX_VALUE_BYTES)
        key = self._key("ranks", incident.user, incident.job, incident.id, self.host)
        await self.client.put(key, _json.encode(ranks), lease=lease)

    async def _watch(self) -> None:
        """Follow the host keys and the incidents' heads."""
        hosts, heads = self._key("hosts", ""), self._key("incidents", "")
        await self._follow_keys(hosts, through=heads, at=_Position())

    def _follow(self, incident: IncidentInfo, revision: int) -> None:
        """Follow the ranks of ``incident``, kept here, from ``revision`` (its
        head's: every host's ranks of it came later), with those of the other
        incidents of its job followed now."""
        if incident.id in self._followed:
            return
        self._followed[incident.id] = None
        while len(self._followed) > MAX_PENDING:
            self._followed.popitem(last=False)
        job = (incident.user, incident.job)
        open_until = incident.time + self.service.incidents.window
        following = self._following.get(job)
        if following is not None:
            # Its job's ranks are watched already, but some of its may have come
            # before its head was seen here: the watch starts again from the head,
            # with this window counted.
            following.incidents[incident.id] = (incident.host, open_until)
            following.rewind = min(following.rewind, revision)
            following.stage.cancel()
            return
        incidents = {incident.id: (incident.host, open_until)}
        self._following[job] = _Following(incidents, _Position(revision))
        assert self._nursery is not None
        self._nursery.start_soon(self._follow_job, job)

    async def _follow_job(self, job: tuple[str, str]) -> None:
        """Follow the ranks of the job's incidents through their windows (an expiry
        on an incident's host joins it until then, and the peer policy reaches the
        processes it adds), then until every host of the job has settled each, for
        `_SETTLE` seconds at most."""
        following = self._following[job]

        def settled() -> bool:
            holders = self.holders(*job) | {self.host}
            return all(
                holders | {host} <= self.service.incidents.settled_hosts(incident)
                for incident, (host, _) in following.incidents.items()
            )

        prefix, at = self._key("ranks", *job, ""), following.at
        async with self._limiter:
            while True:
                following.stage = trio.CancelScope()
                at.revision = min(at.revision, following.rewind)
                following.rewind = _NEVER
                with following.stage:
                    last = max(until for _, until in following.incidents.values())
                    with trio.move_on_after(max(0.0, last - self._wall())) as windows:
                        await self._follow_keys(prefix, at=at)
                    if windows.cancelled_caught:  # every window has passed
                        with trio.move_on_after(_SETTLE):
                            await self._follow_keys(prefix, at=at, done=settled)
                if not following.stage.cancelled_caught:
                    del self._following[job]
                    return

    async def _follow_keys(
        self,
        prefix: str,
        *,
        through: str | None = None,
        at: _Position,
        done: Callable[[], bool] = lambda: False,
    ) -> None:
        """Read the keys under ``prefix`` (through ``through``, as
        `EtcdClient.range`) once, unless ``at`` says where to start, then watch
        them from there, until ``done``. ``at`` follows what was seen."""
        backoff = Backoff()
        while not done():
            try:
                if not at.revision:
                    snapshot = await self.client.range(prefix, through=through)
                    for kv in snapshot.kvs:
                        self._seen(kv.key, kv.value, kv.mod_revision, initial=True)
                    at.revision = snapshot.revision + 1
                    continue
                async with self.client.open_watch(
                    prefix, through=through, start_revision=at.revision
                ) as watch:
                    self._up()
                    backoff.reset()
                    async for event in watch:
                        self._event(event)
                        at.revision = event.revision + 1
                        if done():
                            return
            except EtcdCompacted:
                at.revision = 0
            except EtcdFailure as exc:
                self._down(exc)
                await backoff.wait()

    def _event(self, event: Event) -> None:
        if event.kind == "put":
            self._seen(event.key, event.value, event.revision, initial=False)
            return
        parts = self._parts(event.key)
        if len(parts) == 2 and parts[0] == "hosts" and parts[1] != self.host:
            gone = self._hosts.pop(parts[1], None)
            if gone is not None and gone.state != "stopped":
                log.warning(logfmt("fleet_host_lost", host=parts[1]))
                self.service.host_lost(parts[1], gone.jobs)

    def _seen(self, key: bytes, value: bytes, revision: int, *, initial: bool) -> None:
        """A key put at ``revision`` (``initial``: read at start, not watched)."""
        parts = self._parts(key)
        try:
            if len(parts) == 2 and parts[0] == "hosts" and parts[1] != self.host:
                self._hosts[parts[1]] = _host_decoder.decode(value)
            elif len(parts) == 2 and parts[0] == "incidents":
                self._incident(_incident_decoder.decode(value), revision, initial=initial)
            elif len(parts) == 5 and parts[0] == "ranks":
                ranks = _ranks_decoder.decode(value)
                runs = self.service.fleet_ranks(parts[3], parts[4], ranks, self._clock())
                if runs:
                    self._carry_out(runs)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning(
                logfmt("fleet_unreadable_key", key=key.decode(errors="replace"), error=str(exc))
            )

    def _incident(self, incident: IncidentInfo, revision: int, *, initial: bool) -> None:
        # A lost host is seen by each of its peers, which opens an incident of its
        # own: only an expiry is another host's to share.
        if incident.host == self.host or incident.kind != "expired":
            return
        if initial and incident.time < self._wall() - _STALE:
            return
        runs = self.service.fleet_incident(incident, self._clock())
        if runs:
            log.info(
                logfmt("fleet_incident", incident=incident.id, host=incident.host, peers=len(runs))
            )
            self._carry_out(runs)
        if incident.id in self.service.incidents:
            self._follow(incident, revision)

    # Helpers.

    def _key(self, *parts: str) -> str:
        """A key of the prefix; each part quoted, so a job or user with a ``/`` in
        its name is still one part."""
        return "/".join((self.prefix, *(quote(part, safe="") for part in parts)))

    def _parts(self, key: bytes) -> list[str]:
        text = key.decode(errors="replace")
        if not text.startswith(self.prefix + "/"):
            return []
        return [unquote(part) for part in text[len(self.prefix) + 1 :].split("/")]

    def _up(self) -> None:
        if self._connected is not True:
            self._connected = True
            log.info(logfmt("fleet_connected", endpoint=self.client.endpoint))
            self.service.fleet_changed(True, f"connected to {self.client.endpoint}")

    def _down(self, exc: EtcdFailure) -> None:
        self.service.metrics.fleet_errors += 1
        if self._connected is not False:
            self._connected = False
            log.warning(logfmt("fleet_unreachable", error=str(exc)))
            self.service.fleet_changed(False, str(exc))


def _within(ranks: list[RankInfo], limit: int) -> list[RankInfo]:
    """``ranks`` with their stacks cut, evenly, so that they encode to at most
    about ``limit`` bytes."""
    if len(_json.encode(ranks)) <= limit:
        return ranks
    share = max(1024, limit // max(1, len(ranks)) - 1024)
    return [
        msgspec.structs.replace(rank, stack=rank.stack.encode()[:share].decode(errors="ignore"))
        if len(rank.stack.encode()) > share
        else rank
        for rank in ranks
    ]
