"""The table of jobs' hangs: which fingerprints each job's settled verdicts had, and
whether one repeated often enough that the job is marked *repeating*.

A job (its owner's uid and its name, as incidents key it) has a row once a hang of
it was counted (`watchdogd.core.fingerprint.uncounted`). A row keeps the job's
latest `MAX_HANGS` hangs (incident, time, fingerprint id) and what each of their
fingerprints stands for, with who besides root may see its frames. A hang of a
fingerprint that the job had ``limit`` times within ``window`` seconds (its own
included, none before the row's last reset) marks the row repeating on it; a reset
clears the mark, and hangs before it count no more. A hang is counted once: again
with an incident the row lists (a verdict settled once more after a restart), or
within ``same_within`` seconds (the incident window) of one of its fingerprint
(two hosts' incidents of one expiry, before they merged), it replaces that one.

Bounded on its own, as the incidents are (`watchdogd.core.shares`): at most
`JOBS` rows of root's jobs, a share no other uid's row takes, and `JOBS` of all
other uids' together, `JOBS_PER_UID` of one uid's; past a bound a row of the uid
holding the most goes, its least recently changed one that is not repeating
first. Nothing else makes room in it: the incidents' and the events' bounds, and
the record's, never drop a row (the record file writes the rows whole, first:
`watchdogd.storage.record_file`). What changed is handed to the record as rows
and keys dropped (`take`), and a restarted daemon takes the rows back (`restore`).

Pure: times are passed in (wall seconds, the incidents' clock), nothing is read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from .fingerprint import Fingerprint
from .identity import ROOT
from .shares import Shares

#: Rows of root's jobs kept, and of all other uids' jobs together.
JOBS: Final = 256
#: Rows of one non-root uid's jobs kept.
JOBS_PER_UID: Final = 64
#: Hangs a row keeps, the latest; ``repeat_limit`` is at most this.
MAX_HANGS: Final = 16
#: Fingerprints a row describes, those of its latest hangs.
MAX_PRINTS: Final = 8

JobKey = tuple[int, str]


#: A fingerprint's id (`watchdogd.core.fingerprint`), an incident's, a user's name
#: and a job's, as the record reads them back: bounded as a reply's are.
_Id = Annotated[str, Meta(max_length=64)]
_Incident = Annotated[str, Meta(max_length=128)]
_Name = Annotated[str, Meta(max_length=256)]


class Print(msgspec.Struct, frozen=True, array_like=True):
    """A fingerprint a row's hangs have, with who besides root may see its frames
    (`watchdogd.core.ranks.may_read`: None, root alone)."""

    fingerprint: Fingerprint
    reader_uid: int | None = None
    reader_gid: int | None = None


class Hang(msgspec.Struct, frozen=True, array_like=True):
    """A hang counted: its incident, when that opened (wall seconds), its
    fingerprint's id."""

    incident: _Incident
    time: float
    fingerprint: _Id


class JobRow(msgspec.Struct, frozen=True, array_like=True):
    """A job's row: its owner (``uid``, named ``user``), its hangs (oldest first)
    and their fingerprints, the fingerprint it is marked ``repeating`` on ("":
    none) since ``marked``, its last ``reset`` (wall seconds; 0: none) and the
    number of the latest event about it (``event``: its last hang's verdict, its
    mark or its reset), written with it."""

    uid: Annotated[int, Meta(ge=0, le=2**32 - 1)]
    user: _Name
    job: _Name
    hangs: Annotated[list[Hang], Meta(max_length=MAX_HANGS)] = []
    prints: Annotated[list[Print], Meta(max_length=MAX_PRINTS)] = []
    repeating: _Id = ""
    marked: float = 0.0
    reset: float = 0.0
    event: int = 0

    @property
    def key(self) -> JobKey:
        return (self.uid, self.job)


class Repeats:
    """The rows, bounded as the module says; ``limit`` hangs of one fingerprint
    within ``window`` seconds mark a job."""

    def __init__(
        self,
        *,
        limit: int = 3,
        window: float = 86_400.0,
        same_within: float = 30.0,
        keep: int = JOBS,
        per_uid: int = JOBS_PER_UID,
    ) -> None:
        self.limit = limit
        self.window = window
        self.same_within = same_within
        self._shares = Shares(keep, per_uid)
        self._rows: dict[JobKey, JobRow] = {}
        #: Each uid's keys, the least recently changed first.
        self._owned: dict[int, OrderedDict[JobKey, None]] = {}
        self._changed: dict[JobKey, None] = {}
        self._dropped: dict[JobKey, None] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: JobKey) -> JobRow | None:
        """The row of ``key``, if it has one."""
        return self._rows.get(key)

    def add(
        self, key: JobKey, user: str, hang: Hang, fingerprint: Print, event: int = 0
    ) -> tuple[JobRow, bool]:
        """Count ``hang`` of job ``key`` (of ``user``), whose verdict's event is
        number ``event``: its row as it is now, and whether the job was marked
        repeating by it."""
        row = self._rows.get(key) or JobRow(uid=key[0], user=user, job=key[1])
        hangs = [
            kept
            for kept in row.hangs
            if kept.incident != hang.incident
            and not (
                kept.fingerprint == hang.fingerprint
                and abs(kept.time - hang.time) < self.same_within
            )
        ]
        hangs = sorted([*hangs, hang], key=lambda kept: kept.time)[-MAX_HANGS:]
        prints = [p for p in row.prints if p.fingerprint.id != hang.fingerprint]
        prints.append(fingerprint)
        ids = {kept.fingerprint for kept in hangs}
        prints = [p for p in prints if p.fingerprint.id in ids][-MAX_PRINTS:]
        row = msgspec.structs.replace(row, user=user, hangs=hangs, prints=prints, event=event)
        marked = not row.repeating and self.count(row, hang.fingerprint, hang.time) >= self.limit
        if marked:
            row = msgspec.structs.replace(row, repeating=hang.fingerprint, marked=hang.time)
        self._put(row)
        return row, marked

    def count(self, row: JobRow, fingerprint: str, now: float) -> int:
        """The hangs of ``row`` with ``fingerprint`` within the window before
        ``now``, none before its reset."""
        since = max(now - self.window, row.reset)
        return sum(
            1 for hang in row.hangs if hang.fingerprint == fingerprint and hang.time >= since
        )

    def reset(self, key: JobKey, wall: float) -> JobRow | None:
        """Clear the mark of ``key``'s row, and count its hangs from ``wall`` on:
        the row as it was (None: it has none)."""
        row = self._rows.get(key)
        if row is not None:
            self._put(msgspec.structs.replace(row, repeating="", marked=0.0, reset=wall))
        return row

    def noted(self, key: JobKey, event: int) -> None:
        """The latest event about ``key``'s repeats is number ``event``."""
        row = self._rows.get(key)
        if row is not None:
            self._put(msgspec.structs.replace(row, event=event))

    def repeating(self, key: JobKey) -> str:
        """The fingerprint ``key`` is marked repeating on ("": none)."""
        row = self._rows.get(key)
        return "" if row is None else row.repeating

    def marked(self) -> list[JobKey]:
        """The jobs marked repeating."""
        return [key for key, row in self._rows.items() if row.repeating]

    def _put(self, row: JobRow) -> None:
        key = row.key
        if key not in self._rows:
            victim = self._shares.add(key[0])
            if victim is not None:
                self._drop_one(victim)
            self._owned.setdefault(key[0], OrderedDict())[key] = None
        self._owned[key[0]].move_to_end(key)
        self._rows[key] = row
        self._changed[key] = None
        self._dropped.pop(key, None)

    def _drop_one(self, uid: int) -> None:
        """Drop a row of ``uid``'s: its least recently changed not repeating, else
        its least recently changed."""
        owned = self._owned[uid]
        key = next((k for k in owned if not self._rows[k].repeating), next(iter(owned)))
        del owned[key]
        if not owned:
            del self._owned[uid]
        del self._rows[key]
        self._changed.pop(key, None)
        self._dropped[key] = None

    def take(self) -> tuple[list[JobRow], list[JobKey]]:
        """The rows changed since the last take, and the keys dropped."""
        changed = [self._rows[key] for key in self._changed]
        dropped = list(self._dropped)
        self._changed, self._dropped = {}, {}
        return changed, dropped

    def everything(self) -> list[JobRow]:
        """Every row, the least recently changed first."""
        return [self._rows[key] for owned in self._owned.values() for key in owned]

    def restore(self, rows: Iterable[JobRow]) -> None:
        """Keep ``rows`` (read back from the record, in the order written) under the
        bounds, each cut to what a row keeps."""
        for row in rows:
            hangs = sorted(row.hangs, key=lambda hang: hang.time)[-MAX_HANGS:]
            self._put(msgspec.structs.replace(row, hangs=hangs, prints=row.prints[-MAX_PRINTS:]))
        self.take()

    def visible(self, reader: int | None) -> list[JobKey]:
        """The marked jobs ``reader`` may see: root every one, another uid its own,
        None (a page anyone may read) none."""
        return [key for key in self.marked() if reader == ROOT or key[0] == reader]
