"""The state file: writes, group commits, and files that cannot be used."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import zlib
from pathlib import Path

import msgspec
import pytest
import trio

from watchdogd import store as store_module
from watchdogd.store import Row, StateError, Store, default_state_path
from watchdogd.timers import Timer


def timer(pid: int, scope: str, deadline: float = 100.0) -> Timer:
    return Timer(
        pid=pid,
        scope=scope,
        policy="kill",
        uid=1000,
        owner=1000,
        timeout=10.0,
        armed_at=deadline - 10,
        deadline=deadline,
        seq=0,
    )


def values(pid: int, scope: str) -> tuple[object, ...]:
    return (pid, scope, "kill", 1000, 1000, 10.0, 90.0, 100.0, 1)


def test_default_path_is_beside_the_socket() -> None:
    assert (
        default_state_path("/run/watchdogd/watchdogd.sock") == "/run/watchdogd/watchdogd.state.db"
    )


def test_a_new_state_is_private_and_empty(tmp_path: Path) -> None:
    store, rows = Store.open(str(tmp_path / "state.db"))
    store.close()
    assert rows == []
    for name in ("state.db", "state.db.journal.1"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600


def test_changes_collapse_and_survive_a_crash(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    child = os.fork()
    if child == 0:  # pragma: no cover - the daemon that dies
        store, _ = Store.open(path)
        store.put(timer(10, "a"), 555)
        store.put(timer(10, "b"), 555)
        store.put(timer(10, "a", deadline=200.0), 555)  # re-armed: only the last counts
        store.put(timer(11, "gone"), 777)
        store.drop((11, "gone"))
        trio.run(store.commit, store.generation)
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no fold: a crash
    os.waitpid(child, 0)
    _, rows = Store.open(path)
    assert sorted(rows, key=lambda row: row.scope) == [
        Row(10, "a", "kill", 1000, 1000, 10.0, 190.0, 200.0, 555),
        Row(10, "b", "kill", 1000, 1000, 10.0, 90.0, 100.0, 555),
    ]


async def test_one_write_serves_every_change_of_a_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = Store.open(str(tmp_path / "state.db"))
    writes: list[int] = []
    write_all = store_module._write_all

    def counting(fd: int, data: bytes) -> None:
        writes.append(len(data))
        write_all(fd, data)

    monkeypatch.setattr(store_module, "_write_all", counting)
    acknowledged: list[int] = []

    async def acknowledge(pid: int) -> None:
        store.put(timer(pid, "s"), 1)
        changed = store.generation
        await trio.lowlevel.checkpoint()  # as the server does before committing
        await store.commit(changed)
        acknowledged.append(pid)

    async with trio.open_nursery() as nursery:
        for pid in range(5):
            nursery.start_soon(acknowledge, pid)
    assert sorted(acknowledged) == list(range(5))
    assert len(writes) == 1
    store.close()
    assert len(Store.open(str(tmp_path / "state.db"))[1]) == 5


async def test_changes_nobody_waits_for_are_written_soon(tmp_path: Path) -> None:
    store, _ = Store.open(str(tmp_path / "state.db"))
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        store.put(timer(1, "expired-later"), 1)
        store.commit_soon()
        with trio.fail_after(5):
            while store._committed < store.generation:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    store.close()


async def test_full_journals_are_folded_into_the_database(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path, journal_bytes=2000)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        for i in range(200):
            store.put(timer(i, "s"), 1)
            if i % 3 == 0:
                store.drop((i, "s"))
            await store.commit(store.generation)
            await trio.sleep(0)
        with trio.fail_after(5):
            while store._folding or store._written >= store._journal_bytes:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    journals = sorted(name for name in os.listdir(tmp_path) if ".journal." in name)
    assert len(journals) == 1  # the folded ones are gone
    store.close()
    raw = sqlite3.connect(path)
    in_database = raw.execute("SELECT count(*) FROM timers").fetchone()[0]
    raw.close()
    assert 0 < in_database <= 133
    _, rows = Store.open(path)
    assert sorted(row.pid for row in rows) == [i for i in range(200) if i % 3]


def test_a_record_cut_short_ends_its_journal_not_the_next(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    for number, scope, tail in ((1, "whole", b"\x00\x00\x01\x00cut"), (2, "next", b"")):
        record = msgspec.msgpack.encode([(number, scope, list(values(number, scope)))])
        journal = store_module._open_journal(path, number)
        os.write(journal, store_module._RECORD.pack(len(record), zlib.crc32(record)) + record)
        os.write(journal, tail)  # the daemon died while writing this
        os.close(journal)
    _, rows = Store.open(path)
    assert sorted(row.scope for row in rows) == ["next", "whole"]


def test_a_state_held_by_another_daemon_is_refused_not_moved(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    holder, _ = Store.open(path)
    try:
        with pytest.raises(StateError, match="in use by another watchdogd"):
            Store.open(path)
        assert not [name for name in os.listdir(tmp_path) if "unreadable" in name]
    finally:
        holder.close()


async def test_a_failed_write_keeps_its_changes_for_the_next(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    os.close(store._fd)
    store._fd = os.open("/dev/null", os.O_RDONLY)  # as good as a full disk
    store.put(timer(1, "first"), 1)
    await store.commit(store.generation)  # acknowledged: the daemon keeps serving
    assert store.errors == 1
    store.put(timer(1, "second"), 1)  # a new journal takes both
    await store.commit(store.generation)
    assert store.errors == 1
    store.close()
    _, rows = Store.open(path)
    assert sorted(row.scope for row in rows) == ["first", "second"]


async def test_a_failed_fold_keeps_the_journals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path, journal_bytes=1)

    def failing(db: sqlite3.Connection, changes: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store_module, "_write", failing)
    store.put(timer(1, "kept"), 1)
    await store.commit(store.generation)
    await store._fold()
    assert store.errors == 1
    assert store._unfolded  # still owed to the database
    monkeypatch.undo()
    store.close()
    _, rows = Store.open(path)
    assert [row.scope for row in rows] == ["kept"]


def test_a_corrupt_database_is_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database" * 100)
    (tmp_path / "state.db.journal.3").write_bytes(b"orphan")
    store, rows = Store.open(str(path))
    store.close()
    assert rows == []
    aside = sorted(name for name in os.listdir(tmp_path) if ".unreadable-" in name)
    assert len(aside) == 2  # the database and its journal
    database = next(
        name for name in aside if name.startswith("state.db.unreadable-") and "journal" not in name
    )
    assert (tmp_path / database).read_bytes().startswith(b"this is not a database")
    assert "event=state_unreadable" in caplog.text


def test_a_newer_schema_is_moved_aside(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    Store.open(path)[0].close()
    raw = sqlite3.connect(path)
    raw.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    raw.commit()
    raw.close()
    store, rows = Store.open(path)
    store.close()
    assert rows == []
    assert any(name.startswith("state.db.unreadable-") for name in os.listdir(tmp_path))


def test_state_from_another_boot_is_discarded(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    store.put(timer(10, "a"), 1)
    store.write_now()
    store.close()
    raw = sqlite3.connect(path)
    raw.execute("UPDATE meta SET value = 'another-boot' WHERE key = 'boot_id'")
    raw.commit()
    raw.close()
    store, rows = Store.open(path)
    store.close()
    assert rows == []
