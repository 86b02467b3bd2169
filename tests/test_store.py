"""The state file: writes, group commits, and files that cannot be used."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest
import trio

from watchdogd.store import Row, Store, default_state_path
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


def test_default_path_is_beside_the_socket() -> None:
    assert (
        default_state_path("/run/watchdogd/watchdogd.sock") == "/run/watchdogd/watchdogd.state.db"
    )


def test_a_new_file_is_private_and_empty(tmp_path: Path) -> None:
    store, rows = Store.open(str(tmp_path / "state.db"))
    store.close()
    assert rows == []
    assert stat.S_IMODE(os.stat(tmp_path / "state.db").st_mode) == 0o600


async def test_changes_collapse_and_commit_together(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store, _ = Store.open(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        store.put(timer(10, "a"), 555)
        store.put(timer(10, "b"), 555)
        store.put(timer(10, "a", deadline=200.0), 555)  # re-armed: only the last counts
        store.put(timer(11, "gone"), 777)
        store.drop((11, "gone"))
        await store.commit(store.generation)
        nursery.cancel_scope.cancel()
    store.close()
    # What another process sees, as after a crash: the committed rows.
    _, rows = Store.open(path)
    assert sorted(rows, key=lambda row: row.scope) == [
        Row(10, "a", "kill", 1000, 1000, 10.0, 190.0, 200.0, 555),
        Row(10, "b", "kill", 1000, 1000, 10.0, 90.0, 100.0, 555),
    ]


async def test_one_commit_serves_every_change_of_a_turn(tmp_path: Path) -> None:
    store, _ = Store.open(str(tmp_path / "state.db"))
    transactions = 0
    write = store._write

    def counting_write(batch: dict[tuple[int, str], tuple[object, ...] | None]) -> None:
        nonlocal transactions
        transactions += 1
        write(batch)

    store._write = counting_write  # type: ignore[method-assign]
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
    assert transactions == 1
    store.close()
    raw = sqlite3.connect(tmp_path / "state.db")
    assert raw.execute("SELECT count(*) FROM timers").fetchone() == (5,)
    raw.close()


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


def test_a_corrupt_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database" * 100)
    store, rows = Store.open(str(path))
    store.close()
    assert rows == []
    aside = [name for name in os.listdir(tmp_path) if name.startswith("state.db.unreadable-")]
    assert len(aside) == 1
    assert (tmp_path / aside[0]).read_bytes().startswith(b"this is not a database")
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


async def test_a_failed_write_keeps_its_changes_for_the_next(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    # A state file whose COMMIT fails while pid 999 has no parent row: a stand-in
    # for a disk that is full at commit time.
    raw = sqlite3.connect(path)
    raw.executescript(
        """
        CREATE TABLE parent (pid INTEGER PRIMARY KEY);
        INSERT INTO parent VALUES (1);
        CREATE TABLE timers (
            pid INTEGER NOT NULL REFERENCES parent(pid) DEFERRABLE INITIALLY DEFERRED,
            scope TEXT NOT NULL, policy TEXT NOT NULL, uid INTEGER NOT NULL,
            owner INTEGER NOT NULL, timeout REAL NOT NULL, armed_at REAL NOT NULL,
            deadline REAL NOT NULL, start_time INTEGER NOT NULL,
            PRIMARY KEY (pid, scope)) WITHOUT ROWID;
        """
    )
    raw.close()
    store, _ = Store.open(str(path))
    store._db.execute("PRAGMA foreign_keys=ON")
    store.put(timer(999, "refused"), 1)
    store.put(timer(1, "kept"), 1)
    await store.commit(store.generation)  # acknowledged: the daemon keeps serving
    assert store.errors == 1
    assert not store._db.in_transaction  # rolled back, not left open
    store._db.execute("INSERT INTO parent VALUES (999)")  # the disk has room again
    store.put(timer(1, "later"), 1)
    await store.commit(store.generation)
    assert store.errors == 1
    store.close()
    raw = sqlite3.connect(path)
    assert sorted(row[0] for row in raw.execute("SELECT scope FROM timers")) == [
        "kept",
        "later",
        "refused",
    ]
    raw.close()
