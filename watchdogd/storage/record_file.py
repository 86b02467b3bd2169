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
  changed is written within `WRITE_INTERVAL` of the change, in one ``writev(2)``,
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
  again, to a new file renamed over it: a crash leaves the old or the new. Neither
  kind of write holds a second copy of what it writes: an append is its records'
  frames in one writev(2), a whole write goes out a part at a time as it is
  framed (`watchdogd.storage.whole_record`).
- Bounded in bytes, and never in the room the timers' state needs: the file
  holds at most its ``bound`` (the config's ``record_bytes``), and at most half
  the room its disk has beyond what the state wants left free (``reserve``,
  `watchdogd.storage.room.Room.wanted`), so that a whole write fits beside
  the file it replaces. What would pass that is not appended; the next whole
  write (at most every `RETRY` while it must leave things out) fits half of it:
  stacks cut to their main thread first, other users' before root's and the
  oldest first, then whole records by the same order, never the newest event
  (numbering goes on from it). What it left off is logged, and shown as the
  ``watchdogd_record_left_off_bytes`` metric; memory keeps it all.
- The timers' state is written first: nothing is written here while it cannot
  be written (``state_failing``), and when it finds its disk full, this file
  gives its room back at once (`give_way`: it is removed, its records kept in
  memory and written whole again, within the room left, once the state is); a
  whole write under way then stops at its next part, its new file emptied at
  once (it holds the file open: removed alone, its room would stay taken until
  that write ended) and never renamed into place.
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
  the file was deleted under the daemon (its directory removed), open or not.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import time
from collections.abc import Callable
from typing import Final

import trio

from ..core import Counters, EventLog, IncidentLog, Repeats, StoredIncident
from ..logs import log, logfmt
from .faults import Aside, NotRegular, reason
from .files import NewFile, open_regular, removed_now
from .journal import close, write_all, write_parts
from .record_entries import (
    SCHEMA,
    DroppedRecord,
    Entry,
    EventRecord,
    Header,
    IncidentRecord,
    Read,
    Reading,
    RowDroppedRecord,
    RowRecord,
    framed,
    read_records,
)
from .whole_record import StartOver, WholeWrite

#: Seconds between a change and its write, at most (changes of one interval share
#: one write: an incident whose ranks report one by one is not written per rank).
WRITE_INTERVAL: Final = 0.1
#: Seconds between tries of a disk that refused a write.
RETRY: Final = 1.0
#: Growth allowed past twice the size of the last whole write.
_SLACK: Final = 4 * 1024 * 1024
#: A whole write is framed in the loop's turns, each this long at most (CPU
#: seconds): the file may hold hundreds of MiB of stacks, and a due timer's signal
#: waits for the turn in progress.
_TURN: Final = 0.002
#: The config's ``record_bytes`` default: the most the file takes on disk.
RECORD_BYTES: Final = 256 * 1024 * 1024


def record_path(state_path: str) -> str:
    return state_path + ".record"


class RecordFile:
    """Reads ``path`` into ``events``, ``incidents`` and ``repeats`` at start;
    writes what they keep as it changes. ``wall`` is the wall clock (an incident's window is on it);
    ``slack``, the growth allowed past twice the last whole write; ``turn``, the
    CPU seconds a whole write is framed for before other tasks run. ``bound`` is
    the most the file may take (the config's ``record_bytes``, read at each
    write), ``reserve`` the bytes of its disk the state wants left free, and
    ``state_failing`` whether the state cannot be written now; ``metrics`` shows
    what the file leaves off."""

    def __init__(
        self,
        path: str,
        events: EventLog,
        incidents: IncidentLog,
        *,
        wall: Callable[[], float] = time.time,
        slack: int = _SLACK,
        turn: float = _TURN,
        bound: Callable[[], int] = lambda: RECORD_BYTES,
        reserve: Callable[[], int] = lambda: 0,
        state_failing: Callable[[], bool] = lambda: False,
        metrics: Counters | None = None,
        repeats: Repeats | None = None,
    ) -> None:
        self.path = path
        self._slack = slack
        self._turn = turn
        self._bound = bound
        self._reserve = reserve
        self._state_failing = state_failing
        self._metrics = Counters() if metrics is None else metrics
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
        #: Times it gave way (`give_way`): a whole write stops when it changes.
        self._gave_way = 0
        #: Set when a whole write, under way in a worker thread, has ended.
        self._replacing: trio.Event | None = None
        #: No whole write before this (monotonic): the last one left records off.
        self._next_whole = 0.0
        #: The last whole write found no room for the file.
        self._roomless = False

    # Loading.

    def load(self) -> None:
        """Read the file back into the rings (before anything records an event:
        numbering goes on after the last one read). What could not be read is
        said by an event (`_report`)."""
        read = Read()
        try:
            with open(open_regular(self.path), "rb") as file:
                # Record by record: what loading holds at once is one record.
                reading = read_records(file, read)
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

    def _report(self, reading: Reading, moved_to: str) -> None:
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
            if self._state_failing():
                continue  # the state's own full write has the disk's room first
            if self._whole_due():
                await self._write_whole()
            else:
                self._append()

    async def _write_whole(self) -> None:
        """Write the file whole, framed in turns, each part written in a worker
        thread as it is framed (`watchdogd.storage.whole_record`)."""
        # Set first: an event appended while the whole file is framed would be
        # lost with the file it replaces (`through` waits instead).
        self._replacing = trio.Event()
        given = self._gave_way
        try:
            whole = self._everything()
            if whole.target <= 0:
                self._no_room()
                return
            new = NewFile(self.path)
            try:
                await trio.to_thread.run_sync(new.open)
                for step in whole.framed(self._turn):
                    if self._gave_way != given:
                        return
                    if step is None:
                        await trio.lowlevel.checkpoint()
                    else:
                        await trio.to_thread.run_sync(_carry_out, new, step)
                if self._gave_way == given:
                    await trio.to_thread.run_sync(new.commit)
            except OSError as exc:
                if self._gave_way == given:  # else its file went from under it
                    self._failed(exc)
                return
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(new.discard)
            if self._gave_way != given:
                # The state asked for the room while the new file was renamed
                # into place: it goes as the old one did.
                self.give_way()
                return
            self._wrote_whole(whole)
        finally:
            self._replacing.set()
            self._replacing = None

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
        while self._written < seq and not self._failing and not self._state_failing():
            if self._replacing is not None:
                # Appended to the file being replaced, they would be lost with it.
                await self._replacing.wait()
                continue
            self._append()
            return

    def write_now(self) -> None:
        """Write what changed, on the spot (the daemon stops)."""
        if self._state_failing():
            return
        if not (self._whole or self._outgrown(self._cap())):
            self._append()
            if not self._whole:
                return  # else what changed did not fit: the file is written whole
        whole = self._everything()
        if whole.target <= 0:
            self._no_room()
            return
        new = NewFile(self.path)
        try:
            new.open()
            for step in whole.framed(math.inf):  # the daemon stops: no turns
                if step is not None:
                    _carry_out(new, step)
            new.commit()
        except OSError as exc:
            self._failed(exc)
            return
        finally:
            new.discard()
        self._wrote_whole(whole)

    def _whole_due(self) -> bool:
        """Whether the file is to be written whole now: it must be (a write
        failed, it was damaged or gave way), or it outgrew its bounds; not
        sooner than `RETRY` after a whole write that left records off."""
        if time.monotonic() < self._next_whole:
            return False
        return self._whole or self._outgrown(self._cap())

    def _outgrown(self, cap: int) -> bool:
        return self._size > min(2 * self._base + self._slack, cap)

    def _room(self) -> int | None:
        """What the file may take of its disk in all: what is free and what it
        holds, less what the state wants left free (None: the disk says nothing)."""
        try:
            disk = os.statvfs(os.path.dirname(self.path) or ".")
        except OSError:
            return None
        return disk.f_bavail * disk.f_frsize + self._size - self._reserve()

    def _cap(self) -> int:
        """The most the file may hold now: its bound, and half its room: half, so
        that a whole write fits beside the file it replaces."""
        room = self._room()
        return self._bound() if room is None else max(0, min(self._bound(), room // 2))

    def _target(self) -> int:
        """What a whole write may hold: half of `_cap`, so that the file may grow
        before the next, and no more than the room beside the file it replaces."""
        room = self._room()
        if room is None:
            return self._bound() // 2
        return min(min(self._bound(), room // 2) // 2, room - self._size)

    def _no_room(self) -> None:
        """No room beside the file for a whole write, beyond what the state wants:
        the file gives way (its records stay in memory) until there is."""
        self._next_whole = time.monotonic() + RETRY
        if not self.give_way() and not self._roomless:
            log.warning(
                logfmt(
                    "record_not_written",
                    path=self.path,
                    note="no room beyond what the timers' state needs; kept in memory",
                )
            )
        self._roomless = True

    def give_way(self) -> bool:
        """The state found its disk full: this file goes, so that the state is
        written (its records stay in memory, and are written whole, within the
        room left, once the state is written again). Whether it freed anything."""
        # A whole write under way stops at its next part (`_write_whole`); the
        # new file it holds open gives its room back now (`removed_now`).
        self._gave_way += 1
        freed = removed_now(self.path) + removed_now(self.path + ".new")
        self.close()
        self._whole = True
        self._size = self._base = 0
        if freed:
            self._metrics.record_left_off += freed
            log.warning(
                logfmt(
                    "record_dropped",
                    path=self.path,
                    bytes=freed,
                    note="the timers' state needed the room; kept in memory",
                )
            )
        return freed > 0

    def close(self) -> None:
        if self._fd is not None:
            close(self._fd)
            self._fd = None

    def _append(self) -> None:
        if self._state_failing():
            return
        # Nothing new, most turns: no walk of the rings then.
        fresh = self._events.last != self._written
        events = self._events.since(self._written) if fresh else []
        changed, dropped = self._incidents.changes.take()
        rows, gone = self._repeats.take()
        if not (events or changed or dropped or rows or gone):
            return
        # The rows first, with the events: what stops a hang that repeats, and
        # what a reply shows.
        first: list[Entry] = [
            *(RowRecord(row) for row in rows),
            *(RowDroppedRecord(uid, job) for uid, job in gone),
            *(EventRecord(event) for event in events),
        ]
        data = self._fitting(first, changed, dropped)
        if not data:
            return
        try:
            if self._fd is None:
                self._fd = self._open_append()
                if self._fd is None:
                    return
            write_parts(self._fd, data)
            lost = os.fstat(self._fd).st_nlink == 0
        except OSError as exc:
            self._failed(exc)
            return
        if events:
            self._written = events[-1].seq
        self._size += sum(map(len, data))
        if lost:
            # Deleted under the daemon (its directory removed): what it holds is
            # written whole again, where the store makes the directory anew.
            self._whole = True
            close(self._fd)
            self._fd = None
            return
        self._recovered()

    def _fitting(
        self, first: list[Entry], changed: list[StoredIncident], dropped: list[str]
    ) -> list[bytearray]:
        """What an append writes: the frames of ``first`` and of the incidents
        ``changed`` and ``dropped``; of ``first`` alone when those pass the
        file's bound or room (the next whole write fits them), or nothing when
        ``first`` does too. Frames, not a copy of them joined: the changes of an
        incident are megabytes of stacks, and one writev(2) writes them as one
        write."""
        news = [framed(entry) for entry in first]
        cap = self._cap()
        # Stacks are the bulk of an incident: one that plainly does not fit is
        # not framed (megabytes, on the loop) to find it out.
        stacks = sum(len(rank.stack) for incident in changed for rank in incident.ranks)
        size = self._size + sum(map(len, news))
        if size + stacks <= cap:
            data = [
                *news,
                *(framed(IncidentRecord(incident)) for incident in changed),
                *(framed(DroppedRecord(incident_id)) for incident_id in dropped),
            ]
            if self._size + sum(map(len, data)) <= cap:
                return data
        self._whole = True
        # The events go now if they fit, the numbers a reply shows among them.
        return news if first and size <= cap else []

    def _everything(self) -> WholeWrite:
        """The whole file if it is written now (copies of the records as they are
        now: framing them may take many turns), to fit half of what it may hold."""
        self._incidents.changes.take()  # all of them are in it
        self._repeats.take()
        events = self._events.since(0)
        entries: list[Entry] = [
            Header(SCHEMA),
            # First, and never left off: what stops a hang that repeats.
            *(RowRecord(row) for row in self._repeats.everything()),
            *(EventRecord(event) for event in events),
            *(IncidentRecord(incident) for incident in self._incidents.everything()),
        ]
        return WholeWrite(entries, self._events.last, self._target())

    def _wrote_whole(self, whole: WholeWrite) -> None:
        if self._fd is not None:
            close(self._fd)  # of the file replaced
            self._fd = None
        self._written = whole.written
        self._size = self._base = whole.size
        self._whole = self._roomless = False
        self._recovered()
        was, self._metrics.record_left_off = self._metrics.record_left_off, whole.left
        self._next_whole = time.monotonic() + RETRY if whole.left else 0.0
        if whole.left and not was:
            log.warning(
                logfmt(
                    "record_trimmed",
                    path=self.path,
                    kept=whole.size,
                    left_off=whole.left,
                    note="within record_bytes and the room the state leaves; kept in memory",
                )
            )
        elif was and not whole.left:
            log.info(logfmt("record_whole", path=self.path, bytes=whole.size))

    def _open_append(self) -> int | None:
        """The file, opened to append to; None if it is new where the one written
        held records (deleted while closed: it is written whole, not only what follows)."""
        try:
            fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except NotRegular as exc:
            # A failed write: the next one writes the file whole, renamed over it.
            raise OSError(errno.EINVAL, f"{self.path} is {exc}") from None
        if os.fstat(fd).st_size == 0:
            if self._size > 0:
                close(fd)
                self._whole = True
                return None
            try:
                write_all(fd, framed(Header(SCHEMA)))
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


def _carry_out(new: NewFile, step: bytes | bytearray | StartOver) -> None:
    """A step of a whole write (`watchdogd.storage.whole_record.Step`) on ``new``."""
    if isinstance(step, StartOver):
        new.start_over()
    else:
        new.write(step)
