"""Unblocks: the ranks of this host owed a cut out of the collective they wait in,
why, and what became of each.

Two things order one, for the ranks of a job that respond here and said they
unblock (`watchdogd.core.responders.Responder.unblock`); a rank without such a
responder is never unblocked:

- a host of the job was lost (`host_lost`): each rank here is asked to be cut out
  of a collective it entered before the loss and has waited in for ``waited``
  seconds (``[fleet] unblock_after``), whichever it has waited in longest;
- a rank's policy asked for its peers to be unblocked (a step ``unblock =
  "peers"`` on this host, `want`, or a rank of another host that says so,
  `want_remote`): once the incident's verdict names its culprits and a collective
  (`check`, which the runtime calls while any such incident waits, for
  `WANT_FOR` seconds at most), each rank of the job here but the culprits is asked
  to be cut out of that collective (the same group and number), once it has
  waited ``waited`` seconds in it.

Either way the rank's own responder decides, from its own Flight Recorder read
when it is asked (`watchdogd_client.unblocking`): what etcd says (a host record
lapsing, a rank of another host asking) is only a reason to ask, so a rank whose
collectives complete is never cut, whatever was forged there.

The runtime takes what is due (`take`) and hands back each answer (`answered`). A
rank cut out is recorded in an ``unblocked`` event of its owner's and in the
incident: who, why and when. One asked too soon is asked again when its responder
says it will have waited long enough, pinned to that very collective, at most
`MAX_TRIES` times; any other answer ends its unblock. A rank is asked at most once
per incident (within the last `MAX_ORDERED` ordered), and at most `MAX_OWED`
unblocks wait at once.

Pure: no clock is read (``now`` is the daemon's clock, passed in; the wall clock
is the service's) and nothing is sent: the runtime's `watchdogd.runtime.unblocker`
does that.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from msgspec.structs import replace as replace_struct

from watchdogd_protocol import (
    Culprit,
    EventInfo,
    IncidentInfo,
    RankInfo,
    Unblocked,
    UnblockOutcome,
    UnblockWanted,
    Verdict,
)

from .counters import Counters
from .events import EventLog
from .identity import ROOT
from .incidents import IncidentLog
from .responders import Responder, Responders

#: Why an unblock was ordered (``unblocked`` events' ``outcome``, the metric's
#: ``cause``).
HOST_LOST: Final = "host_lost"
PEERS: Final = "peers"
#: How many times a rank too soon is asked again, at most.
MAX_TRIES: Final = 8
#: Unblocks waiting at once, at most: past it, a new one is dropped and counted.
MAX_OWED: Final = 65_536
#: (incident, rank) pairs remembered as ordered already.
MAX_ORDERED: Final = 65_536
#: How long an incident's verdict is waited for to name what to cut, at most:
#: past any window and the settling of every host's evidence.
WANT_FOR: Final = 300.0
#: Incidents waited for at once, at most (the oldest gives way).
MAX_WANTED: Final = 1024
#: The longest a request's bounds on time say (the protocol's).
_DAY: Final = 86_400.0


@dataclass(frozen=True, slots=True)
class OwedUnblock:
    """One unblock owed: ``responder``'s process, a rank of ``incident``'s job, to
    be cut out of ``group``'s collective ``seq`` (None: of any it waits in), for
    ``cause`` (`HOST_LOST`, `PEERS`), as ``why`` says. ``lost``: when the host was
    lost, on the daemon's clock (only a collective entered before then is held up
    by it)."""

    incident: str
    responder: Responder
    cause: str
    why: str
    group: str | None = None
    seq: int | None = None
    lost: float | None = None
    tries: int = 0

    def wanted(self, waited: float, now: float) -> UnblockWanted:
        """The request to send at ``now``: only a collective waited in ``waited``
        seconds at least."""
        before = None if self.lost is None else min(max(0.0, now - self.lost), _DAY)
        return UnblockWanted(
            ask=0,
            waited=min(waited, _DAY),
            group=self.group,
            seq=self.seq,
            entered_before=before,
            incident=self.incident[:128],
            reason=self.why[:1024],
        )


class Unblocks:
    """The unblocks owed by this host's ranks, and what came of them (see the
    module docstring). ``waited`` is ``[fleet] unblock_after``; ``host`` this
    host's name; ``on_owed`` is called when an unblock may be due sooner than the
    runtime expects, or an incident's verdict may name what to cut."""

    def __init__(
        self,
        incidents: IncidentLog,
        responders: Responders,
        events: EventLog,
        metrics: Counters,
        *,
        wall: Callable[[], float],
        waited: float,
        on_owed: Callable[[], object] = lambda: None,
    ) -> None:
        self._incidents = incidents
        self._responders = responders
        self._events = events
        self._metrics = metrics
        self._wall = wall
        self.waited = waited
        self.on_owed = on_owed
        #: Owed unblocks by when they are due (the daemon's clock).
        self._due: list[tuple[float, int, OwedUnblock]] = []
        self._order = itertools.count()
        self._ordered: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        #: The incidents whose verdict is waited for, with when it stops being;
        #: and those whose ranks here were ordered already.
        self._wanted: OrderedDict[str, float] = OrderedDict()
        self._done: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._due)

    def _owed(self) -> None:
        self.on_owed()

    # What orders them.

    def host_lost(self, incident: str, job: tuple[int, str], host: str, now: float) -> int:
        """``host`` of ``job`` was lost at ``now`` (incident ``incident`` says so):
        each rank of the job here is owed a cut out of a collective it entered
        before now and has waited in long enough. How many were ordered."""
        why = f"host {host} left the fleet (its lease lapsed)"
        return sum(
            self._order_one(OwedUnblock(incident, responder, HOST_LOST, why, lost=now), now)
            for responder in self._responders.of_job(*job)
        )

    def want(self, incident: str, pid: int, uid: int, now: float) -> bool:
        """The policy of this host's rank ``pid`` (of ``uid``) of ``incident`` asks for
        the job's ranks waiting in the collective its verdict names to be unblocked:
        said with the rank, which the fleet publishes, so that every host of the
        job orders its own. False for an incident not kept."""
        if incident not in self._incidents:
            return False

        def asking(rank: RankInfo | None) -> RankInfo:
            if rank is None:
                host = self._incidents.host
                return RankInfo(
                    host=host, pid=pid, uid=uid, role="expired", scope="", unblock=PEERS
                )
            return replace_struct(rank, unblock=PEERS)

        self._incidents.amend(incident, pid, asking)
        self.want_remote(self._incidents.resolve(incident), now)
        return True

    def want_remote(self, incident: str, now: float) -> None:
        """A rank of ``incident`` (kept here, under this id) asks for its peers to be
        unblocked, as its host says: a reason to wait for the verdict here, which
        this host's own ranks' evidence is part of."""
        if incident in self._done or incident in self._wanted:
            return
        self._wanted[incident] = now + WANT_FOR
        while len(self._wanted) > MAX_WANTED:
            self._wanted.popitem(last=False)
        self._owed()

    @property
    def waiting(self) -> bool:
        """Whether an incident's verdict is waited for (`check` is to be called)."""
        return bool(self._wanted)

    def check(self, now: float) -> int:
        """Order, for each incident waited for whose verdict now names its culprits
        and a collective, each rank of its job here but the culprits; how many
        were ordered. An incident waited for past `WANT_FOR`, or no longer kept,
        is waited for no more."""
        ordered = 0
        for incident, until in list(self._wanted.items()):
            info, verdict = self._verdict(incident)
            if info is not None and verdict is not None:
                ordered += self._peers(info, verdict, now)
            elif info is not None and now < until:
                continue
            del self._wanted[incident]
            self._done[incident] = None
            while len(self._done) > MAX_WANTED:
                self._done.popitem(last=False)
        return ordered

    def _verdict(self, incident: str) -> tuple[IncidentInfo | None, Verdict | None]:
        """The incident, if kept, and its verdict once it names its culprits and a
        collective."""
        info = self._incidents.get(incident, ROOT, ROOT)
        verdict = None if info is None else info.verdict
        if verdict is None or not verdict.culprits or verdict.collective is None:
            return info, None
        return info, verdict

    def named(self, incident: str) -> Verdict | None:
        """The verdict on ``incident`` once it names its culprits and a collective."""
        return self._verdict(incident)[1]

    def unanswered(self, incident: str, verdict: Verdict, pid: int) -> list[RankInfo]:
        """This host's ranks of ``incident`` that no responder of theirs can unblock,
        but process ``pid`` and the culprits ``verdict`` names from their own Flight
        Recorder: those the fallback signal of ``pid``'s unblock step is for. A rank
        with no Flight Recorder (no responder gave one) is named ``missing`` for want
        of a record, not for cause, and nothing says whether it waits: the policy's
        author chose to signal it."""
        info = self._incidents.get(incident, ROOT, ROOT)
        host, named = self._incidents.host, {(c.host, c.pid) for c in verdict.culprits}
        return [
            rank
            for rank in ([] if info is None else info.ranks)
            if rank.host == host
            and rank.pid != pid
            and not ((host, rank.pid) in named and rank.flight)
            and not ((responder := self._responders.get(rank.pid)) and responder.unblock)
        ]

    def _peers(self, incident: IncidentInfo, verdict: Verdict, now: float) -> int:
        collective = verdict.collective
        assert collective is not None
        host = self._incidents.host
        named = {(c.host, c.pid) for c in verdict.culprits}
        # A culprit that never answered is named by its rank alone.
        numbers = {c.rank for c in verdict.culprits if not c.host and c.rank is not None}
        who = _culprits(verdict.culprits)
        why = (
            f"the job waits for {who} in {collective.op} #{collective.seq} of group "
            f"{collective.group} ({verdict.kind}), and a policy asked for its peers "
            "to be unblocked"
        )
        ordered = 0
        for responder in self._responders.of_job(incident.uid, incident.job):
            if (host, responder.pid) in named or responder.rank in numbers:
                continue
            unblock = OwedUnblock(
                incident.id, responder, PEERS, why, collective.group, collective.seq
            )
            ordered += self._order_one(unblock, now)
        return ordered

    def _order_one(self, unblock: OwedUnblock, now: float) -> bool:
        responder = unblock.responder
        key = (unblock.incident, responder.pid, responder.start_time)
        if not responder.unblock or key in self._ordered:
            return False
        if len(self._due) >= MAX_OWED:
            self._metrics.unblocks[(unblock.cause, "dropped")] += 1
            return False
        self._ordered[key] = None
        while len(self._ordered) > MAX_ORDERED:
            self._ordered.popitem(last=False)
        self._put(unblock, now)
        return True

    def _put(self, unblock: OwedUnblock, due: float) -> None:
        first = not self._due or due < self._due[0][0]
        heapq.heappush(self._due, (due, next(self._order), unblock))
        if first:
            self._owed()

    # What the runtime does with them.

    def next_due(self) -> float | None:
        """When the next unblock is due, on the daemon's clock (None: none is owed)."""
        return self._due[0][0] if self._due else None

    def take(self, now: float) -> list[OwedUnblock]:
        """The unblocks due at ``now``, for the runtime to ask."""
        taken = []
        while self._due and self._due[0][0] <= now:
            taken.append(heapq.heappop(self._due)[2])
        return taken

    def answered(self, unblock: OwedUnblock, answer: Unblocked | None, now: float) -> None:
        """What the rank's responder answered ``unblock`` at ``now`` (None: it did
        not: gone, or silent within the bound)."""
        outcome = "no_answer" if answer is None else answer.outcome
        if outcome not in (*UnblockOutcome, "no_answer"):
            outcome = UnblockOutcome.FAILED  # a responder newer than this daemon
        self._metrics.unblocks[(unblock.cause, outcome)] += 1
        if answer is None:
            return
        if outcome == UnblockOutcome.TOO_SOON and unblock.tries + 1 < MAX_TRIES:
            pinned = answer.collective
            again = replace(
                unblock,
                tries=unblock.tries + 1,
                group=unblock.group if pinned is None else pinned.group,
                seq=unblock.seq if pinned is None else pinned.seq,
            )
            self._put(again, now + max(answer.retry, 0.0))
        elif outcome == UnblockOutcome.UNBLOCKED:
            self._record(unblock, answer)

    def _record(self, unblock: OwedUnblock, answer: Unblocked) -> None:
        """``answer`` says the rank was cut out: an event of its owner's, and the
        incident's record of it."""
        responder, wall = unblock.responder, self._wall()
        cut = answer.collective
        what = "its collective" if cut is None else f"{cut.op} #{cut.seq} of group {cut.group}"
        how = (
            f"{answer.cut} group{'s' if answer.cut != 1 else ''} aborted"
            if cut is not None and cut.op.startswith("nccl")
            else f"{answer.cut} connection{'s' if answer.cut != 1 else ''} shut"
        )
        note = f"cut out of {what} after waiting {answer.waited:.1f} s ({how}): {unblock.why}"
        self._events.record(
            EventInfo(
                seq=0,
                kind="unblocked",
                time=wall,
                pid=responder.pid,
                uid=responder.uid,
                scope="",
                policy="",
                job=responder.job,
                rank=responder.rank,
                incident=unblock.incident,
                outcome=unblock.cause,
                note=note,
            )
        )
        host = self._incidents.host

        def cut_out(rank: RankInfo | None) -> RankInfo:
            if rank is None:
                rank = RankInfo(
                    host=host,
                    pid=responder.pid,
                    uid=responder.uid,
                    role="peer",
                    scope="",
                    state="done",
                    rank=responder.rank,
                    local_rank=responder.local_rank,
                    group_rank=responder.group_rank,
                )
            return replace_struct(rank, unblocked=note, unblocked_at=wall)

        self._incidents.amend(unblock.incident, responder.pid, cut_out)


def _culprits(culprits: list[Culprit]) -> str:
    """The culprits a verdict names, by rank and host, the first few."""
    named = [
        f"rank {'?' if c.rank is None else c.rank}" + (f" on host {c.host}" if c.host else "")
        for c in culprits[:4]
    ]
    more = len(culprits) - len(named)
    return ", ".join(named) + (f" and {more} more" if more > 0 else "")
