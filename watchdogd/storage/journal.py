"""The journals: append-only files (``PATH.journal.N``) of checksummed records of
changes to the state, replayed in order over the database at start.

Invariants:

- A record is one ``write(2)``: its payload's length and CRC-32, then the payload,
  a `Record` in msgpack. Nothing is fsynced: what was written is in the kernel's
  page cache, which survives the daemon being killed at any instant.
- The first record of every journal names the ``boot`` it was written in: a
  journal of another boot is never replayed.
- A record cut short at the end of the newest journal (a write the daemon died in,
  never acknowledged) ends that journal. A damaged record (a bad checksum or
  undecodable content in a complete record) is damage: the good prefix counts and
  the journal is moved aside (`watchdogd.storage.faults.Aside`).
- Journals are numbered from 1 up; a name whose suffix is not a number (a journal
  moved aside) is never replayed.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Final

import msgspec

from ..core.timers import StoreKey, Timer
from ..logs import log, logfmt
from .faults import Aside, reason
from .schema import Changes, Shared, boot_id, share_values

#: A journal record: payload length and CRC-32, then the msgpack payload.
RECORD: Final = struct.Struct(">II")
#: No record is larger (the full state of the largest table is far smaller): a
#: header declaring more is damage, not a write cut short.
_MAX_RECORD: Final = 1 << 30


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
CHANGES: Final = Record()

_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(Record)


def encode(header: Record, changes: Mapping[StoreKey, Timer | None]) -> bytes:
    """A journal record of ``changes`` under ``header``'s ``reset`` and ``boot``:
    the bytes of the `Record` they make, encoded as its array without making one
    (a reply's commit makes a record, `CHANGES`)."""
    puts: list[Timer] = []
    drops: list[StoreKey] = []
    for key, timer in changes.items():
        if timer is None:
            drops.append(key)
        else:
            puts.append(timer)
    payload = _encoder.encode((header.reset, puts, drops, header.boot))
    return RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def records(data: bytes, *, newest: bool) -> Iterator[Record | str]:
    """The records of a journal, in order; a description of the damage ends them
    at a record that is not valid.

    A record cut short at the end of the ``newest`` journal is a write the daemon
    died in (never acknowledged): it ends the journal quietly. Anywhere else, or
    declaring more than any record could hold, it is damage."""
    offset = 0
    while offset < len(data):
        length = checksum = 0
        if offset + RECORD.size <= len(data):
            length, checksum = RECORD.unpack_from(data, offset)
        start = offset + RECORD.size
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


def replay(
    path: str, shared: Shared, aside: Aside, degrade: Callable[[str], object]
) -> tuple[Changes, bool, int]:
    """The changes the journals of ``path`` record, in order; whether one of them
    starts over from a reset record; and the highest journal number found.

    A damaged journal counts up to the damage and is moved aside; one that cannot
    be read is kept for the next start, and the store is degraded."""
    changes: Changes = {}
    reset = False
    found = journals(path)
    for journal in found:
        try:
            with open(journal, "rb") as source:
                data = source.read()
        except OSError as exc:
            # Unreadable is not proof of damage: it is kept for the next start.
            degrade(reason(exc))
            aside.keep(journal)
            continue
        for index, record in enumerate(records(data, newest=journal == found[-1])):
            if isinstance(record, str):
                aside.move(journal, record)
                break
            if index == 0 and record.boot not in ("", boot_id()):
                log.info(logfmt("state_from_another_boot", path=journal))
                break
            if record.reset:
                changes, reset = {}, True
            share_values(record.puts, shared)
            for timer in record.puts:
                changes[timer.store_key] = timer
            for pid, scope, firing in record.drops:
                changes[(pid, scope, firing)] = None
    return changes, reset, max(map(number_of, found), default=0)


def write_all(fd: int | None, data: bytes) -> None:
    if fd is None:
        raise OSError(errno.EBADF, "no journal is open")
    if os.write(fd, data) != len(data):
        raise OSError(errno.ENOSPC, "No space left on device (a record was written in part)")


def close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def path_of(path: str, number: int) -> str:
    """Journal ``number`` of the state ``path``."""
    return f"{path}.journal.{number}"


def journals(path: str) -> list[str]:
    """The journals of ``path``, oldest first (damaged ones moved aside excluded)."""
    found = glob.glob(glob.escape(path) + ".journal.*")
    return sorted((j for j in found if number_of(j) > 0), key=number_of)


def number_of(journal: str) -> int:
    suffix = journal.rsplit(".", 1)[1]
    return int(suffix) if suffix.isdigit() else -1
