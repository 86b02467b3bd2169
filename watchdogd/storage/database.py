"""The database: a SQLite file (``state.db``) holding the timers as they were at its
last fold, one row per store key, each row's record a stored `Timer`.

Invariants:

- The file is created 0600 before SQLite sees it, and an exclusive lock on it is
  held for the store's life: a second daemon on the same state is refused
  (`watchdogd.storage.faults.StateError`), even when nothing can be written.
- Only folds write it, in a worker thread, each in one transaction; its ``meta``
  table names the schema and the boot it was written in. A database of an older
  schema is read through the migrations (`watchdogd.storage.schema`) and
  rewritten whole, in this schema, by the first fold.
- Each row says by when a start must have loaded it (``due``, indexed: a timer's
  deadline, zero for a firing one), so a start reads the timers due soon first
  (`Database.read`) and the rest (`Database.read_later`) while those fire.
- A database SQLite calls corrupt (SQLITE_CORRUPT, SQLITE_NOTADB), with content
  that does not decode, or of a schema this daemon cannot read is moved aside,
  with SQLite's own files beside it. One that cannot be read and is not damaged
  (a failing disk) is never written over: the next start reads it again.
- SQLite opens only regular files: the database and its side files (-wal, -shm,
  -journal) are checked before it connects, and anything else in their place is
  moved aside unread (`watchdogd.storage.faults.NotRegular`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import stat
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Final, Literal

import msgspec

from ..core import StoreKey, Timer
from ..logs import log, logfmt
from . import schema
from .faults import Aside, Damaged, NotRegular, StateError, Unreadable, reason
from .files import open_regular
from .schema import Changes, Shared, boot_id, decode_timers, share_values

_INSERT: Final = "INSERT OR REPLACE INTO timers VALUES (?, ?, ?, ?, ?)"
_DELETE: Final = "DELETE FROM timers WHERE pid = ? AND scope = ? AND firing = ?"
#: SQLite's primary result codes that mean the file itself is damaged.
_CORRUPT_CODES: Final = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB
#: Records read from the database and decoded at a time: the copies of repeated
#: values that one batch frees are reused by the next (`share_values`), and a
#: batch's records stay in the CPU's caches through the passes over them, which a
#: much larger batch outgrows.
_LOAD_BATCH: Final = 1024

#: What a database read at start is: of this boot and schema ("current"); absent,
#: new or moved aside ("none": the journals hold everything since); written in
#: another boot; or of an older schema, migrated.
DatabaseKind = Literal["current", "none", "other_boot", "older_schema"]

_encoder = msgspec.msgpack.Encoder()


class Database:
    """The database file of the state ``path``: its lock, its connection, its
    reading at start and its writing by folds. Files it cannot read go to ``aside``;
    ``degrade(reason)`` is told of a disk that refuses it."""

    def __init__(self, path: str, aside: Aside, degrade: Callable[[str], object]) -> None:
        self.path = path
        self._aside = aside
        self._degrade = degrade
        self._db: sqlite3.Connection | None = None
        self.lock_fd: int | None = None
        #: The database exists but could not be read at start: never written over.
        self.unread = False

    def read(self, shared: Shared, until: float) -> tuple[list[Timer], DatabaseKind, bool]:
        """The timers in the database (none when there is none, or it was moved
        aside) that a start loads first, what the database is, and whether more
        are left for `read_later`. Keeps the connection.

        Loaded first: in a database of this schema, the timers due by ``until``
        and every firing one; in any other, all of them.

        A database SQLite cannot open for writing (a read-only disk) is read
        through an immutable connection; one that cannot be read at all, and is
        not damaged, is left as it is and never written over (``unread``: the
        store stays degraded): the next start reads it again."""
        # Only a regular file can hold timers that must never be written over.
        existed = _regular_at(self.path)
        if not self.lock():
            self.unread = existed
            return [], "none", False
        later = False
        try:
            self._clear_side_files()
            db = _connect(self.path)
            try:
                stored, stored_schema, boot = _read_timers(db, shared, until)
                later = (
                    stored_schema == schema.SCHEMA
                    and boot is not None
                    and _any_due_after(db, until)
                )
            except BaseException:
                db.close()
                raise
        except (sqlite3.Error, Unreadable) as exc:
            if isinstance(exc, Unreadable):
                self._move_aside(exc)
                return [], "none", False
            if _code(exc) in _CORRUPT_CODES:
                self._move_aside(Damaged(str(exc)))
                return [], "none", False
            self._degrade(reason(exc))
            try:
                stored, stored_schema, boot = _read_immutable(self.path, shared)
            except (sqlite3.Error, Unreadable) as again:
                log.error(logfmt("state_unread", path=self.path, error=reason(again)))
                self.unread = True
                return [], "none", False
        else:
            self._db = db
        if boot is None:
            return stored, "none", False
        if boot != boot_id():
            log.info(logfmt("state_from_another_boot", path=self.path, discarded=len(stored)))
            return [], "other_boot", False
        if stored_schema != schema.SCHEMA:
            return stored, "older_schema", False
        return stored, "current", later

    def read_later(self, shared: Shared, until: float) -> list[Timer]:
        """In a worker thread: the timers `read` left, every one due after
        ``until``. Damage found now moves the database aside, as at start, and
        raises `watchdogd.storage.faults.Damaged`: the timers read before are
        the store's to write anew. A file that fails to read raises its
        `sqlite3.Error`, and is never written over (``unread``)."""
        assert self._db is not None
        try:
            rows = self._db.execute(
                # A scan of the table (the unary + keeps SQLite off the index):
                # an index walk would fetch most rows one b-tree search each,
                # several times slower.
                "SELECT record FROM timers WHERE +due > ?",
                (until,),
            )
            return _decode_rows(rows, schema.SCHEMA, shared)
        except Damaged as exc:
            problem = exc
        except (ValueError, TypeError, KeyError) as exc:
            problem = Damaged(f"unreadable content: {exc}")
        except sqlite3.Error as exc:
            if _code(exc) not in _CORRUPT_CODES:
                log.error(logfmt("state_unread", path=self.path, error=reason(exc)))
                self.unread = True
                raise
            problem = Damaged(str(exc))
        self._db.close()
        self._db = None
        self._move_aside(problem)
        raise problem

    def _move_aside(self, problem: Unreadable) -> None:
        self._move_files(problem)
        self.lock()  # a new file in its place

    def _move_files(self, problem: Unreadable) -> None:
        # SQLite's own files go with it: a rollback journal left beside a new,
        # empty database would be played back into it.
        if os.path.lexists(self.path):
            self._aside.move(self.path, problem)
        beside = Unreadable(f"SQLite's file of {self.path}, which went aside: {problem}")
        beside.suffix, beside.event = problem.suffix, problem.event
        for name in _side_files(self.path):
            if os.path.lexists(name):
                self._aside.move(name, beside)

    def _clear_side_files(self) -> None:
        """Move aside, unread, each of SQLite's side files that is no regular
        file: SQLite opens them by name and reads them as it finds them (a FIFO
        as the rollback journal blocks the first read of the database for ever;
        as the -wal, every fold fails). One that cannot be moved (a read-only
        disk) raises `sqlite3.OperationalError`, as a disk that fails does."""
        for name in _side_files(self.path):
            try:
                os.close(open_regular(name))
            except NotRegular as exc:
                self._aside.move(name, exc)
                if name in self._aside.stuck:
                    # Left in place (a read-only disk): SQLite must not open it.
                    raise sqlite3.OperationalError(reason(exc)) from None
            except OSError:
                pass  # absent, or SQLite's to find unreadable

    def lock(self) -> bool:
        """Create the database file if need be (0600, before SQLite sees it; its
        -wal and -shm files follow) and hold an exclusive lock on it for the
        store's life, so that a second daemon on the same state is refused even
        when nothing can be written. Returns whether the file is there.

        Only a regular file is SQLite's to open (`open_regular`): anything else
        at the path (a FIFO, whose reads block; a directory, a socket, a device,
        a symlink) is moved aside unread, with SQLite's side files, and a new file
        made. SQLite opens the path by name once this checked it: the state's
        directory is the daemon's own, so no one else swaps it in between."""
        if self.lock_fd is not None:
            _close(self.lock_fd)
            self.lock_fd = None
        fd = self._open()
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _close(fd)
            raise StateError(
                f"{self.path} is in use by another watchdogd; give each daemon its own "
                "state file (--state) or stop the other one"
            ) from None
        self.lock_fd = fd
        return True

    def _open(self) -> int | None:
        """The database file, opened as a regular file (made if need be); None if
        it cannot be (the store is then degraded)."""
        try:
            return self._open_file()
        except NotRegular as exc:
            self._move_files(exc)
        try:
            return self._open_file()
        except NotRegular as exc:
            # It could not be moved (a read-only disk), or another took its place.
            self._degrade(reason(exc))
            return None

    def _open_file(self) -> int | None:
        try:
            return open_regular(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            try:
                return open_regular(self.path)  # a read-only disk
            except OSError:
                self._degrade(reason(exc))
                return None

    def replaced(self) -> bool:
        """Whether the file locked is no longer the one at ``path`` (it was
        deleted, or another took its name): the lock and the connection are then
        of a file nobody will read."""
        if self.lock_fd is None:
            return False
        try:
            held, named = os.fstat(self.lock_fd), os.stat(self.path)
        except OSError:
            return True
        return (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino)

    def write(self, changes: Changes, reset: bool) -> None:
        """In a worker thread: apply a fold to the database (``reset``: make it
        exactly ``changes``), opening it if the daemon started without one."""
        if self._db is None:
            if self.lock_fd is None and not self.lock():
                raise OSError(errno.EIO, f"cannot create {self.path}")
            self._clear_side_files()
            db = _connect(self.path)
            try:
                _read_timers(db)
            except BaseException:
                db.close()
                raise
            self._db = db
        if reset:
            timers = {key: timer for key, timer in changes.items() if timer is not None}
            replace_all(self._db, timers, boot_id())
        else:
            _apply(self._db, changes)
        # Into the database file itself before the journals go: a start on a
        # read-only disk reads the file alone (immutable), without the -wal.
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        if self.lock_fd is not None:
            _close(self.lock_fd)
            self.lock_fd = None
        if self._db is not None:
            self._db.close()
            self._db = None


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _side_files(path: str) -> tuple[str, str, str]:
    """The files SQLite keeps beside the database ``path``."""
    return f"{path}-wal", f"{path}-shm", f"{path}-journal"


def _regular_at(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


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
    db: sqlite3.Connection, shared: Shared | None = None, until: float | None = None
) -> tuple[list[Timer], int, str | None]:
    """The timers of a database (of this schema and with ``until``: those due by
    then, and the firing ones), its schema and the boot it was written in (None
    for a new database); raises `Damaged` for content that does not decode and
    `watchdogd.storage.schema.SchemaError` for a schema this daemon cannot read.
    The timers share their repeated values with each other and with what else was
    loaded with ``shared``."""
    try:
        return _parse_timers(db, {} if shared is None else shared, until)
    except (ValueError, TypeError, KeyError) as exc:
        raise Damaged(f"unreadable content: {exc}") from None


def _parse_timers(
    db: sqlite3.Connection, shared: Shared, until: float | None
) -> tuple[list[Timer], int, str | None]:
    meta = _meta(db)
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master")}
    if "timers" not in tables:
        return [], schema.SCHEMA, None
    named = meta.get("schema")
    if named is None or not named.isdigit():
        raise Damaged(f"schema version {named!r}")
    stored = int(named)
    schema.check(stored)
    if stored == schema.SCHEMA and until is not None:
        rows = db.execute("SELECT record FROM timers WHERE due <= ?", (until,))
    else:
        rows = db.execute("SELECT record FROM timers")
    return _decode_rows(rows, stored, shared), stored, meta.get("boot_id")


def _any_due_after(db: sqlite3.Connection, until: float) -> bool:
    """Whether a database of this schema holds a timer due after ``until``."""
    return db.execute("SELECT 1 FROM timers WHERE due > ? LIMIT 1", (until,)).fetchone() is not None


def _decode_rows(rows: sqlite3.Cursor, stored: int, shared: Shared) -> list[Timer]:
    """The timers of ``rows`` of records of schema ``stored``."""
    timers: list[Timer] = []
    # A batch of records as one msgpack array, decoded in one call: a start with a
    # million timers spends its time here.
    while blobs := [blob for (blob,) in rows.fetchmany(_LOAD_BATCH)]:
        array = b"\xdd" + len(blobs).to_bytes(4, "big") + b"".join(blobs)
        del blobs
        try:
            batch = decode_timers(array, stored)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Damaged(f"unreadable timer record: {exc}") from None
        share_values(batch, shared)
        timers += batch
    return timers


def _read_immutable(path: str, shared: Shared) -> tuple[list[Timer], int, str | None]:
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


def replace_all(db: sqlite3.Connection, timers: Mapping[StoreKey, Timer | None], boot: str) -> None:
    """Make the database exactly ``timers``, in this schema, in one transaction."""
    db.execute("PRAGMA journal_mode=WAL")  # an interrupted write never damages it
    db.execute("PRAGMA synchronous=OFF")
    db.execute("BEGIN")
    try:
        db.execute("DROP TABLE IF EXISTS timers")
        db.execute(
            "CREATE TABLE timers (pid INTEGER NOT NULL, scope TEXT NOT NULL,"
            " firing INTEGER NOT NULL, due REAL NOT NULL, record BLOB NOT NULL,"
            " PRIMARY KEY (pid, scope, firing)) WITHOUT ROWID"
        )
        db.execute("CREATE INDEX timers_due ON timers (due)")
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.executemany(_INSERT, _rows(timers))
        db.executemany(
            "INSERT OR REPLACE INTO meta VALUES (?, ?)",
            [("schema", str(schema.SCHEMA)), ("boot_id", boot)],
        )
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _rows(timers: Mapping[StoreKey, Timer | None]) -> Iterator[tuple[object, ...]]:
    """The rows of ``timers``: a timer's ``due`` says how soon a start must load
    it (its deadline; a firing one at once)."""
    for timer in timers.values():
        if timer is not None:
            due = 0.0 if timer.firing else timer.deadline
            yield timer.pid, timer.scope, timer.firing, due, _encoder.encode(timer)


def _apply(db: sqlite3.Connection, changes: Changes) -> None:
    """Apply ``changes`` to the database in one transaction."""
    if not changes:
        return
    db.execute("BEGIN")
    try:
        db.executemany(_INSERT, _rows(changes))
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
