"""What happened, kept beside the state (``STATE.record``): the events
(`watchdogd.core.events`), the incidents (`watchdogd.core.incidents`) and the
jobs' hangs (`watchdogd.core.repeats`), so that ``watchdogctl events`` and
``watchdogctl incident ID`` still explain a kill after the daemon restarted,
``events --follow`` goes on from the number it saw, and ``watchdogctl job`` still
stops a hang that repeats.

Invariants:

- An append-only file of checksummed records, framed as the journal's are
  (`watchdogd.storage.journal.RECORD`): a header naming the file's schema first,
  then jobs' rows of hangs, events, incidents as they now are (the last record
  of an incident or a row is what it is) and incidents and rows dropped. What
  changed is written within `WRITE_INTERVAL` of the change, in one ``write(2)``,
  and before any reply that shows an event's number is sent
  (`RecordFile.through`): numbering goes on after the last event read at start,
  so a number a client saw is never given to another event; a row changes with
  an event about it (a mark, a reset) in the same write.
  Nothing is fsynced: the page cache survives a kill of the daemon, as the
  journal's records do.
- Bounded as the rings are: the file holds the kept events, incidents and rows,
  and the changes since it was last written whole. The rows of hangs are bounded
  by their own table alone, small, and written first: nothing that makes room
  in this file drops or cuts them (a job whose hang repeats must stay marked).
  When it outgrows twice what it held then (and `_SLACK`), it is written whole
  again, to a new file renamed over it: a crash leaves the old or the new.
- Read at start, in order, each record typed and bounded as a reply is, and
  only from a regular file (`watchdogd.storage.files.open_regular`: anything
  else at its name is moved aside unread, ``.not-regular-TIME``). A record cut
  short at the end is a write the daemon died in, or a file cut short: the file
  is cut back to before it. A damaged record (bad checksum, content that does
  not decode) is jumped over when its length leads to a whole record, else it
  ends the reading; either way the file is moved aside (``.damaged``) and
  written whole from what was read. What was not read back (how many bytes,
  from where, how many whole records) is said by an event of the daemon
  (``record_cut``, ``record_damaged``), and so its log line.
- Readable by root alone (0600): stacks may hold secrets. Who else may read each
  stack was decided when it was dumped, and is kept with it.
- A write that fails (a full, read-only or failing disk) is logged once per run
  of failures; the records stay in memory, bounded as ever, and the next write,
  tried every `RETRY` seconds, writes the file whole. So does the next write after
  the file was deleted under the daemon (its directory removed).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, Final

import msgspec
import trio

from watchdogd_client.protocol import EventInfo

from ..core.events import EventLog
from ..core.incidents import IncidentLog, StoredIncident
from ..core.repeats import JobKey, JobRow, Repeats
from ..logs import log, logfmt
from .faults import Aside, NotRegular, reason
from .files import open_regular, replace_file
from .journal import RECORD, close, write_all

#: Seconds between a change and its write, at most (changes of one interval share
#: one write: an incident whose ranks report one by one is not written per rank).
WRITE_INTERVAL: Final = 0.1
#: Seconds between tries of a disk that refused a write.
RETRY: Final = 1.0
#: The schema of the records; a file of another is moved aside, unread.
SCHEMA: Final = 1
#: Growth allowed past twice the size of the last whole write.
_SLACK: Final = 4 * 1024 * 1024
#: No record is larger: an incident of 1,024 ranks with 64 KiB stacks is 64 MiB.
_MAX_RECORD: Final = 128 * 1024 * 1024
#: A whole write is framed in the loop's turns, each this long at most (CPU
#: seconds): the file may hold hundreds of MiB of stacks, and a due timer's signal
#: waits for the turn in progress.
_TURN: Final = 0.002
#: The frames of a whole write are joined into parts of about this size, which the
#: worker thread writes in turn (no copy of the whole file in one piece).
_PART: Final = 1024 * 1024


class _Header(msgspec.Struct, tag="header", array_like=True):
    schema: int


class _Event(msgspec.Struct, tag="event", array_like=True):
    event: EventInfo


class _Incident(msgspec.Struct, tag="incident", array_like=True):
    incident: StoredIncident


class _Dropped(msgspec.Struct, tag="dropped", array_like=True):
    id: str


class _Row(msgspec.Struct, tag="job", array_like=True):
    row: JobRow


class _RowDropped(msgspec.Struct, tag="job_dropped", array_like=True):
    uid: int
    job: str


_Entry = _Header | _Event | _Incident | _Dropped | _Row | _RowDropped
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Entry)


def record_path(state_path: str) -> str:
    return state_path + ".record"


def _frame(entry: _Entry) -> bytes:
    payload = _encoder.encode(entry)
    return RECORD.pack(len(payload), zlib.crc32(payload)) + payload


class _Parts:
    """The frames of a whole write, joined into parts of about `_PART` bytes."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self._batch: list[bytes] = []
        self._batched = 0

    def add(self, entry: _Entry) -> None:
        frame = _frame(entry)
        self._batch.append(frame)
        self._batched += len(frame)
        self.size += len(frame)
        if self._batched >= _PART:
            self.done()

    def frame(self, entries: Iterable[_Entry], turn: float) -> Iterator[None]:
        """Frame ``entries`` in, pausing (a yield) whenever ``turn`` seconds of this
        thread's CPU have gone since the last pause."""
        turn_ends = time.thread_time() + turn
        for entry in entries:
            self.add(entry)
            if time.thread_time() >= turn_ends:
                yield
                turn_ends = time.thread_time() + turn

    def done(self) -> list[bytes]:
        if self._batch:
            self.parts.append(b"".join(self._batch))
            self._batch, self._batched = [], 0
        return self.parts


class RecordFile:
    """Reads ``path`` into ``events``, ``incidents`` and ``repeats`` at start;
    writes what they keep as it changes. ``wall`` is the wall clock (an incident's
    window is on it); ``slack``, the growth allowed past twice the last whole
    write; ``turn``, the CPU seconds a whole write is framed for before other
    tasks run."""

    def __init__(
        self,
        path: str,
        events: EventLog,
        incidents: IncidentLog,
        *,
        repeats: Repeats | None = None,
        wall: Callable[[], float] = time.time,
        slack: int = _SLACK,
        turn: float = _TURN,
    ) -> None:
        self.path = path
        self._slack = slack
        self._turn = turn
        self._events = events
        self._incidents = incidents
        self._repeats = Repeats() if repeats is None else repeats
        self._wall = wall
        self._fd: int | None = None
        #: The number of the last event written.
        self._written = 0
        self._size = 0
        #: The size of the last whole write: the file is written whole again at
        #: twice it (and `_SLACK`).
        self._base = 0
        #: The next write writes the file whole (a write failed, or it was damaged).
        self._whole = True
        self._failing = False
        #: Set when a whole write, under way in a worker thread, has ended.
        self._replacing: trio.Event | None = None

    # Loading.

    def load(self) -> None:
        """Read the file back into the rings (before anything records an event:
        numbering goes on after the last one read). What could not be read is
        said by an event (`_report`)."""
        read = _Read()
        try:
            with open(open_regular(self.path), "rb") as file:
                # Record by record: what loading holds at once is one record.
                reading = _read(file, read)
        except FileNotFoundError:
            return
        except NotRegular as exc:
            # Never opened for reading nor appended to: the first write writes
            # it whole, by a rename over what is left if it cannot be moved.
            Aside().move(self.path, exc)
            return
        except OSError as exc:
            log.error(logfmt("record_unreadable", path=self.path, error=reason(exc)))
            return
        moved_to = ""
        if reading.problem is not None:
            moved_to = self.path + ".damaged"
            try:
                os.replace(self.path, moved_to)
            except OSError as exc:
                moved_to = f"nowhere ({reason(exc)})"
        elif reading.good < reading.size:
            # A write the daemon died in, or a file cut short: appending after it
            # would run records together, so the file ends before it.
            with contextlib.suppress(OSError):
                os.truncate(self.path, reading.good)
            self._whole = False
        else:
            self._whole = False
        self._size = self._base = reading.good
        self._events.restore(read.events)
        self._incidents.restore(list(read.incidents.values()), self._wall())
        self._repeats.restore(read.rows.values())
        self._written = self._events.last
        log.info(
            logfmt(
                "record",
                path=self.path,
                events=len(read.events),
                incidents=len(read.incidents),
                jobs=len(read.rows),
            )
        )
        self._report(reading, moved_to)

    def _report(self, reading: _Reading, moved_to: str) -> None:
        """Say what the file held that was not read back: an event of the daemon
        (``record_damaged``, ``record_cut``), and so its log line, written to the
        file with the rest."""
        if reading.first_lost < 0:
            return
        lost = f"{reading.size - reading.read} bytes, the first at byte {reading.first_lost}"
        if reading.skipped:
            lost += f", {reading.skipped} whole records among them"
        if reading.problem is None:
            kind = "record_cut"
            note = (
                f"{self.path} ended in a record cut short: {lost} dropped (a write "
                "the daemon died in, or a file cut short); the file now ends before it"
            )
        else:
            kind = "record_damaged"
            note = (
                f"{self.path} was damaged ({reading.problem}): {lost} dropped, "
                f"{reading.records} records read; the file was moved to {moved_to} "
                "and is written anew from what was read"
            )
        self._events.record_daemon(kind, note, pid=os.getpid(), time=self._wall())

    # Writing.

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(WRITE_INTERVAL if not self._failing else RETRY)
            if self._whole or self._outgrown():
                # Set first: an event appended while the whole file is framed would
                # be lost with the file it replaces (`through` waits instead).
                self._replacing = trio.Event()
                try:
                    entries, written = self._everything()
                    parts = _Parts()
                    for _ in parts.frame(entries, self._turn):
                        await trio.lowlevel.checkpoint()
                    if await trio.to_thread.run_sync(self._replace, parts.done()):
                        self._wrote_whole(parts.size, written)
                finally:
                    self._replacing.set()
                    self._replacing = None
            else:
                self._append()

    @property
    def written(self) -> int:
        """The number of the last event written."""
        return self._written

    async def through(self, seq: int) -> None:
        """Return once every event up to number ``seq`` is written, writing them
        now if need be: a reply that shows ``seq`` is sent after this, so that no
        number a client saw goes to another event after a crash. Returns at once
        while the disk refuses writes (numbers seen then may come again after a
        crash, as the events themselves are lost)."""
        while self._written < seq and not self._failing:
            if self._replacing is not None:
                # Appended to the file being replaced, they would be lost with it.
                await self._replacing.wait()
                continue
            self._append()
            return

    def write_now(self) -> None:
        """Write what changed, on the spot (the daemon stops)."""
        if self._whole or self._outgrown():
            entries, written = self._everything()
            parts = _Parts()
            for _ in parts.frame(entries, math.inf):  # the daemon stops: no turns
                pass
            if self._replace(parts.done()):
                self._wrote_whole(parts.size, written)
        else:
            self._append()

    def _outgrown(self) -> bool:
        return self._size > 2 * self._base + self._slack

    def close(self) -> None:
        if self._fd is not None:
            close(self._fd)
            self._fd = None

    def _append(self) -> None:
        # Nothing new, most turns: no walk of the rings then.
        fresh = self._events.last != self._written
        events = self._events.since(self._written) if fresh else []
        changed, dropped = self._incidents.changes.take()
        rows, gone = self._repeats.take()
        if not (events or changed or dropped or rows or gone):
            return
        entries: Iterable[_Entry] = (
            *(_Row(row) for row in rows),
            *(_RowDropped(uid, job) for uid, job in gone),
            *(_Event(event) for event in events),
            *(_Incident(incident) for incident in changed),
            *(_Dropped(incident_id) for incident_id in dropped),
        )
        data = b"".join(map(_frame, entries))
        try:
            if self._fd is None:
                self._fd = self._open_append()
            write_all(self._fd, data)
            lost = os.fstat(self._fd).st_nlink == 0
        except OSError as exc:
            self._failed(exc)
            return
        if events:
            self._written = events[-1].seq
        self._size += len(data)
        if lost:
            # Deleted under the daemon (its directory removed): what it holds is
            # written whole again, where the store makes the directory anew.
            self._whole = True
            close(self._fd)
            self._fd = None
            return
        self._recovered()

    def _everything(self) -> tuple[list[_Entry], int]:
        """What the whole file holds if it is written now (copies of the records
        as they are now: framing them may take many turns), and the last event in
        it."""
        self._incidents.changes.take()  # all of them are in it
        self._repeats.take()
        events = self._events.since(0)
        entries: list[_Entry] = [
            _Header(SCHEMA),
            # First, and never left off: what stops a hang that repeats.
            *(_Row(row) for row in self._repeats.everything()),
            *(_Event(event) for event in events),
            *(_Incident(incident) for incident in self._incidents.everything()),
        ]
        return entries, self._events.last

    def _replace(self, parts: list[bytes]) -> bool:
        """Write ``parts`` as the whole file (possibly in a worker thread)."""
        try:
            replace_file(self.path, parts)
        except OSError as exc:
            self._failed(exc)
            return False
        return True

    def _wrote_whole(self, size: int, written: int) -> None:
        if self._fd is not None:
            close(self._fd)  # of the file replaced
            self._fd = None
        self._written = written
        self._size = self._base = size
        self._whole = False
        self._recovered()

    def _open_append(self) -> int:
        try:
            fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except NotRegular as exc:
            # A failed write: the next one writes the file whole, renamed over it.
            raise OSError(errno.EINVAL, f"{self.path} is {exc}") from None
        if os.fstat(fd).st_size == 0:
            try:
                write_all(fd, _frame(_Header(SCHEMA)))
            except OSError:
                close(fd)
                raise
        return fd

    def _failed(self, exc: OSError) -> None:
        self._whole = True  # what this write held is written with the rest
        if not self._failing:
            self._failing = True
            log.warning(
                logfmt(
                    "record_write_failed",
                    path=self.path,
                    error=reason(exc),
                    note=f"kept in memory; tried again every {RETRY:g} s",
                )
            )

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.info(logfmt("record_written", path=self.path))


class _Reading(msgspec.Struct):
    """What reading the file found: ``size`` bytes, ``read`` of them read back
    in ``records`` records, which end at byte ``good`` (where an append goes
    on); ``skipped`` damaged records jumped over; the first byte not read back
    (``first_lost``, -1: none); and the first damage (None: none, though the
    end may have been cut short)."""

    size: int
    good: int = 0
    read: int = 0
    records: int = 0
    skipped: int = 0
    first_lost: int = -1
    problem: str | None = None

    def lost(self, offset: int, problem: str | None) -> None:
        """The bytes from ``offset`` are not read back, for ``problem``."""
        if self.first_lost < 0:
            self.first_lost = offset
        if self.problem is None:
            self.problem = problem


class _Read:
    """What the records read say: the events, the incidents and the jobs' rows."""

    def __init__(self) -> None:
        self.events: list[EventInfo] = []
        self.incidents: dict[str, StoredIncident] = {}
        self.rows: dict[JobKey, JobRow] = {}


def _read(file: BinaryIO, read: _Read) -> _Reading:
    """Read the records of ``file`` into ``read``; what was read and what was not.

    A record whose content does not decode, or whose checksum fails where its
    length leads to a whole record (or to the end of the file), is jumped over:
    a flipped byte costs that record alone. A length that leads nowhere, or a
    schema this daemon does not read, ends the reading there."""
    reading = _Reading(size=os.fstat(file.fileno()).st_size)
    offset = 0
    while offset < reading.size:
        frame = _frame_at(file, offset)
        if isinstance(frame, str):
            reading.lost(offset, frame or None)
            break
        length, checksum, payload = frame
        following = offset + RECORD.size + length
        if zlib.crc32(payload) != checksum:
            reading.lost(offset, f"bad checksum in the record at byte {offset}")
            if not _whole_at(file, following, reading.size):
                break
            file.seek(following)
            reading.skipped += 1
        elif (problem := _entry(payload, offset, read)) is not None:
            reading.lost(offset, problem)
            if problem.startswith("schema"):
                break
            reading.skipped += 1
        else:
            reading.records += 1
            reading.read += following - offset
            reading.good = following
        offset = following
    return reading


def _frame_at(file: BinaryIO, offset: int) -> tuple[int, int, bytes] | str:
    """The record at ``offset`` (``file`` is there): its length, its checksum
    and its payload; or why there is none: damage, or "" for a record cut short
    by the end of the file."""
    header = file.read(RECORD.size)
    if len(header) < RECORD.size:
        return ""
    length, checksum = RECORD.unpack(header)
    if length > _MAX_RECORD:
        return f"a record of {length} bytes at byte {offset}"
    payload = file.read(length)
    if len(payload) < length:
        return ""
    return length, checksum, payload


def _whole_at(file: BinaryIO, offset: int, size: int) -> bool:
    """Whether a whole record, its checksum good, starts at ``offset`` (or the
    file ends there)."""
    if offset == size:
        return True
    if offset > size:
        return False
    file.seek(offset)
    frame = _frame_at(file, offset)
    return not isinstance(frame, str) and zlib.crc32(frame[2]) == frame[1]


def _entry(payload: bytes, offset: int, read: _Read) -> str | None:
    """Read one record's ``payload`` (its checksum good) into ``read``; what is
    wrong with it, if anything."""
    try:
        entry = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"unreadable record at byte {offset}: {exc}"
    match entry:
        case _Header(schema=schema) if schema != SCHEMA:
            return f"schema {schema}, this daemon reads {SCHEMA}"
        case _Header():
            pass
        case _Event(event=event):
            read.events.append(event)
        case _Incident(incident=incident):
            read.incidents[incident.info.id] = incident
        case _Dropped(id=incident_id):
            read.incidents.pop(incident_id, None)
        case _Row(row=row):
            read.rows.pop(row.key, None)  # the order written is the order kept
            read.rows[row.key] = row
        case _RowDropped(uid=uid, job=job):
            read.rows.pop((uid, job), None)
    return None
