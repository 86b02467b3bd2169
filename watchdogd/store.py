"""Durable timers: every acknowledged change survives a crash of the daemon.

Two files, side by side: a SQLite database (``state.db``) holding the timers as they
were at its last update, and an append-only journal (``state.db.journal``) of every
change since. A commit is one ``write(2)`` of a checksummed record to the journal:
a few microseconds, where a SQLite commit costs tens. When the journal grows past a
bound, a background task writes its changes into the database in a worker thread
and starts a new journal. Nothing is fsynced: what was written is in the kernel's
page cache, which survives the daemon being killed at any instant (a reboot does not
matter: pids do not survive it either, and state from another boot is discarded).

Invariants:

- A change is recorded the moment the in-memory table changes. Changes to one key
  collapse: only the latest state of ``(pid, scope)`` is written.
- A request's reply is sent only after a commit that includes its change
  (`Journal.commit`). The task that made the change lets every other task of the
  current turn of the event loop run, then the first of them back writes all that
  is pending as one record; the others find their changes written already. So one
  write serves every request of a turn (group commit).
- Changes no reply waits for (expiries, exits) are written soon after by a
  background task (`Journal.commit_soon`).
- Loading reads the database, then replays every journal in order, stopping at a
  record cut short or damaged (a write the daemon died in, never acknowledged). The
  result is written back into the database and the journals are removed. A journal
  is removed only after the database holds its changes, so an interrupted update
  is simply replayed again.
- Deadlines are stored on CLOCK_MONOTONIC, which keeps running while the daemon is
  down, so its downtime counts against them. Each row keeps its process's start time,
  so that a pid now held by another process is recognized at load.
- An unreadable or corrupt database is moved aside (with its journals) and the
  daemon starts empty; it never refuses to start because of its state.
- A write that fails (a full disk) is logged and counted, and its changes stay
  pending, to be written with the next commit. Meanwhile the daemon keeps serving
  from memory: a watchdog that stops answering protects nobody.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import sqlite3
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Protocol, cast

import msgspec
import trio

from .errors import DaemonError
from .logs import log, logfmt
from .timers import Key, Timer

SCHEMA: Final = 1
#: A journal this large is folded into the database and a new one started.
JOURNAL_BYTES: Final = 8 * 1024 * 1024
_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"
_INSERT: Final = "INSERT OR REPLACE INTO timers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
_DELETE: Final = "DELETE FROM timers WHERE pid = ? AND scope = ?"
#: A journal record: payload length and CRC-32, then the msgpack payload.
_RECORD: Final = struct.Struct(">II")

#: The values of a row as the INSERT takes them.
Values = tuple[int, str, str, int, int, float, float, float, int]
Changes = dict[Key, Values | None]


class StateError(DaemonError):
    """Raised at start when no state can be kept at the given path: another daemon
    holds the file, or it cannot be created. (A file that is merely unreadable is
    moved aside instead.)"""


@dataclass(slots=True, frozen=True)
class Row:
    """A stored timer, with the start time of its process (clock ticks since boot)."""

    pid: int
    scope: str
    policy: str
    uid: int
    owner: int
    timeout: float
    armed_at: float
    deadline: float
    start_time: int


class Journal(Protocol):
    """Where the service reports each change of the timer table."""

    @property
    def generation(self) -> int:
        """Bumped by every change."""

    def put(self, timer: Timer, start_time: int) -> None:
        """``timer`` is armed (new or re-armed)."""

    def drop(self, key: Key) -> None:
        """The timer ``key`` is gone (released, expired, or its process exited)."""

    async def commit(self, generation: int) -> None:
        """Return once every change up to ``generation`` is committed."""

    def commit_soon(self) -> None:
        """Have what is pending written soon, though no reply waits for it."""

    @property
    def errors(self) -> int:
        """Writes that failed (their changes were kept for the next one)."""


class NullJournal:
    """The journal of a daemon without state (``--no-state``): remembers nothing."""

    generation = 0
    errors = 0

    def put(self, timer: Timer, start_time: int) -> None:
        pass

    def drop(self, key: Key) -> None:
        pass

    async def commit(self, generation: int) -> None:
        pass

    def commit_soon(self) -> None:
        pass


_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(list[tuple[int, str, list[object] | None]])


class Store:
    """The state files, the journal writer, and the folding of the journal into the
    database. ``journal_bytes`` bounds a journal before it is folded."""

    def __init__(
        self, db: sqlite3.Connection, path: str, number: int, journal_bytes: int = JOURNAL_BYTES
    ) -> None:
        self.path = path
        self._db = db
        self._journal_bytes = journal_bytes
        self._number = number
        self._fd = _open_journal(path, number)
        self._written = 0
        self._pending: Changes = {}
        #: Changes in journals the database does not hold yet.
        self._unfolded: Changes = {}
        self._folding = False
        self.generation = 0
        self._committed = 0
        self._wakeup = trio.Event()
        self.errors = 0

    @classmethod
    def open(cls, path: str, journal_bytes: int = JOURNAL_BYTES) -> tuple[Store, list[Row]]:
        """Open (or create) the state and read its timers. A database that cannot be
        read is moved aside with its journals, with a logged error, and a new one is
        started. Raises `StateError` only when no state can be kept at ``path`` at
        all (another daemon holds it, or the directory is not writable)."""
        try:
            return cls._open(path, journal_bytes)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc):
                raise StateError(
                    f"{path} is in use by another watchdogd; give each daemon its own "
                    "state file (--state) or stop the other one"
                ) from None
            unreadable: Exception = exc
        except sqlite3.DatabaseError as exc:
            unreadable = exc
        except OSError as exc:
            raise StateError(f"cannot keep state in {path}: {exc.strerror}") from None
        aside = f"{path}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}"
        for name in [path, f"{path}-wal", f"{path}-shm", *_journals(path)]:
            with contextlib.suppress(FileNotFoundError):
                os.replace(name, aside + name[len(path) :])
        log.error(logfmt("state_unreadable", path=path, error=str(unreadable), moved_to=aside))
        try:
            return cls._open(path, journal_bytes)
        except (sqlite3.Error, OSError) as exc:
            raise StateError(f"cannot keep state in {path}: {exc}") from None

    @classmethod
    def _open(cls, path: str, journal_bytes: int) -> tuple[Store, list[Row]]:
        # Created 0600 before SQLite sees it; its -wal and -shm files follow suit.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            # The database is written in large batches only (folds): WAL keeps an
            # interrupted fold from damaging it. Only this daemon uses the file.
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")
            db.execute(
                "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )
            db.execute(
                "CREATE TABLE IF NOT EXISTS timers ("
                " pid INTEGER NOT NULL, scope TEXT NOT NULL, policy TEXT NOT NULL,"
                " uid INTEGER NOT NULL, owner INTEGER NOT NULL, timeout REAL NOT NULL,"
                " armed_at REAL NOT NULL, deadline REAL NOT NULL, start_time INTEGER NOT NULL,"
                " PRIMARY KEY (pid, scope)) WITHOUT ROWID"
            )
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            _check_schema(meta)
            boot = _boot_id()
            journals = _journals(path)
            if meta.get("boot_id", boot) != boot:
                discarded = db.execute("SELECT count(*) FROM timers").fetchone()[0]
                log.info(logfmt("state_from_another_boot", path=path, discarded=discarded))
                db.execute("DELETE FROM timers")
            else:
                changes: Changes = {}
                for journal in journals:
                    changes.update(_replay(journal))
                _write(db, changes)
            for journal in journals:
                os.unlink(journal)
            db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [("schema", str(SCHEMA)), ("boot_id", boot)],
            )
            rows = [Row(*values) for values in db.execute("SELECT * FROM timers").fetchall()]
        except BaseException:
            db.close()
            raise
        return cls(db, path, number=1, journal_bytes=journal_bytes), rows

    def put(self, timer: Timer, start_time: int) -> None:
        self._pending[timer.key] = (
            timer.pid,
            timer.scope,
            timer.policy,
            timer.uid,
            timer.owner,
            timer.timeout,
            timer.armed_at,
            timer.deadline,
            start_time,
        )
        self.generation += 1

    def drop(self, key: Key) -> None:
        self._pending[key] = None
        self.generation += 1

    async def commit(self, generation: int) -> None:
        if self._committed < generation:
            self._append_pending()

    def commit_soon(self) -> None:
        self._wakeup.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the changes no reply waits for, and fold full journals."""
        task_status.started()
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            self._append_pending()
            if self._written >= self._journal_bytes and not self._folding:
                await self._fold()

    def _append_pending(self) -> None:
        batch, self._pending = self._pending, {}
        generation = self.generation
        if batch:
            record = _encoder.encode(
                [(pid, scope, values) for (pid, scope), values in batch.items()]
            )
            frame = _RECORD.pack(len(record), zlib.crc32(record)) + record
            try:
                _write_all(self._fd, frame)
            except OSError as exc:
                self.errors += 1
                log.error(logfmt("state_write_failed", path=self.path, error=exc.strerror))
                # Keep what failed, unless a newer change to the same key came since,
                # and leave whatever part of it was written at the end of a journal
                # of its own: replay stops there, and goes on with the next journal.
                for key, values in batch.items():
                    self._pending.setdefault(key, values)
                self._next_journal()
            else:
                self._written += _RECORD.size + len(record)
                self._unfolded.update(batch)
                if self._written >= self._journal_bytes:
                    self._wakeup.set()
        self._committed = max(self._committed, generation)

    async def _fold(self) -> None:
        """Write what the journals hold into the database, then remove them; new
        changes go to a new journal meanwhile."""
        self._folding = True
        try:
            changes, self._unfolded = self._unfolded, {}
            finished = self._number
            self._next_journal()
            try:
                await trio.to_thread.run_sync(_write, self._db, changes)
            except Exception as exc:
                self.errors += 1
                log.error(logfmt("state_fold_failed", path=self.path, error=str(exc)))
                for key, values in changes.items():
                    self._unfolded.setdefault(key, values)
                return  # the journals stay, and are replayed at the next start
            for journal in _journals(self.path):
                if _journal_number(journal) <= finished:
                    os.unlink(journal)
        finally:
            self._folding = False

    def _next_journal(self) -> None:
        os.close(self._fd)
        self._number += 1
        self._fd = _open_journal(self.path, self._number)
        self._written = 0

    def write_now(self) -> None:
        """Commit what is pending, on the spot (at shutdown)."""
        self._append_pending()

    def close(self) -> None:
        os.close(self._fd)
        self._db.close()


def _write_all(fd: int, data: bytes) -> None:
    if os.write(fd, data) != len(data):
        raise OSError(errno.ENOSPC, "the journal took part of a record")


def _write(db: sqlite3.Connection, changes: Changes) -> None:
    """Apply ``changes`` to the database in one transaction."""
    if not changes:
        return
    puts = [values for values in changes.values() if values is not None]
    drops = [key for key, values in changes.items() if values is None]
    db.execute("BEGIN")
    try:
        if puts:
            db.executemany(_INSERT, puts)
        if drops:
            db.executemany(_DELETE, drops)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _replay(journal: str) -> Iterator[tuple[Key, Values | None]]:
    """The changes a journal records, up to its first damaged or cut-short record."""
    with open(journal, "rb") as source:
        data = source.read()
    offset = 0
    while offset + _RECORD.size <= len(data):
        length, checksum = _RECORD.unpack_from(data, offset)
        record = data[offset + _RECORD.size : offset + _RECORD.size + length]
        changes = None
        if len(record) == length and zlib.crc32(record) == checksum:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                changes = _record_decoder.decode(record)
        if changes is None:
            log.info(logfmt("state_journal_cut", journal=journal, at=offset))
            return
        for pid, scope, values in changes:
            yield (pid, scope), (cast(Values, tuple(values)) if values is not None else None)
        offset += _RECORD.size + length


def _open_journal(path: str, number: int) -> int:
    return os.open(
        f"{path}.journal.{number}", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
    )


def _journals(path: str) -> list[str]:
    """The journals of ``path``, oldest first."""
    return sorted(glob.glob(glob.escape(path) + ".journal.*"), key=_journal_number)


def _journal_number(journal: str) -> int:
    suffix = journal.rsplit(".", 1)[1]
    return int(suffix) if suffix.isdigit() else -1


def _check_schema(meta: dict[str, str]) -> None:
    schema = int(meta.get("schema", SCHEMA))
    if schema != SCHEMA:
        raise sqlite3.DatabaseError(f"schema version {schema}; this daemon reads {SCHEMA}")


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
