"""What the daemon does with each hang: counts a settled verdict toward its job's
repeats, marks a job whose hang repeats, and answers `Hangs` (``watchdogctl job``).

Invariants:

- A verdict counts once, when it settles on this host, from the ranks this host
  keeps (`watchdogd.core.fingerprint.uncounted` says which count); no verdict or
  fingerprint is ever read from another host. Its fingerprint and whether it
  counted are kept with the incident (`watchdogd.core.incidents`).
- A job marked repeating gets a ``repeating`` event of its owner's, once, and
  stays marked until ``watchdogctl job JOB --reset`` (a ``repeat_reset`` event).
- A job is its owner's: a caller other than root asks about, and resets, its
  own jobs alone (a refusal says so before anything about the job is looked up);
  root names the owner. The frames of a fingerprint are shown to root, and to a
  caller who could read the stacks of the ranks they come from
  (`watchdogd.core.ranks.may_read`).
- A reply about a job names the latest event about it (``event``: its last
  hang's verdict, its mark or its reset): it is sent once that event, and the
  row written with it, is kept beside the state (`watchdogd.core.session`), so
  what a launcher was told survives a crash of the daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from watchdogd_protocol import (
    MAX_JOB_BYTES,
    ErrorCode,
    EventInfo,
    FingerprintInfo,
    HangInfo,
    Hangs,
    HangsReply,
    IncidentInfo,
    RankInfo,
    Verdict,
)

from ..errors import Refusal
from .counters import Counters
from .fingerprint import COUNTED, reader_of, uncounted
from .identity import ROOT, Peer
from .repeats import Hang, JobKey, JobRow, Print, Repeats
from .verdict import Decision

if TYPE_CHECKING:
    from .context import CoreContext

#: The most incidents of a job a reply lists, the latest.
MAX_LISTED: Final = 32


class JobHangs:
    """The hangs of jobs, and the ``Hangs`` request."""

    def __init__(
        self, context: CoreContext[Any], repeats: Repeats, *, holds: Callable[[JobKey], bool]
    ) -> None:
        self.repeats = repeats
        self._incidents = context.incidents
        self._holds = holds
        self._events = context.events
        self._wall = context.wall

    def settled(
        self,
        info: IncidentInfo,
        decision: Decision | None,
        ranks: list[RankInfo],
        event: int = 0,
    ) -> tuple[str, str]:
        """The verdict on ``info`` settled as ``decision`` (None: none) over
        ``ranks``, recorded as event number ``event``: its fingerprint's id and
        whether it counted (`watchdogd.core.fingerprint.COUNTED`, else why not),
        counted here."""
        host = self._incidents.host
        if decision is None or decision.fingerprint is None:
            return "", uncounted(info, Verdict(kind="undecided"), ranks, host)
        head, hang = decision.head, decision.fingerprint
        why = uncounted(info, head, ranks, host)
        if why:
            return hang.id, why
        reader = reader_of(head.culprits, ranks)
        key = (info.uid, info.job)
        row, marked = self.repeats.add(
            key, info.user, Hang(info.id, info.time, hang.id), Print(hang, *reader), event
        )
        if marked:
            count = self.repeats.count(row, hang.id, info.time)
            note = (
                f"job {info.job} hung the same way {count} times within "
                f"{_span(self.repeats.window)} (fingerprint {hang.id}: "
                f"{hang.describe(frames=False)}): marked repeating; watchdogctl job "
                f"{info.job} exits 3 until --reset"
            )
            self._record("repeating", row, info.id, note)
        return hang.id, COUNTED

    def _record(self, kind: str, row: JobRow, incident: str, note: str) -> None:
        """An event of ``row``'s owner about its repeats (``outcome``: the
        fingerprint marked, or cleared), noted in the row."""
        event = self._events.record(
            EventInfo(
                seq=0,
                kind=kind,
                time=self._wall(),
                pid=0,
                uid=row.uid,
                scope="",
                policy="",
                job=row.job,
                incident=incident,
                outcome=row.repeating,
                note=note,
            )
        )
        self.repeats.noted(row.key, event.seq)

    def hangs(self, request: Hangs, peer: Peer) -> HangsReply:
        """Answer `Hangs`: the job's hangs as ``peer`` may see them, after a reset
        when asked."""
        uid = peer.uid if request.uid is None else request.uid
        if peer.uid not in (ROOT, uid):
            raise Refusal(
                ErrorCode.PERMISSION_DENIED,
                "a job is its owner's: you may ask about and reset your own jobs only",
            )
        if len(request.job.encode()) > MAX_JOB_BYTES:
            raise Refusal(ErrorCode.INVALID_REQUEST, f"a job is at most {MAX_JOB_BYTES} bytes")
        key = (uid, request.job)
        listed = [i for i in self._incidents.listing(peer.uid, len(self._incidents) or 1)
                  if (i.uid, i.job) == key][-MAX_LISTED:]  # fmt: skip
        if self.repeats.get(key) is None and not listed and not self._holds(key):
            raise Refusal(
                ErrorCode.NO_SUCH_JOB,
                f"no job {request.job!r} of uid {uid} is known here: no timer, incident "
                "or hang of it",
            )
        if request.reset:
            self._reset(key, peer)
        return self._reply(request, key, listed, peer)

    def _reset(self, key: JobKey, peer: Peer) -> None:
        before = self.repeats.reset(key, self._wall())
        if before is not None and before.repeating:
            note = (
                f"the repeating mark of job {key[1]} (fingerprint {before.repeating}) was "
                f"cleared by uid {peer.uid}: its hangs count anew from now"
            )
            self._record("repeat_reset", before, "", note)

    def _reply(
        self, request: Hangs, key: JobKey, listed: list[IncidentInfo], peer: Peer
    ) -> HangsReply:
        # A job with no hang counted yet: its owner's name from its incidents.
        user = listed[-1].user if listed else ""
        row = self.repeats.get(key) or JobRow(uid=key[0], user=user, job=key[1])
        now = self._wall()
        return HangsReply(
            id=request.id,
            job=key[1],
            uid=key[0],
            user=row.user,
            repeating=row.repeating,
            marked=row.marked,
            reset=row.reset,
            limit=self.repeats.limit,
            window=self.repeats.window,
            hangs=[
                HangInfo(incident=h.incident, time=h.time, fingerprint=h.fingerprint)
                for h in row.hangs
            ],
            fingerprints=[
                _described(shown, peer, self.repeats.count(row, shown.fingerprint.id, now), row)
                for shown in row.prints
            ],
            incidents=self.flag(listed),
            event=row.event,
        )

    def flag(self, incidents: list[IncidentInfo]) -> list[IncidentInfo]:
        """``incidents`` with each whose job is marked repeating on its fingerprint
        flagged so (``repeating``)."""
        return [
            msgspec.structs.replace(incident, repeating=True)
            if incident.verdict is not None
            and incident.verdict.fingerprint
            and self.repeats.repeating((incident.uid, incident.job)) == incident.verdict.fingerprint
            else incident
            for incident in incidents
        ]

    def gauge(self, reader: int | None) -> dict[tuple[int, str], int]:
        """The jobs marked repeating that ``reader`` may see, for the metrics: the
        first `Counters.JOB_LABELS` by their own, the rest as job ``(other)``."""
        marked = sorted(self.repeats.visible(reader))
        shown = dict.fromkeys(marked[: Counters.JOB_LABELS], 1)
        if len(marked) > Counters.JOB_LABELS:
            shown[(ROOT, "(other)")] = len(marked) - Counters.JOB_LABELS
        return shown


def _described(shown: Print, peer: Peer, hangs: int, row: JobRow) -> FingerprintInfo:
    """A fingerprint of ``row`` as ``peer`` may see it, with its ``hangs`` in the
    window."""
    fingerprint = shown.fingerprint
    readable = peer.uid == ROOT or (
        shown.reader_uid == peer.uid and shown.reader_gid in (None, peer.gid)
    )
    times = [hang.time for hang in row.hangs if hang.fingerprint == fingerprint.id]
    return FingerprintInfo(
        id=fingerprint.id,
        kind=fingerprint.kind,
        op=fingerprint.op,
        group=fingerprint.group,
        frames=fingerprint.frames if readable else [],
        hidden=bool(fingerprint.frames) and not readable,
        hangs=hangs,
        last=max(times, default=0.0),
    )


def _span(seconds: float) -> str:
    """A window as a sentence says it: ``1d``, ``12h``, ``90s``."""
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
