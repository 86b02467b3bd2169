"""Incidents: what happened to a distributed job when one of its timers expired.

A timer armed with a ``job`` belongs to that job *of the user who armed it*: a job
is keyed by (owner uid, job name), so a user who names another user's job gets an
incident of their own, and an expiry never reaches another user's processes (root's
timers aside: root's jobs are root's). The first expiry of a job's timer opens an
incident; expiries of the same job within `IncidentLog.window` seconds join it as more
expired ranks. When an incident opens, and when an expiry joins it, every local process
holding a timer of the job that the incident does not list yet gets the expired
timer's policy's ``peers`` policy (by default ``peer_dump``, which records its stack
and touches nothing; `watchdogd.core.policies`): so the ranks of a job restarted
within the window (torchrun's ``--max-restarts``) are seen too, and none twice.

Each process of an incident is a `RankInfo`: ``pending`` until its policy has run,
then ``done`` (or ``gone``, ``denied``), with the stack its dump step captured and
the innermost frame of its main thread (`first_frame`); what is said of a rank
later (it asks for its peers to be unblocked, it was cut out of its collective:
`watchdogd.core.unblocks`) amends it (`IncidentLog.amend`). Incidents of other hosts
of the job arrive from the fleet (`IncidentLog.merge`) and are kept beside this
host's.

Pure and synchronous, bounded per uid as the events ring is
(`watchdogd.core.shares`): an incident counts against the uid that owns its job
(``IncidentInfo.uid``), one merged from the fleet too. At most ``keep`` of root's
incidents are kept, a share no other uid's incident evicts; at most ``keep`` of
every other uid's together, and ``per_uid`` of any one uid's. Past that the oldest
incident of the uid holding the most goes (the opening uid on a tie), so one uid's
flood evicts only its own older incidents once it holds the most, and a uid
holding no more than its fair share keeps all of its. At most `MAX_RANKS`
processes an incident, each stack cut to `MAX_STACK_BYTES`.

Bytes are bounded the same way: the ranks of root's incidents take at most
``evidence`` bytes, those of every other uid's together as much, and
``evidence_per_uid`` of any one uid's; the excess is trimmed from the uid's own
incidents, stacks first (`watchdogd.core.evidence_budget`). What changed is handed
to the runtime as `StoredIncident` records (`changes`), which the state keeps, and a
restarted daemon takes them back (`restore`): an incident still open goes on
gathering, with its ranks, stacks, readers and verdict as they were. Root sees every
incident; another uid, those of its own jobs, and of each the stacks only of the
processes ptrace's read rule let it read when dumped (`may_read`, kept with the rank).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Final

import msgspec

from watchdogd_protocol import (
    MAX_REPLY_BYTES,
    EventInfo,
    GroupState,
    IncidentInfo,
    RankInfo,
)

from .evidence_budget import EVIDENCE_BYTES, EVIDENCE_BYTES_PER_UID, EvidenceBudget, Kept
from .identity import ROOT
from .ranks import (
    MAX_STACK_BYTES,
    bounded,
    clip,
    first_frame,
    may_read,
    reported,
    shown_order,
    stack_of,
    state_of,
    unread,
    with_evidence_of,
)
from .shares import Shares
from .user_frames import Library
from .verdict import Decision, decide
from .viewing import viewed

#: The most processes one incident lists.
MAX_RANKS: Final = 1024
#: The most ids of incidents that joined another that are remembered.
_MAX_ALIASES: Final = 4096
#: Room a reply keeps for everything but the stacks.
_ENVELOPE_BYTES: Final = 64 * 1024

JobKey = tuple[int, str]
#: Told of each verdict that settles (None: no rank gave evidence for one), with
#: the incident's ranks: the fingerprint it settles with and whether it counted.
Settled = Callable[[IncidentInfo, Decision | None, list[RankInfo]], tuple[str, str]]


class StoredIncident(msgspec.Struct, array_like=True, frozen=True):
    """An incident as the state keeps it: its head (``info``, without ranks), its
    ranks, and what decides how it goes on (the wall time its window closes,
    whether its verdict settled, the hosts it waits for). Its verdict is not
    stored: the same ranks judge to the same verdict; the fingerprint it settled
    with is (and in ``info``, whether that counted: `watchdogd.core.hangs`)."""

    info: IncidentInfo
    ranks: list[RankInfo]
    open_until: float
    settled: bool
    hosts: list[str]
    fingerprint: str = ""


def _kept(stored: StoredIncident) -> Kept:
    """An incident as the state kept it."""
    incident = Kept(stored.info, [], stored.open_until, None, stored.settled)
    incident.hosts = frozenset(stored.hosts)
    incident.fingerprint = stored.fingerprint
    incident.assign([bounded(rank) for rank in stored.ranks[:MAX_RANKS]])
    return incident


def _stored(incident: Kept) -> StoredIncident:
    """``incident`` as the state keeps it."""
    kept = incident
    return StoredIncident(kept.info, list(kept.ranks), kept.open_until, kept.settled,
                          sorted(kept.hosts), kept.fingerprint)  # fmt: skip


class _Aliases(OrderedDict[str, str]):
    """Incidents of a job that another of its window took in, oldest first: the
    id each goes by now (`IncidentLog.merge`). At most `_MAX_ALIASES`."""

    def add(self, old: str, new: str) -> None:
        for key, value in self.items():
            if value == old:
                self[key] = new
        self[old] = new
        while len(self) > _MAX_ALIASES:
            self.popitem(last=False)


class Changes:
    """What changed among the incidents since the state last took it (`take`):
    the incidents changed, the ids of those dropped. Bounded: an incident is in it
    once, and a drop only of one that was kept."""

    def __init__(self, count: Callable[[Kept], object] = lambda incident: None) -> None:
        self._changed: dict[str, Kept] = {}
        self._dropped: list[str] = []
        #: Told of each change too: its bytes count (`watchdogd.core.evidence_budget`).
        self.count = count

    def touch(self, incident: Kept) -> None:
        self._changed[incident.info.id] = incident
        self.count(incident)

    def gone(self, incident_id: str) -> None:
        self._changed.pop(incident_id, None)
        self._dropped.append(incident_id)

    def take(self) -> tuple[list[StoredIncident], list[str]]:
        """The incidents changed, as the state keeps them, and the ids dropped."""
        changed = [_stored(incident) for incident in self._changed.values()]
        dropped, self._changed, self._dropped = self._dropped, {}, []
        return changed, dropped


class _Judge:
    """Judges incidents' verdicts (`watchdogd.core.verdict`), and says once when
    each settles."""

    def __init__(
        self,
        library: Library,
        on_settled: Settled,
        touched: Callable[[Kept], object],
    ) -> None:
        self.library = library
        self.on_settled = on_settled
        #: Called with each incident whose ranks or standing change.
        self.touched = touched
        #: A fleet listens: an incident's verdict waits for the hosts of its job
        #: (`IncidentLog.expect`) or its window, not only for this host's ranks.
        self.fleet = False

    def judge(self, incident: Kept) -> None:
        """What is known of ``incident`` changed: its verdict is judged anew when it
        is next read (judging it at every rank's word would cost an incident of many
        ranks time squared, on the loop); once it settles, it is recorded
        (``on_settled``), once."""
        self.touched(incident)
        incident.decision = None
        if (
            not incident.settled
            and _reported(incident)
            and (bool(incident.hosts) or not self.fleet)
        ):
            self.settle(incident)

    def settle(self, incident: Kept) -> None:
        self.touched(incident)
        incident.settled = True
        incident.decision = None
        decision = self.decided(incident)
        incident.fingerprint, repeat = self.on_settled(incident.info, decision, incident.ranks)
        incident.info = msgspec.structs.replace(incident.info, repeat=repeat)

    def decided(self, incident: Kept) -> Decision | None:
        """The verdict on ``incident`` as its ranks say now (None: it has none)."""
        if incident.decision is None and incident.ranks:
            incident.decision = decide(
                incident.ranks, library=self.library, settled=incident.settled
            )
        return incident.decision


class IncidentLog:
    """The latest incidents, this host's and the fleet's, newest last."""

    def __init__(
        self,
        host: str,
        *,
        keep: int = 100,
        per_uid: int | None = None,
        window: float = 30.0,
        new_id: Callable[[], str] | None = None,
        library: Library | None = None,
        on_settled: Settled = lambda incident, decision, ranks: ("", ""),
        evidence: int = EVIDENCE_BYTES,
        evidence_per_uid: int | None = EVIDENCE_BYTES_PER_UID,
        on_trimmed: Callable[[int, int], object] = lambda uid, size: None,
    ) -> None:
        self.host = host
        self.window = window
        self.budget = EvidenceBudget(
            evidence,
            evidence_per_uid,
            owned=lambda uid: [self._incidents[i] for i in self._owned.get(uid, ())],
            drop_oldest=self._drop_oldest,
            touch=lambda incident: self.changes.touch(incident),  # noqa: PLW0108 (made next)
            on_trimmed=on_trimmed,
        )
        #: What the state has still to take (`watchdogd.storage.record_file`).
        self.changes = Changes(self.budget.count)
        library = Library(frozenset()) if library is None else library
        self._judges = _Judge(library, on_settled, self.changes.touch)
        self._shares = Shares(keep, per_uid)
        numbers = itertools.count(1)
        # The runtime passes ids that differ from one run of the daemon to the
        # next (`watchdogd.runtime.daemon`); these only count.
        self._new_id = new_id or (lambda: f"{host}-{next(numbers)}")
        self._incidents: OrderedDict[str, Kept] = OrderedDict()
        #: The ids of each uid's incidents, oldest first: whose oldest gives way.
        self._owned: dict[int, deque[str]] = {}
        #: The incident still open to more expiries, by job.
        self._open: dict[JobKey, str] = {}
        self._aliases = _Aliases()
        #: Counts the incidents opened to expiries: the jobs this host holds change.
        self.windows_opened = 0
        self._listener: Callable[[IncidentInfo], object] = lambda incident: None

    def __len__(self) -> int:
        return len(self._incidents)

    def subscribe(self, listener: Callable[[IncidentInfo], object]) -> None:
        """Have ``listener`` called with each incident this host opens or adds to,
        whole, as it changes (the fleet publishes it); it replaces the one before."""
        self._listener = listener
        self._judges.fleet = True

    def kept(self, uid: int) -> int:
        """How many incidents of ``uid``'s jobs are kept."""
        return self._shares.held(uid)

    def resize(self, keep: int, per_uid: int | None = None) -> None:
        """Keep at most ``keep`` (and ``per_uid`` per uid) from now on; the newest
        stay when a bound shrinks."""
        for uid in self._shares.resize(keep, per_uid):
            self._drop_oldest(uid)

    def expired(
        self, job: JobKey, user: str, rank: RankInfo, reason: str, wall: float
    ) -> tuple[str, bool]:
        """A timer of ``job`` expired on the process ``rank`` describes: the id of
        the incident it belongs to, and whether that incident is new (its peers
        are then to be acted on)."""
        held = self._incidents.get(self._open.get(job, ""))
        if held is not None and wall < held.open_until:
            # A process listed already (a peer: the incident came from another host
            # first) is listed once, as expired from now on, keeping what its peer
            # dump gave until its own dump replaces it (the verdict still has it).
            for index, listed in enumerate(held.ranks):
                if (listed.host, listed.pid) == (rank.host, rank.pid):
                    held.put(index, with_evidence_of(rank, listed))
                    self._judges.judge(held)
                    self._listener(_whole(held))
                    return held.info.id, False
            self._add(held, rank)
            return held.info.id, False
        info = _head(self._new_id(), self.host, job, user, wall, scope=rank.scope, reason=reason)
        info = msgspec.structs.replace(info, rank=rank.rank)
        incident = Kept(info, open_until=wall + self.window)
        self._keep(incident)
        self._open[job] = info.id
        self.windows_opened += 1
        self._add(incident, rank)
        return info.id, True

    def opened(self, kind: str, job: JobKey, user: str, note: str, wall: float) -> str:
        """An incident of ``job`` that no expiry opened (``kind``, e.g.
        ``host_lost``); its id."""
        info = _head(self._new_id(), self.host, job, user, wall, scope="", reason=note, kind=kind)
        incident = Kept(info)
        self._keep(incident)
        self._listener(_whole(incident))
        return info.id

    def pids(self, incident_id: str) -> set[int]:
        """The pids of this host's processes the incident lists."""
        incident = self._incidents.get(self.resolve(incident_id))
        if incident is None:
            return set()
        return {rank.pid for rank in incident.ranks if rank.host == self.host}

    def add(self, incident_id: str, rank: RankInfo) -> None:
        """Another process of the incident's job (a peer)."""
        incident = self._incidents.get(self.resolve(incident_id))
        if incident is not None:
            self._add(incident, rank)

    def _add(self, incident: Kept, rank: RankInfo) -> None:
        if len(incident.ranks) < MAX_RANKS:
            incident.append(rank)
            self._judges.judge(incident)
            self._listener(_whole(incident))

    def evidence_in(self, incident_id: str, pid: int) -> bool:
        """Whether every rank of ``incident_id`` on this host but ``pid`` reported."""
        incident = self._incidents.get(self.resolve(incident_id))
        ranks = () if incident is None else incident.ranks
        return all(reported(r) for r in ranks if r.host == self.host and r.pid != pid)

    def expect(self, incident_id: str, hosts: frozenset[str]) -> None:
        """The fleet says ``hosts`` hold the incident's job: its verdict settles
        once each has reported (or its window closes)."""
        incident = self._incidents.get(incident_id)
        if incident is not None and not incident.settled:
            incident.hosts = hosts
            self._judges.judge(incident)

    def tick(self, wall: float) -> None:
        """At ``wall``: the verdict of an incident whose window has closed settles
        on what has come."""
        for incident in self._incidents.values():
            if not incident.settled and wall >= incident.info.time + self.window:
                self._judges.settle(incident)

    def dumped(
        self,
        incident_id: str,
        pid: int,
        role: str,
        reader: tuple[int, int] | None,
        *,
        evidence: str = "",
        flight: Sequence[GroupState] = (),
    ) -> None:
        """The dump of this host's process ``pid`` (its ``role`` in the incident) was
        taken: ``reader`` is who besides root may read it (`get`), ``evidence`` how
        it was taken, ``flight`` its Flight Recorder's groups."""
        found = self._pending(incident_id, pid, role)
        if found is not None:
            incident, index = found
            uid, gid = (None, None) if reader is None else reader
            incident.update(
                index, reader_uid=uid, reader_gid=gid, evidence=evidence, flight=list(flight)
            )
            self.changes.touch(incident)

    def given(
        self,
        incident_id: str,
        pid: int,
        stack: str,
        *,
        evidence: str,
        flight: Sequence[GroupState],
        reader: tuple[int, int] | None,
        note: str = "",
    ) -> None:
        """The evidence of this host's rank ``pid``, a peer no policy runs on (it
        holds no timer of the job, `watchdogd.core.firing`): its stack as text, how
        it was taken, its Flight Recorder's groups, who besides root may read it."""
        found = self._pending(incident_id, pid, "peer")
        if found is None:
            return
        incident, index = found
        uid, gid = (None, None) if reader is None else reader
        rank = incident.ranks[index]
        incident.update(
            index,
            state="done",
            stack=clip(stack, MAX_STACK_BYTES),
            frame=first_frame(stack),
            evidence=evidence,
            flight=list(flight),
            reader_uid=uid,
            reader_gid=gid,
            note=f"{rank.note}; {note}" if note else rank.note,
        )
        self._judges.judge(incident)
        self._listener(_whole(incident))

    def finished(self, event: EventInfo) -> None:
        """The policy of a process of an incident has run: its ``expired`` or
        ``peer`` event says how, and holds its stack if it dumped one."""
        role = "peer" if event.kind == "peer" else "expired"
        found = self._pending(event.incident, event.pid, role)
        if found is None:
            return
        incident, index = found
        stack = stack_of(event) or incident.ranks[index].stack  # none dumped: a peer's
        incident.update(
            index, state=state_of(event), stack=stack, frame=first_frame(stack), note=event.note
        )
        self._judges.judge(incident)
        self._listener(_whole(incident))

    def _pending(self, incident_id: str, pid: int, role: str) -> tuple[Kept, int] | None:
        """The kept incident and the index of this host's rank ``pid`` in ``role``
        whose policy has not run yet, if there is one."""
        incident = self._incidents.get(self.resolve(incident_id))
        if incident is None:
            return None
        for index, rank in enumerate(incident.ranks):
            if (rank.host, rank.pid, rank.role, rank.state) == (self.host, pid, role, "pending"):
                return incident, index
        return None

    def amend(
        self, incident_id: str, pid: int, change: Callable[[RankInfo | None], RankInfo]
    ) -> None:
        """This host's rank ``pid`` of the incident becomes ``change(rank)``, or
        ``change(None)`` joins it where it lists none; published either way."""
        incident = self._incidents.get(self.resolve(incident_id))
        if incident is not None:
            here = [i for i, r in enumerate(incident.ranks) if (r.host, r.pid) == (self.host, pid)]
            if not here:
                self._add(incident, change(None))
                return
            incident.ranks[here[0]] = change(incident.ranks[here[0]])
            self._judges.judge(incident)
            self._listener(_whole(incident))

    def __contains__(self, incident_id: object) -> bool:
        return incident_id in self._incidents or incident_id in self._aliases

    def merge(self, remote: IncidentInfo) -> str:
        """An incident another host opened, as the fleet has it (its ranks come
        host by host: `merge_ranks`); the id it is kept under here.

        Expiries of one job within its window are one incident on every host: of
        two opened within a window of each other (each host opened its own, a
        moment apart), the one opened first (then the smaller id) is the one, on
        every host alike. When it is the remote one, this host's ranks move into it
        (and are published under its id); otherwise the remote id is taken for this
        host's, and its host's ranks join this host's incident as they come."""
        known = self.resolve(remote.id)
        if known in self._incidents:
            return known
        job = (remote.uid, remote.job)
        rival = self._rival(job, remote.time, remote.host)
        if rival is not None and (rival.info.time, rival.info.id) < (remote.time, remote.id):
            self._aliases.add(remote.id, rival.info.id)
            return rival.info.id
        head = msgspec.structs.replace(remote, ranks=[], count=0, trimmed=0)
        incident = Kept(head, open_until=remote.time + self.window)
        self._keep(incident)
        if rival is not None:
            self._forget(rival.info.id)
            incident.assign(rival.ranks[:MAX_RANKS])
            self._aliases.add(rival.info.id, remote.id)
        if remote.kind == "expired":
            # Any rival lost to it: expiries of the job here join it from now on.
            self._open[job] = remote.id
            self.windows_opened += 1
        self._judges.judge(incident)
        if rival is not None:
            self._listener(_whole(incident))
        return remote.id

    def _rival(self, job: JobKey, time: float, host: str) -> Kept | None:
        """An incident of ``job`` kept here that another host than ``host`` opened
        within a window of ``time``: two hosts' takes on one expiry. Two incidents
        of one host are two: that host's window kept them apart."""
        for incident in reversed(self._incidents.values()):
            info = incident.info
            if (
                (info.uid, info.job) == job
                and info.kind == "expired"
                and info.host != host
                and abs(info.time - time) < self.window
            ):
                return incident
        return None

    def open_for(self, job: JobKey, wall: float) -> bool:
        """Whether an incident of ``job`` is open to more expiries at ``wall``."""
        held = self._incidents.get(self._open.get(job, ""))
        return held is not None and wall < held.open_until

    def open_jobs(self, wall: float) -> list[JobKey]:
        """The jobs with an incident open to more expiries at ``wall``."""
        return [job for job in self._open if self.open_for(job, wall)]

    def resolve(self, incident_id: str) -> str:
        """The id an incident goes by here (another, once it joined another host's)."""
        return self._aliases.get(incident_id, incident_id)

    def _forget(self, incident_id: str) -> None:
        """Drop a kept incident whose ranks another took in."""
        incident = self._incidents.pop(incident_id, None)
        if incident is None:
            return
        self.changes.gone(incident_id)
        uid = incident.info.uid
        owned = self._owned.get(uid)
        if owned is not None and incident_id in owned:
            owned.remove(incident_id)
            if not owned:
                del self._owned[uid]
        self._shares.remove(uid)
        self.budget.forget(incident)
        job = (uid, incident.info.job)
        if self._open.get(job) == incident_id:
            del self._open[job]

    def merge_ranks(self, incident_id: str, host: str, ranks: list[RankInfo]) -> bool:
        """The ranks another host found of a kept incident: they replace what was
        known of that host's. Whether an expired rank came with them that was not
        known before, in a later word from that host (an expiry there joined the
        incident after it opened)."""
        incident = self._incidents.get(self.resolve(incident_id))
        if incident is None or host == self.host:
            return False
        if not any(rank.host == host for rank in incident.ranks):
            expired = {rank.pid for rank in ranks if rank.role == "expired"}
        else:
            expired = {r.pid for r in incident.ranks if r.host == host and r.role == "expired"}
        kept = [rank for rank in incident.ranks if rank.host != host]
        incident.assign((kept + [bounded(rank) for rank in ranks if rank.host == host])[:MAX_RANKS])
        self._judges.judge(incident)
        return any(
            rank.role == "expired" and rank.pid not in expired
            for rank in ranks
            if rank.host == host
        )

    def head(self, incident_id: str) -> IncidentInfo | None:
        """What an incident is, without its ranks."""
        incident = self._incidents.get(self.resolve(incident_id))
        return None if incident is None else incident.info

    def settled_hosts(self, incident_id: str) -> set[str]:
        """The hosts whose ranks of a kept incident are known, none of them still
        ``pending`` (none, for an incident not kept)."""
        incident = self._incidents.get(self.resolve(incident_id))
        if incident is None:
            return set()
        hosts = {rank.host for rank in incident.ranks}
        return hosts - {rank.host for rank in incident.ranks if rank.state == "pending"}

    def listing(self, viewer: int, limit: int) -> list[IncidentInfo]:
        """The latest ``limit`` incidents ``viewer`` may see, newest last, without
        their ranks (``count`` says how many)."""
        seen = [
            msgspec.structs.replace(
                incident.info,
                count=len(incident.ranks),
                verdict=viewed(
                    self._judges.decided(incident), incident.ranks, incident.fingerprint, viewer
                ),
            )
            for incident in reversed(self._incidents.values())
            if viewer in (ROOT, incident.info.uid)
        ]
        return seen[:limit][::-1]

    def about(self, pid: int, viewer: int) -> list[IncidentInfo]:
        """The incidents ``viewer`` may see that process ``pid`` of this host is a
        rank of, oldest first, without their ranks."""
        return [
            msgspec.structs.replace(incident.info, count=len(incident.ranks))
            for incident in self._incidents.values()
            if viewer in (ROOT, incident.info.uid)
            and any(rank.pid == pid and rank.host == self.host for rank in incident.ranks)
        ]

    def get(self, incident_id: str, viewer: int, viewer_gid: int) -> IncidentInfo | None:
        """One incident as ``viewer`` (of group ``viewer_gid``) may see it (None:
        none it may see), expired ranks first, then by host and rank, its stacks cut
        to fit a reply. A rank's stack and frame are shown to root, and to the
        rank's reader (`may_read`); to anyone else, a note says why not."""
        incident = self._incidents.get(self.resolve(incident_id))
        if incident is None or viewer not in (ROOT, incident.info.uid):
            return None
        ranks = [
            rank if may_read(rank, viewer, viewer_gid) else unread(rank)
            for rank in sorted(incident.ranks, key=shown_order)
        ]
        budget = (MAX_REPLY_BYTES - _ENVELOPE_BYTES) // max(1, len(ranks))
        ranks = [
            rank
            if len(rank.stack.encode()) <= budget
            else msgspec.structs.replace(rank, stack=clip(rank.stack, budget))
            for rank in ranks
        ]
        return msgspec.structs.replace(
            incident.info,
            ranks=ranks,
            count=len(ranks),
            verdict=viewed(
                self._judges.decided(incident),
                incident.ranks,
                incident.fingerprint,
                viewer,
                viewer_gid,
            ),
        )

    def _keep(self, incident: Kept) -> None:
        uid = incident.info.uid
        victim = self._shares.add(uid)
        if victim is not None:
            self._drop_oldest(victim)
        self._incidents[incident.info.id] = incident
        self._owned.setdefault(uid, deque()).append(incident.info.id)
        self.changes.touch(incident)

    def everything(self) -> list[StoredIncident]:
        """Every kept incident as the state keeps it, oldest first."""
        return [_stored(incident) for incident in self._incidents.values()]

    def restore(self, stored: Sequence[StoredIncident], wall: float) -> None:
        """Keep ``stored`` (read back from the state, oldest first) under the bounds;
        one whose window is open at ``wall`` takes its job's expiries again."""
        for record in stored:
            if record.info.id not in self._incidents:
                self._keep(_kept(record))
                if record.info.kind == "expired" and wall < record.open_until:
                    self._open[(record.info.uid, record.info.job)] = record.info.id
                    self.windows_opened += 1
        self.changes.take()

    def _drop_oldest(self, uid: int) -> None:
        owned = self._owned[uid]
        oldest = owned.popleft()
        if not owned:
            del self._owned[uid]
        dropped = self._incidents.pop(oldest)
        self.budget.forget(dropped)
        self.changes.gone(oldest)
        job = (dropped.info.uid, dropped.info.job)
        if self._open.get(job) == oldest:
            del self._open[job]


def _head(
    incident_id: str,
    host: str,
    job: JobKey,
    user: str,
    wall: float,
    *,
    scope: str,
    reason: str,
    kind: str = "expired",
) -> IncidentInfo:
    """A new incident of ``job`` opened on ``host`` at ``wall``."""
    uid, name = job
    return IncidentInfo(
        id=incident_id, job=name, user=user, uid=uid, host=host, scope=scope, reason=reason,
        time=wall, kind=kind,
    )  # fmt: skip


def _whole(incident: Kept) -> IncidentInfo:
    """``incident`` with its ranks, as the fleet publishes it."""
    return msgspec.structs.replace(
        incident.info, ranks=list(incident.ranks), count=len(incident.ranks)
    )


def _reported(incident: Kept) -> bool:
    """Whether every rank known has reported and every host of the job too."""
    hosts = {rank.host for rank in incident.ranks}
    return (
        bool(incident.ranks)
        and incident.hosts <= hosts
        and all(rank.state != "pending" for rank in incident.ranks)
    )
