"""The records of the record file (`watchdogd.storage.record_file`): their types
(events, incidents, the jobs' rows of hangs, and the dropping of either),
their framing (a journal's: length, checksum, msgpack), and reading them back.

Each record is typed and bounded as a reply is; a reading skips a damaged record
whose length still leads to a whole one, and says what it could not read back
(`Reading`)."""

from __future__ import annotations

import os
import zlib
from typing import BinaryIO, Final

import msgspec

from watchdogd_protocol import EventInfo

from ..core import JobKey, JobRow, StoredIncident
from .journal import RECORD

#: The schema of the records; a file of another is moved aside, unread.
SCHEMA: Final = 1
#: No record is larger: an incident of 1,024 ranks with 64 KiB stacks is 64 MiB.
MAX_RECORD: Final = 128 * 1024 * 1024


class Header(msgspec.Struct, tag="header", array_like=True):
    schema: int


class EventRecord(msgspec.Struct, tag="event", array_like=True):
    event: EventInfo


class IncidentRecord(msgspec.Struct, tag="incident", array_like=True):
    incident: StoredIncident


class DroppedRecord(msgspec.Struct, tag="dropped", array_like=True):
    id: str


class RowRecord(msgspec.Struct, tag="job", array_like=True):
    row: JobRow


class RowDroppedRecord(msgspec.Struct, tag="job_dropped", array_like=True):
    uid: int
    job: str


Entry = Header | EventRecord | IncidentRecord | DroppedRecord | RowRecord | RowDroppedRecord
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Entry)


def framed(entry: Entry) -> bytearray:
    """``entry`` as a record of the file, encoded in place behind its header (an
    incident's record is megabytes of stacks: no second copy of it)."""
    frame = bytearray(RECORD.size)
    _encoder.encode_into(entry, frame, RECORD.size)
    with memoryview(frame) as view, view[RECORD.size :] as payload:
        RECORD.pack_into(frame, 0, len(payload), zlib.crc32(payload))
    return frame


class Reading(msgspec.Struct):
    """What reading the file found: ``size`` bytes, ``read`` of them read back
    in ``records`` records, which end at byte ``good`` (where an append goes
    on); ``skipped`` damaged records jumped over; the first byte not read back
    (``first_lost``, -1: none); and the first damage (None: none, though the
    end may have been cut short)."""

    size: int
    good: int = 0
    read: int = 0
    records: int = 0
    skipped: int = 0
    first_lost: int = -1
    problem: str | None = None

    def lost(self, offset: int, problem: str | None) -> None:
        """The bytes from ``offset`` are not read back, for ``problem``."""
        if self.first_lost < 0:
            self.first_lost = offset
        if self.problem is None:
            self.problem = problem


class Read:
    """What the records read say: the events, the incidents and the jobs' rows."""

    def __init__(self) -> None:
        self.events: list[EventInfo] = []
        self.incidents: dict[str, StoredIncident] = {}
        self.rows: dict[JobKey, JobRow] = {}


def read_records(file: BinaryIO, read: Read) -> Reading:
    """Read the records of ``file`` into ``read``; what was read and what was not.

    A record whose content does not decode, or whose checksum fails where its
    length leads to a whole record (or to the end of the file), is jumped over:
    a flipped byte costs that record alone. A length that leads nowhere, or a
    schema this daemon does not read, ends the reading there."""
    reading = Reading(size=os.fstat(file.fileno()).st_size)
    offset = 0
    while offset < reading.size:
        frame = _frame_at(file, offset)
        if isinstance(frame, str):
            reading.lost(offset, frame or None)
            break
        length, checksum, payload = frame
        following = offset + RECORD.size + length
        if zlib.crc32(payload) != checksum:
            reading.lost(offset, f"bad checksum in the record at byte {offset}")
            if not _whole_at(file, following, reading.size):
                break
            file.seek(following)
            reading.skipped += 1
        elif (problem := _entry(payload, offset, read)) is not None:
            reading.lost(offset, problem)
            if problem.startswith("schema"):
                break
            reading.skipped += 1
        else:
            reading.records += 1
            reading.read += following - offset
            reading.good = following
        offset = following
    return reading


def _frame_at(file: BinaryIO, offset: int) -> tuple[int, int, bytes] | str:
    """The record at ``offset`` (``file`` is there): its length, its checksum
    and its payload; or why there is none: damage, or "" for a record cut short
    by the end of the file."""
    header = file.read(RECORD.size)
    if len(header) < RECORD.size:
        return ""
    length, checksum = RECORD.unpack(header)
    if length > MAX_RECORD:
        return f"a record of {length} bytes at byte {offset}"
    payload = file.read(length)
    if len(payload) < length:
        return ""
    return length, checksum, payload


def _whole_at(file: BinaryIO, offset: int, size: int) -> bool:
    """Whether a whole record, its checksum good, starts at ``offset`` (or the
    file ends there)."""
    if offset == size:
        return True
    if offset > size:
        return False
    file.seek(offset)
    frame = _frame_at(file, offset)
    return not isinstance(frame, str) and zlib.crc32(frame[2]) == frame[1]


def _entry(payload: bytes, offset: int, read: Read) -> str | None:
    """Read one record's ``payload`` (its checksum good) into ``read``; what is
    wrong with it, if anything."""
    try:
        entry = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"unreadable record at byte {offset}: {exc}"
    match entry:
        case Header(schema=schema) if schema != SCHEMA:
            return f"schema {schema}, this daemon reads {SCHEMA}"
        case Header():
            pass
        case EventRecord(event=event):
            read.events.append(event)
        case IncidentRecord(incident=incident):
            read.incidents[incident.info.id] = incident
        case DroppedRecord(id=incident_id):
            read.incidents.pop(incident_id, None)
        case RowRecord(row=row):
            read.rows.pop(row.key, None)  # the order written is the order kept
            read.rows[row.key] = row
        case RowDroppedRecord(uid=uid, job=job):
            read.rows.pop((uid, job), None)
    return None
