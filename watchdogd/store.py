"""Durable timers: every acknowledged change survives a crash of the daemon, and a
failing disk never stops it.

Two kinds of file, side by side: a SQLite database (``state.db``) holding the timers
as they were at its last update, and append-only journals (``state.db.journal.N``)
of every change since. A commit is one ``write(2)`` of a checksummed record to the
current journal: a few microseconds, where a SQLite commit costs tens. When the
journal grows past a bound, a background task writes its changes into the database
in a worker thread and starts a new journal. Nothing is fsynced: what was written is
in the kernel's page cache, which survives the daemon being killed at any instant (a
reboot does not matter: pids do not survive it either, and state from another boot
is discarded).

A record is a timer (`watchdogd.timers.Timer`, the one shape of a timer in memory,
in the journal and in the database) or the removal of one, under its store key
``(pid, scope, firing)``: an armed timer, and one whose policy is in progress.
Schema 4 stores a `Timer` as the array of its fields, ``deadline`` and ``seq``
first, a firing timer's progress through its policy (`Run`) and what only some
timers keep (`Watch`) each an array of their own in the last two.

Invariants:

- A change is recorded the moment the in-memory state changes. Changes to one key
  collapse: only the latest state of a key is written.
- `Store.commit` returns whether every change up to a generation is written: a
  request's reply is sent after it, and says so when it is not (the daemon is
  degraded). One write serves every request of a turn of the event loop (group
  commit); changes no reply waits for are written soon after by a background task.
- Exactly one descriptor of a journal is open, owned here; the next journal is
  opened before the previous one is closed, and a number is never kept once closed.
  Journals are started only by a fold or a recovery, so at most a few ever exist.
- A write that fails (ENOSPC, EDQUOT, no inodes, EIO, a read-only file system) puts
  the store in the degraded state: it says so once (``on_degraded``), stops writing
  changes one by one, and retries with backoff. A retry writes the whole current
  state (``snapshot``) to a new journal headed by a reset record, removes the older
  journals it supersedes, and clears the degraded state. Memory stays bounded while
  degraded: nothing is queued but the need for that one full write.
- Loading reads the database, then replays every journal in order. A record cut
  short at the end of a journal (a write the daemon died in, never acknowledged)
  ends that journal. A damaged record (a bad checksum or undecodable content in a
  complete record) is corruption: the good prefix is kept and the journal is moved
  aside, never deleted, with an ERROR naming where. A database SQLite calls corrupt
  (SQLITE_CORRUPT, SQLITE_NOTADB) or of an unknown schema is moved aside likewise.
  Anything else that fails at start (a full or read-only disk) starts the daemon
  degraded with everything it could read.
- Deadlines are stored on CLOCK_MONOTONIC, which keeps running while the daemon is
  down, so its downtime counts against them.
- Loaded timers share their repeated values (`_share_values`): a restarted daemon
  holds its timers in as little memory as one that armed them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import itertools
import math
import operator
import os
import sqlite3
import struct
import time
import urllib.parse
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final, Literal

import msgspec
import trio

from .core.timers import StoreKey, Timer
from .errors import DaemonError
from .logs import log, logfmt

SCHEMA: Final = 4
#: A journal this large is folded into the database and a new one started.
JOURNAL_BYTES: Final = 8 * 1024 * 1024
#: Retries of a failing disk wait this long at first, doubling up to the maximum.
RETRY_FIRST: Final = 0.1
RETRY_MAX: Final = 10.0
_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"
_INSERT: Final = "INSERT OR REPLACE INTO timers VALUES (?, ?, ?, ?)"
_DELETE: Final = "DELETE FROM timers WHERE pid = ? AND scope = ? AND firing = ?"
#: A journal record: payload length and CRC-32, then the msgpack payload.
_RECORD: Final = struct.Struct(">II")
#: No record is larger (the full state of the largest table is far smaller): a
#: header declaring more is damage, not a write cut short.
_MAX_RECORD: Final = 1 << 30
#: SQLite's primary result codes that mean the file itself is damaged.
_CORRUPT_CODES: Final = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB
#: Records read from the database and decoded at a time: the copies of repeated
#: values that one batch frees are reused by the next (`_share_values`), and a
#: batch's records stay in the CPU's caches through the passes over them (in
#: batches of 65,536 they did not, and sharing took 1.6 s for a million).
_LOAD_BATCH: Final = 1024

Changes = dict[StoreKey, Timer | None]
#: What a database read at start is: of this boot ("current"); absent, new or moved
#: aside ("none": the journals hold everything since); or written in another boot.
DatabaseKind = Literal["current", "none", "other_boot"]


class StateError(DaemonError):
    """Raised at start when another running daemon holds the state file. (A file
    that is damaged is moved aside, and a disk that fails starts the daemon
    degraded, instead.)"""


class _Corrupt(Exception):
    """A state file that is damaged, not merely unwritable."""


class Record(msgspec.Struct, array_like=True):
    """One journal record: ``reset`` says the state is exactly what follows (a full
    write after a failure); ``puts`` and ``drops`` are changes. The first record
    of every journal names the ``boot`` it was written in: a journal of another
    boot is never replayed (its pids and start times mean nothing now)."""

    reset: bool = False
    puts: list[Timer] = []
    drops: list[StoreKey] = []
    boot: str = ""


#: The header of a record of changes alone (no reset, no boot).
_CHANGES: Final = Record()


_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(Record)
_timers_decoder = msgspec.msgpack.Decoder(list[Timer])


class Loaded(msgspec.Struct):
    """What `Store.open` read: every timer it found, and what it moved aside."""

    timers: list[Timer]
    moved_aside: list[str]


class Store:
    """The state files, the journal writer, and the folding of journals into the
    database. Construct with `Store.open`.

    ``snapshot`` (set by the daemon) returns every timer the state must hold, for
    the full write that ends a degraded period; ``on_degraded(degraded, reason)``
    is called when the store enters and leaves it.
    """

    def __init__(self, path: str, journal_bytes: int = JOURNAL_BYTES) -> None:
        self.path = path
        self._journal_bytes = journal_bytes
        self._db: sqlite3.Connection | None = None
        self._fd: int | None = None
        self._lock_fd: int | None = None
        #: The database exists but could not be read at start: never written over.
        self._db_unread = False
        #: A fold failed: the next one writes the whole state, from ``snapshot``.
        self._rebuild = False
        self._number = 0
        self._written = 0
        self._pending: Changes = {}
        #: Changes in journals the database does not hold yet; with
        #: ``_unfolded_reset``, the whole state the database must become.
        self._unfolded: Changes = {}
        self._unfolded_reset = False
        #: Damaged files that could not be moved aside yet: never removed.
        self._damaged: list[str] = []
        self._folding = False
        #: A fold is due though the journal is not full (after a start or recovery).
        self._fold_wanted = False
        self._fold_retry_at = 0.0
        self.generation = 0
        self._durable = 0
        self._wakeup = trio.Event()
        self.errors = 0
        self.degraded = False
        self.degraded_reason = ""
        self._retry_at = 0.0
        self._backoff = RETRY_FIRST
        #: One object per repeated value among the timers loaded (`_share_values`),
        #: from the database and the journals alike; emptied once loaded.
        self._shared: _Shared = {}
        self.snapshot: Callable[[], Iterable[Timer]] = list
        self.on_degraded: Callable[[bool, str], object] = lambda degraded, reason: None

    # Opening and loading.

    @classmethod
    def open(cls, path: str, journal_bytes: int = JOURNAL_BYTES) -> tuple[Store, Loaded]:
        """Open (or create) the state and read its timers.

        Raises `StateError` only when another daemon holds the file. A damaged file
        is moved aside (logged at ERROR with where it went); a file system that
        refuses writes leaves the store degraded, holding what could be read. The
        database is not written here: the journals read are folded into it by the
        background task, so a start costs one read of the state."""
        store = cls(path, journal_bytes)
        moved: list[str] = []
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        stored, kind = store._read_database(moved)
        changes, reset = store._replay_journals(moved)
        if kind == "current" and not reset:
            # The common start: the journals' changes over the database's timers,
            # without a dictionary of a million of them.
            if changes:
                stored = [t for t in stored if (t.pid, t.scope, t.firing) not in changes]
                stored += [timer for timer in changes.values() if timer is not None]
            store._unfolded = changes
            store._start_journal(None)
            store._shared = {}
            return store, Loaded(timers=stored, moved_aside=moved)
        state: Changes = {} if reset else {timer.store_key: timer for timer in stored}
        state.update(changes)
        timers = {key: timer for key, timer in state.items() if timer is not None}
        # The database must be rewritten whole by the first fold.
        store._unfolded, store._unfolded_reset = dict(timers), True
        # The journals must no longer be replayed over what the database holds
        # (another boot's state): this run's first journal starts with the whole
        # state, which supersedes every older file.
        store._start_journal(timers if kind == "other_boot" else None)
        store._shared = {}
        return store, Loaded(timers=list(timers.values()), moved_aside=moved)

    def _read_database(self, moved: list[str]) -> tuple[list[Timer], DatabaseKind]:
        """The timers in the database (none when there is none, or it was moved
        aside), and what the database is. Keeps the connection.

        A database SQLite cannot open for writing (a read-only disk) is read
        through an immutable connection; one that cannot be read at all, and is
        not damaged, is left as it is and never written over (`recover` keeps the
        store degraded): the next start reads it again."""
        existed = os.path.exists(self.path)
        if not self._lock():
            self._db_unread = existed
            return [], "none"
        try:
            db = _connect(self.path)
            try:
                stored, boot = _read_timers(db, self._shared)
            except BaseException:
                db.close()
                raise
        except (sqlite3.Error, _Corrupt) as exc:
            if isinstance(exc, _Corrupt) or _code(exc) in _CORRUPT_CODES:
                self._move_database_aside(str(exc), moved)
                return [], "none"
            self._enter_degraded(_reason(exc))
            try:
                stored, boot = _read_immutable(self.path, self._shared)
            except (sqlite3.Error, _Corrupt) as again:
                log.error(logfmt("state_unread", path=self.path, error=_reason(again)))
                self._db_unread = True
                return [], "none"
        else:
            self._db = db
        if boot is None:
            return stored, "none"
        if boot != _boot_id():
            log.info(logfmt("state_from_another_boot", path=self.path, discarded=len(stored)))
            return [], "other_boot"
        return stored, "current"

    def _move_database_aside(self, why: str, moved: list[str]) -> None:
        # SQLite's own files go with it: a rollback journal left beside a new,
        # empty database would be played back into it.
        for name in (self.path, f"{self.path}-wal", f"{self.path}-shm", f"{self.path}-journal"):
            if os.path.exists(name):
                self._move_aside(name, why, moved)
        self._lock()  # a new file in its place

    def _lock(self) -> bool:
        """Create the database file if need be (0600, before SQLite sees it; its
        -wal and -shm files follow) and hold an exclusive lock on it for the
        store's life, so that a second daemon on the same state is refused even
        when nothing can be written. Returns whether the file is there."""
        if self._lock_fd is not None:
            _close(self._lock_fd)
            self._lock_fd = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)  # a read-only disk
            except OSError:
                self._enter_degraded(_reason(exc))
                return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _close(fd)
            raise StateError(
                f"{self.path} is in use by another watchdogd; give each daemon its own "
                "state file (--state) or stop the other one"
            ) from None
        self._lock_fd = fd
        return True

    def _replay_journals(self, moved: list[str]) -> tuple[Changes, bool]:
        """The changes the journals record, in order, and whether one of them
        starts over from a reset record."""
        changes: Changes = {}
        reset = False
        journals = _journals(self.path)
        for journal in journals:
            try:
                with open(journal, "rb") as source:
                    data = source.read()
            except OSError as exc:
                # Unreadable is not proof of damage: it is kept for the next start.
                self._enter_degraded(_reason(exc))
                self._damaged.append(journal)
                continue
            for index, record in enumerate(_records(data, newest=journal == journals[-1])):
                if isinstance(record, str):
                    self._move_aside(journal, record, moved)
                    break
                if index == 0 and record.boot not in ("", _boot_id()):
                    log.info(logfmt("state_from_another_boot", path=journal))
                    break
                if record.reset:
                    changes, reset = {}, True
                _share_values(record.puts, self._shared)
                for timer in record.puts:
                    changes[timer.store_key] = timer
                for pid, scope, firing in record.drops:
                    changes[(pid, scope, firing)] = None
        self._number = max(map(_journal_number, journals), default=0)
        return changes, reset

    def _start_journal(self, full_state: Mapping[StoreKey, Timer | None] | None) -> None:
        """Open the first journal of this run, after any left by an earlier one.
        Its first record (a reset record holding ``full_state``, or an empty one)
        is written at once, which shows at start whether the disk takes writes."""
        if self.degraded:
            return  # a recovery starts one, headed by the full state
        number = self._number + 1
        if full_state is None:
            fd = self._new_journal(number, Record(), {})
        else:
            fd = self._new_journal(number, Record(reset=True), full_state)
        if fd is None:
            return
        if full_state is not None:
            self._remove_journals(self._journals_before(number))
        self._fd, self._number = fd, number
        if self._unfolded or self._unfolded_reset or self._journals_before(number):
            self._fold_wanted = True
            self._wakeup.set()

    def _new_journal(
        self,
        number: int,
        first: Record,
        changes: Mapping[StoreKey, Timer | None],
        *,
        degrade: bool = True,
    ) -> int | None:
        """Create journal ``number`` and write its first record (``first``, with
        ``changes`` and this boot); None, with nothing left behind, if it fails."""
        record = _encode(msgspec.structs.replace(first, boot=_boot_id()), changes)
        fd = self._open_journal(number, degrade=degrade)
        if fd is None:
            return None
        try:
            _write_all(fd, record)
        except OSError as exc:
            _close(fd)
            with contextlib.suppress(OSError):
                os.unlink(_journal_path(self.path, number))
            if degrade:
                self._enter_degraded(_reason(exc))
            return None
        self._written = len(record)
        return fd

    # The hot path.

    def put(self, timer: Timer) -> None:
        """``timer`` is armed (new or re-armed), or its policy moved on a step."""
        if not self.degraded:
            self._pending[timer.store_key] = timer
        self.generation += 1

    def drop(self, timer: Timer) -> None:
        """``timer`` is gone: released, its process exited, or its policy ended."""
        if not self.degraded:
            self._pending[timer.store_key] = None
        self.generation += 1

    def commit(self, generation: int) -> bool:
        """Write what is pending; returns whether every change up to
        ``generation`` is in the state (False while degraded). Synchronous: a
        reply's commit is one write(2), with no turn of the event loop."""
        if self._durable < generation and not self.degraded:
            self._append_pending()
        return self._durable >= generation

    def commit_soon(self) -> None:
        """Have what is pending written soon, though no reply waits for it."""
        self._wakeup.set()

    def _append_pending(self) -> None:
        batch, self._pending = self._pending, {}
        generation = self.generation
        if batch:
            record = _encode(_CHANGES, batch)
            try:
                _write_all(self._fd, record)
            except OSError as exc:
                self._enter_degraded(_reason(exc))
                return
            self._written += len(record)
            if not self._rebuild:
                self._unfolded.update(batch)
            if self._written >= self._journal_bytes:
                self._wakeup.set()
        self._durable = generation

    # The background task.

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the changes no reply waits for, retry a failing disk with backoff,
        and fold full journals into the database. It waits for work or for the
        next retry, never in a sleep that a commit cannot cut short."""
        task_status.started()
        while True:
            if self.degraded:
                retry = self._retry_at
            elif self._fold_wanted:
                retry = self._fold_retry_at
            else:
                retry = math.inf  # nothing to retry: wait for work
            with trio.move_on_after(max(0.0, retry - time.monotonic())):
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            if self.degraded:
                if time.monotonic() >= self._retry_at:
                    self.recover()
                continue
            self._append_pending()
            if self._rebuild and self._written >= 4 * self._journal_bytes:
                self._rebase()  # the database refuses folds: keep the journals bounded
            if (
                (self._fold_wanted or self._written >= self._journal_bytes)
                and not self._folding
                and time.monotonic() >= self._fold_retry_at
            ):
                await self._fold()

    def recover(self) -> bool:
        """Try once to end the degraded state: write the whole current state to a
        new journal headed by a reset record. Returns whether the store is well."""
        if not self.degraded:
            return True
        if self._db_unread:
            return self._schedule_retry()  # writing over it would lose its timers
        if self._lock_fd is None:
            try:
                if not self._lock():
                    return self._schedule_retry()
            except StateError as exc:
                self.degraded_reason = str(exc)
                return self._schedule_retry()
        self._move_damaged_aside()
        if not self._rebase():
            return self._schedule_retry()
        self.degraded = False
        self._backoff = RETRY_FIRST
        self.on_degraded(False, "")
        return True

    def _rebase(self) -> bool:
        """Write the whole current state to a new journal headed by a reset record,
        and remove every older journal, which it supersedes."""
        number = self._number + 1
        generation = self.generation
        timers: Changes = {timer.store_key: timer for timer in self.snapshot()}
        fd = self._new_journal(number, Record(reset=True), timers, degrade=False)
        if fd is None:
            self.errors += 1
            return False
        if self._fd is not None:
            _close(self._fd)
        self._fd, self._number = fd, number
        self._remove_journals(self._journals_before(number))
        self._pending = {}
        self._durable = generation
        self._unfolded, self._unfolded_reset, self._rebuild = timers, True, False
        self._fold_wanted = True
        self._fold_retry_at = 0.0
        return True

    def _schedule_retry(self) -> bool:
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RETRY_MAX)
        return False

    async def _fold(self) -> None:
        """Write what the journals hold into the database, then remove them.

        New changes go to a new journal meanwhile, unless an earlier fold failed
        and its journals are still there: then the current journal goes on, and
        only the older ones are removed (replaying a folded change again is
        harmless: the latest state of each key wins). A failure keeps the
        journals (they are replayed at the next start) and is retried later, with
        the whole state then taken from memory, so that nothing accumulates for
        it; a journal that grows meanwhile past four times its bound is replaced
        by one holding the whole state. So at most three journals exist, however
        long the database refuses writes."""
        self._folding = True
        self._fold_wanted = False
        try:
            finished = self._journals_before(self._number)
            if not finished:
                # No inode for a new journal is no failure: the current one goes on.
                fd = self._new_journal(self._number + 1, Record(), {}, degrade=False)
                if fd is None:
                    self._fold_retry_at = time.monotonic() + RETRY_MAX
                else:
                    assert self._fd is not None
                    _close(self._fd)
                    finished = self._journals_before(self._number + 1)
                    self._fd, self._number = fd, self._number + 1
            changes: Changes
            if self._rebuild:
                changes = {timer.store_key: timer for timer in self.snapshot()}
                reset = True
            else:
                changes, reset = self._unfolded, self._unfolded_reset
            self._unfolded, self._unfolded_reset, self._rebuild = {}, False, False
            try:
                await trio.to_thread.run_sync(self._write_database, changes, reset)
            except (sqlite3.Error, OSError, _Corrupt, StateError) as exc:
                self.errors += 1
                log.error(logfmt("state_fold_failed", path=self.path, error=_reason(exc)))
                self._unfolded, self._rebuild = {}, True
                self._fold_retry_at = time.monotonic() + RETRY_MAX
                self._fold_wanted = True
                return
            self._fold_retry_at = 0.0
            self._remove_journals(finished)
        finally:
            self._folding = False

    def _journals_before(self, number: int) -> list[str]:
        return [j for j in _journals(self.path) if _journal_number(j) < number]

    def _write_database(self, changes: Changes, reset: bool) -> None:
        """In a worker thread: apply a fold to the database, opening it if the
        daemon started without one."""
        if self._db is None:
            if self._lock_fd is None and not self._lock():
                raise OSError(errno.EIO, f"cannot create {self.path}")
            db = _connect(self.path)
            try:
                _read_timers(db)
            except BaseException:
                db.close()
                raise
            self._db = db
        if reset:
            timers = {key: timer for key, timer in changes.items() if timer is not None}
            _replace_all(self._db, timers, _boot_id())
        else:
            _apply(self._db, changes)
        # Into the database file itself before the journals go: a start on a
        # read-only disk reads the file alone (immutable), without the -wal.
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # Failure handling.

    def _enter_degraded(self, reason: str) -> None:
        self.errors += 1
        self._pending = {}
        if self.degraded:
            return
        self.degraded = True
        self.degraded_reason = reason
        self._schedule_retry()
        self.on_degraded(True, reason)  # said once, by the daemon: log, event, status
        self._wakeup.set()

    def _open_journal(self, number: int, *, degrade: bool = True) -> int | None:
        try:
            return os.open(
                _journal_path(self.path, number),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                0o600,
            )
        except OSError as exc:
            if not degrade:
                log.warning(logfmt("state_journal_not_started", path=self.path, error=_reason(exc)))
            elif self.degraded:
                self.errors += 1
                self.degraded_reason = _reason(exc)
            else:
                self._enter_degraded(_reason(exc))
            return None

    def _move_aside(self, name: str, why: str, moved: list[str]) -> None:
        aside = f"{name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            os.replace(name, aside)
        except OSError as exc:
            self._damaged.append(name)
            log.error(logfmt("state_damaged", path=name, error=why, not_moved=_reason(exc)))
            return
        moved.append(aside)
        log.error(logfmt("state_damaged", path=name, error=why, moved_to=aside))

    def _move_damaged_aside(self) -> None:
        damaged, self._damaged = self._damaged, []
        for name in damaged:
            if os.path.exists(name):
                self._move_aside(name, "damaged or unreadable at start", [])

    def _remove_journals(self, journals: Iterable[str]) -> None:
        for journal in journals:
            if journal in self._damaged:
                continue
            with contextlib.suppress(FileNotFoundError):
                try:
                    os.unlink(journal)
                except OSError as exc:
                    # Left in place: a later reset record or fold supersedes it.
                    log.warning(logfmt("state_journal_kept", path=journal, error=_reason(exc)))

    # Stopping.

    def write_now(self) -> None:
        """Commit what is pending, on the spot (at shutdown); one last try at a
        degraded disk."""
        if self.degraded:
            self.recover()
        else:
            self._append_pending()

    def close(self) -> None:
        if self._fd is not None:
            _close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            _close(self._lock_fd)
            self._lock_fd = None
        if self._db is not None:
            self._db.close()
            self._db = None


def _encode(header: Record, changes: Mapping[StoreKey, Timer | None]) -> bytes:
    """A journal record of ``changes`` under ``header``'s ``reset`` and ``boot``:
    the bytes of the `Record` they make, encoded as its array without making one
    (a reply's commit makes a record, `_CHANGES`)."""
    puts: list[Timer] = []
    drops: list[StoreKey] = []
    for key, timer in changes.items():
        if timer is None:
            drops.append(key)
        else:
            puts.append(timer)
    payload = _encoder.encode((header.reset, puts, drops, header.boot))
    return _RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def _records(data: bytes, *, newest: bool) -> Iterator[Record | str]:
    """The records of a journal, in order; a description of the damage ends them
    at a record that is not valid.

    A record cut short at the end of the ``newest`` journal is a write the daemon
    died in (never acknowledged): it ends the journal quietly. Anywhere else, or
    declaring more than any record could hold, it is damage."""
    offset = 0
    while offset < len(data):
        length = checksum = 0
        if offset + _RECORD.size <= len(data):
            length, checksum = _RECORD.unpack_from(data, offset)
        start = offset + _RECORD.size
        if start + length > len(data):
            if newest and length <= _MAX_RECORD:
                return
            yield f"a record cut short at byte {offset}"
            return
        payload = data[start : start + length]
        if zlib.crc32(payload) != checksum:
            yield f"bad checksum in the record at byte {offset}"
            return
        try:
            yield _record_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            yield f"unreadable record at byte {offset}: {exc}"
            return
        offset = start + length


#: Per load, per kind of value: one object for each distinct value.
_Shared = dict[str, dict[object, object]]
#: The fields whose values repeat from timer to timer, with the kind of value
#: each holds: a process's pid and start time, policies, uids and timeouts.
#: (Decoding makes every one of a field's values of its
#: declared type, so an int never stands in for an equal float.)
_SHARED_FIELDS: Final = (
    ("pid", "pid"),
    ("start_time", "start_time"),
    ("policy", "policy"),
    ("uid", "uid"),
    ("owner", "uid"),
    ("timeout", "time"),
)


def _share_values(timers: list[Timer], shared: _Shared) -> None:
    """Make equal values of the repeating fields one object across ``timers``
    and every batch loaded before with ``shared``.

    A decoded record holds a copy of each value: a million timers of a thousand
    processes would hold a million pids, policy names, timeouts and zeroes, some
    200 bytes a timer, where timers armed by requests share them (see
    `watchdogd.core.timers`). Done on records nobody else holds yet (hence
    ``force_setattr`` on frozen Structs), batch by batch, in C loops (``map``):
    a quarter of a second for a million, against the 200 megabytes it saves."""
    for name, kind in _SHARED_FIELDS:
        values = list(map(operator.attrgetter(name), timers))
        one = list(map(shared.setdefault(kind, {}).setdefault, values, values))
        deque(map(msgspec.structs.force_setattr, timers, itertools.repeat(name), one), maxlen=0)


def _write_all(fd: int | None, data: bytes) -> None:
    if fd is None:
        raise OSError(errno.EBADF, "no journal is open")
    if os.write(fd, data) != len(data):
        raise OSError(errno.ENOSPC, "No space left on device (a record was written in part)")


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        # Only this daemon uses the file; the first read takes the lock, so a second
        # daemon on the same file is refused here.
        db.execute("PRAGMA locking_mode=EXCLUSIVE")
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except BaseException:
        db.close()
        raise
    return db


def _read_timers(
    db: sqlite3.Connection, shared: _Shared | None = None
) -> tuple[list[Timer], str | None]:
    """The timers of a database and the boot it was written in (None for a new
    database); raises `_Corrupt` for a schema this daemon cannot read. The timers
    share their repeated values with each other and with what else was loaded with
    ``shared``."""
    try:
        return _parse_timers(db, {} if shared is None else shared)
    except (ValueError, TypeError, KeyError) as exc:
        raise _Corrupt(f"unreadable content: {exc}") from None


def _parse_timers(db: sqlite3.Connection, shared: _Shared) -> tuple[list[Timer], str | None]:
    meta = _meta(db)
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master")}
    if "timers" not in tables:
        return [], None
    if meta.get("schema") != str(SCHEMA):
        raise _Corrupt(f"schema version {meta.get('schema')}; this daemon reads {SCHEMA}")
    timers: list[Timer] = []
    # A batch of records as one msgpack array, decoded in one call: a start with a
    # million timers spends its time here.
    rows = db.execute("SELECT record FROM timers")
    while blobs := [blob for (blob,) in rows.fetchmany(_LOAD_BATCH)]:
        array = b"\xdd" + len(blobs).to_bytes(4, "big") + b"".join(blobs)
        del blobs
        try:
            batch = _timers_decoder.decode(array)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _Corrupt(f"unreadable timer record: {exc}") from None
        _share_values(batch, shared)
        timers += batch
    return timers, meta.get("boot_id")


def _read_immutable(path: str, shared: _Shared) -> tuple[list[Timer], str | None]:
    """Read the database file as it is, through a connection that writes nothing
    (the lock held on it keeps others out): what a read-only disk allows."""
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?immutable=1"
    db = sqlite3.connect(uri, uri=True)
    try:
        return _read_timers(db, shared)
    finally:
        db.close()


def _meta(db: sqlite3.Connection) -> dict[str, str]:
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master")}
    if "meta" not in tables:
        return {}
    return dict(db.execute("SELECT key, value FROM meta").fetchall())


def _replace_all(
    db: sqlite3.Connection, timers: Mapping[StoreKey, Timer | None], boot: str
) -> None:
    """Make the database exactly ``timers``, in this schema, in one transaction."""
    db.execute("PRAGMA journal_mode=WAL")  # an interrupted write never damages it
    db.execute("PRAGMA synchronous=OFF")
    db.execute("BEGIN")
    try:
        db.execute("DROP TABLE IF EXISTS timers")
        db.execute(
            "CREATE TABLE timers (pid INTEGER NOT NULL, scope TEXT NOT NULL,"
            " firing INTEGER NOT NULL, record BLOB NOT NULL,"
            " PRIMARY KEY (pid, scope, firing)) WITHOUT ROWID"
        )
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.executemany(
            _INSERT,
            (
                (timer.pid, timer.scope, timer.firing, _encoder.encode(timer))
                for timer in timers.values()
                if timer is not None
            ),
        )
        db.executemany(
            "INSERT OR REPLACE INTO meta VALUES (?, ?)",
            [("schema", str(SCHEMA)), ("boot_id", boot)],
        )
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _apply(db: sqlite3.Connection, changes: Changes) -> None:
    """Apply ``changes`` to the database in one transaction."""
    if not changes:
        return
    db.execute("BEGIN")
    try:
        db.executemany(
            _INSERT,
            (
                (timer.pid, timer.scope, timer.firing, _encoder.encode(timer))
                for timer in changes.values()
                if timer is not None
            ),
        )
        db.executemany(_DELETE, (key for key, timer in changes.items() if timer is None))
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _code(exc: BaseException) -> int:
    """SQLite's primary result code of an error (-1 when it has none)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return -1 if code is None else code & 0xFF


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    return str(exc) or type(exc).__name__


def _journal_path(path: str, number: int) -> str:
    return f"{path}.journal.{number}"


def _journals(path: str) -> list[str]:
    """The journals of ``path``, oldest first (damaged ones moved aside excluded)."""
    found = glob.glob(glob.escape(path) + ".journal.*")
    return sorted((j for j in found if _journal_number(j) > 0), key=_journal_number)


def _journal_number(journal: str) -> int:
    suffix = journal.rsplit(".", 1)[1]
    return int(suffix) if suffix.isdigit() else -1


def _boot_id() -> str:
    try:
        with open(_BOOT_ID) as boot:
            return boot.read().strip()
    except OSError:
        return "unknown"


def default_state_path(socket_path: str) -> str:
    """Beside the socket: ``/run/watchdogd/watchdogd.sock`` keeps its timers in
    ``/run/watchdogd/watchdogd.state.db`` (which survives restarts of the service)."""
    base, _ = os.path.splitext(socket_path)
    return base + ".state.db"
