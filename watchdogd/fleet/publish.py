"""What this host writes to etcd, under the fleet's ``prefix`` (the layout of this
release; each part of a key is URL-quoted, `watchdogd.fleet.records.make_key`):

- ``PREFIX/hosts/HOST``: this host, under its lease: the jobs it holds timers of,
  as (user name, job) pairs, and its state (``up``; ``stopped`` just before a clean
  stop revokes the lease).
- ``PREFIX/jobs/USER/JOB/HOST``: one key per job it holds, under its lease, so a
  job's hosts are one range read away.
- ``PREFIX/incidents/ID``: an incident this host opened (`IncidentInfo` without
  its ranks), put once, and ``PREFIX/ranks/USER/JOB/ID/HOST``: each host's ranks of
  it, stacks included, put as they change. Each incident's keys are put under a
  lease of its own of ``ttl`` seconds (`watchdogd.fleet.member.head_ttl`), never
  kept alive, so that etcd forgets an incident once no host follows it.

The host's lease is the member's (`watchdogd.fleet.member`), which keeps it alive
and hands it to each write of the host keys. The incidents are this module's:

- What waits to be published is the latest state of each incident, by the uid it
  belongs to: at most `PENDING_PER_UID` of one uid, `MAX_PENDING` in all; past
  either, the oldest of the uid with the most is dropped and counted
  (``fleet_dropped``), so one user's flood drops only its own.
- The uids take turns, and each publishes at most `PUBLISH_BURST` puts at once,
  then `PUBLISH_RATE` a second: the others' turns are never spent on it.
- A change that could not be published because etcd could not be reached waits
  again (unless a later state of it came meanwhile); one that etcd refused is
  dropped and counted, since trying again changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Final, Generic

import msgspec
import trio

from watchdogd_protocol import IncidentInfo, RankInfo

from ..core import FleetBridge, P
from ..host.users import UserNames
from ..logs import Throttle, logfmt
from .etcd import EtcdClient
from .gateway import EtcdError, EtcdFailure, LeaseNotFound
from .records import MAX_RANKS_BYTES, HostRecord, encode_ranks, make_key

log = logging.getLogger("watchdogd")

#: Incident changes waiting to be published, at most: `PENDING_PER_UID` of one
#: uid (past it, that uid's oldest goes), `MAX_PENDING` in all.
MAX_PENDING: Final = 256
PENDING_PER_UID: Final = 32
#: What one uid publishes: `PUBLISH_BURST` puts at once, then `PUBLISH_RATE` a
#: second; the others' turns are never spent on it.
PUBLISH_BURST: Final = 20
PUBLISH_RATE: Final = 2.0

_json = msgspec.json.Encoder()


class _Queue:
    """What waits to be published: the latest state of each incident, by the uid
    it belongs to, taken a uid at a time in turn. A uid holds at most
    `PENDING_PER_UID`, all at most `MAX_PENDING`: past either, the oldest of the
    uid with the most goes, so one user's flood drops only its own."""

    def __init__(self) -> None:
        self._by_uid: dict[int, OrderedDict[str, IncidentInfo]] = {}
        self._turns: deque[int] = deque()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def put(self, incident: IncidentInfo) -> int:
        """Queue ``incident`` (in place of an older state of it); how many were
        dropped for it."""
        held = self._by_uid.get(incident.uid)
        if held is None:
            held = self._by_uid[incident.uid] = OrderedDict()
            self._turns.append(incident.uid)
        if held.pop(incident.id, None) is None:
            self._count += 1
        held[incident.id] = incident
        dropped = 0
        while len(held) > PENDING_PER_UID or self._count > MAX_PENDING:
            fullest = held if len(held) > PENDING_PER_UID else max(self._by_uid.values(), key=len)
            fullest.popitem(last=False)
            self._count -= 1
            dropped += 1
        return dropped

    def put_back(self, incident: IncidentInfo) -> None:
        """``incident`` could not be published: it waits again, unless a later state
        of it came meanwhile."""
        held = self._by_uid.get(incident.uid)
        if held is not None and incident.id in held:
            return
        self.put(incident)

    def take(self, admit: Callable[[int], bool]) -> IncidentInfo | None:
        """The oldest change of the next uid in turn that ``admit`` lets publish;
        None when none may."""
        for _ in range(len(self._turns)):
            uid = self._turns[0]
            self._turns.rotate(-1)
            held = self._by_uid[uid]
            if not held:
                self._forget(uid)
                continue
            if not admit(uid):
                continue
            _, incident = held.popitem(last=False)
            self._count -= 1
            if not held:
                self._forget(uid)
            return incident
        return None

    def _forget(self, uid: int) -> None:
        del self._by_uid[uid]
        self._turns.remove(uid)


class Publisher(Generic[P]):
    """Writes this host's keys through ``client``: its host key and job keys under
    the lease it is handed (`put_host`, `put_stopped`), and each incident the core
    tells it of (`incident_changed`) when the member asks for the next
    (`publish_next`), under a lease of ``ttl`` seconds of the incident's own.
    ``names`` gives the fleet names of uids."""

    def __init__(
        self,
        client: EtcdClient,
        core: FleetBridge[P],
        names: UserNames,
        *,
        prefix: str,
        ttl: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._core = core
        self._names = names
        self._host = core.host
        self._prefix = prefix
        self._ttl = ttl
        self._queue = _Queue()
        self._news = trio.Event()
        self._rate = Throttle(PUBLISH_BURST, PUBLISH_RATE, clock=clock)
        #: The lease of each incident whose keys were put, the latest.
        self._leases: OrderedDict[str, int] = OrderedDict()

    # The host's keys.

    async def put_host(
        self, lease: int, jobs: list[tuple[str, str]], before: list[tuple[str, str]]
    ) -> None:
        """Say this host is up and holds ``jobs`` (as the fleet names them), under
        ``lease``: its host key, and a key of each job it did not hold ``before``;
        the key of each job it no longer holds is deleted."""
        value = _json.encode(HostRecord(self._host, "up", jobs))
        await self._client.put(self._key("hosts", self._host), value, lease=lease)
        for user, job in sorted(set(jobs) - set(before)):
            await self._client.put(self._key("jobs", user, job, self._host), b"", lease=lease)
        for user, job in sorted(set(before) - set(jobs)):
            await self._client.delete(self._key("jobs", user, job, self._host))

    async def put_stopped(self, lease: int) -> None:
        """Say this host stops, under ``lease``, so that the lease's end is no
        ``host_lost`` on the other hosts."""
        value = _json.encode(HostRecord(self._host, "stopped"))
        await self._client.put(self._key("hosts", self._host), value, lease=lease)

    # The incidents.

    def incident_changed(self, incident: IncidentInfo) -> None:
        """An incident this host opened or added to: queued to be published."""
        for _ in range(self._queue.put(incident)):
            self._core.fleet_dropped()
        self._news.set()

    async def publish_next(self, follow: Callable[[IncidentInfo, int], None]) -> None:
        """Wait for the next change a uid's rate lets go, and put it: its head once
        (when this host opened it: the head never changes), then this host's ranks
        of it as they are now. The head of an expiry is handed to ``follow`` with
        its revision as soon as it is put, before the ranks: other hosts act on it.

        A change that etcd refused is dropped and counted. Raises `EtcdFailure`
        when etcd could not be reached; the change waits again."""
        while True:
            incident = await self._next()
            try:
                await self._put_incident(incident, follow)
            except LeaseNotFound:
                self._leases.pop(incident.id, None)  # etcd lost it: anew
                self._queue.put_back(incident)
                continue
            except EtcdError as exc:
                # etcd refused it (too large, say): trying again changes nothing.
                log.warning(logfmt("fleet_incident_refused", incident=incident.id, error=str(exc)))
                self._core.fleet_dropped()
            except EtcdFailure:
                self._queue.put_back(incident)
                raise
            return

    async def _next(self) -> IncidentInfo:
        """The next change to publish, a uid at a time in turn, each within its rate."""
        while True:
            incident = self._queue.take(self._admit)
            if incident is not None:
                return incident
            if self._queue:
                # Every uid with changes waiting is over its rate for now.
                await trio.sleep(1 / PUBLISH_RATE)
            else:
                await self._news.wait()
                self._news = trio.Event()

    def _admit(self, uid: int) -> bool:
        return self._rate.admit(uid) is not None

    async def _put_incident(
        self, incident: IncidentInfo, follow: Callable[[IncidentInfo, int], None]
    ) -> None:
        if incident.host == self._host:
            # The name the fleet knows the user by, looked up now if it was not
            # known when the incident opened.
            user = await self._names.resolve_name(incident.uid)
            incident = msgspec.structs.replace(incident, user=user)
        lease = self._leases.get(incident.id)
        if lease is None:
            lease = await self._client.grant(self._ttl)
            if incident.host == self._host:
                head = _json.encode(msgspec.structs.replace(incident, ranks=[], count=0))
                key = self._key("incidents", incident.id)
                revision = await self._client.put(key, head, lease=lease)
                if incident.kind == "expired":  # the only kind other hosts act on
                    follow(incident, revision)
            self._leases[incident.id] = lease
            while len(self._leases) > MAX_PENDING:
                self._leases.popitem(last=False)
        ranks = [(rank, await self._reader_name(rank)) for rank in self._core.own_ranks(incident)]
        key = self._key("ranks", incident.user, incident.job, incident.id, self._host)
        await self._client.put(key, encode_ranks(ranks, MAX_RANKS_BYTES), lease=lease)

    async def _reader_name(self, rank: RankInfo) -> str:
        uid = rank.reader_uid
        return "" if uid is None else await self._names.resolve_name(uid)

    def _key(self, *parts: str) -> str:
        return make_key(self._prefix, *parts)


__all__ = ["MAX_PENDING", "PENDING_PER_UID", "PUBLISH_BURST", "PUBLISH_RATE", "Publisher"]
