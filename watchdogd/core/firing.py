"""Expiry: timers taken out of the heap when due, kept as firing until their policy
has run, with the starvation rule and the incident peers that an expiry brings.

Invariants:

- A timer that falls due leaves the table and enters the firing set in the same
  journal record (the armed record dropped, the firing one put): a crash leaves one
  of the two, never neither. It stays there, with the step its policy reached,
  until `Firing.finished`.
- A timer whose policy has ``starvation_grace`` is judged at its deadline, before
  its policy starts (`watchdogd.core.starvation`): one whose process was starved is
  armed again for the grace, once per arming, with an ``extended`` event that says
  why. Only such timers pay for it: the others read nothing from the system when
  they fire.
- An expiry of a timer that carries a job opens (or joins) the job's incident, and
  each other local process of the job that the incident does not list yet gets a
  firing record of its own for the job's peer policy. A peer policy only root may
  choose runs on a user's job as the built-in ``peer_dump``.
- Firing records are numbered in the order they fired; the numbers go on from the
  highest restored (`Firing.resume`).
- A registered scope's timer (`watchdogd.core.slots`) that the table gives as due
  is a look at its slot first: it fires only when its slot holds a block whose
  deadline has passed, on that deadline.
- A timer restored at a start (armed before it) that falls due within
  `RESTART_GRACE` of the start is held until the grace ends, back in the table on
  that deadline: its worker's release may be on its way, sent while the daemon
  was down, and a client sends it again as soon as it has reconnected. The grace
  is the arming's, once: when it ends is recorded with the timer in the state
  (`Watch.held_until`, beside the deadline it was armed with), and a later start
  holds it until then at most, so a daemon that restarts in a loop fires it when
  that grace ends, or at the first start after. Its expiry, if no release comes,
  keeps its own deadline (its event says how late and why). A policy that was in
  progress resumes at once, held by nothing, and so does a registered scope's
  block: its slot says whether it was released.
- A due timer whose policy starts with a signal to its process, and that nothing
  else is made of (no hold, no starvation grace, no job), may be taken out as a
  `Due` (`Firing.take_due`): its signal goes out before its firing record is made
  (`Firing.record`), so that a burst's signals wait for no bookkeeping. Until then
  the state still holds it armed, a full write of it too: after a crash in
  between, the next start fires it again if its process is still there (one that
  survived its first signal, a SIGTERM say, gets it again, then the rest of its
  policy), and drops it with the timers of processes that exited meanwhile if not
  (counted in the start's ``state`` line, with no event of its own). A scope
  armed again before its `Due` is recorded has the firing record made first, in
  the same commit (`Firing.record_taken`): the arming's record takes the armed
  one's place, and the rest of the policy stays owed. No signal is lost.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Generic

import msgspec

from watchdogd_protocol import RESTART_GRACE, EventInfo, GroupState, RankInfo

from .expiry import first_signal
from .identity import ROOT
from .policies import BUILTIN, NO_PEERS, PEER_DUMP, Policy, Signal
from .ports import P
from .responders import Responder
from .slots import Slots
from .starvation import Starvation, judge_due
from .timers import Course, Expired, StoreKey, Timer, Watch
from .writer import TableWriter

if TYPE_CHECKING:
    from .context import CoreContext


class Due(msgspec.Struct, Generic[P], frozen=True):
    """A timer taken out of the table whose first step, ``signal``, goes to its
    process before its firing record is made (`Firing.record`): ``timer`` as it
    was armed, the process handle retained for the caller, ``orphaned`` as in
    `Expired`, its ``policy``, and the number and time of its firing."""

    timer: Timer
    process: P
    orphaned: bool
    policy: Policy
    signal: Signal
    number: int
    fired_at: float


class RestartGrace(Generic[P]):
    """The timers restored at a start (armed before it) that fall due within
    `RESTART_GRACE` of it: each is held until its grace ends, back in the table
    on that deadline (the state keeps the deadline it was armed with, and when
    its grace ends), and then fires with its own deadline and a note that says
    why late. A timer given its grace by an earlier start is held until that
    grace ends, and no longer."""

    def __init__(self, writer: TableWriter[P], started: float) -> None:
        self._writer = writer
        self._started = started
        #: When the grace this start gives ends, on the table's clock.
        self.until = started + RESTART_GRACE
        #: The deadlines, as armed, of the restored timers held until then.
        self._held: dict[StoreKey, float] = {}

    def armed_before(self, now: float) -> float:
        """The timers due at ``now`` that the grace holds or held are those armed
        before this time (minus infinity once the grace is over)."""
        return self._started if self._held or now < self.until else -math.inf

    def ends(self, timer: Timer) -> float:
        """When the grace of ``timer``, restored and due, ends: the one an earlier
        start gave it, if any, else this start's."""
        watch = timer.watched
        if watch is None or watch.held_until is None:
            return self.until
        return watch.held_until

    def hold(self, item: Expired[P], until: float) -> None:
        """Put the timer of ``item`` back in the table until ``until``, when its
        grace ends; recorded with it in the state, unless it was already."""
        timer = item.timer
        armed = self._held.setdefault(timer.store_key, timer.deadline)
        watch = timer.as_watch
        if watch.held_until != until:
            watch = msgspec.structs.replace(watch, held_until=until)
            self._writer.record(
                msgspec.structs.replace(timer, deadline=armed, watch=watch), commit=True
            )
        self._writer.moved(
            item.process, msgspec.structs.replace(timer, deadline=until, watch=watch)
        )

    def ended(self, item: Expired[P]) -> Expired[P]:
        """``item`` whose grace is over, with the deadline its timer was armed with
        and a note that says it was held."""
        timer = item.timer
        deadline = self._held.pop(timer.store_key, timer.deadline)
        until = self.ends(timer)
        if deadline == timer.deadline and until == self.until:
            return item  # restored due after its grace ended: never held
        note = (
            f"held {RESTART_GRACE:g}s after the restart for a release on its way"
            if until == self.until
            else f"held {RESTART_GRACE:g}s after an earlier restart for a release on its "
            "way, and no longer: the grace is given once an arming"
        )
        timer = msgspec.structs.replace(timer, deadline=deadline)
        return msgspec.structs.replace(item, timer=timer, note=note)

    def passed(self, now: float) -> None:
        """A pass at ``now`` is over: once every held timer fired or was released,
        nothing is held any more."""
        if self._held and now >= self.until:
            soonest = self._writer.next_deadline()
            if soonest is None or soonest > self.until:
                self._held.clear()


class Firing(Generic[P]):
    """The timers whose policy is in progress, and how a due timer becomes one."""

    def __init__(self, context: CoreContext[P], *, slots: Slots[P] | None = None) -> None:
        """The timers armed before ``context.started`` were restored, and those
        due before ``started + RESTART_GRACE`` are held until then."""
        self._rules = context.rules
        self._responders = context.responders
        self._slots = slots
        #: Ranks of incidents that hold no timer but respond: (incident, responder)
        #: for the runtime to ask for evidence (`take_asks`).
        self._asks: list[tuple[str, Responder]] = []
        self._writer = context.writer
        self._table = context.table
        self._processes = context.processes
        self._events = context.events
        self._incidents = context.incidents
        self._metrics = context.metrics
        self._wall = context.wall
        #: Timers whose policy is in progress, by store key: part of the state
        #: until the policy has finished.
        self._firing: dict[StoreKey, Timer] = {}
        #: The `Due`s whose firing record is not made yet, by their armed record's
        #: key: the state holds them as armed until then, a full write of it too.
        self._taken: dict[StoreKey, Due[P]] = {}
        self._numbers = itertools.count(1)
        #: Firing timers of each (owner, job): a job stays held while its expiry
        #: runs, after its timer left the table.
        self._jobs: dict[tuple[int, str], int] = {}
        #: Grows whenever a job gains its first firing timer or loses its last.
        self.jobs_changed = 0
        self._grace = RestartGrace(context.writer, context.started)

    def __len__(self) -> int:
        return len(self._firing)

    def timers(self) -> Iterable[Timer]:
        """Every firing timer, and every `Due` not recorded yet as it was armed,
        for the state's snapshot."""
        taken = (due.timer for due in self._taken.values())
        return itertools.chain(self._firing.values(), taken)

    def holds(self, job: tuple[int, str]) -> bool:
        """Whether a timer of ``job`` is firing: its policy is in progress."""
        return job in self._jobs

    def jobs(self) -> list[tuple[int, str]]:
        """The jobs with a timer firing, in the order they came."""
        return list(self._jobs)

    def _count_job(self, timer: Timer, delta: int) -> None:
        watch = timer.watched
        if watch is None or not watch.job:
            return
        key = (timer.owner, watch.job)
        count = self._jobs.get(key, 0) + delta
        if count > 0:
            self._jobs[key] = count
            self.jobs_changed += count == delta
        else:
            self._jobs.pop(key, None)
            self.jobs_changed += 1

    def of_pid(self, pid: int) -> list[Timer]:
        """The firing timers of ``pid``, in the order they fired."""
        held = (timer for timer in self._firing.values() if timer.pid == pid)
        return sorted(held, key=lambda timer: timer.firing)

    def resume(self, timers: Iterable[Timer]) -> None:
        """Keep ``timers``, firing when the state was written, as firing again
        (the daemon restarted); numbering goes on past theirs."""
        highest = 0
        for timer in timers:
            self._firing[timer.store_key] = timer
            self._count_job(timer, +1)
            highest = max(highest, timer.firing)
        self._numbers = itertools.count(highest + 1)

    def expire_due(self, now: float, limit: int | None = None) -> list[Expired[P]]:
        """Take out the timers due at ``now`` (the earliest ``limit``, when given);
        each stays in the state as firing (the returned timer) until `finished`.
        Each returned process handle is retained for the caller, who closes it
        when the action is done.

        A timer whose policy has ``starvation_grace`` is judged first
        (`watchdogd.core.starvation.judge_due`): if its process was starved it is armed again for
        the grace instead (`_extend`), and is not returned."""
        return [
            self.record(item) if isinstance(item, Due) else item
            for item in self.take_due(now, limit)
        ]

    def take_due(self, now: float, limit: int | None = None) -> list[Expired[P] | Due[P]]:
        """`expire_due`, but a timer whose policy starts with a signal to its
        process and that nothing else is made of comes back as a `Due`: the
        caller sends that signal, then has its firing record made (`record`)."""
        expired = self._writer.pop_due(now, limit)
        fired: list[Expired[P] | Due[P]] = []
        put_back = False
        if self._slots is not None:
            expired, put_back = self._slots.looked(expired, now)
        dues = 0
        # Looked up once a pass, not once a timer: in a burst every microsecond
        # spent before a signal is a microsecond later for the rest of the pass.
        held_before = self._grace.armed_before(now)
        policies: dict[str, tuple[Policy, str]] = {}
        for popped in expired:
            item = popped
            if item.timer.armed_at < held_before and not _registered(item.timer):
                until = self._grace.ends(item.timer)
                if now < until:
                    self._grace.hold(item, until)
                    put_back = True
                    continue
                item = self._grace.ended(item)
            found = policies.get(item.timer.policy)
            if found is None:
                found = policies[item.timer.policy] = self._rules.policy_for(item.timer.policy)
            policy, vanished = found
            note = self._judged(item, policy, now) if policy.starvation_grace else item.note
            if note is None:
                put_back = True
                continue
            # A process whose last timer fell due is back in the table when
            # another of its timers was extended or held in this pass: it stays
            # tracked.
            orphaned = item.orphaned and not (
                put_back and self._table.process(item.timer.pid) is item.process
            )
            item.process.retain()
            if orphaned:
                self._processes.untrack(item.process)
            # A policy no longer configured (its default acts) is said in the
            # run's event: the usual way.
            due = None if vanished else self._due(item, policy, note, orphaned, now)
            if due is not None:
                fired.append(due)
                dues += 1
            else:
                fired += self._recorded(item, policy, note, orphaned, now)
        if len(expired) > dues:
            self._writer.commit_soon()  # a `Due` changes the state once recorded
        self._grace.passed(now)
        return fired

    def _judged(self, item: Expired[P], policy: Policy, now: float) -> str | None:
        """The note of ``item``'s expiry with the starvation rule's verdict on its
        process; None when the process was starved and its timer was extended
        instead."""
        verdict = judge_due(
            item.timer.watched,
            functools.partial(self._processes.sample, item.process),
            pressure=policy.starvation_pressure,
            cpu=policy.starvation_cpu,
        )
        if verdict.starved:
            self._extend(item, policy, verdict, now)
            return None
        return "; ".join(filter(None, (item.note, verdict.note)))

    def _due(
        self, item: Expired[P], policy: Policy, note: str, orphaned: bool, now: float
    ) -> Due[P] | None:
        """``item`` as a `Due`, if its policy starts with a signal to its process
        and nothing else is made of it (no note, no job); None otherwise."""
        watch = item.timer.watched
        if watch is not None and watch.job:
            return None
        signal = first_signal(item.timer, policy, note)
        if signal is None:
            return None
        number = next(self._numbers)
        due = Due(item.timer, item.process, orphaned, policy, signal, number, now)
        self._taken[item.timer.store_key] = due
        return due

    def _recorded(
        self, item: Expired[P], policy: Policy, note: str, orphaned: bool, now: float
    ) -> list[Expired[P]]:
        """``item`` firing in the state, with the peer runs of its incident if it
        carries a job."""
        run = Course(fired_at=now, plan=policy.plan)
        peers: list[Expired[P]] = []
        watch = item.timer.watched
        if watch is not None and watch.job:
            run, peers = self._incident(item.timer, watch, policy, run, now)
        firing = self._put_firing(item.timer, next(self._numbers), run)
        return [Expired(firing, item.process, orphaned, note), *peers]

    def _put_firing(self, armed: Timer, number: int, run: Course, *, commit: bool = False) -> Timer:
        """``armed`` firing in the state as number ``number`` with ``run`` (written
        soon with ``commit``). The armed record and the firing one go out in the
        same journal record: a crash leaves one of the two, never neither."""
        firing = msgspec.structs.replace(armed, firing=number, run=run)
        self._writer.fired(armed, firing, commit=commit)
        self._firing[firing.store_key] = firing
        self._count_job(firing, +1)
        return firing

    def record(self, due: Due[P]) -> Expired[P]:
        """The firing record of ``due``, whose signal has gone out: from here on
        it is firing in the state, as `expire_due` returns it."""
        if self._taken.get(due.timer.store_key) is due:  # not made by `record_taken`
            self._record(due, commit=True)
        firing = self._firing[(due.timer.pid, due.timer.scope, due.number)]
        return Expired(firing, due.process, due.orphaned)

    def record_taken(self, pid: int, scope: str) -> None:
        """``scope`` of ``pid`` is about to be armed again: a `Due` of it not
        recorded yet gets its firing record now, in the same commit as the new
        arming, whose record then takes the armed one's place. A crash after that
        arming's answer must still find the policy in progress: its first signal
        is out, the rest of it is owed."""
        if self._taken and (due := self._taken.get((pid, scope, 0))) is not None:
            self._record(due)

    def _record(self, due: Due[P], *, commit: bool = False) -> None:
        del self._taken[due.timer.store_key]
        run = Course(fired_at=due.fired_at, plan=due.policy.plan)
        self._put_firing(due.timer, due.number, run, commit=commit)

    def step_started(self, timer: Timer, step: int, step_end: float = 0.0) -> Timer:
        """The policy of firing ``timer`` starts its step ``step`` (a wait ending at
        ``step_end``); returns the timer as now recorded."""
        timer = timer.at_step(step, step_end)
        if timer.store_key in self._firing:
            self._firing[timer.store_key] = timer
            self._writer.record(timer, commit=True)
        return timer

    def finished(self, timer: Timer) -> None:
        """The policy of firing ``timer`` has ended: it leaves the state."""
        if (gone := self._firing.pop(timer.store_key, None)) is not None:
            self._count_job(gone, -1)
            self._writer.dropped([timer])

    def record_expiries(self, events: list[EventInfo]) -> None:
        """Policies ended: count expiries by policy and outcome, record the events
        (followers are woken once), and give each incident what its processes'
        policies found."""
        for event in events:
            if event.kind == "expired":
                self._metrics.expiries[(event.policy, event.outcome)] += 1
            if event.incident:
                self._incidents.finished(event)
        self._events.record_many(events)

    def dump_taken(
        self,
        timer: Timer,
        reader: tuple[int, int] | None,
        evidence: str = "",
        flight: Sequence[GroupState] = (),
    ) -> None:
        """The dump step of ``timer``'s policy ran; ``reader`` is the one (uid, gid)
        besides root that may read what it captured (None: root alone), as the
        kernel judged it then; ``evidence`` how it was taken (`watchdogd.core.kept_evidence`)
        and ``flight`` the groups of the worker's Flight Recorder. Kept with the
        incident's rank, if it has one."""
        if timer.run is not None and timer.run.incident:
            role = "peer" if timer.run.peer else "expired"
            self._incidents.dumped(
                timer.run.incident, timer.pid, role, reader, evidence=evidence, flight=flight
            )

    def record_unkillable(self, event: EventInfo) -> None:
        """A target outlived SIGKILL."""
        self._metrics.unkillable += 1
        self._events.record(event)

    def _incident(
        self, timer: Timer, watch: Watch, policy: Policy, run: Course, now: float
    ) -> tuple[Course, list[Expired[P]]]:
        """``timer`` of a job expired under ``policy``: the run of its policy,
        which names the job's incident, and the peer policy's runs on the job's
        other processes that the incident does not list yet: all of them when it
        is new (`watchdogd.core.incidents`)."""
        job = (timer.owner, watch.job)
        reason = "stalled" if timer.stalled else "timeout"
        expired = RankInfo(
            host=self._incidents.host,
            pid=timer.pid,
            uid=timer.uid,
            role="expired",
            scope=timer.scope,
            rank=watch.rank,
            local_rank=watch.local_rank,
            group_rank=watch.group_rank,
            policy=policy.name,
            reason=reason,
        )
        user = self._processes.user_name(timer.owner)
        incident, new = self._incidents.expired(job, user, expired, reason, self._wall())
        if new:
            self._metrics.incidents += 1
        run = msgspec.structs.replace(run, incident=incident)
        listed = self._incidents.pids(incident) | {timer.pid}
        return run, self.peers(incident, job, policy.peers, listed, now)

    def peers(
        self,
        incident: str,
        job: tuple[int, str],
        peers: str | None,
        listed: set[int],
        now: float,
    ) -> list[Expired[P]]:
        """Runs of the peer policy ``peers`` (None: each process's timer's policy's
        own) on each process not ``listed`` holding a timer of ``job``: firing
        records of their own, kept in the state like an expiry's until the policy
        has run. A peer policy only root may choose runs on a user's job as the
        built-in ``peer_dump``."""
        runs: list[Expired[P]] = []
        for pid in self._table.job_pids(*job):
            process = self._table.process(pid)
            if pid in listed or process is None:
                continue
            timer = next(
                timer
                for timer in self._table.timers_of(pid)
                if timer.owner == job[0]
                and timer.watched is not None
                and timer.watched.job == job[1]
            )
            name = self._rules.policy_for(timer.policy)[0].peers if peers is None else peers
            if name == NO_PEERS:
                continue
            peer_policy = self._rules.policies.get(name) or BUILTIN[PEER_DUMP]
            if peer_policy.root_only and job[0] != ROOT:
                peer_policy = BUILTIN[PEER_DUMP]
            firing = msgspec.structs.replace(
                timer,
                firing=next(self._numbers),
                policy=peer_policy.name,
                run=Course(fired_at=now, plan=peer_policy.plan, incident=incident, peer=True),
            )
            self._writer.record(firing)
            self._firing[firing.store_key] = firing
            self._count_job(firing, +1)
            assert timer.watched is not None
            self._incidents.add(
                incident,
                RankInfo(
                    host=self._incidents.host,
                    pid=pid,
                    uid=timer.uid,
                    role="peer",
                    scope=timer.scope,
                    rank=timer.watched.rank,
                    local_rank=timer.watched.local_rank,
                    group_rank=timer.watched.group_rank,
                    policy=peer_policy.name,
                ),
            )
            process.retain()
            runs.append(Expired(firing, process, orphaned=False))
        self._responding_peers(incident, job, listed)
        return runs

    def _responding_peers(self, incident: str, job: tuple[int, str], listed: set[int]) -> None:
        """The job's processes that hold no timer of it but respond (a rank stuck
        outside any ``expires()`` block): ranks of the incident too, whose evidence
        the runtime asks for (`take_asks`). No policy runs on them."""
        held = set(self._table.job_pids(*job))
        for responder in self._responders.of_job(*job):
            if responder.pid in listed or responder.pid in held:
                continue
            self._incidents.add(
                incident,
                RankInfo(
                    host=self._incidents.host,
                    pid=responder.pid,
                    uid=responder.uid,
                    role="peer",
                    scope="",
                    rank=responder.rank,
                    local_rank=responder.local_rank,
                    group_rank=responder.group_rank,
                    note="holds no timer of the job; its responder was asked",
                ),
            )
            self._asks.append((incident, responder))

    def take_asks(self) -> list[tuple[str, Responder]]:
        """The incident and the responder of each rank whose evidence is wanted
        that no policy of it dumps, since the last call."""
        asks, self._asks = self._asks, []
        return asks

    def evidence_given(
        self,
        incident: str,
        pid: int,
        stack: str,
        *,
        evidence: str,
        flight: Sequence[GroupState],
        reader: tuple[int, int] | None,
        note: str = "",
    ) -> None:
        """What was taken of a rank `take_asks` named."""
        self._incidents.given(
            incident, pid, stack, evidence=evidence, flight=flight, reader=reader, note=note
        )

    def _extend(self, item: Expired[P], policy: Policy, verdict: Starvation, now: float) -> None:
        """Arm the timer of ``item`` again for its policy's grace, its process
        being starved: an ``extended`` event says why, and its `Watch` that it was
        extended (it is not again until it is armed anew)."""
        timer, grace = item.timer, policy.starvation_grace
        watch = timer.as_watch
        timer = self._writer.rearm(
            item.process,
            msgspec.structs.replace(
                timer,
                deadline=now + grace,
                watch=msgspec.structs.replace(watch, extended=grace),
            ),
        )
        self._metrics.extensions[policy.name] += 1
        wall = self._wall()
        self._events.record(
            EventInfo(
                seq=0,
                kind="extended",
                time=wall,
                pid=timer.pid,
                uid=timer.uid,
                scope=timer.scope,
                policy=policy.name,
                command=self._processes.command(item.process),
                armed_at=wall - (now - timer.armed_at),
                deadline=wall + grace,
                note=f"{verdict.note}; given {grace:g}s more, once",
            )
        )


def _registered(timer: Timer) -> bool:
    """Whether ``timer`` is a registered scope's, whose slot says what became of it."""
    return timer.slot is not None
