"""Durable timers: every acknowledged change survives a crash of the daemon.

The store is SQLite in WAL mode with ``synchronous=OFF``: a committed transaction is
in the kernel's page cache, which survives the daemon being killed at any instant (a
reboot does not matter: pids do not survive it either, and state from another boot
is discarded). Invariants:

- A change is put in the journal the moment the in-memory table changes. Changes to
  one key collapse: only the latest state of ``(pid, scope)`` is written.
- A request's reply is sent only after a commit that includes its change
  (`Journal.commit`). The task that made the change first lets every other task of
  the current turn of the event loop run, then the first of them back writes all
  that is pending as one transaction; the others find their changes written
  already. So one commit serves every request of a turn (group commit).
- Changes no reply waits for (expiries, exits) are written soon after by a
  background task (`Journal.commit_soon`).
- Small transactions are written on the event loop (tens of microseconds); large
  ones in a worker thread, so the loop is never blocked for long.
- Deadlines are stored on CLOCK_MONOTONIC, which keeps running while the daemon is
  down, so its downtime counts against them. Each row keeps its process's start time,
  so that a pid now held by another process is recognized at load.
- An unreadable or corrupt state file is moved aside and the daemon starts empty; it
  never refuses to start because of its state.
- A write that fails (a full disk) is logged and counted, and its changes stay
  pending, to be written with the next commit. Meanwhile the daemon keeps serving
  from memory: a watchdog that stops answering protects nobody.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Final, Protocol

import trio

from .logs import log, logfmt
from .timers import Key, Timer

SCHEMA: Final = 1
#: Transactions with more rows than this are written in a worker thread.
_INLINE_ROWS: Final = 256
_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"
_INSERT: Final = "INSERT OR REPLACE INTO timers VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
_DELETE: Final = "DELETE FROM timers WHERE pid = ? AND scope = ?"


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


class Store:
    """The SQLite state file and its committer."""

    def __init__(self, db: sqlite3.Connection, path: str) -> None:
        self.path = path
        self._db = db
        # The values of a row as the INSERT takes them, or None for a deletion.
        self._pending: dict[Key, tuple[object, ...] | None] = {}
        self.generation = 0
        self._committed = 0
        self._writing = False
        self._wakeup = trio.Event()
        self._done = trio.lowlevel.ParkingLot()
        #: Commits that failed (the daemon keeps serving from memory).
        self.errors = 0

    @classmethod
    def open(cls, path: str) -> tuple[Store, list[Row]]:
        """Open (or create) the state file and read its timers. A file that cannot
        be used is moved aside, with a logged error, and a new one is started."""
        try:
            return cls._open(path)
        except sqlite3.DatabaseError as exc:
            aside = f"{path}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}"
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(path + suffix, aside + suffix)
            log.error(logfmt("state_unreadable", path=path, error=str(exc), moved_to=aside))
            return cls._open(path)

    @classmethod
    def _open(cls, path: str) -> tuple[Store, list[Row]]:
        # Created 0600 before SQLite sees it; its -wal and -shm files follow suit.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            # Only this daemon uses the file: holding the lock for good spares a
            # shared-memory lock round per transaction (half the cost of a commit).
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
            rows = [Row(*values) for values in db.execute("SELECT * FROM timers").fetchall()]
            if meta.get("boot_id", boot) != boot:
                log.info(logfmt("state_from_another_boot", path=path, discarded=len(rows)))
                db.execute("DELETE FROM timers")
                rows = []
            db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [("schema", str(SCHEMA)), ("boot_id", boot)],
            )
        except BaseException:
            db.close()
            raise
        return cls(db, path), rows

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
        while self._committed < generation:
            if self._writing:
                await self._done.park()  # a write in a thread may cover it
            else:
                await self._write_pending()

    def commit_soon(self) -> None:
        self._wakeup.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the changes that no reply waits for."""
        task_status.started()
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            await self.commit(self.generation)

    async def _write_pending(self) -> None:
        batch, self._pending = self._pending, {}
        generation = self.generation
        try:
            if len(batch) > _INLINE_ROWS:
                self._writing = True
                try:
                    await trio.to_thread.run_sync(self._write, batch)
                finally:
                    self._writing = False
            else:
                self._write(batch)
        except Exception as exc:
            self.errors += 1
            log.error(logfmt("state_write_failed", path=self.path, error=str(exc)))
            # Keep what failed, unless a newer change to the same key came since.
            for key, values in batch.items():
                self._pending.setdefault(key, values)
        self._committed = max(self._committed, generation)
        self._done.unpark_all()

    def _write(self, batch: dict[Key, tuple[object, ...] | None]) -> None:
        db = self._db
        if len(batch) == 1:
            # One request in the turn: a single statement is its own transaction.
            [(key, values)] = batch.items()
            db.execute(_DELETE, key) if values is None else db.execute(_INSERT, values)
            return
        puts = [values for values in batch.values() if values is not None]
        drops = [key for key, values in batch.items() if values is None]
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

    def write_now(self) -> None:
        """Commit what is pending, on the spot (at shutdown)."""
        batch, self._pending = self._pending, {}
        if batch:
            self._write(batch)
        self._committed = self.generation

    def close(self) -> None:
        self._db.close()


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
