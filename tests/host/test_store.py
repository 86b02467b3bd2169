"""The state files: writes, group commits, folds, and files that cannot be used.

Faults of a real disk (full, out of inodes, read-only) are in test_storage_faults.py,
on real tmpfs mounts.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sqlite3
import stat
import time
import zlib
from pathlib import Path

import msgspec
import pytest
import trio

from watchdogd.core.timers import Course, SlotRef, Timer, Watch
from watchdogd.storage import database, schema
from watchdogd.storage import journal as journal_module
from watchdogd.storage import room as room_module
from watchdogd.storage import store as store_module
from watchdogd.storage.journal import RECORD, Record, encode, records, write_all
from watchdogd.storage.store import StateError, Store, default_state_path

from helpers.special_files import SPECIAL, each_special, freed_after, make_special, moved_aside
from helpers.state_files import PIDS, SCHEMAS, WRITTEN, make_own


def timer(pid: int, scope: str, deadline: float = 100.0, **fields: object) -> Timer:
    """A timer; ``step``, ``step_end``, ``fired_at`` and ``plan`` make its `Course`."""
    run = {name: fields.pop(name) for name in Course.__struct_fields__ if name in fields}
    if run:
        fields["run"] = Course(**run)  # type: ignore[arg-type]
    return Timer(
        pid=pid,
        scope=scope,
        policy="kill",
        uid=1000,
        owner=1000,
        timeout=10.0,
        armed_at=deadline - 10,
        deadline=deadline,
        start_time=555,
        **fields,  # type: ignore[arg-type]
    )


def journals(directory: Path) -> list[str]:
    return sorted(
        (name for name in os.listdir(directory) if name.split(".")[-1].isdigit()),
        key=lambda name: int(name.rsplit(".", 1)[1]),
    )


def append(path: str, number: int, record: Record, tail: bytes = b"") -> None:
    """Write one journal record as the daemon does, then ``tail``."""
    changes: dict[tuple[int, str, int], Timer | None] = {t.store_key: t for t in record.puts}
    changes.update(dict.fromkeys(record.drops))
    with open(f"{path}.journal.{number}", "ab") as journal:
        journal.write(encode(record, changes) + tail)


def test_default_path_is_beside_the_socket() -> None:
    assert (
        default_state_path("/run/watchdogd/watchdogd.sock") == "/run/watchdogd/watchdogd.state.db"
    )


def test_a_new_state_is_private_and_empty(tmp_path: Path) -> None:
    store, loaded = Store.open(str(tmp_path / "state.db"))
    store.close()
    assert loaded.timers == []
    assert not store.degraded
    for name in ("state.db", "state.db.journal.1"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600


def test_a_record_of_changes_is_made_as_a_record_would_be() -> None:
    """A journal record is encoded without building a `Record` (`encode`): the
    bytes must stay those of the `Record` they stand for."""
    armed = timer(10, "a")
    firing = timer(12, "due", firing=7, step=2, step_end=123.5, fired_at=100.5)
    changes = {armed.store_key: armed, (11, "gone", 0): None, firing.store_key: firing}
    for header in (Record(), Record(reset=True, boot="a-boot")):
        made = encode(header, changes)
        record = msgspec.structs.replace(header, puts=[armed, firing], drops=[(11, "gone", 0)])
        payload = msgspec.msgpack.encode(record)
        assert made == RECORD.pack(len(payload), zlib.crc32(payload)) + payload
        assert list(records(made, newest=True)) == [record]


def test_changes_collapse_and_survive_a_crash(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    child = os.fork()
    if child == 0:  # pragma: no cover - the daemon that dies
        store, _ = Store.open(path)
        store.put(timer(10, "a"))
        store.put(timer(10, "b"))
        store.put(timer(10, "a", deadline=200.0))  # re-armed: only the last counts
        store.put(timer(11, "gone"))
        store.drop(timer(11, "gone"))
        firing = timer(12, "due", firing=7, step=2, step_end=123.5, fired_at=100.5)
        store.put(firing)
        assert store.commit(store.generation)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no fold: a crash
    os.waitpid(child, 0)
    _, loaded = Store.open(path)
    assert sorted(loaded.timers, key=lambda t: t.scope) == [
        timer(10, "a", deadline=200.0),
        timer(10, "b"),
        timer(12, "due", firing=7, step=2, step_end=123.5, fired_at=100.5),
    ]


def test_an_armed_timer_and_its_firing_record_are_kept_apart(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    store.put(timer(10, "a", firing=3, step=1))  # its policy is in progress...
    store.put(timer(10, "a", deadline=300.0))  # ...and the worker armed it again
    store.write_now()
    store.close()
    _, loaded = Store.open(path)
    assert sorted(t.firing for t in loaded.timers) == [0, 3]


async def test_one_write_serves_every_change_of_a_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = Store.open(str(tmp_path / "state.db"))
    writes: list[int] = []

    def counting(fd: int | None, data: bytes) -> None:
        writes.append(len(data))
        write_all(fd, data)

    monkeypatch.setattr(room_module, "write_all", counting)
    acknowledged: list[int] = []

    async def acknowledge(pid: int) -> None:
        store.put(timer(pid, "s"))
        changed = store.generation
        await trio.lowlevel.checkpoint()  # as the server does before committing
        assert store.commit(changed)
        acknowledged.append(pid)

    async with trio.open_nursery() as nursery:
        for pid in range(5):
            nursery.start_soon(acknowledge, pid)
    assert sorted(acknowledged) == list(range(5))
    assert len(writes) == 1
    store.close()
    assert len(Store.open(str(tmp_path / "state.db"))[1].timers) == 5


async def test_changes_nobody_waits_for_are_written_soon(tmp_path: Path) -> None:
    store, _ = Store.open(str(tmp_path / "state.db"))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        store.put(timer(1, "expired-later"))
        store.commit_soon()
        with trio.fail_after(5):
            while not store.commit(store.generation) or store._pending:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    store.close()
    assert len(Store.open(str(tmp_path / "state.db"))[1].timers) == 1


async def test_a_firing_record_replaces_its_armed_one_and_is_written_soon(
    tmp_path: Path,
) -> None:
    store, _ = Store.open(str(tmp_path / "state.db"))
    armed, other = timer(1, "due"), timer(2, "gone")
    store.put(armed)
    store.put(other)
    assert store.commit(store.generation)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        before = store.generation
        store.drop(soon=True)  # no timer: no change
        assert store.generation == before
        store.put(timer(1, "due", firing=4, step=1), replacing=armed, soon=True)
        store.drop(other)
        with trio.fail_after(5):
            while not store.commit(store.generation) or store._pending:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    store.close()
    [kept] = Store.open(str(tmp_path / "state.db"))[1].timers
    assert (kept.pid, kept.scope, kept.firing) == (1, "due", 4)


async def test_full_journals_are_folded_and_few_files_exist(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path, journal_bytes=2000)
    most = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        for i in range(200):
            store.put(timer(i, "s"))
            if i % 3 == 0:
                store.drop(timer(i, "s"))
            assert store.commit(store.generation)
            await trio.sleep(0)
            most = max(most, len(journals(tmp_path)))
        with trio.fail_after(5):
            while store._folding or store._fold_wanted or store._written >= 2000:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert most <= 3
    assert len(journals(tmp_path)) == 1  # the folded ones are gone
    store.close()
    raw = sqlite3.connect(path)
    in_database = raw.execute("SELECT count(*) FROM timers").fetchone()[0]
    raw.close()
    assert 0 < in_database <= 133
    _, loaded = Store.open(path)
    assert sorted(t.pid for t in loaded.timers) == [i for i in range(200) if i % 3]


def test_a_record_cut_short_at_the_end_is_a_write_the_daemon_died_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    append(path, 5, Record(puts=[timer(1, "older")]))
    append(path, 6, Record(puts=[timer(2, "whole")]), tail=b"\x00\x00\x01\x00cut")
    _, loaded = Store.open(path)
    assert sorted(t.scope for t in loaded.timers) == ["older", "whole"]
    assert "state_damaged" not in caplog.text  # never acknowledged: no damage


def test_a_damaged_journal_is_moved_aside_and_its_good_prefix_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    append(path, 5, Record(puts=[timer(1, "before")]))
    with open(f"{path}.journal.5", "ab") as journal:  # overwritten with garbage
        journal.write(os.urandom(64) + b"\x00" * 64)
    append(path, 5, Record(puts=[timer(2, "after-the-damage")]))
    append(path, 6, Record(puts=[timer(3, "next")]))
    store, loaded = Store.open(path)
    store.close()
    assert sorted(t.scope for t in loaded.timers) == ["before", "next"]
    [aside] = loaded.moved_aside
    assert aside.startswith(f"{path}.journal.5.damaged-")
    assert os.path.getsize(aside) > 128  # moved, never deleted
    assert "ERROR" in caplog.text
    assert f"moved_to={aside}" in caplog.text


def test_a_state_held_by_another_daemon_is_refused_not_moved(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    holder, _ = Store.open(path)
    try:
        with pytest.raises(StateError, match="in use by another watchdogd"):
            Store.open(path)
        assert not [name for name in os.listdir(tmp_path) if "damaged" in name]
    finally:
        holder.close()


def test_a_corrupt_database_is_moved_aside_and_the_journals_still_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database" * 100)
    append(str(path), 3, Record(puts=[timer(1, "since-the-last-fold")]))
    store, loaded = Store.open(str(path))
    store.close()
    assert [t.scope for t in loaded.timers] == ["since-the-last-fold"]
    [aside] = loaded.moved_aside
    assert Path(aside).read_bytes().startswith(b"this is not a database")
    assert "event=state_damaged" in caplog.text
    assert not store.degraded


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")


@each_special
def test_a_journal_that_is_no_regular_file_is_moved_aside_unread(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    append(path, 5, Record(puts=[timer(1, "before")]))
    special = tmp_path / "state.db.journal.6"
    make_special(kind, special)
    append(path, 7, Record(puts=[timer(2, "after")]))
    with freed_after(special):
        store, loaded = Store.open(path)
    store.close()
    assert sorted(t.scope for t in loaded.timers) == ["after", "before"]
    assert not store.degraded
    assert loaded.moved_aside == [str(moved_aside(special, kind, caplog.text))]


@each_special
def test_a_database_that_is_no_regular_file_goes_aside_with_sqlites_files(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db"
    make_special(kind, path)
    # A rollback journal beside it would be played back into the new database.
    (tmp_path / "state.db-journal").write_bytes(b"of another database")
    append(str(path), 3, Record(puts=[timer(1, "since-the-last-fold")]))
    with freed_after(path):
        store, loaded = Store.open(str(path))
    assert [t.scope for t in loaded.timers] == ["since-the-last-fold"]
    assert not store.degraded
    moved_aside(path, kind, caplog.text)
    [rollback] = tmp_path.glob("state.db-journal.not-regular-*")
    assert rollback.read_bytes() == b"of another database"
    store._write_database({timer(2, "folded").store_key: timer(2, "folded")}, reset=True)
    store.close()
    assert stat.S_ISREG(os.lstat(path).st_mode)
    scopes = [t.scope for t in Store.open(str(path))[1].timers]
    assert sorted(scopes) == ["folded", "since-the-last-fold"]


@needs_root
@pytest.mark.parametrize("side", ["-journal", "-wal", "-shm"])
@pytest.mark.parametrize("kind", SPECIAL)
def test_a_side_file_of_sqlites_that_is_no_regular_file_is_moved_aside(
    tmp_path: Path, kind: str, side: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    store._write_database({timer(1, "kept").store_key: timer(1, "kept")}, reset=True)
    store.close()
    for name in os.listdir(tmp_path):
        if ".journal." in name:
            os.unlink(tmp_path / name)
    special = tmp_path / f"state.db{side}"
    make_special(kind, special)
    with freed_after(special):
        store, loaded = Store.open(path)
    try:
        assert [t.scope for t in loaded.timers] == ["kept"]
        assert not store.degraded
        moved_aside(special, kind, caplog.text)
        # A fold opens the database through SQLite, which makes its own files anew.
        store._write_database({timer(2, "folded").store_key: timer(2, "folded")}, reset=False)
    finally:
        store.close()
    assert sorted(t.scope for t in Store.open(path)[1].timers) == ["folded", "kept"]


@needs_root
def test_a_journal_started_where_something_else_is_goes_aside_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    special = tmp_path / "state.db.journal.2"
    make_special("fifo", special)
    with freed_after(special):
        assert store._rebase()  # a recovery starts journal 2
    store.put(timer(1, "after"))
    assert store.commit(store.generation)
    store.close()
    moved_aside(special, "fifo", caplog.text)
    assert [t.scope for t in Store.open(path)[1].timers] == ["after"]


def database_of_schema(path: str, named: str) -> None:
    """A database holding one timer, whose ``meta`` names schema ``named``."""
    store, _ = Store.open(path)
    store._write_database({timer(1, "a").store_key: timer(1, "a")}, reset=True)
    store.close()
    for journal in journals(Path(path).parent):
        os.unlink(Path(path).parent / journal)
    raw = sqlite3.connect(path)
    raw.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (named,))
    raw.commit()
    raw.close()


def test_a_newer_schema_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "state.db")
    database_of_schema(path, "99")
    store, loaded = Store.open(path)
    store.close()
    assert loaded.timers == []
    [aside] = loaded.moved_aside
    assert aside.startswith(f"{path}.schema-99-")
    assert any(".schema-99-" in name for name in os.listdir(tmp_path))
    # Moved whole, never decoded: what it held is still there.
    raw = sqlite3.connect(aside)
    assert raw.execute("SELECT count(*) FROM timers").fetchone() == (1,)
    raw.close()
    [line] = [r for r in caplog.records if "event=state_schema_unreadable" in r.getMessage()]
    assert line.levelname == "ERROR"
    assert f"newer than this daemon's {schema.SCHEMA}" in line.getMessage()
    assert "none of its timers are restored" in line.getMessage()
    assert f"moved_to={aside}" in line.getMessage()
    assert not store.degraded
    _, again = Store.open(path)  # a new, empty state in its place
    assert again.timers == []
    assert again.moved_aside == []


def test_a_schema_older_than_any_release_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "state.db")
    database_of_schema(path, "3")
    store, loaded = Store.open(path)
    store.close()
    assert loaded.timers == []
    [aside] = loaded.moved_aside
    assert aside.startswith(f"{path}.schema-3-")
    assert "older than any this daemon reads (from 4 on)" in caplog.text


def test_a_journal_of_a_newer_schema_is_moved_aside_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its first record names its schema: the journal is moved aside whole, not
    replayed even in part."""
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    payload = msgspec.msgpack.encode((False, [timer(1, "of-schema-99")], [], schema.boot_id(), 99))
    newer = RECORD.pack(len(payload), zlib.crc32(payload)) + payload
    Path(f"{path}.journal.7").write_bytes(newer)
    store, loaded = Store.open(path)
    store.close()
    assert loaded.timers == []
    [aside] = loaded.moved_aside
    assert aside.startswith(f"{path}.journal.7.schema-99-")
    assert Path(aside).read_bytes() == newer
    assert "event=state_schema_unreadable" in caplog.text
    assert not store.degraded


def test_a_journal_that_names_no_schema_is_of_schema_4(tmp_path: Path) -> None:
    """The first journals of schema 4 named none: their first record has four
    elements, the boot last."""
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    for journal in journals(tmp_path):
        os.unlink(tmp_path / journal)
    append(path, 1, Record(puts=[timer(1, "named-no-schema")], boot=schema.boot_id()))
    store, loaded = Store.open(path)
    store.close()
    assert [t.scope for t in loaded.timers] == ["named-no-schema"]
    assert loaded.moved_aside == []


def test_the_first_record_of_a_journal_names_this_schema(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    [first] = journals(tmp_path)
    data = (tmp_path / first).read_bytes()
    length, _ = RECORD.unpack_from(data)
    fields = msgspec.msgpack.decode(data[RECORD.size : RECORD.size + length])
    assert fields == [False, [], [], schema.boot_id(), schema.SCHEMA]


def test_state_from_another_boot_is_discarded(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    store._write_database({timer(10, "a").store_key: timer(10, "a")}, reset=True)
    store.close()
    for journal in journals(tmp_path):
        os.unlink(tmp_path / journal)
    raw = sqlite3.connect(path)
    raw.execute("UPDATE meta SET value = 'another-boot' WHERE key = 'boot_id'")
    raw.commit()
    raw.close()
    store, loaded = Store.open(path)
    store.close()
    assert loaded.timers == []
    _, again = Store.open(path)  # and it stays discarded
    assert again.timers == []


def own_timers(pids: list[int], starts: list[int]) -> dict[str, Timer]:
    """`WRITTEN` as `make_own` makes it, for processes ``pids``."""
    values = dict(zip(PIDS, zip(pids, starts, strict=True), strict=True))
    return {
        scope: msgspec.structs.replace(
            written,
            pid=values[written.pid][0],
            start_time=values[written.pid][1],
            uid=os.getuid(),
            owner=os.getuid(),
        )
        for scope, written in WRITTEN.items()
    }


@pytest.mark.parametrize("stored", SCHEMAS)
def test_the_state_of_every_released_schema_loads_as_it_was_written(
    stored: int, tmp_path: Path
) -> None:
    """tests/data/schemaN/ was written by the store of schema N (`write_state`): a
    database with armed timers of every built-in policy, one of a job with its
    progress watched and a firing one folded in, and a journal that arms one more,
    re-arms one and releases one. Every attribute comes back as it was written,
    through the migrations from N to this schema, and again once rewritten."""
    pids, starts = [101, 102, 103, 104], [11, 12, 13, 14]
    path = str(make_own(stored, tmp_path, pids, starts))
    for _ in range(2):
        store, loaded = Store.open(path)
        timers = loaded.timers + (store.load_later() if store.loading else [])
        store.close()
        assert {t.scope: t for t in timers} == own_timers(pids, starts)
        assert loaded.moved_aside == []
        assert not store.degraded


def test_every_schema_since_the_first_release_has_its_migration_and_its_state() -> None:
    """Schema 4 is that of the first release: each one since migrates from the one
    before it, and tests/data/ holds a state of each, written by its own store."""
    assert set(schema.MIGRATIONS) == set(range(4, schema.SCHEMA))
    assert set(range(4, schema.SCHEMA)) | {4} <= set(SCHEMAS)


def upgraded_policy(fields: list[object]) -> list[object]:
    """A migration to a hypothetical next schema, whose stored policy names say so."""
    return [*fields[:4], f"{fields[4]}@next", *fields[5:]]


async def test_the_loader_walks_the_migrations_to_this_schema_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon of a hypothetical schema after this one starts on
    tests/data/schema4/: the database and the journal are read through every
    migration from 4, the first journal of the run holds the whole state in the
    new schema, and once folded the database is of the new schema; neither is
    migrated again."""
    following = schema.SCHEMA + 1
    monkeypatch.setattr(schema, "SCHEMA", following)
    monkeypatch.setattr(schema, "MIGRATIONS", {**schema.MIGRATIONS, following - 1: upgraded_policy})
    pids, starts = [101, 102, 103, 104], [11, 12, 13, 14]
    path = str(make_own(4, tmp_path, pids, starts))
    expected = {
        scope: msgspec.structs.replace(t, policy=f"{t.policy}@next")
        for scope, t in own_timers(pids, starts).items()
    }
    store, loaded = Store.open(path)
    store.close()  # killed before its first fold
    assert {t.scope: t for t in loaded.timers} == expected
    [first] = journals(tmp_path)
    assert first == "state.db.journal.3"  # the older journals it supersedes are gone
    store, loaded = Store.open(path)
    assert {t.scope: t for t in loaded.timers} == expected
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        with trio.fail_after(5):
            while store._fold_wanted or store._folding:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    store.close()
    raw = sqlite3.connect(path)
    assert raw.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (
        str(following),
    )
    raw.close()
    store, loaded = Store.open(path, load_ahead=math.inf)
    store.close()
    assert {t.scope: t for t in loaded.timers} == expected


def test_migrations_run_in_order_from_the_files_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "SCHEMA", 6)
    monkeypatch.setattr(
        schema,
        "MIGRATIONS",
        {4: upgraded_policy, 5: lambda fields: [*fields[:4], f"{fields[4]}@6", *fields[5:]]},
    )
    array = msgspec.msgpack.encode([timer(1, "a")])
    assert [t.policy for t in schema.decode_timers(array, 4)] == ["kill@next@6"]
    assert [t.policy for t in schema.decode_timers(array, 5)] == ["kill@6"]
    schema.check(4)
    with pytest.raises(schema.SchemaError, match="schema 3, older than any this daemon reads"):
        schema.check(3)
    with pytest.raises(schema.SchemaError, match="schema 7, newer than this daemon's 6"):
        schema.check(7)


def test_a_clients_arming_number_of_schema_6_moves_into_the_timers_watch() -> None:
    """Schema 6 stored the number a client gave each arming as a timer's last
    field; schema 7 keeps it, where it is not 0, in the timer's `Watch`
    (``client_arm``), made for it when the timer had none, for the release of
    the client that armed it before the upgrade."""
    plain = timer(1, "plain")
    numbered = timer(1, "numbered", deadline=101.0)
    watched = timer(1, "watched", watch=Watch(job="j", rank=2, progress=4))

    def as_in_6(armed: Timer, arm: int) -> list[object]:
        fields = msgspec.to_builtins(armed)
        if fields[-1] is not None:
            fields[-1] = fields[-1][1:11]  # a Watch of schema 6: no tag, no client_arm
        return [*fields, arm]

    array = msgspec.msgpack.encode(
        [as_in_6(plain, 0), as_in_6(numbered, 7), as_in_6(watched, 2**40)]
    )
    assert schema.decode_timers(array, 6) == [
        plain,
        msgspec.structs.replace(numbered, watch=Watch(client_arm=7)),
        msgspec.structs.replace(
            watched, watch=Watch(job="j", rank=2, progress=4, client_arm=2**40)
        ),
    ]
    with pytest.raises(msgspec.ValidationError, match="does not migrate"):
        schema.decode_timers(msgspec.msgpack.encode([[*as_in_6(plain, 0)[:-2], "no watch", 1]]), 6)


def test_the_watches_and_slots_of_schema_9_are_read_with_their_tags() -> None:
    """Schema 9 stored a `Watch` and the `SlotRef` in it as plain arrays; schema 10
    leads each with its tag (a registration that needs nothing else keeps its bare
    `SlotRef`), and reads a timer of schema 9 as it was."""
    ref = SlotRef(page=123_456, index=5, period=0.875)
    plain = timer(1, "plain")
    watched = timer(1, "watched", watch=Watch(job="j", rank=2, progress=4))
    registered = timer(1, "registered", watch=Watch(progressed_at=90.0, slot=ref))

    def as_in_9(armed: Timer) -> list[object]:
        fields = msgspec.to_builtins(armed)
        watch = fields[-1]
        if watch is not None:
            watch = watch[1:]  # no tag
            if watch[-1] is not None:
                watch[-1] = watch[-1][1:]
        return [*fields[:-1], watch]

    assert msgspec.to_builtins(registered)[-1][-1] == [2, 123_456, 5, 0.875]
    array = msgspec.msgpack.encode([as_in_9(each) for each in (plain, watched, registered)])
    assert schema.decode_timers(array, 9) == [plain, watched, registered]
    bare = msgspec.structs.replace(registered, watch=ref)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(bare), type=Timer) == bare
    with pytest.raises(msgspec.ValidationError, match="does not migrate"):
        schema.decode_timers(msgspec.msgpack.encode([[*as_in_9(plain)[:-1], "no watch"]]), 9)


def test_a_timer_that_does_not_migrate_is_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schema, "SCHEMA", 5)
    monkeypatch.setattr(schema, "MIGRATIONS", {4: lambda fields: fields[99]})
    path = str(make_own(4, tmp_path, [101, 102, 103, 104], [11, 12, 13, 14]))
    store, loaded = Store.open(path)
    store.close()
    assert loaded.timers == []
    assert sorted(Path(aside).name.split("-")[0] for aside in loaded.moved_aside) == [
        "state.db.damaged",
        "state.db.journal.2.damaged",
    ]


def test_loaded_timers_share_their_repeated_values(tmp_path: Path) -> None:
    """A decoded record would hold its own copy of every value; loaded timers hold
    one object per distinct pid, start time, policy, uid and timeout, from
    the database and the journals alike (a million of them would otherwise cost
    some 200 bytes each more than when armed)."""
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    folded = [timer(4000 + i % 3, f"s{i}", deadline=100.0 + i) for i in range(200)]
    raw = sqlite3.connect(path, isolation_level=None)
    database.replace_all(raw, {t.store_key: t for t in folded}, schema.boot_id())
    raw.close()
    append(path, 1, Record(puts=[timer(4000, "from-the-journal", deadline=50.0)]))
    # Every timer in the first read, whatever the host's uptime (the deadlines are
    # on its monotonic clock, and those past the look ahead would be read later).
    store, loaded = Store.open(path, load_ahead=math.inf)
    store.close()
    assert len(loaded.timers) == 201
    for name in ("policy", "uid", "owner", "timeout", "start_time"):
        assert len({id(getattr(t, name)) for t in loaded.timers}) == 1, name
    assert len({id(t.pid) for t in loaded.timers}) == 3


def test_a_record_is_one_timer_shape() -> None:
    """What the journal holds is the in-memory Timer itself."""
    armed = timer(1, "x", firing=2, step=1, step_end=5.0, fired_at=4.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(armed), type=Timer)
    assert decoded == armed


async def test_a_reset_record_is_folded_as_a_reset(tmp_path: Path) -> None:
    """A timer released while degraded must not come back from the database once
    the whole state was written after the disk returned (the reset record)."""
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    store._write_database({timer(1, "released").store_key: timer(1, "released")}, reset=True)
    for journal in journals(tmp_path):
        os.unlink(tmp_path / journal)
    store.close()
    store, loaded = Store.open(path)
    assert [t.scope for t in loaded.timers] == ["released"]
    store.snapshot = lambda: [timer(2, "kept")]  # the state in memory: released since
    store.degraded = True
    assert store.recover()
    store.close()  # killed before the fold
    store, loaded = Store.open(path)
    assert [t.scope for t in loaded.timers] == ["kept"]
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        with trio.fail_after(5):
            while store._fold_wanted or store._folding:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    store.close()
    assert [t.scope for t in Store.open(path)[1].timers] == ["kept"]


def test_a_journal_of_another_boot_is_not_replayed(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    append(path, 7, Record(puts=[timer(1, "before-the-reboot")], boot="another-boot"))
    store, loaded = Store.open(path)
    store.close()
    assert loaded.timers == []


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE meta SET value = '2x' WHERE key = 'schema'",
        "UPDATE timers SET record = 'text, not a record'",
    ],
)
def test_unreadable_database_content_is_moved_aside(tmp_path: Path, damage: str) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    store._write_database({timer(1, "a").store_key: timer(1, "a")}, reset=True)
    store.close()
    raw = sqlite3.connect(path)
    raw.execute(damage)
    raw.commit()
    raw.close()
    store, loaded = Store.open(path)
    store.close()
    assert len(loaded.moved_aside) == 1
    assert not store.degraded


async def test_a_database_that_refuses_folds_keeps_memory_and_journals_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path, journal_bytes=4096)
    live: dict[tuple[int, str, int], Timer] = {}
    store.snapshot = lambda: list(live.values())

    def refuse(changes: object, reset: bool) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "_write_database", refuse)
    journal_most = memory_most = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        for index in range(10_000):
            armed = timer(10_000 + index, "churn")
            store.put(armed)
            store.drop(armed)  # released: nothing stays live
            assert store.commit(store.generation)
            await trio.sleep(0)
            journal_most = max(journal_most, store._written)
            memory_most = max(memory_most, len(store._unfolded))
        nursery.cancel_scope.cancel()
    store.close()
    assert len(journals(tmp_path)) <= 3
    # Nothing is kept for the database once a fold failed, and the journal is
    # replaced once past four times its bound; only what arrives while a fold is in
    # flight comes on top. Unbounded, both would grow with all 10,000 changes
    # (10,000 entries, about 380 KiB).
    assert memory_most <= 3000
    assert journal_most <= 16 * 4096


def test_a_start_loads_the_timers_due_soon_first_and_the_rest_later(tmp_path: Path) -> None:
    """The database's timers due within the load-ahead and the firing ones come
    from `Store.open`; the later ones from `Store.load_later`, the journals'
    changes winning over the database in both (a key released or re-armed
    since the fold is never loaded from it)."""
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    now = time.monotonic()
    folded = [
        timer(1, "soon", deadline=now + 5),
        timer(1, "later", deadline=now + 300),
        timer(2, "released-since", deadline=now + 400),
        timer(2, "re-armed-later", deadline=now + 5),
        timer(3, "firing", deadline=now - 1, firing=1, fired_at=now - 1),
    ]
    store._write_database({t.store_key: t for t in folded}, reset=True)
    store.close()
    for journal in journals(tmp_path):
        os.unlink(tmp_path / journal)
    re_armed = timer(2, "re-armed-later", deadline=now + 500)
    append(
        path,
        1,
        Record(
            puts=[timer(4, "journaled-soon", deadline=now + 1), re_armed],
            drops=[(2, "released-since", 0)],
        ),
    )
    store, loaded = Store.open(path, load_ahead=60.0)
    try:
        assert store.loading
        assert sorted(t.scope for t in loaded.timers) == ["firing", "journaled-soon", "soon"]
        later = store.load_later()
        assert sorted(t.scope for t in later) == ["later", "re-armed-later"]
        assert [t for t in later if t.scope == "re-armed-later"] == [re_armed]
        store.loaded()
        assert not store.loading
        assert not store.degraded
    finally:
        store.close()
    # Nothing due later: nothing is left for later.
    store, loaded = Store.open(path, load_ahead=math.inf)
    store.close()
    assert not store.loading
    assert len(loaded.timers) == 5


def test_no_fold_and_no_full_write_before_the_load_is_whole(tmp_path: Path) -> None:
    """While the later timers are being read, the state in memory is not whole: a
    recovery that wrote it would lose them. It waits for `Store.loaded`."""
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    now = time.monotonic()
    folded = [timer(1, "soon", deadline=now + 1), timer(1, "later", deadline=now + 300)]
    store._write_database({t.store_key: t for t in folded}, reset=True)
    store.close()
    store, loaded = Store.open(path, load_ahead=60.0)
    try:
        store.snapshot = lambda: loaded.timers  # what a daemon holds so far
        store.degraded = True
        assert not store.recover()
        assert not store.commit(store.generation + 1)
        store.load_later()
        store.loaded()
        store._retry_at = 0.0
        store.snapshot = lambda: folded
        assert store.recover()
    finally:
        store.close()
    store, loaded = Store.open(path, load_ahead=math.inf)
    store.close()
    assert sorted(t.scope for t in loaded.timers) == ["later", "soon"]


def test_damage_found_by_the_later_load_moves_the_database_aside_and_writes_it_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record due later that does not decode: the start went on with the first
    timers; the later read moves the database aside (ERROR, where to), and what
    is in memory is written anew, so the next start has it."""
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    now = time.monotonic()
    store._write_database(
        {timer(1, "soon", deadline=now + 1).store_key: timer(1, "soon", deadline=now + 1)},
        reset=True,
    )
    store.close()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("INSERT INTO timers VALUES (1, 'garbled', 0, ?, ?)", (now + 300, b"\xc1"))
    raw.close()
    store, loaded = Store.open(path, load_ahead=60.0)
    try:
        assert [t.scope for t in loaded.timers] == ["soon"]
        store.snapshot = lambda: loaded.timers
        assert store.load_later() == []
        store.loaded()
        assert not store.degraded
    finally:
        store.close()
    assert any(".damaged-" in name for name in os.listdir(tmp_path))
    assert "event=state_damaged" in caplog.text
    store, again = Store.open(path, load_ahead=math.inf)
    store.close()
    assert [t.scope for t in again.timers] == ["soon"]


def test_a_write_looks_at_the_journals_name_when_the_watch_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fstat(2) after a write costs more than the write: a write checks the
    journal's link count when its inotify watch saw something happen to it, or
    the journal is new. A deletion is seen by the first write after it, before
    that write is acknowledged, and the state is written anew there."""
    looked: list[int | None] = []

    def unlinked(fd: int | None) -> bool:
        looked.append(fd)
        return journal_module.unlinked(fd)

    monkeypatch.setattr(store_module, "unlinked", unlinked)
    directory = tmp_path / "state"
    store, _ = Store.open(str(directory / "state.db"))
    held = [timer(1, f"s{n}") for n in range(100)]
    store.snapshot = lambda: held
    for armed in held:
        store.put(armed)
        assert store.commit(store.generation)
    assert len(looked) == 1  # the journal's first write: a journal new to the watch
    shutil.rmtree(directory)
    held.append(timer(1, "after"))
    store.put(held[-1])
    assert store.commit(store.generation)  # written anew, before the answer
    assert len(looked) == 2
    assert (directory / "state.db").exists()
    assert not store.degraded
    store.close()
    _, loaded = Store.open(str(directory / "state.db"))
    assert len(loaded.timers) == 101
