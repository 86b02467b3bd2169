"""This daemon as a member of a fleet: hosts whose jobs span each other, joined
through etcd.

What it keeps in etcd is `watchdogd.fleet.publish`'s to write: this host's key
and its jobs' keys, under the lease this member keeps alive, and the incidents this
host opened, with its ranks of each, under leases of their own of `head_ttl`
seconds.

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

- Another host's incident of a job this host holds (the same user's, by name): the
  incident is kept here too, and the job's local processes get the peer policy of
  their own timers' policies, and those that hold no timer of it but respond are
  asked for their evidence (`FleetBridge.fleet_incident`); the ranks this host finds
  are published under the incident, and those of the other hosts are merged into
  it, so ``watchdogctl incident`` shows the whole job on every host.
- A host key deleted without its ``stopped`` state (its lease lapsed: the daemon or
  the host is gone, or it was frozen): a ``host_lost`` incident on this host for
  each job the two shared (`FleetBridge.host_lost`).

etcd is never on the path of local protection: expiries are decided and carried
out by the daemon alone; this task only publishes what happened and acts on what
others published. Every etcd call is bounded (`watchdogd.fleet.etcd`); a failure
marks the fleet unreachable (status, a ``fleet_degraded`` event, the
``fleet_connected`` metric) and each loop tries again with backoff until it heals.
What waits to be published is bounded (`watchdogd.fleet.publish`), and so are what
it keeps of other hosts (`watchdogd.fleet.view`) and the jobs a host registers
(`MAX_JOBS`); which parts work is `watchdogd.fleet.health`'s to say.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import msgspec
import trio

from watchdogd_protocol import IncidentInfo, RankInfo

from ..core import Expired, FleetBridge, FleetConfig, TargetProcess
from ..host.users import UserNames
from ..logs import Throttle, logfmt
from .etcd import Backoff, EtcdClient
from .gateway import EtcdCompacted, EtcdFailure, EtcdTooLarge
from .health import Health
from .publish import MAX_PENDING, Publisher
from .records import (
    MAX_JOBS,
    MAX_USERS,
    MAX_VALUE_BYTES,
    FleetRank,
    Rejected,
    decode_head,
    decode_host,
    decode_ranks,
    make_key,
    read_key,
)
from .view import FleetView
from .watch import Event

log = logging.getLogger("watchdogd")

#: Jobs of one uid (root's aside) among those a host registers, at most.
MAX_JOBS_PER_UID: Final = 100
#: Another host's incidents acted on, per job: `HEADS_BURST` at once, then one
#: every `window` / `HEADS_BURST` seconds (each starts the job's peer policy here).
HEADS_BURST: Final = 4
#: Jobs whose incidents' ranks are followed at once, at most: each holds one of
#: the client's 8 connections, beside the watch and the calls of registering,
#: publishing and leaving.
MAX_FOLLOWED: Final = 4
#: How long past an incident's window its ranks are followed, at most: well past
#: the end of any peer policy that reports (a dump's timeout is 10 s).
_SETTLE: Final = 120.0
#: A revision after every other.
_NEVER: Final = sys.maxsize
#: How long a follow holds its watch while other jobs wait for one, at least; how
#: often, past that, it looks whether one waits.
_TURN: Final = 2.0
_TURN_CHECK: Final = 0.25
#: How often the jobs held are compared with those registered.
_CHECK_EVERY: Final = 0.5
#: An incident older than this when first seen (after a partition, say) is kept
#: but no longer acted on: its ranks have long moved on.
_STALE: Final = 60.0


def head_ttl(window: float) -> int:
    """Seconds etcd keeps an incident's keys: through its window and the follow of
    its ranks after it, with a minute to spare; no longer, so that a flood of
    incidents leaves etcd soon."""
    return int(window + _SETTLE + 60)


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


P = TypeVar("P", bound=TargetProcess)


class FleetMember(Generic[P]):
    """Registers this host, publishes its incidents and acts on the fleet's.
    ``client`` stands in for the one ``config`` names (bench/fleet.py counts its
    calls); ``names`` maps uids and fleet names (`watchdogd.host.users`)."""

    def __init__(
        self,
        config: FleetConfig,
        core: FleetBridge[P],
        carry_out: Callable[[list[Expired[P]]], None],
        names: UserNames,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        client: EtcdClient | None = None,
    ) -> None:
        self.client = client or EtcdClient(
            config.etcd, ca=config.ca, cert=config.cert, key=config.key
        )
        self.core = core
        self.names = names
        self.host = core.host
        self.prefix = config.prefix.rstrip("/")
        self.ttl = config.lease
        self._carry_out = carry_out
        self._clock = clock
        self._wall = wall
        self._lease: int | None = None
        self._publisher = Publisher(
            self.client,
            core,
            names,
            prefix=self.prefix,
            ttl=head_ttl(core.incident_window),
            clock=clock,
        )
        self._heads = Throttle(
            HEADS_BURST, HEADS_BURST / max(core.incident_window, 1.0), clock=clock
        )
        #: The incidents whose ranks this host follows or followed, the latest.
        self._followed: OrderedDict[str, None] = OrderedDict()
        #: The jobs whose incidents' ranks are followed, as (user name, job).
        self._following: dict[tuple[str, str], _Following] = {}
        self._limiter = trio.CapacityLimiter(MAX_FOLLOWED)
        self._nursery: trio.Nursery | None = None
        self._view = FleetView()
        #: The jobs this host holds, as the fleet names them (`held`), as of the
        #: count of changes `_held_at`.
        self._held: frozenset[tuple[str, str]] = frozenset()
        self._held_at = -1
        self._health = Health(core, self.client)
        self._log = Throttle(5, 0.2, clock=clock)
        core.attach(self._publisher)

    def holders(self, user: str, job: str) -> set[str]:
        """The other hosts that hold timers of ``job`` (of the user named ``user``),
        as their keys last said."""
        return self._view.holders(user, job)

    # The tasks.

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.client, trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._supervised, "register", self._register)
            nursery.start_soon(self._supervised, "publish", self._publish)
            nursery.start_soon(self._supervised, "watch", self._watch)
            task_status.started()

    async def _supervised(self, part: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop`` and, should an error nothing expected end it (a bug), count
        it, say so and run it again with backoff: no error of the fleet reaches the
        daemon, whose protection goes on without it."""
        backoff = Backoff(0.5, 30.0)
        while True:
            try:
                await loop()
            except Exception as exc:
                self.core.fleet_failed(unexpected=True)
                if self._log.admit(("unexpected", part)) is not None:
                    log.exception(logfmt("fleet_task_failed", part=part))
                self._health.down(part, f"its task failed ({exc!r}) and starts again")
            else:
                return
            await backoff.wait()

    async def leave(self) -> None:
        """Say this host stops (so its lease's end is no ``host_lost``) and give
        its keys up: the daemon stops cleanly."""
        if self._lease is None:
            return
        try:
            await self._publisher.put_stopped(self._lease)
            await self.client.revoke(self._lease)
        except EtcdFailure as exc:
            log.warning(logfmt("fleet_leave_failed", error=str(exc)))

    async def _register(self) -> None:
        """Keep this host's lease alive and its keys current."""
        backoff = Backoff()
        registered: list[tuple[str, str]] | None = None
        seen = -1
        kept_alive = 0.0
        while True:
            try:
                if self._lease is None:
                    self._lease = await self.client.grant(self.ttl)
                    registered, kept_alive = None, self._clock()
                changed = self.core.jobs_changed()
                if changed != seen or registered is None:
                    jobs = sorted(await self.held())
                    if jobs != registered:
                        await self._publisher.put_host(self._lease, jobs, registered or [])
                        registered = jobs
                    seen = changed
                if self._clock() - kept_alive >= self.ttl / 3:
                    if not await self.client.keepalive_once(self._lease):
                        self._lease = None  # lapsed (this host was frozen): anew
                        continue
                    kept_alive = self._clock()
                self._health.ok("register")
                backoff.reset()
                await trio.sleep(_CHECK_EVERY)
            except EtcdFailure as exc:
                self._health.down("register", str(exc))
                await backoff.wait()

    async def held(self) -> frozenset[tuple[str, str]]:
        """The jobs this host registers, as the fleet names them: cut to their
        bounds before any name is looked up, and made again only when a job came
        or went."""
        changed = self.core.jobs_changed()
        if changed != self._held_at:
            self._held = frozenset(await self._held_jobs())
            self._held_at = changed
        return self._held

    async def _held_jobs(self) -> list[tuple[str, str]]:
        held = self.core.held_jobs(MAX_JOBS, MAX_JOBS_PER_UID)
        users: dict[int, str] = {}
        jobs: set[tuple[str, str]] = set()
        for uid, job in held:
            if uid not in users:
                if len(users) == MAX_USERS:
                    continue
                users[uid] = await self.names.resolve_name(uid)
            jobs.add((users[uid], job))
        return sorted(jobs)

    async def _publish(self) -> None:
        """Publish each incident that changed (`Publisher.publish_next`), and follow
        the ranks of each expiry whose head this host put."""
        backoff = Backoff()
        while True:
            try:
                await self._publisher.publish_next(self._follow)
            except EtcdFailure as exc:
                self._health.down("publish", str(exc))
                await backoff.wait()
                continue
            self._health.ok("publish")
            backoff.reset()

    async def _watch(self) -> None:
        """Follow the host keys and the incidents' heads."""
        hosts, heads = self._key("hosts", ""), self._key("incidents", "")
        await self._follow_keys("watch", hosts, through=heads, at=_Position())

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
        # Its verdict settles once every host of the job has reported.
        self.core.expect(incident.id, frozenset(self.holders(*job) | {self.host, incident.host}))
        open_until = incident.time + self.core.incident_window
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
        self._nursery.start_soon(self._supervised, "ranks", lambda: self._follow_job(job))

    async def _follow_job(self, job: tuple[str, str]) -> None:
        """Follow the ranks of the job's incidents through their windows (an expiry
        on an incident's host joins it until then, and the peer policy reaches the
        processes it adds), then until every host of the job has settled each, for
        `_SETTLE` seconds past the last window at most.

        At most `MAX_FOLLOWED` jobs hold a watch at once; while others wait for
        one, each holds it for a turn of `_TURN` seconds, then lets the next go
        first (`_end_turn`), and goes on from the revision it reached: so incidents
        that never settle (forged, or of a host gone) delay a real one by a turn, no
        more. A watch nobody waits for is kept, never opened again each turn."""
        following = self._following.get(job)
        if following is None:
            return  # its task failed and was started again: the follow was over

        def settled() -> bool:
            holders = self.holders(*job) | {self.host}
            return all(
                holders | {host} <= self.core.settled_hosts(incident)
                for incident, (host, _) in following.incidents.items()
            )

        prefix, at = self._key("ranks", *job, ""), following.at
        try:
            while True:
                async with self._limiter, trio.open_nursery() as turn:
                    turn.start_soon(self._end_turn, turn.cancel_scope)
                    await self._follow_turn(following, prefix, at, settled)
                    turn.cancel_scope.cancel()
                    return
                # The turn is over and another follow waits: it goes first.
        finally:
            del self._following[job]
            if not self._following:
                self._health.forget("ranks")

    async def _end_turn(self, turn: trio.CancelScope) -> None:
        """End ``turn`` once it has lasted `_TURN` seconds and another follow waits
        for a watch; while none waits, the watch is kept."""
        await trio.sleep(_TURN)
        while not self._limiter.statistics().tasks_waiting:
            await trio.sleep(_TURN_CHECK)
        turn.cancel()

    async def _follow_turn(
        self,
        following: _Following,
        prefix: str,
        at: _Position,
        settled: Callable[[], bool],
    ) -> None:
        """Follow the ranks from ``at`` until the follow is over: through the
        windows, then until ``settled`` or the settling time is up."""
        while True:
            following.stage = trio.CancelScope()
            at.revision = min(at.revision, following.rewind)
            following.rewind = _NEVER
            with following.stage:
                last = max(until for _, until in following.incidents.values())
                with trio.move_on_after(max(0.0, last - self._wall())):
                    await self._follow_keys("ranks", prefix, at=at)
                with trio.move_on_after(max(0.0, last + _SETTLE - self._wall())):
                    await self._follow_keys("ranks", prefix, at=at, done=settled)
            if not following.stage.cancelled_caught:
                return

    async def _follow_keys(
        self,
        part: str,
        prefix: str,
        *,
        through: str | None = None,
        at: _Position,
        done: Callable[[], bool] = lambda: False,
    ) -> None:
        """Read the keys under ``prefix`` (through ``through``, as
        `EtcdClient.range`) once, a page at a time, unless ``at`` says where to
        start, then watch them from there, until ``done``. ``at`` follows what was
        seen; ``part`` is what a failure marks down."""
        backoff = Backoff()
        while not done():
            try:
                if not at.revision:
                    revision = 0
                    async for page in self.client.range_pages(prefix, through=through):
                        revision = page.revision
                        for kv in page.kvs:
                            await self._apply(kv.key, kv.value, kv.mod_revision, initial=True)
                    at.revision = revision + 1
                    continue
                async with self.client.open_watch(
                    prefix, through=through, start_revision=at.revision, max_value=MAX_VALUE_BYTES
                ) as watch:
                    self._health.ok(part)
                    backoff.reset()
                    async for event in watch:
                        await self._event(event)
                        at.revision = event.revision + 1
                        if done():
                            return
            except EtcdCompacted:
                at.revision = 0
            except EtcdTooLarge as exc:
                # What etcd holds there is over the bounds: read the present state
                # again (a page at a time), after a while.
                at.revision = 0
                self._health.down(part, str(exc))
                await backoff.wait()
            except EtcdFailure as exc:
                self._health.down(part, str(exc))
                await backoff.wait()

    # What the fleet says.

    async def _event(self, event: Event) -> None:
        if event.kind == "put":
            await self._apply(
                event.key, event.value, event.revision, initial=False, oversize=event.oversize
            )
            return
        await trio.lowlevel.checkpoint()
        try:
            parts = read_key(self.prefix, event.key)
        except Rejected:
            return  # a key this host never took is gone: nothing to forget
        if parts[0] == "hosts" and parts[1] != self.host:
            await self._host_gone(parts[1])

    async def _apply(
        self, key: bytes, value: bytes, revision: int, *, initial: bool, oversize: int = 0
    ) -> None:
        """A key put at ``revision`` (``initial``: read at start, not watched):
        decoded whole, then applied; a key that is not taken is counted and
        skipped, nothing of it applied. ``oversize``: the size of a value the
        watch left undecoded as over every bound."""
        await trio.lowlevel.checkpoint()
        try:
            match read_key(self.prefix, key):
                case ("hosts", host):
                    if host != self.host:
                        self._view.host_seen(host, decode_host(host, _whole(value, oversize)))
                case ("incidents", incident_id):
                    head = decode_head(incident_id, _whole(value, oversize), self._wall())
                    await self._head_seen(head, revision, initial=initial)
                case ("ranks", _user, _job, incident_id, host):
                    await self._ranks_seen(incident_id, host, value, oversize)
        except Rejected as exc:
            self.core.fleet_rejected(exc.reason)
            if self._log.admit(("rejected", exc.reason)) is not None:
                log.warning(
                    logfmt(
                        "fleet_key_rejected",
                        key=key[:200].decode(errors="replace"),
                        reason=exc.reason,
                        error=exc.detail[:200],
                    )
                )
        except Exception:
            # A bug: this key is lost, and counted; the fleet goes on.
            self.core.fleet_failed(unexpected=True)
            self.core.fleet_rejected("unexpected")
            if self._log.admit("unexpected") is not None:
                log.exception(logfmt("fleet_key_failed", key=key[:200].decode(errors="replace")))

    async def _host_gone(self, host: str) -> None:
        jobs = self._view.host_gone(host)
        if jobs is None:
            return
        log.warning(logfmt("fleet_host_lost", host=host))
        # Only the jobs this host holds too matter: no name of the others is
        # looked up.
        for user, job in sorted(jobs & await self.held()):
            uid = await self.names.resolve_uid(user)
            if uid is not None:
                self.core.host_lost(host, user, [(uid, job)], self._clock())

    async def _head_seen(self, incident: IncidentInfo, revision: int, *, initial: bool) -> None:
        # A lost host is seen by each of its peers, which opens an incident of its
        # own: only an expiry is another host's to share.
        if incident.host == self.host or incident.kind != "expired":
            return
        if initial and incident.time < self._wall() - _STALE:
            return
        job = (incident.user, incident.job)
        if job not in await self.held() or self.core.knows(incident.id):
            return
        if self._heads.admit(job) is None:
            raise Rejected("budget", f"more incidents of job {incident.job} than its rate")
        uid = await self.names.resolve_uid(incident.user)
        if uid is None:
            return
        runs = self.core.fleet_incident(incident, uid, self._clock())
        if self.core.knows(incident.id):
            log.info(
                logfmt("fleet_incident", incident=incident.id, host=incident.host, peers=len(runs))
            )
        # Even with no policy to run: the ranks here that hold no timer of the job
        # but respond are asked for their evidence as it is carried out.
        self._carry_out(runs)
        if self.core.knows(incident.id):
            self._follow(incident, revision)

    async def _ranks_seen(
        self, incident_id: str, host: str, value: bytes, oversize: int = 0
    ) -> None:
        if host == self.host or not self.core.knows(incident_id):
            return
        self._view.take_ranks(incident_id, host, oversize or len(value), self.core.knows)
        ranks: list[RankInfo] = []
        for rank, reader in decode_ranks(host, _whole(value, oversize)):
            # Who may read its stack here: the local user of the reader's name.
            uid = None if not reader else await self.names.resolve_uid(reader)
            ranks.append(msgspec.structs.replace(rank, reader_uid=uid, reader_gid=None))
        self._carry_out(self.core.fleet_ranks(incident_id, host, ranks, self._clock()))

    # Helpers.

    def _key(self, *parts: str) -> str:
        return make_key(self.prefix, *parts)


def _whole(value: bytes, oversize: int) -> bytes:
    """``value``, unless the watch left it undecoded as over every bound."""
    if oversize:
        raise Rejected("size", f"{oversize} bytes, over the bound of every key ({MAX_VALUE_BYTES})")
    return value


__all__ = ["FleetMember", "FleetRank", "head_ttl"]
