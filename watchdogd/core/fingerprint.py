"""A hang's fingerprint, and whether a settled verdict counts as a hang of its job.

A fingerprint is what a verdict that names culprits (``missing``, ``mismatch``,
``odd_frame``) says of the hang, without what changes from one run of its job to
the next or from one host to another: the verdict's kind, the op and the group of
the collective it names (not its sequence number), and the frames its culprits
wait in, each by its file's name and its function (not the line, the directory,
the pid, the host or the rank). Its id is a hash of those, so the same hang has
the same id on every host and in every run. Bounded whatever the ranks said
(another host's come through etcd, untrusted): at most `MAX_FRAMES` frames, each
name cut to `NAME_CHARS` characters, distinct and sorted.

A settled verdict counts toward its job's repeats (`watchdogd.core.repeats`) only
when it is a hang of the job's own that this host saw itself (`uncounted`):

- an incident of an expiry (a ``host_lost`` is a host's fault, not the job's);
- a verdict that names culprits (an ``undecided`` one names none);
- a culprit that gave evidence: a rank named for its silence alone (a host frozen
  or lost, whose ranks never answered) is no sign of where the job hangs, so three
  frozen hosts are not a deterministic hang;
- a rank of this host took part, as this host saw it: its own timer expired in
  the incident, or its own Flight Recorder waits in the collective the verdict
  names. Another host's ranks come through etcd, which anyone with write access
  to it can forge; a verdict no rank of this host bears out is not counted here
  (each host counts the hangs its own ranks were part of).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from watchdogd_protocol import (
    CollectiveRef,
    Culprit,
    Frame,
    IncidentInfo,
    RankInfo,
    Verdict,
)

from .ranks import reported

#: The most frames a fingerprint keeps.
MAX_FRAMES: Final = 4
#: The most characters of a file's name, a function's, an op's or a group's.
NAME_CHARS: Final = 96
#: The verdicts that name culprits.
NAMING: Final = frozenset({"missing", "mismatch", "odd_frame"})
#: What an incident whose hang counts says of it (`watchdogd_protocol.IncidentInfo.repeat`).
COUNTED: Final = "counted"
_Name = Annotated[str, Meta(max_length=NAME_CHARS)]


class Fingerprint(msgspec.Struct, frozen=True, array_like=True):
    """A hang's fingerprint: ``id`` and what it was made of (``frames`` as
    ``file function``)."""

    id: Annotated[str, Meta(max_length=64)]
    kind: Annotated[str, Meta(max_length=64)]
    op: _Name = ""
    group: _Name = ""
    frames: Annotated[list[Annotated[str, Meta(max_length=2 * NAME_CHARS + 1)]],
                      Meta(max_length=MAX_FRAMES)] = []  # fmt: skip

    def describe(self, *, frames: bool = True) -> str:
        """In words: ``odd_frame at loader.py read_shard``, ``missing in
        gloo:all_reduce of group 0``; without its frames when ``frames`` is False."""
        parts = [self.kind]
        if self.op or self.group:
            parts.append(f"in {self.op or '?'} of group {self.group or '?'}")
        if frames and self.frames:
            parts.append(f"at {', '.join(self.frames)}")
        return " ".join(parts)


def fingerprint_of(
    kind: str, collective: CollectiveRef | None, frames: Iterable[Frame | None]
) -> Fingerprint:
    """The fingerprint of a verdict of ``kind`` about ``collective`` whose culprits
    wait in ``frames`` (None: a culprit without a frame)."""
    named = sorted({_frame_name(frame) for frame in frames if frame is not None})[:MAX_FRAMES]
    op = _cut(collective.op) if collective is not None else ""
    group = _cut(collective.group) if collective is not None else ""
    made = msgspec.msgpack.encode([kind, op, group, named])
    digest = hashlib.blake2b(made, digest_size=8, person=b"watchdogd-hang").hexdigest()
    return Fingerprint(id=digest, kind=kind, op=op, group=group, frames=named)


def _frame_name(frame: Frame) -> str:
    file = frame.file.rsplit("/", 1)[-1]
    return f"{_cut(file)} {_cut(frame.function)}"


def _cut(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def uncounted(info: IncidentInfo, verdict: Verdict, ranks: Sequence[RankInfo], host: str) -> str:
    """Why the settled ``verdict`` on the incident ``info`` of ``ranks`` does not
    count toward its job's repeats on ``host``; "" when it counts."""
    if info.kind != "expired":
        return f"not counted: a {info.kind} incident is no hang of the job's own"
    if verdict.kind not in NAMING:
        return "not counted: its verdict names no culprit"
    heard = {(rank.host, rank.pid) for rank in ranks if reported(rank)}
    if not any(
        (culprit.host, culprit.pid) in heard for culprit in verdict.culprits if culprit.host
    ):
        return (
            "not counted: no culprit it names gave evidence (a frozen or lost host's "
            "ranks are named for their silence)"
        )
    here = [rank for rank in ranks if rank.host == host]
    if not any(
        rank.role == "expired" or _waits_in(rank, verdict.collective)
        for rank in here
        if reported(rank)
    ):
        return (
            "not counted here: no rank of this host expired in it or waits in the "
            "collective it names"
        )
    return ""


def _waits_in(rank: RankInfo, collective: CollectiveRef | None) -> bool:
    """Whether ``rank``'s own Flight Recorder waits in ``collective``."""
    if collective is None:
        return False
    return any(
        group.group == collective.group
        and group.entered is not None
        and group.entered.seq == collective.seq
        and group.completed < collective.seq
        for group in rank.flight
    )


def reader_of(
    culprits: Sequence[Culprit], ranks: Sequence[RankInfo]
) -> tuple[int | None, int | None]:
    """Who besides root may see a fingerprint's frames: the reader
    (`watchdogd.core.ranks.may_read`) of every culprit alike; (None, None), root
    alone, when they differ or one has none."""
    named = {(culprit.host, culprit.pid) for culprit in culprits}
    readers = {
        (rank.reader_uid, rank.reader_gid) for rank in ranks if (rank.host, rank.pid) in named
    }
    uids = {uid for uid, _ in readers}
    gids = {gid for _, gid in readers if gid is not None}
    if len(uids) != 1 or None in uids or len(gids) > 1:
        return None, None
    return uids.pop(), next(iter(gids), None)
