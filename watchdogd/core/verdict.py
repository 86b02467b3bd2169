"""The verdict: which rank an incident's job waits for, from its ranks' evidence.

`decide` reads an incident's ranks (`RankInfo`, every host's) and says who the
others wait for, by the Flight Recorder first, where ranks have one:

- For each process group, a rank *waits* in the newest collective it entered
  when that collective's sequence number is above the last one it completed. The
  collective of a group is the sequence number the most waiting ranks wait in (the
  newest, on a tie); the group is the one with the most ranks waiting there.
- Its members are every rank any record of the group lists; a group whose records
  list none but give its size has ranks 0 to size - 1 (the default group's shape,
  as `summary` keeps it).
- ``missing``: members that never entered it (they entered and completed only
  older ones, have no record of the group, or are absent from the incident: a rank
  that never answered, named by its number alone). ``mismatch``: ranks that
  entered the same sequence number with another op, sizes or dtypes than most
  (sizes or dtypes left out of a record are not held against it); a mismatch is
  named before a missing rank, being the surer sign.
- Until the caller says the verdict is ``settled`` (every host has reported, or
  the incident's window has closed), a member with no record that has not
  reported yet (``pending``, or absent) is not named: the verdict is
  ``undecided`` and says whom it waits for.

Without a collective to name, by stacks: each rank's main thread waits in a frame
(`pick`); a *small minority* against a *large majority* is ``odd_frame``: the
ranks in the most common frame number at least two, and all the others together
at most a third of the ranks with a frame (so 1 against 2, 2 against 4). Fewer
ranks cannot outvote anyone, and a bigger minority is as likely to be right as
the majority. Anything else is ``undecided``, with each frame and its ranks.

What is not the user's frame is `watchdogd.core.user_frames`'s to say (`Library`).
A verdict that names culprits carries its hang's fingerprint
(`watchdogd.core.fingerprint`): its kind, its collective's op and group, its
culprits' frames.

Each rank's frame is shown only to a viewer who may see that rank's stack: a
`Decision` keeps the sentence without any frame and each frame beside it with the
ranks it is about, and `for_viewer` puts back those the viewer may see; the
culprit's identity and the collective are in every rendering. Pure: hostile
input (huge numbers, empty groups, a rank listed twice) gives a verdict, never an
exception; a record whose numbers are out of the protocol's bounds is skipped.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from watchdogd_protocol import (
    Collective,
    CollectiveRef,
    Culprit,
    FlightRecord,
    Frame,
    GroupState,
    RankInfo,
    ThreadStack,
    Verdict,
)

from .fingerprint import Fingerprint, fingerprint_of
from .ranks import reported
from .user_frames import Library, frame_line, name_text, number_text, pick, where

#: The most ranks a verdict names as culprits.
MAX_CULPRITS: Final = 32
#: The most frames an ``undecided`` verdict lists.
MAX_GROUPS: Final = 16
#: The most groups of one rank's Flight Recorder an incident keeps (`summary`).
SUMMARY_GROUPS: Final = 8
#: The most ranks a sentence names one by one before saying how many more.
_NAMED: Final = 5
#: The most pieces (ranks or runs of ranks) a list of rank numbers shows.
_PIECES: Final = 8
#: The protocol's bounds: a number outside them did not come off the wire.
_SEQ_MAX: Final = 2**63 - 1
_RANK_MAX: Final = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Part:
    """A piece of a verdict that names frames: ``text``, shown to a viewer who may
    see the stack of one of ``ranks`` (the frame is theirs), else ``hidden``
    (nothing, when empty)."""

    text: str
    hidden: str
    ranks: tuple[Culprit, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """A verdict and what it takes to show it to each viewer: ``head`` without its
    text and groups, ``said`` (the sentence with no frame in it), ``parts`` (the
    clauses that name frames, each put after it) and ``groups`` (each frame the
    ranks wait in, for an ``undecided`` verdict); a verdict that names culprits,
    its ``fingerprint`` (`watchdogd.core.fingerprint`, whose id the head
    carries). `verdict` is it with every frame, as root sees it; `for_viewer` as
    another viewer may."""

    head: Verdict
    said: str
    parts: tuple[Part, ...] = ()
    groups: tuple[Part, ...] = ()
    fingerprint: Fingerprint | None = None

    @property
    def verdict(self) -> Verdict:
        """The verdict with every frame in it."""
        return for_viewer(self, lambda culprit: True)


def for_viewer(decision: Decision, may_see_stack_of: Callable[[Culprit], bool]) -> Verdict:
    """The verdict as a viewer sees it: a frame only where ``may_see_stack_of``
    one of the ranks it is about (`watchdogd.core.incidents.may_read` of that
    rank); the ranks named and the collective always."""

    def shown(part: Part) -> str:
        return part.text if any(may_see_stack_of(rank) for rank in part.ranks) else part.hidden

    clauses = [text for text in map(shown, decision.parts) if text]
    text = "; ".join([decision.said, *clauses])
    groups = [text for text in map(shown, decision.groups) if text]
    return msgspec.structs.replace(decision.head, text=text, groups=groups)


def nobody(culprit: Culprit) -> bool:
    """A viewer who may see no rank's stack (for `for_viewer`)."""
    return False


def decide(
    ranks: Iterable[RankInfo],
    *,
    library: Library,
    settled: bool,
    threads: Mapping[tuple[str, int], Sequence[ThreadStack]] | None = None,
) -> Decision:
    """Who an incident's job waits for, from its ``ranks`` (every host's).

    ``threads`` are the stacks ranks' responders gave, by (host, pid), taken over
    a rank's py-spy text; ``settled`` is the caller's: every host has reported,
    or the incident's window has closed."""
    jury = _Jury(_distinct(ranks), library, threads or {}, settled)
    return jury.decide()


def summary(record: FlightRecord, most: int = SUMMARY_GROUPS) -> list[GroupState]:
    """A rank's Flight Recorder as an incident keeps it (`RankInfo.flight`): the
    groups it waits in first, then the others in its order, at most ``most``, each
    group once; members 0 to size - 1 are left to its ``size`` to say."""
    seen: set[str] = set()
    kept: list[GroupState] = []
    for group in sorted(record.groups, key=lambda group: not _waits(group)):
        if group.group not in seen and len(kept) < most:
            seen.add(group.group)
            kept.append(_compact(group))
    return kept


def _compact(group: GroupState) -> GroupState:
    members = group.ranks
    if members and group.size in (0, len(members)) and members == list(range(len(members))):
        return msgspec.structs.replace(group, ranks=[], size=len(members))
    return group


def flight_text(groups: Sequence[GroupState]) -> str:
    """A rank's Flight Recorder summary, a line per group: the last collective it
    entered there (op, inputs, state) and the last it completed."""
    lines = []
    for group in groups:
        members = len(group.ranks) or group.size
        head = _group_name(group.group, group.desc) + (
            f", {number_text(members)} ranks" if members else ""
        )
        entered = group.entered
        if entered is None:
            went = "entered nothing recorded"
        else:
            state = f", {name_text(entered.state)}" if entered.state else ""
            went = f"last entered #{number_text(entered.seq)} {_inputs(entered)}{state}"
        done = "none" if group.completed < 0 else f"#{number_text(group.completed)}"
        lines.append(f"{head}: {went}; last completed {done}")
    return "\n".join(lines)


def _waits(group: GroupState) -> bool:
    """Whether the rank waits in the newest collective it entered in ``group``."""
    return group.entered is not None and group.entered.seq > group.completed


def _sane(group: GroupState) -> bool:
    """Whether ``group``'s numbers are within the protocol's bounds."""
    numbers = [group.completed] + ([group.entered.seq] if group.entered else [])
    return all(-1 <= n <= _SEQ_MAX for n in numbers) and 0 <= group.size <= _RANK_MAX


def _distinct(ranks: Iterable[RankInfo]) -> list[RankInfo]:
    """One record per process, then per rank number (a rank restarted within the
    window is two processes): the one that says most, the latest on a tie."""
    by_process: dict[tuple[str, int], RankInfo] = {}
    for given in ranks:
        # A rank number out of bounds is dropped, not the process.
        bad = given.rank is not None and not 0 <= given.rank <= _RANK_MAX
        rank = msgspec.structs.replace(given, rank=None) if bad else given
        held = by_process.get((rank.host, rank.pid))
        if held is None or _says(rank) >= _says(held):
            by_process[rank.host, rank.pid] = rank
    by_number: dict[object, RankInfo] = {}
    for rank in by_process.values():
        key: object = (rank.host, rank.pid) if rank.rank is None else rank.rank
        held = by_number.get(key)
        if held is None or _says(rank) >= _says(held):
            by_number[key] = rank
    return sorted(by_number.values(), key=_order)


def _says(rank: RankInfo) -> tuple[bool, bool, bool]:
    return (bool(rank.flight), rank.state != "gone", bool(rank.stack or rank.frame))


def _order(rank: RankInfo | Culprit) -> tuple[bool, int, str, int]:
    return (rank.rank is None, rank.rank or 0, rank.host, rank.pid)


def _culprit(rank: RankInfo) -> Culprit:
    return Culprit(host=rank.host, pid=rank.pid, rank=rank.rank)


@dataclass(frozen=True, slots=True)
class _Collective:
    """The collective of one group that ranks wait in, and who did what about it."""

    ref: CollectiveRef
    desc: str
    waiting: list[Culprit]
    #: Members that did not enter it: named (they did not), and not reported yet.
    missing: list[Culprit]
    missing_count: int
    unreported: list[Culprit]
    unreported_count: int
    #: Ranks that entered it otherwise than most, and how most entered it.
    mismatch: list[tuple[Culprit, Collective]]
    agreed: list[Culprit]
    usual: Collective | None
    tie: bool

    def score(self) -> tuple[int, bool, bool]:
        named = bool(self.missing or self.mismatch)
        return (len(self.waiting), named, self.desc == "default_pg")


class _Jury:
    """One incident's ranks weighed: by Flight Recorder, then by stacks."""

    def __init__(
        self,
        ranks: list[RankInfo],
        library: Library,
        threads: Mapping[tuple[str, int], Sequence[ThreadStack]],
        settled: bool,
    ) -> None:
        self.ranks = ranks
        self.library = library
        self.threads = threads
        self.settled = settled
        self.numbered = {rank.rank: rank for rank in ranks if rank.rank is not None}

    def decide(self) -> Decision:
        found = self._collective()
        if found is not None and found.mismatch:
            return self._mismatch(found)
        if found is not None and found.missing:
            return self._missing(found)
        if found is not None and found.unreported:
            return self._unreported(found)
        by_stacks = self._by_stacks()
        if found is None or by_stacks.head.kind == "odd_frame":
            return by_stacks
        return self._entered_by_all(found, by_stacks)

    # By the Flight Recorder.

    def _records(self) -> dict[str, dict[int, GroupState]]:
        """Each group's state as each numbered rank recorded it."""
        groups: dict[str, dict[int, GroupState]] = {}
        for number, rank in self.numbered.items():
            for group in rank.flight:
                if _sane(group):
                    groups.setdefault(group.group, {}).setdefault(number, group)
        return groups

    def _collective(self) -> _Collective | None:
        found = [
            self._weigh(name, records, seq)
            for name, records in sorted(self._records().items())
            if (seq := _waited_in(records)) is not None
        ]
        return max(found, key=_Collective.score, default=None)

    def _weigh(self, name: str, records: dict[int, GroupState], seq: int) -> _Collective:
        entrants = {n: g.entered for n, g in records.items() if g.entered and g.entered.seq == seq}
        waiting = [n for n, g in records.items() if n in entrants and g.completed < seq]
        usual, odd, tie = _usual(entrants)
        members = _members(records.values())
        behind, unreported, counts = self._absentees(records, members, seq)
        desc = next((g.desc for g in records.values() if g.desc), "")
        agreed = [n for n in entrants if n not in odd]
        return _Collective(
            ref=CollectiveRef(group=name, seq=seq, op=usual.op if usual is not None else ""),
            desc=desc,
            waiting=[_culprit(self.numbered[n]) for n in sorted(waiting)],
            missing=behind,
            missing_count=counts[0],
            unreported=unreported,
            unreported_count=counts[1],
            mismatch=[(_culprit(self.numbered[n]), entrants[n]) for n in sorted(odd)],
            agreed=[_culprit(self.numbered[n]) for n in sorted(agreed)],
            usual=usual,
            tie=tie,
        )

    def _absentees(
        self, records: dict[int, GroupState], members: range | frozenset[int], seq: int
    ) -> tuple[list[Culprit], list[Culprit], tuple[int, int]]:
        """The members that never entered ``seq``: those it names and those not
        reported yet (the first of each), and how many of each there are."""
        known = sorted(n for n in self.numbered if n in members)
        named: list[int] = []
        waited: list[int] = []
        for number in known:
            group = records.get(number)
            if group is not None:
                if _reached(group) < seq:
                    named.append(number)
            elif self.settled or reported(self.numbered[number]):
                named.append(number)
            else:
                waited.append(number)
        # A member absent from the incident never answered. A huge group's are
        # counted, not walked: only the first few are listed.
        absent_count = len(members) - len(known)
        ordered = members if isinstance(members, range) else sorted(members)
        absent = itertools.islice((n for n in ordered if n not in self.numbered), MAX_CULPRITS)
        strangers = [Culprit(host="", pid=0, rank=number) for number in absent]
        listed = [_culprit(self.numbered[n]) for n in named]
        waiting = [_culprit(self.numbered[n]) for n in waited]
        if self.settled:
            everyone = sorted(listed + strangers, key=_order)[:MAX_CULPRITS]
            return everyone, waiting, (len(named) + absent_count, len(waited))
        unheard = sorted(waiting + strangers, key=_order)[:MAX_CULPRITS]
        return listed[:MAX_CULPRITS], unheard, (len(named), len(waited) + absent_count)

    def _mismatch(self, found: _Collective) -> Decision:
        coll = f"#{number_text(found.ref.seq)} of {_group_name(found.ref.group, found.desc)}"
        odd = [culprit for culprit, _ in found.mismatch]
        if found.tie or found.usual is None:
            said = (
                f"{_identities(odd, len(odd))} entered {coll} with ops, sizes or dtypes "
                "that disagree, as many ranks one way as another"
            )
        else:
            theirs = {_inputs(entered) for _, entered in found.mismatch}
            how = theirs.pop() if len(theirs) == 1 else "other ops, sizes or dtypes"
            differ = _differences(found.usual, [entered for _, entered in found.mismatch])
            said = (
                f"{_identities(odd, len(odd))} entered {coll} as {how}, where "
                f"{_who(found.agreed)} entered it as "
                f"{_inputs(found.usual)}: {differ} differ"
            )
        if found.missing:
            said += f"; {_identities(found.missing, found.missing_count)} never entered it"
        return self._named("mismatch", found, odd, said)

    def _missing(self, found: _Collective) -> Decision:
        said = (
            f"{_identities(found.missing, found.missing_count)} never entered "
            f"{_collective_name(found)}, which {_who(found.waiting)} "
            f"{_verb(found.waiting, 'waits', 'wait')} in"
        )
        if found.unreported:
            said += f"; {_not_reported(found.unreported, found.unreported_count)}"
        return self._named("missing", found, found.missing, said)

    def _named(self, kind: str, found: _Collective, culprits: list[Culprit], said: str) -> Decision:
        named = culprits[:MAX_CULPRITS]
        hang = fingerprint_of(kind, found.ref, map(self._frame_of, named))
        head = Verdict(
            kind=kind,
            basis="flight_recorder",
            culprits=named,
            collective=found.ref,
            settled=self.settled,
            fingerprint=hang.id,
        )
        return Decision(head=head, said=said, parts=self._places(culprits), fingerprint=hang)

    def _places(self, culprits: list[Culprit]) -> tuple[Part, ...]:
        """Where each named culprit is, a clause each (the first few)."""
        found = ((culprit, self._frame_of(culprit)) for culprit in culprits[:_NAMED])
        return tuple(
            _place(culprit, frame, alone=len(culprits) == 1)
            for culprit, frame in found
            if frame is not None
        )

    def _unreported(self, found: _Collective) -> Decision:
        said = (
            f"{_who(found.waiting)} {_verb(found.waiting, 'waits', 'wait')} in "
            f"{_collective_name(found)}; {_not_reported(found.unreported, found.unreported_count)}"
        )
        head = Verdict(
            kind="undecided", basis="flight_recorder", collective=found.ref, settled=self.settled
        )
        return Decision(head=head, said=said)

    def _entered_by_all(self, found: _Collective, by_stacks: Decision) -> Decision:
        said = (
            f"{_who(found.waiting)} {_verb(found.waiting, 'waits', 'wait')} in "
            f"{_collective_name(found)}, which every member entered alike: "
            "the collective itself does not complete"
        )
        head = Verdict(
            kind="undecided", basis="flight_recorder", collective=found.ref, settled=self.settled
        )
        return Decision(head=head, said=said, groups=by_stacks.groups)

    # By stacks.

    def _frame_of(self, culprit: Culprit) -> Frame | None:
        rank = next((r for r in self.ranks if (r.host, r.pid) == (culprit.host, culprit.pid)), None)
        return None if rank is None else self._frame(rank)

    def _frame(self, rank: RankInfo) -> Frame | None:
        given = self.threads.get((rank.host, rank.pid))
        if given:
            return pick(given, self.library)
        if rank.stack:
            return pick(rank.stack, self.library)
        # No stack, only the frame it waited in
        # (`watchdogd.core.incidents.first_frame`): the innermost
        # of all, which is the user's or says nothing.
        frame = frame_line(f"    {rank.frame}")
        return frame if frame is not None and not self.library.owns(frame.file) else None

    def _by_stacks(self) -> Decision:
        placed = [(rank, frame) for rank in self.ranks if (frame := self._frame(rank)) is not None]
        buckets: dict[tuple[str, int], list[tuple[Culprit, Frame]]] = {}
        for rank, frame in placed:
            key = (frame.file.rsplit("/", 1)[-1], frame.line)
            buckets.setdefault(key, []).append((_culprit(rank), frame))
        ordered = sorted(buckets.values(), key=lambda bucket: (-len(bucket), _order(bucket[0][0])))
        if not ordered:
            return self._nothing()
        majority, minority = ordered[0], [entry for bucket in ordered[1:] for entry in bucket]
        if len(majority) >= 2 and minority and 3 * len(minority) <= len(placed):
            return self._odd_frame(majority, minority)
        return self._undecided(ordered, len(placed))

    def _odd_frame(
        self, majority: list[tuple[Culprit, Frame]], minority: list[tuple[Culprit, Frame]]
    ) -> Decision:
        odd = sorted((culprit for culprit, _ in minority), key=_order)
        usual = [culprit for culprit, _ in majority]
        said = (
            f"{_identities(odd, len(odd))} {_verb(odd, 'waits', 'wait')} elsewhere "
            f"than {_who(usual)}"
        )
        frames = dict(minority)
        places = [_place(culprit, frames[culprit], alone=len(odd) == 1) for culprit in odd[:_NAMED]]
        they = "they are" if len(usual) > 1 else "it is"
        places.append(Part(f"{they} in {where(majority[0][1])}", "", tuple(usual)))
        named = odd[:MAX_CULPRITS]
        hang = fingerprint_of("odd_frame", None, (frames[culprit] for culprit in named))
        head = Verdict(
            kind="odd_frame",
            basis="stacks",
            culprits=named,
            settled=self.settled,
            fingerprint=hang.id,
        )
        return Decision(head=head, said=said, parts=tuple(places), fingerprint=hang)

    def _undecided(self, ordered: list[list[tuple[Culprit, Frame]]], placed: int) -> Decision:
        if placed == 1:
            said = f"{_who([ordered[0][0][0]])} is the only rank with a stack: none to compare"
        elif len(ordered) == 1:
            said = f"{_who([c for c, _ in ordered[0]])} all wait in the same frame: none stands out"
        else:
            said = (
                f"{placed} ranks wait in {len(ordered)} frames, none a small minority "
                "against a large majority"
            )
        groups = tuple(
            Part(f"{where(bucket[0][1])}: {who}", f"{who}: stack not shown", ranks)
            for bucket in ordered[:MAX_GROUPS]
            for ranks in [tuple(c for c, _ in bucket)]
            for who in [_who(ranks)]
        )
        head = Verdict(kind="undecided", basis="stacks", settled=self.settled)
        return Decision(head=head, said=said, groups=groups)

    def _nothing(self) -> Decision:
        said = (
            "no rank has reported yet"
            if not self.ranks
            else "no rank's Flight Recorder or stack says where it waits"
        )
        return Decision(head=Verdict(kind="undecided", settled=self.settled), said=said)


def _place(culprit: Culprit, frame: Frame, *, alone: bool) -> Part:
    """The clause that says where a culprit is, shown to who may see its stack."""
    subject = "it is" if alone else f"{_who([culprit])} is"
    return Part(f"{subject} in {where(frame)}", "", (culprit,))


def _waited_in(records: dict[int, GroupState]) -> int | None:
    """The collective of a group that the most of its ranks wait in (the newest
    on a tie), None when none waits."""
    waiting = Counter(g.entered.seq for g in records.values() if g.entered and _waits(g))
    return max(waiting, key=lambda seq: (waiting[seq], seq), default=None)


def _reached(group: GroupState) -> int:
    """The newest collective a rank entered or completed in ``group``."""
    return max(group.completed, group.entered.seq if group.entered else -1)


def _members(records: Iterable[GroupState]) -> range | frozenset[int]:
    """A group's members, from every record of it: those listed, else 0 to size - 1."""
    listed: set[int] = set()
    size = 0
    for group in records:
        listed.update(n for n in group.ranks if 0 <= n <= _RANK_MAX)
        size = max(size, group.size)
    return frozenset(listed) if listed else range(size)


def _usual(
    entrants: dict[int, Collective],
) -> tuple[Collective | None, list[int], bool]:
    """How most ranks entered a collective and the ranks that entered it
    otherwise; on a tie (no way of entering it held more ranks than another), every
    rank that entered it, and True."""
    if not entrants:
        return None, [], False
    ways = Counter(_signature(entered) for entered in entrants.values())
    first = {_signature(e): e for _, e in sorted(entrants.items(), reverse=True)}
    ranked = sorted(ways, key=lambda way: (-ways[way], -_completeness(first[way]), repr(way)))
    usual = first[ranked[0]]
    odd = [n for n, entered in entrants.items() if not _agrees(usual, entered)]
    rivals = [way for way in ranked[1:] if not _agrees(usual, first[way])]
    if rivals and ways[rivals[0]] >= ways[ranked[0]]:
        # As many ranks one way as another: no side can be told from the other.
        return usual, list(entrants), True
    return usual, odd, False


def _signature(entered: Collective) -> tuple[str, str, str]:
    return (entered.op, repr(entered.input_sizes), repr(entered.input_dtypes))


def _completeness(entered: Collective) -> int:
    return bool(entered.input_sizes) + bool(entered.input_dtypes)


def _agrees(usual: Collective, other: Collective) -> bool:
    """Whether ``other`` entered as ``usual`` did: what a record leaves out is not
    held against it (a responder may cut a rank's inputs to fit)."""
    return (
        usual.op == other.op
        and (
            not usual.input_sizes or not other.input_sizes or usual.input_sizes == other.input_sizes
        )
        and (
            not usual.input_dtypes
            or not other.input_dtypes
            or usual.input_dtypes == other.input_dtypes
        )
    )


def _differences(usual: Collective, others: list[Collective]) -> str:
    differ = [
        what
        for what, field in (("op", "op"), ("sizes", "input_sizes"), ("dtypes", "input_dtypes"))
        if any(getattr(usual, field) != getattr(other, field) for other in others)
    ]
    return " and ".join(differ) if differ else "inputs"


def _inputs(entered: Collective) -> str:
    """An entered collective as a sentence names it: ``gloo:all_reduce of [4, 3] Float``."""
    sizes = ", ".join(
        f"[{', '.join(number_text(d) for d in dims[:8])}]" for dims in entered.input_sizes[:4]
    )
    sizes += ", …" if len(entered.input_sizes) > 4 else ""
    dtypes = ", ".join(name_text(dtype) for dtype in entered.input_dtypes[:4])
    given = " ".join(part for part in (sizes, dtypes) if part)
    return f"{name_text(entered.op)} of {given}" if given else name_text(entered.op)


def _collective_name(found: _Collective) -> str:
    ref = found.ref
    return f"{name_text(ref.op)} #{number_text(ref.seq)} of {_group_name(ref.group, found.desc)}"


def _group_name(group: str, desc: str) -> str:
    if desc == "default_pg":
        return "the default group"
    named = f"group {name_text(group)}"
    return f"{named} ({name_text(desc)})" if desc not in ("", "undefined", group) else named


def _identity(culprit: Culprit) -> str:
    if not culprit.host:
        return f"rank {number_text(culprit.rank or 0)} (never answered)"
    if culprit.rank is None:
        return f"pid {number_text(culprit.pid)} on host {name_text(culprit.host)}"
    rank, host, pid = number_text(culprit.rank), name_text(culprit.host), number_text(culprit.pid)
    return f"rank {rank} on host {host} (pid {pid})"


def _identities(culprits: Sequence[Culprit], total: int) -> str:
    """The culprits, each by host, rank and pid, the first few of ``total``."""
    shown = [_identity(culprit) for culprit in culprits[:_NAMED]]
    more = max(0, total - len(shown))
    if more:
        return f"{', '.join(shown)} and {number_text(more)} more"
    return _and(shown)


def _who(ranks: Sequence[Culprit], total: int = 0) -> str:
    """Ranks by their numbers (a run as ``0-127``), a rank without one by its pid
    and host; ``total`` when more are meant than are given."""
    numbers = sorted({rank.rank for rank in ranks if rank.rank is not None})
    pieces = _runs(numbers) + [(_identity(rank), 1) for rank in ranks if rank.rank is None]
    counted = sum(count for _, count in pieces)
    more = max(0, total - counted)
    if len(pieces) > _PIECES:
        more += sum(count for _, count in pieces[_PIECES - 1 :])
        pieces = pieces[: _PIECES - 1]
    shown = [text for text, _ in pieces] + ([f"{number_text(more)} more"] if more else [])
    lead = "rank " if counted + more == 1 and numbers else "ranks " if numbers else ""
    return lead + _and(shown)


def _runs(numbers: list[int]) -> list[tuple[str, int]]:
    """Sorted numbers as pieces of a list, each with how many it stands for."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    pieces: list[tuple[str, int]] = []
    for run in runs:
        if len(run) >= 3:
            pieces.append((f"{number_text(run[0])}-{number_text(run[-1])}", len(run)))
        else:
            pieces.extend((number_text(number), 1) for number in run)
    return pieces


def _not_reported(ranks: Sequence[Culprit], total: int) -> str:
    verb = "has" if total == 1 else "have"
    return f"{_who(ranks, total)} {verb} not reported yet"


def _verb(ranks: Sequence[Culprit], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _and(pieces: Sequence[str]) -> str:
    if len(pieces) <= 1:
        return "".join(pieces)
    return f"{', '.join(pieces[:-1])} and {pieces[-1]}"
