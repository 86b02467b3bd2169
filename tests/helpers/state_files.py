"""The state files kept in tests/data/: each ``schemaN/`` was written by the store of
schema N, and every later daemon must start on it with its timers.

What they hold is `WRITTEN`, written by `write_state` (a database with most timers
folded in, then a journal of changes since). They were written on another host, in
another boot: their pids, start times, uids and boot are stand-ins (`PIDS`,
`STARTS`, `UID`, `BOOT`, values no real process or boot has), which
`make_own` replaces in a copy with those of live processes, of the test's user and
of this boot, in the stored bytes themselves, without the store of the day.
Deadlines are near a billion seconds on CLOCK_MONOTONIC (`THEN`), which no host's
uptime reaches: the timers are still ahead wherever a test runs.

When the stored form changes (a new schema), write ``tests/data/schemaN/`` with the
store of schema N, before the change: ``python tests/helpers/state_files.py tests/data/schemaN``.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import struct
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import msgspec
import trio

from watchdogd.core.policies import BUILTIN
from watchdogd.core.timers import Course, Timer, Watch

DATA = Path(__file__).parent.parent / "data"
#: The schemas that tests/data/ holds a state of.
SCHEMAS = sorted(int(path.name.removeprefix("schema")) for path in DATA.glob("schema*"))

#: The stand-ins, distinct from each other and from any other value in the files:
#: pids above the largest pid_max, start times and a uid no process has.
PIDS = (9_000_001, 9_000_002, 9_000_003, 9_000_004)
STARTS = (9_100_000_001, 9_100_000_002, 9_100_000_003, 9_100_000_004)
UID = 9_200_001
BOOT = "5ca1ab1e-0000-4000-8000-00000000da7a"
#: "Now", on the monotonic clock of the daemon that wrote the files.
THEN = 1_000_000_000.0


def _timer(process: int, scope: str, policy: str, timeout: float, **fields: Any) -> Timer:
    """An armed timer of process ``process`` (0 to 3), armed five seconds before
    `THEN` unless ``fields`` say otherwise."""
    fields.setdefault("armed_at", THEN - 5)
    fields.setdefault("deadline", fields["armed_at"] + timeout)
    return Timer(
        pid=PIDS[process],
        scope=scope,
        policy=policy,
        uid=UID,
        owner=UID,
        timeout=timeout,
        start_time=STARTS[process],
        **fields,
    )


#: Folded into the database: armed timers of each built-in policy, one of a job
#: with its progress watched, and an expiry whose policy was in progress.
FOLDED = (
    _timer(0, "train/step", "kill", 60.0),
    _timer(0, "checkpoint", "term", 600.0),
    _timer(
        1,
        "rank-3/allreduce",
        "abort",
        300.0,
        deadline=THEN + 28,
        seq=1,
        watch=Watch(
            progress=41,
            progressed_at=THEN - 2,
            stall=30.0,
            job="job-7",
            rank=3,
            local_rank=1,
            group_rank=0,
        ),
    ),
    _timer(2, "released-later", "kill", 120.0),
    _timer(
        2,
        "hung",
        "log",
        4.0,
        armed_at=THEN - 5,
        deadline=THEN - 1,
        firing=1,
        run=Course(fired_at=THEN - 1, plan=BUILTIN["log"].plan),
    ),
)
#: Then, in the journal: a timer armed since (on a deadline it shares with one
#: folded, so told apart by ``seq``), one re-armed, one released.
JOURNALED = (
    _timer(3, "from-the-journal", "signal:USR1", 33.0, seq=2, exit_releases=True),
    _timer(0, "train/step", "kill", 60.0, armed_at=THEN - 2),
)
RELEASED = ("released-later",)

#: What the files hold, by scope.
WRITTEN = {timer.scope: timer for timer in (*FOLDED, *JOURNALED) if timer.scope not in RELEASED}


def make_own(schema: int, into: Path, pids: list[int], starts: list[int]) -> Path:
    """Copy ``tests/data/schema{schema}/`` into ``into`` as if this boot had written
    it for processes ``pids`` (started at ``starts``) of the test's user; returns
    the path of the copy's database.

    Works on the files' own bytes: the rows of the database (their ``pid`` column
    and their msgpack ``record``), its ``meta`` table's ``boot_id``, and the
    journals' records (a length and CRC-32, then msgpack) are decoded without a
    type, every stand-in in them replaced, and written back."""
    into.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(DATA / f"schema{schema}"):
        shutil.copy(DATA / f"schema{schema}" / name, into / name)
    with open("/proc/sys/kernel/random/boot_id") as boot:
        values: dict[object, object] = {BOOT: boot.read().strip()}
    values.update(zip(PIDS, pids, strict=True))
    values.update(zip(STARTS, starts, strict=True))
    values[UID] = os.getuid()
    database = into / "state.db"
    db = sqlite3.connect(database, isolation_level=None)
    # Every column as it is but the pid and the record: a schema's columns are
    # its own (schema 5 added ``due``).
    cursor = db.execute("SELECT * FROM timers")
    columns = [column for column, *_ in cursor.description]
    rows = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
    db.execute("DELETE FROM timers")
    for row in rows:
        row["pid"] = values.get(row["pid"], row["pid"])
        row["record"] = msgspec.msgpack.encode(
            _replaced(msgspec.msgpack.decode(row["record"]), values)
        )
        db.execute(
            f"INSERT INTO timers ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
            [row[column] for column in columns],
        )
    db.execute("UPDATE meta SET value = ? WHERE key = 'boot_id'", (values[BOOT],))
    db.close()
    header = struct.Struct(">II")
    for journal in into.glob("state.db.journal.*"):
        data, out, offset = journal.read_bytes(), b"", 0
        while offset < len(data):
            length, _ = header.unpack_from(data, offset)
            start = offset + header.size
            payload = msgspec.msgpack.decode(data[start : start + length])
            payload = msgspec.msgpack.encode(_replaced(payload, values))
            out += header.pack(len(payload), zlib.crc32(payload)) + payload
            offset = start + length
        journal.write_bytes(out)
    return database


def _replaced(value: object, values: dict[object, object]) -> object:
    """``value`` (decoded msgpack) with every stand-in in ``values`` replaced."""
    if isinstance(value, list):
        return [_replaced(item, values) for item in value]
    if isinstance(value, dict):
        return {key: _replaced(item, values) for key, item in value.items()}
    if type(value) in (int, str):
        return values.get(value, value)
    return value


def write_state(directory: Path) -> None:
    """Write `WRITTEN` with the store of this checkout, as a daemon would have
    left it when killed: `FOLDED` in the database, then a journal of `JOURNALED`
    and `RELEASED`. Every file names the boot `BOOT`."""
    from watchdogd.storage import schema
    from watchdogd.storage.store import Store

    with tempfile.NamedTemporaryFile("w") as boot:
        boot.write(BOOT + "\n")
        boot.flush()
        schema._BOOT_ID = boot.name  # type: ignore[misc]
        trio.run(_write, str(directory / "state.db"), Store)


async def _write(path: str, store_class: Any) -> None:
    store, loaded = store_class.open(path)
    assert loaded.timers == []
    for timer in FOLDED:
        store.put(timer)
    assert store.commit(store.generation)
    await store._fold()  # into the database, and a new journal
    for timer in JOURNALED:
        store.put(timer)
    for timer in FOLDED:
        if timer.scope in RELEASED:
            store.drop(timer)
    assert store.commit(store.generation)
    store.close()  # killed before its next fold


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True)
    write_state(target)
    print("\n".join(sorted(os.listdir(target))))
