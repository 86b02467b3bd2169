"""The journals: append-only files (``PATH.journal.N``) of checksummed records of
changes to the state, replayed in order over the database at start.

Invariants:

- A record is one ``write(2)``: its payload's length and CRC-32, then the payload,
  a `Record` in msgpack. Nothing is fsynced: what was written is in the kernel's
  page cache, which survives the daemon being killed at any instant.
- The first record of every journal names the ``boot`` it was written in (a
  journal of another boot is never replayed) and the schema of every record in it
  (`watchdogd.storage.schema`): a fifth element, which `Record` does not hold; a
  journal whose first record names none is of schema 4.
- A record cut short at the end of the newest journal (a write the daemon died in,
  never acknowledged) ends that journal. A damaged record (a bad checksum or
  undecodable content in a complete record) is damage: the good prefix counts and
  the journal is moved aside (`watchdogd.storage.faults.Aside`). A journal of a
  schema this daemon cannot read is moved aside whole, unread.
- A journal is read only if it is a regular file (`watchdogd.storage.files`):
  anything else at a journal's name is moved aside unread.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final

import msgspec

from ..core import StoreKey, Timer
from ..logs import log, logfmt
from . import schema
from .faults import Aside, Damaged, NotRegular, Unreadable, reason
from .files import open_regular, read_regular
from .schema import Changes, SchemaError, Shared, boot_id, share_values

#: A journal record: payload length and CRC-32, then the msgpack payload.
RECORD: Final = struct.Struct(">II")
#: No record is larger (the full state of the largest table is far smaller): a
#: header declaring more is damage, not a write cut short.
_MAX_RECORD: Final = 1 << 30


class Record(msgspec.Struct, array_like=True):
    """One journal record: ``reset`` says the state is exactly what follows (a full
    write after a failure); ``puts`` and ``drops`` are changes. The first record
    of every journal names the ``boot`` it was written in (a journal of another
    boot is never replayed: its pids and start times mean nothing now), and after
    it the journal's schema (`_Undecoded`)."""

    reset: bool = False
    puts: list[Timer] = []
    drops: list[StoreKey] = []
    boot: str = ""


#: The header of a record of changes alone (no reset, no boot).
CHANGES: Final = Record()


class _Undecoded(msgspec.Struct, array_like=True):
    """A record of any schema, its changes left undecoded: what a journal's first
    record says of the journal (its boot and schema), and what an older schema's
    record is migrated from."""

    reset: bool
    puts: msgspec.Raw
    drops: msgspec.Raw
    boot: str = ""
    #: A first record that names no schema is of schema 4, whose first journals
    #: did not name theirs.
    schema: int = 4


_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(Record)
_undecoded_decoder = msgspec.msgpack.Decoder(_Undecoded)
_drops_decoder = msgspec.msgpack.Decoder(list[StoreKey])


def encode(
    header: Record, changes: Mapping[StoreKey, Timer | None], *, first: bool = False
) -> bytes:
    """A journal record of ``changes`` under ``header``'s ``reset`` and ``boot``:
    the bytes of the `Record` they make, encoded as its array without making one
    (a reply's commit makes a record, `CHANGES`). The ``first`` record of a
    journal names this schema after them."""
    puts: list[Timer] = []
    drops: list[StoreKey] = []
    for key, timer in changes.items():
        if timer is None:
            drops.append(key)
        else:
            puts.append(timer)
    fields = (header.reset, puts, drops, header.boot)
    payload = _encoder.encode((*fields, schema.SCHEMA) if first else fields)
    return RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def records(data: bytes, *, newest: bool) -> Iterator[Record | Unreadable]:
    """The records of a journal, in order, in this schema; what is wrong ends them
    at a record that is not valid, or at the first one if the journal's schema
    cannot be read.

    A record cut short at the end of the ``newest`` journal is a write the daemon
    died in (never acknowledged): it ends the journal quietly. Anywhere else, or
    declaring more than any record could hold, it is damage."""
    stored: int | None = None
    offset = 0
    while offset < len(data):
        length = checksum = 0
        if offset + RECORD.size <= len(data):
            length, checksum = RECORD.unpack_from(data, offset)
        start = offset + RECORD.size
        if start + length > len(data):
            if newest and length <= _MAX_RECORD:
                return
            yield Damaged(f"a record cut short at byte {offset}")
            return
        payload = data[start : start + length]
        if zlib.crc32(payload) != checksum:
            yield Damaged(f"bad checksum in the record at byte {offset}")
            return
        try:
            if stored is None:
                stored = _undecoded_decoder.decode(payload).schema
                schema.check(stored)
            yield _decode(payload, stored)
        except SchemaError as exc:
            yield exc
            return
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            yield Damaged(f"unreadable record at byte {offset}: {exc}")
            return
        offset = start + length


def _decode(payload: bytes, stored: int) -> Record:
    """A record of schema ``stored`` as a `Record` of this schema."""
    if stored == schema.SCHEMA:
        return _record_decoder.decode(payload)
    old = _undecoded_decoder.decode(payload)
    return Record(
        reset=old.reset,
        puts=schema.decode_timers(old.puts, stored),
        drops=_drops_decoder.decode(old.drops),
        boot=old.boot,
    )


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
            data = read_regular(journal)
        except NotRegular as exc:
            aside.move(journal, exc)
            continue
        except OSError as exc:
            # Unreadable is not proof of damage: it is kept for the next start.
            degrade(reason(exc))
            aside.keep(journal)
            continue
        for index, record in enumerate(records(data, newest=journal == found[-1])):
            if isinstance(record, Unreadable):
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


def unlinked(fd: int | None) -> bool:
    """Whether the file open as ``fd`` has no name left (its directory was
    removed, say). Raises OSError as fstat(2) does."""
    if fd is None:
        raise OSError(errno.EBADF, "no journal is open")
    return os.fstat(fd).st_nlink == 0


def write_all(fd: int | None, data: bytes | bytearray) -> None:
    # The journal's write of every acknowledged change: one write(2), not a
    # writev(2) of one buffer (which costs a list and its sum a call).
    if fd is None:
        raise OSError(errno.EBADF, "no journal is open")
    if os.write(fd, data) != len(data):
        raise OSError(errno.ENOSPC, "No space left on device (a record was written in part)")


#: The most buffers one writev(2) takes (Linux's UIO_MAXIOV).
_IOV_MAX: Final = 1024


def write_parts(fd: int | None, parts: Sequence[bytes | bytearray]) -> None:
    """Write ``parts`` in one writev(2), without a copy of them joined (unless
    there are more than it takes); a write made in part raises."""
    if fd is None:
        raise OSError(errno.EBADF, "no journal is open")
    if len(parts) > _IOV_MAX:
        parts = [b"".join(parts)]
    if os.writev(fd, parts) != sum(map(len, parts)):
        raise OSError(errno.ENOSPC, "No space left on device (a record was written in part)")


def open_journal(path: str, aside: Aside) -> int:
    """Open the journal ``path`` to append to, made if need be. A journal the
    store starts is new: anything but a regular file at its name is not the
    store's, and is moved aside, unread, for a journal in its place. Raises
    OSError, or `NotRegular` if something takes the name again at once."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    try:
        return open_regular(path, flags)
    except NotRegular as exc:
        aside.move(path, exc)
    return open_regular(path, flags)


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
