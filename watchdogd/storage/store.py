"""Durable timers: every acknowledged change survives a crash of the daemon, and a
failing disk never stops it.

Two kinds of file, side by side (`watchdogd.storage`): a SQLite database
(``state.db``, `watchdogd.storage.database`) holding the timers as they were at its
last update, and append-only journals (``state.db.journal.N``,
`watchdogd.storage.journal`) of every change since. A commit is one ``write(2)`` of
a checksummed record to the current journal, far cheaper than a SQLite commit. When
the journal grows past a bound, a background task writes its changes into the
database in a worker thread and starts a new journal. Nothing is fsynced: what was
written is in the kernel's page cache, which survives the daemon being killed at
any instant (a reboot does not matter: pids do not survive it either, and state
from another boot is discarded).

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
  changes one by one, and retries. A retry writes the whole current state
  (``snapshot``) to a new journal headed by a reset record, removes the older
  journals it supersedes, and clears the degraded state. A commit that a reply
  waits for retries on the spot (`EAGER_RETRY`), so the first change acknowledged
  once the disk takes writes again is durable and says so; the background task
  retries with backoff for a daemon that nothing asks. Memory stays bounded while
  degraded: nothing is queued but the need for that one full write.
- Loading reads the journals and the timers of the database due within
  `LOAD_AHEAD` (every firing one too): the daemon fires those while the rest is
  read in a worker thread (`Store.load_later`), so no deadline waits for a whole
  load of a million timers. Until that load is over (`Store.loaded`), nothing is
  folded and no full write is tried: the state in memory is not whole yet.
- Loading replays every journal in order over the database, each file in
  the schema it names (`watchdogd.storage.schema`, which migrates an older one's
  timers). A file that cannot be read (damaged, or of a schema this daemon does
  not read) is moved aside, never deleted, with an ERROR naming where
  (`watchdogd.storage.faults`); the good prefix of a damaged journal still counts.
  Only regular files are opened, read or written, each without blocking
  (`watchdogd.storage.files`): a FIFO, a socket, a directory, a device or a
  symlink at the name of a state file is moved aside unread.
  Anything else that fails at start (a full or read-only disk) starts the daemon
  degraded with everything it could read.
- A state deleted under the daemon (its directory removed, say) is a failing disk
  too: writes into the journal's unlinked file would be lost at the next start.
  Every write checks that the journal still has a name, when the store's inotify
  watch says something happened to it (`NameWatch`), and the background task
  checks once a `LOST_CHECK`; a recovery makes the directory and the database
  again, and writes the whole state there.
- Deadlines are stored on CLOCK_MONOTONIC, which keeps running while the daemon is
  down, so its downtime counts against them.
- The state has the room it needs on its disk before anything else the daemon
  writes there (`watchdogd.storage.room`): its journals are folded before they
  fill a small disk, the record beside it leaves free what the state may still
  take, and a write the disk refuses for lack of room first has the record give
  its room back (``room.make``), and is tried once more, before the store is
  degraded: another user's evidence never costs a timer its durability.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

import msgspec
import trio

from ..core import StoreKey, Timer
from ..host.inotify import NameWatch
from ..logs import log, logfmt
from .database import Database
from .faults import Aside, NotRegular, StateError, Unreadable, reason
from .journal import (
    CHANGES,
    Record,
    close,
    encode,
    journals,
    number_of,
    open_journal,
    path_of,
    replay,
    unlinked,
)
from .room import JOURNAL_BYTES, Room
from .schema import Changes, Shared, boot_id

__all__ = [
    "JOURNAL_BYTES",
    "LOAD_AHEAD",
    "Loaded",
    "Rest",
    "StateError",
    "Store",
    "default_state_path",
]

#: Retries of a failing disk wait this long at first, doubling up to the maximum.
RETRY_FIRST: Final = 0.1
RETRY_MAX: Final = 10.0
#: A reply's commit on a degraded store retries itself at most this often: a
#: tenth of a second is below what a client notices as the space coming back,
#: and ten attempts a second cost a full disk nothing. An attempt writes the whole
#: state, so a large one waits ten times what its last failed attempt took: the
#: loop spends at most a tenth of its time on them.
EAGER_RETRY: Final = 0.1
#: A daemon that writes nothing checks this often that its state was not deleted.
LOST_CHECK: Final = 1.0
#: A start loads the timers due within this long first, and fires them while it
#: loads the rest: many times what a million take to load on a slow machine.
LOAD_AHEAD: Final = 30.0


class Loaded(msgspec.Struct):
    """What `Store.open` read: the timers a start loads first (all of them,
    unless `Store.loading`), and what it moved aside."""

    timers: list[Timer]
    moved_aside: list[str]


class Store:
    """The state's writer: it loads the state, commits changes to the journal,
    folds journals into the database and rides out a failing disk; `Store.open` makes one.

    ``snapshot`` (set by the daemon) returns every timer the state must hold, for
    the full write that ends a degraded period; ``on_degraded(degraded, reason)``
    is called when the store enters and leaves it.
    """

    def __init__(self, path: str, journal_bytes: int = JOURNAL_BYTES) -> None:
        self.path = path
        self.room = Room(path, journal_bytes)
        self._fd: int | None = None
        self._aside = Aside()
        self._database = Database(path, self._aside, self._enter_degraded)
        #: A fold failed: the next one writes the whole state, from ``snapshot``.
        self._rebuild = False
        self._number = 0
        self._written = 0
        self._pending: Changes = {}
        #: Changes in journals the database does not hold yet; with
        #: ``_unfolded_reset``, the whole state the database must become.
        self._unfolded: Changes = {}
        self._unfolded_reset = False
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
        self._eager_at = 0.0
        #: One object per repeated value among the timers loaded (`share_values`),
        #: from the database and the journals alike; emptied once loaded.
        self._shared: Shared = {}
        #: What a start left for `load_later`, until `loaded`.
        self._rest: Rest | None = None
        self.snapshot: Callable[[], Iterable[Timer]] = list
        #: Says when the journal may have lost its name, which a write then checks.
        self._name_watch = NameWatch()
        self.on_degraded: Callable[[bool, str], object] = lambda degraded, reason: None

    # Opening and loading.

    @classmethod
    def open(
        cls, path: str, journal_bytes: int = JOURNAL_BYTES, *, load_ahead: float = LOAD_AHEAD
    ) -> tuple[Store, Loaded]:
        """Open (or create) the state and read the timers a start loads first:
        those due within ``load_ahead`` seconds and the firing ones; the rest,
        if any (`loading`), come from `load_later`.

        Raises `StateError` only when another daemon holds the file. A damaged file
        is moved aside (logged at ERROR with where it went); a file system that
        refuses writes leaves the store degraded, holding what could be read. The
        database is not written here: the journals read are folded into it by the
        background task, so a start costs one read of the state."""
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        store = cls(path, journal_bytes)
        until = time.monotonic() + load_ahead
        stored, kind, later = store._database.read(store._shared, until)
        changes, reset, store._number = replay(
            path, store._shared, store._aside, store._enter_degraded
        )
        moved = list(store._aside.moved)
        if kind == "current" and not reset:
            # The common start: the journals' changes over the database's timers,
            # without a dictionary of a million of them.
            if changes:
                stored = [t for t in stored if (t.pid, t.scope, t.firing) not in changes]
            if later:
                store._rest = Rest(until, changes)
                stored += store._rest.soon
            else:
                stored += [timer for timer in changes.values() if timer is not None]
                store._shared = {}
            store._unfolded = changes
            store._start_journal(None)
            return store, Loaded(timers=stored, moved_aside=moved)
        state: Changes = {} if reset else {timer.store_key: timer for timer in stored}
        state.update(changes)
        timers = {key: timer for key, timer in state.items() if timer is not None}
        # The database must be rewritten whole by the first fold.
        store._unfolded, store._unfolded_reset = dict(timers), True
        # The journals must no longer be replayed over what the database holds
        # (another boot's state, or an older schema's): this run's first journal
        # starts with the whole state, in this schema, which supersedes every
        # older file.
        store._start_journal(timers if kind in ("other_boot", "older_schema") else None)
        store._shared = {}
        return store, Loaded(timers=list(timers.values()), moved_aside=moved)

    @property
    def loading(self) -> bool:
        """Whether timers are left for `load_later`."""
        return self._rest is not None

    def load_later(self) -> list[Timer]:
        """In a worker thread, while the daemon runs on the timers `open` read:
        the rest of the state, every timer due after those (`Rest.read`)."""
        assert self._rest is not None
        timers = self._rest.read(self._database, self._shared)
        self._shared = {}
        return timers

    def loaded(self) -> None:
        """The timers of `load_later` are in memory with the rest: folds and
        full writes may go on. A database that failed to read later leaves the
        store degraded; one found damaged has its timers written anew."""
        rest, self._rest = self._rest, None
        self._retry_at = 0.0  # a store degraded meanwhile retries now
        if rest is not None and rest.unread:
            self._enter_degraded(rest.unread)
        elif rest is not None and rest.damaged and not self.degraded and not self._rebase():
            self._enter_degraded(f"{self.path} was damaged and cannot be written anew")
        self._wakeup.set()

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
        record = encode(msgspec.structs.replace(first, boot=boot_id()), changes, first=True)
        fd = self._open_journal(number, degrade=degrade)
        if fd is None:
            return None
        try:
            self.room.append(fd, record, 0)
        except OSError as exc:
            close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path_of(self.path, number))
            if degrade:
                self._enter_degraded(reason(exc))
            return None
        self._written = len(record)
        return fd

    # The hot path, `Journal`'s; the keys are `Timer.store_key`'s written out: a
    # change is a call into the store and no call back.

    def put(self, timer: Timer, *, replacing: Timer | None = None, soon: bool = False) -> None:
        if replacing is not None:
            self.drop(replacing)
        if not self.degraded:
            self._pending[timer.pid, timer.scope, timer.firing] = timer
        self.generation += 1
        if soon:
            self._wakeup.set()

    def drop(self, *timers: Timer, soon: bool = False) -> None:
        for timer in () if self.degraded else timers:  # a loop: a third of fromkeys' cost
            self._pending[timer.pid, timer.scope, timer.firing] = None
        self.generation += len(timers)
        if soon and timers:
            self._wakeup.set()

    def commit(self, generation: int) -> bool:
        """Write what is pending; returns whether every change up to
        ``generation`` is in the state. Synchronous: a reply's commit is one
        write(2), with no turn of the event loop. While degraded it tries the
        recovery's full write itself, at most once per `EAGER_RETRY`."""
        if self._durable < generation:
            if not self.degraded:
                self._append_pending()
            if (
                self.degraded
                and not self.loading
                and (now := time.monotonic()) >= self._eager_at
                and not self._recover(backoff=False)
            ):
                self._eager_at = now + max(EAGER_RETRY, 10 * (time.monotonic() - now))
        return self._durable >= generation

    def commit_soon(self) -> None:
        self._wakeup.set()

    def _append_pending(self) -> None:
        batch, self._pending = self._pending, {}
        generation = self.generation
        if batch:
            record = encode(CHANGES, batch)
            try:
                self.room.append(self._fd, record, self._written)
            except OSError as exc:
                self._enter_degraded(reason(exc))
                return
            self._written += len(record)
            if not self._rebuild:
                self._unfolded.update(batch)
            if self._written >= self.room.journal_bytes:
                self._wakeup.set()
            if self._name_watch.stirred(self._number, self._fd) and self._journal_lost():
                return
        self._durable = generation

    def _journal_lost(self) -> bool:
        """Whether the journal lost its name (the state was deleted under the
        daemon): then the store is degraded, and a recovery writes it anew."""
        try:
            lost = unlinked(self._fd)
        except OSError as exc:
            self._enter_degraded(reason(exc))
            return True
        if lost:
            self._enter_degraded(f"{path_of(self.path, self._number)} was deleted")
        return lost

    # The background task.

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the changes no reply waits for, retry a failing disk with backoff,
        and fold full journals into the database. It waits for work or for the
        next retry, never in a sleep that a commit cannot cut short."""
        task_status.started()
        while True:
            if self.loading:
                retry = math.inf  # nothing folded nor retried until `loaded`
            elif self.degraded:
                retry = self._retry_at
            elif self._fold_wanted:
                retry = self._fold_retry_at
            else:
                retry = math.inf  # nothing to retry: wait for work
            with trio.move_on_after(min(LOST_CHECK, max(0.0, retry - time.monotonic()))):
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            if not self.degraded and self._fd is not None:
                self._journal_lost()
            if self.degraded:
                if not self.loading and time.monotonic() >= self._retry_at:
                    self.recover()
                continue
            self._append_pending()
            if self.loading:
                continue
            if self._rebuild and self._written >= 4 * self.room.journal_bytes:
                self._rebase()  # the database refuses folds: keep the journals bounded
            if (
                (self._fold_wanted or self._written >= self.room.journal_bytes)
                and not self._folding
                and time.monotonic() >= self._fold_retry_at
            ):
                await self._fold()

    def recover(self) -> bool:
        """Try once to end the degraded state: write the whole current state to a
        new journal headed by a reset record. Returns whether the store is well."""
        return self._recover(backoff=True)

    def _recover(self, *, backoff: bool) -> bool:
        """`recover`; ``backoff``: a failure puts the background retry further off
        (a reply's own attempt leaves its schedule alone)."""
        if not self.degraded:
            return True
        if self._database.unread or self.loading:
            # Writing over it would lose its timers, or those not loaded yet.
            return self._failed(backoff)
        if self._database.replaced():
            if self._folding:
                return self._failed(backoff)  # its connection is the fold's until it ends
            # Deleted under the daemon: a new directory and database in its place.
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
            self._database.close()
        if self._database.lock_fd is None:
            try:
                if not self._database.lock():
                    return self._failed(backoff)
            except StateError as exc:
                self.degraded_reason = str(exc)
                return self._failed(backoff)
        self._aside.move_stuck()
        if not self._rebase():
            return self._failed(backoff)
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
            close(self._fd)
        self._fd, self._number = fd, number
        self._remove_journals(self._journals_before(number))
        self._pending = {}
        self._durable = generation
        self._unfolded, self._unfolded_reset, self._rebuild = timers, True, False
        self._fold_wanted = True
        self._fold_retry_at = 0.0
        return True

    def _failed(self, backoff: bool) -> bool:
        return self._schedule_retry() if backoff else False

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
                    close(self._fd)
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
            except (sqlite3.Error, OSError, Unreadable, StateError) as exc:
                self.errors += 1
                log.error(logfmt("state_fold_failed", path=self.path, error=reason(exc)))
                self._unfolded, self._rebuild = {}, True
                self._fold_retry_at = time.monotonic() + RETRY_MAX
                self._fold_wanted = True
                return
            self._fold_retry_at = 0.0
            self._remove_journals(finished)
        finally:
            self._folding = False

    def _journals_before(self, number: int) -> list[str]:
        return [j for j in journals(self.path) if number_of(j) < number]

    def _write_database(self, changes: Changes, reset: bool) -> None:
        """In a worker thread: write a fold into the database."""
        self._database.write(changes, reset)

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
            return open_journal(path_of(self.path, number), self._aside)
        except (OSError, NotRegular) as exc:
            why = reason(exc)
            if self.degraded:
                # Said once already: a retry's failure only updates the reason.
                self.degraded_reason = why
                if degrade:
                    self.errors += 1
            elif degrade:
                self._enter_degraded(why)
            else:
                log.warning(logfmt("state_journal_not_started", path=self.path, error=why))
            return None

    def _remove_journals(self, journals: Iterable[str]) -> None:
        for journal in journals:
            if journal in self._aside.stuck:
                continue
            with contextlib.suppress(FileNotFoundError):
                try:
                    os.unlink(journal)
                except OSError as exc:
                    # Left in place: a later reset record or fold supersedes it.
                    log.warning(logfmt("state_journal_kept", path=journal, error=reason(exc)))

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
            close(self._fd)
            self._fd = None
        self._name_watch.close()
        self._database.close()


class Rest:
    """What a start left to load: the database's timers due after ``until``
    (but those of the keys the journals ``changes``), and the journals' own
    timers due after it."""

    def __init__(self, until: float, changes: Changes) -> None:
        self.until = until
        self.journal_keys = frozenset(changes)
        #: The journals' timers a start loads first (due by ``until``, or firing).
        self.soon: list[Timer] = []
        self.in_journals: list[Timer] = []
        for timer in changes.values():
            if timer is not None:
                later = not timer.firing and timer.deadline > until
                (self.in_journals if later else self.soon).append(timer)
        #: Reading found the database damaged (moved aside: what was read of it
        #: is written anew), or failing (the reason: the store is degraded).
        self.damaged = False
        self.unread = ""

    def read(self, database: Database, shared: Shared) -> list[Timer]:
        """In a worker thread: every timer left. Touches nothing but the
        database, which no fold uses until the store is `Store.loaded`."""
        timers: list[Timer] = []
        try:
            timers = database.read_later(shared, self.until)
        except Unreadable:
            self.damaged = True
        except sqlite3.Error as exc:
            self.unread = reason(exc)
        if self.journal_keys:
            keys = self.journal_keys
            timers = [t for t in timers if (t.pid, t.scope, t.firing) not in keys]
        timers += self.in_journals
        self.journal_keys, self.soon, self.in_journals = frozenset(), [], []
        return timers


def default_state_path(socket_path: str) -> str:
    """Beside the socket: ``/run/watchdogd/watchdogd.sock`` keeps its timers in
    ``/run/watchdogd/watchdogd.state.db`` (which survives restarts of the service)."""
    base, _ = os.path.splitext(socket_path)
    return base + ".state.db"
