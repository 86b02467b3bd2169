"""The bytes of evidence the incident log keeps (`watchdogd.core.incidents`), and
what a uid past its budget gives back.

Invariants:

- An incident kept (`Kept`) changes its ranks only through `Kept.put`,
  `Kept.append` and `Kept.assign`, which keep what they take (``size``: the bytes
  of each rank as the state encodes it) and how many have a stack longer than a
  trimmed one (``whole``). `EvidenceBudget.count` adds what an incident's size
  changed to its uid's share (`watchdogd.core.shares.ByteShares`): root's
  incidents take at most ``size``, a share of their own, those of every other
  uid together as much, and ``per_uid`` of any one uid's.
- A uid past its bound gives back from its own incidents only, in this order:
  its stacks, oldest incident first and rank by rank, each cut to its main
  thread's innermost frames (`watchdogd.core.ranks.trimmed`, in which the verdict
  reads the same frame as in the whole); then its oldest incidents whole, their
  Flight Recorder summaries and verdicts with them (an incident kept keeps its
  verdict); then, in the one incident left, its ranks' summaries and what was
  kept of their stacks. Past the shared total, the uid holding the most gives
  back first: a uid within its fair share never loses evidence to another's.
- Every rank cut says so in its note, its incident counts the bytes it lost
  (``IncidentInfo.trimmed``), and ``on_trimmed(uid, bytes)`` hears of every byte
  that went, an incident dropped whole included.

Pure and synchronous, as the log is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from watchdogd_protocol import GroupState, IncidentInfo, RankInfo

from .ranks import TRIMMED_STACK_BYTES, trimmed
from .shares import ByteShares
from .verdict import Decision

#: The bytes of evidence root's incidents keep, and other uids' together; and one
#: other uid's (the config's ``incident_bytes`` and ``incident_bytes_per_uid``).
EVIDENCE_BYTES: Final = 64 * 1024 * 1024
EVIDENCE_BYTES_PER_UID: Final = 16 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()


@dataclass(slots=True, eq=False)
class Kept:
    """An incident as the log keeps it, and the bytes its ranks take."""

    info: IncidentInfo
    ranks: list[RankInfo] = field(default_factory=list)
    #: Wall time until which expiries of its job join it (0: none do, a remote one).
    open_until: float = 0.0
    #: Who its job waits for, as the ranks known so far say (`watchdogd.core.verdict`).
    decision: Decision | None = None
    #: Every host of the job has reported, or its window has closed: the verdict
    #: is counted and recorded once, then, and only refined after.
    settled: bool = False
    #: The hosts the fleet says hold the job: each reports before it settles.
    hosts: frozenset[str] = frozenset()
    #: The fingerprint it settled with (`IncidentLog`'s ``on_settled``).
    fingerprint: str = ""
    #: The encoded size of each rank, and their sum.
    sizes: list[int] = field(default_factory=list)
    size: int = 0
    #: Ranks whose stack is longer than a trimmed one.
    whole: int = 0
    #: The bytes its uid's share counts for it (`EvidenceBudget.count`), until
    #: it is no longer kept (``gone``).
    counted: int = 0
    gone: bool = False

    def put(self, index: int, rank: RankInfo) -> None:
        """Rank ``index`` is ``rank`` from now on."""
        self.size -= self.sizes[index]
        self.whole -= _whole(self.ranks[index])
        self.ranks[index] = rank
        self.sizes[index] = self._count(rank)

    def update(self, index: int, **changes: Any) -> None:
        """Rank ``index`` with ``changes`` to its fields from now on."""
        self.put(index, msgspec.structs.replace(self.ranks[index], **changes))

    def append(self, rank: RankInfo) -> None:
        self.ranks.append(rank)
        self.sizes.append(self._count(rank))

    def assign(self, ranks: list[RankInfo]) -> None:
        """The ranks are ``ranks`` from now on."""
        self.ranks, self.size, self.whole = ranks, 0, 0
        self.sizes = [self._count(rank) for rank in ranks]

    def _count(self, rank: RankInfo) -> int:
        size = len(_encoder.encode(rank))
        self.size += size
        self.whole += _whole(rank)
        return size


def _whole(rank: RankInfo) -> bool:
    """Whether ``rank``'s stack is longer than a trimmed one (a character is at
    most 4 bytes: most stacks are told apart without encoding them)."""
    return 4 * len(rank.stack) > TRIMMED_STACK_BYTES and (
        len(rank.stack.encode()) > TRIMMED_STACK_BYTES
    )


class EvidenceBudget:
    """The bytes each uid's incidents take, bounded as the module says. ``owned``
    gives a uid's incidents oldest first, ``drop_oldest`` drops the oldest of a
    uid's, ``touch`` tells the state an incident changed."""

    def __init__(
        self,
        size: int,
        per_uid: int | None,
        *,
        owned: Callable[[int], Sequence[Kept]],
        drop_oldest: Callable[[int], object],
        touch: Callable[[Kept], object],
        on_trimmed: Callable[[int, int], object],
    ) -> None:
        self._bytes = ByteShares(size, per_uid)
        self._owned = owned
        self._drop_oldest = drop_oldest
        self._touch = touch
        self._on_trimmed = on_trimmed

    def held(self, uid: int) -> int:
        """The bytes the ranks of ``uid``'s incidents take."""
        return self._bytes.held(uid)

    def resize(self, size: int, per_uid: int | None) -> None:
        """Bound anew; the excess is trimmed."""
        self._bytes.resize(size, per_uid)
        self.fit(None)

    def count(self, incident: Kept) -> None:
        """``incident``'s ranks changed: its uid's bytes are counted anew, and
        trimmed to fit."""
        if incident.counted != incident.size and not incident.gone:
            self._bytes.add(incident.info.uid, incident.size - incident.counted)
            incident.counted = incident.size
            self.fit(incident.info.uid)

    def forget(self, incident: Kept) -> None:
        """``incident`` is no longer kept."""
        self._bytes.add(incident.info.uid, -incident.counted)
        incident.counted, incident.gone = 0, True

    def fit(self, first: int | None) -> None:
        """Trim the uids over their bytes (``first`` first) until every one fits."""
        while (uid := self._bytes.over(first)) is not None:
            if not self._trim(uid):
                break  # nothing left to trim: what its ranks are takes this much

    def _trim(self, uid: int) -> bool:
        """Give back some of ``uid``'s bytes, as the module says; False when
        nothing is left to give."""
        owned = self._owned(uid)
        if not owned:
            return False
        for incident in owned:
            if incident.whole:
                index = next(i for i, rank in enumerate(incident.ranks) if _whole(rank))
                rank = incident.ranks[index]
                cut = "stack cut to its main thread's innermost frames"
                self._cut(incident, index, cut, stack=trimmed(rank.stack), flight=rank.flight)
                return True
        if len(owned) > 1:
            size = owned[0].counted
            self._drop_oldest(uid)
            self._on_trimmed(uid, size)
            return True
        for index, rank in enumerate(owned[0].ranks):
            if rank.flight or rank.stack:
                cut = "stack and Flight Recorder summary dropped"
                self._cut(owned[0], index, cut, stack="", flight=[])
                return True
        return False

    def _cut(
        self, incident: Kept, index: int, cut: str, *, stack: str, flight: list[GroupState]
    ) -> None:
        """Keep ``stack`` and ``flight`` of rank ``index`` of ``incident``, the rest
        counted as trimmed, and say so in its note (``cut``: what went)."""
        rank = incident.ranks[index]
        uid = incident.info.uid
        why = f"{cut}: the incidents of uid {uid} passed their bytes of evidence"
        before = incident.size
        note = f"{rank.note}; {why}" if rank.note else why
        incident.put(index, msgspec.structs.replace(rank, stack=stack, flight=flight, note=note))
        gone = max(0, before - incident.size)
        incident.info = msgspec.structs.replace(incident.info, trimmed=incident.info.trimmed + gone)
        self._bytes.add(uid, incident.size - incident.counted)
        incident.counted = incident.size
        self._touch(incident)
        self._on_trimmed(uid, gone)
