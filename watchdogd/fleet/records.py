"""What the fleet reads from etcd, decoded into typed, bounded shapes before any of
it is used.

Every key and value under the prefix is untrusted: any etcd client with write
access, or a member that went wrong, can put anything there. `read_key` and the
``decode_*`` functions turn a key and its value into a `HostRecord`, an incident's
head (`IncidentInfo`, without ranks) or a host's ranks of an incident
(`RankInfo`s), or raise `Rejected` with the reason, one of `REASONS`: the whole
key is then skipped, nothing of it applied, and the fleet member counts the
reason (the ``fleet_rejected`` metric) and logs it, throttled.

The bounds (also in docs/fleet.md and SECURITY.md):

- a value is at most `MAX_HOST_BYTES` (a host key), `MAX_HEAD_BYTES` (an incident's
  head) or `MAX_RANKS_BYTES` (one host's ranks of an incident: room for stacks cut
  to 64 KiB and for the collectives summaries of ranks), checked before decoding;
- a host lists at most `MAX_JOBS` jobs of at most `MAX_USERS` users; an incident
  at most `MAX_RANKS` ranks of a host; every string has a bound in bytes;
- names are valid: users as `watchdogd.host.users.fleet_user` says, hosts as the
  config's ``host`` (`HOST`), incident ids as this package makes them (`ID`);
- an incident's ``time`` lies within `MAX_AGE` seconds before the reader's wall
  clock and `MAX_SKEW` after it (a head from ten years ahead would never go
  stale);
- a key's parts agree with its value (the host key of ``h1`` says ``h1``; ranks
  under ``.../HOST`` are all of ``HOST``).

`make_key` and `encode_ranks` go the other way, for what this host writes.

Pure: no clock is read (``now`` is passed in) and nothing is logged.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Final, Literal, TypeVar
from urllib.parse import quote, unquote

import msgspec
from msgspec import Meta, Struct

from watchdogd_protocol import MAX_JOB_BYTES, GroupState, IncidentInfo, RankInfo
from watchdogd_protocol.responding import MAX_GROUPS

from ..host.users import fleet_user

#: Why a key was rejected: the label values of ``fleet_rejected``.
REASONS: Final = ("key", "size", "decode", "name", "time", "mismatch", "budget", "unexpected")

MAX_HOST_BYTES: Final = 256 * 1024
MAX_HEAD_BYTES: Final = 16 * 1024
MAX_RANKS_BYTES: Final = 1024 * 1024
#: The largest value of any key the fleet reads.
MAX_VALUE_BYTES: Final = max(MAX_HOST_BYTES, MAX_HEAD_BYTES, MAX_RANKS_BYTES)
#: Jobs one host registers, at most (what a member registers is cut to it too).
MAX_JOBS: Final = 1000
#: Users among one host's jobs, at most.
MAX_USERS: Final = 256
#: Ranks one host reports of one incident, at most.
MAX_RANKS: Final = 1024
MAX_SCOPE_BYTES: Final = 4096
MAX_TEXT_BYTES: Final = 4096
MAX_STACK_BYTES: Final = 64 * 1024
#: An incident head older than this (seconds) is not taken: etcd keeps heads for
#: less (`watchdogd.fleet.member.head_ttl`).
MAX_AGE: Final = 86_400.0
#: Nor one dated more than this after the reader's clock (hosts' clocks differ by
#: this much at most, with NTP).
MAX_SKEW: Final = 300.0

HOST: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: At most what an `Incident` request may name, so that every incident kept can be read.
ID: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: A wall time no record may pass (the year 5138): finite, unlike what JSON may say.
MAX_WALL: Final = 1e11
#: The largest pid Linux hands out (PID_MAX_LIMIT).
_MAX_PID: Final = 4_194_304

_T = TypeVar("_T")
_Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
_Uid = Annotated[int, Meta(ge=0, le=2**32 - 1)]
_Pid = Annotated[int, Meta(ge=1, le=_MAX_PID)]
_Short = Annotated[str, Meta(max_length=256)]
_Text = Annotated[str, Meta(max_length=MAX_TEXT_BYTES)]


class Rejected(Exception):
    """A key or value the fleet does not take; ``reason`` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class HostRecord(Struct, frozen=True):
    """What ``PREFIX/hosts/HOST`` holds: the host, its state, and the jobs it holds
    timers of as (fleet user name, job)."""

    host: str
    state: Literal["up", "stopped"]
    jobs: Annotated[list[tuple[_Short, _Short]], Meta(max_length=MAX_JOBS)] = []


class _Head(Struct, frozen=True, kw_only=True):
    id: Annotated[str, Meta(max_length=128)]
    job: _Short
    user: Annotated[str, Meta(max_length=64)]
    uid: _Uid
    host: Annotated[str, Meta(max_length=64)]
    scope: Annotated[str, Meta(max_length=MAX_SCOPE_BYTES)]
    reason: _Text
    time: float
    rank: _Count | None = None
    kind: Literal["expired", "host_lost"] = "expired"


class FleetRank(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A rank as the fleet holds it: `RankInfo` without the local readers, with
    the fleet name of the user besides root who may read its stack."""

    host: Annotated[str, Meta(max_length=64)]
    pid: _Pid
    uid: _Uid
    #: ``hung`` is how a daemon of before named ``expired`` (`fleet_rank`).
    role: Literal["expired", "peer", "hung"]
    scope: Annotated[str, Meta(max_length=MAX_SCOPE_BYTES)]
    state: Literal["pending", "done", "gone", "denied"] = "pending"
    rank: _Count | None = None
    local_rank: _Count | None = None
    group_rank: _Count | None = None
    policy: _Short = ""
    reason: _Text = ""
    frame: _Text = ""
    stack: Annotated[str, Meta(max_length=MAX_STACK_BYTES)] = ""
    note: _Text = ""
    #: How its stack was taken (``worker``, ``py-spy``, a dumper's name, ``none``).
    evidence: _Short = ""
    #: Its Flight Recorder's groups: what a verdict needs, no more.
    flight: Annotated[list[GroupState], Meta(max_length=MAX_GROUPS)] = []
    #: ``peers``: its policy asked for the job's ranks waiting in the verdict's
    #: collective to be unblocked; each host checks that with its own ranks'
    #: Flight Recorders before it cuts any.
    unblock: Literal["", "peers"] = ""
    #: What its host cut it out of, and why; when (Unix seconds).
    unblocked: _Text = ""
    unblocked_at: Annotated[float, Meta(ge=0, le=MAX_WALL)] | None = None
    #: The fleet name of the one user besides root who may read the stack.
    reader: Annotated[str, Meta(max_length=64)] = ""


#: The fields a rank has both here and in the fleet: the one list both ways go by.
_SHARED_FIELDS: Final = tuple(name for name in FleetRank.__struct_fields__ if name != "reader")
_encoder: Final = msgspec.json.Encoder()
_host_decoder: Final = msgspec.json.Decoder(HostRecord)
_head_decoder: Final = msgspec.json.Decoder(_Head)
_ranks_decoder: Final = msgspec.json.Decoder(Annotated[list[FleetRank], Meta(max_length=MAX_RANKS)])


def make_key(prefix: str, *parts: str) -> str:
    """A key under ``prefix``, the inverse of `read_key`: each part quoted, so a
    job or user with a ``/`` in its name is still one part."""
    return "/".join((prefix, *(quote(part, safe="") for part in parts)))


def read_key(prefix: str, key: bytes) -> tuple[str, ...]:
    """The parts of ``key`` after ``prefix`` (each unquoted), if it is a key the
    fleet reads: ``("hosts", HOST)``, ``("incidents", ID)`` or ``("ranks", USER,
    JOB, ID, HOST)``. Raises `Rejected` otherwise."""
    try:
        text = key.decode()
    except UnicodeDecodeError:
        raise Rejected("key", "not UTF-8") from None
    if not text.startswith(prefix + "/") or len(text) > 2048:
        raise Rejected("key", "outside the prefix, or too long")
    try:
        parts = tuple(unquote(part, errors="strict") for part in text[len(prefix) + 1 :].split("/"))
    except UnicodeDecodeError:
        raise Rejected("key", "a part that is not UTF-8 once unquoted") from None
    match parts:
        case ("hosts", host) if HOST.fullmatch(host):
            return parts
        case ("incidents", incident) if ID.fullmatch(incident):
            return parts
        case ("ranks", user, job, incident, host) if (
            fleet_user(user) and _job(job) and ID.fullmatch(incident) and HOST.fullmatch(host)
        ):
            return parts
        case ("hosts" | "incidents" | "ranks", *_):
            raise Rejected("name", f"a key of {parts[0]} whose parts are not valid names")
    raise Rejected("key", "not a key of this layout")


def decode_host(host: str, value: bytes) -> HostRecord:
    """The host key of ``host``."""
    record = _decode(_host_decoder, value, MAX_HOST_BYTES)
    if record.host != host:
        raise Rejected("mismatch", f"the key of host {host} names {record.host!r}")
    users = set()
    for user, job in record.jobs:
        if not (fleet_user(user) and _job(job)):
            raise Rejected("name", "a job whose user or name is not valid")
        users.add(user)
    if len(users) > MAX_USERS:
        raise Rejected("size", f"jobs of more than {MAX_USERS} users")
    return record


def decode_head(incident_id: str, value: bytes, now: float) -> IncidentInfo:
    """The head of incident ``incident_id``, read at wall time ``now``."""
    head = _decode(_head_decoder, value, MAX_HEAD_BYTES)
    if head.id != incident_id:
        raise Rejected("mismatch", f"the head of {incident_id} names {head.id!r}")
    if not (fleet_user(head.user) and _job(head.job) and HOST.fullmatch(head.host)):
        raise Rejected("name", "a user, job or host that is not a valid name")
    if not (math.isfinite(head.time) and now - MAX_AGE <= head.time <= now + MAX_SKEW):
        raise Rejected("time", f"dated {head.time!r}, not within a day before now")
    _check_text(head.scope, head.reason)
    return IncidentInfo(
        id=head.id,
        job=head.job,
        user=head.user,
        uid=head.uid,
        host=head.host,
        scope=head.scope,
        reason=head.reason,
        time=head.time,
        rank=head.rank,
        kind=head.kind,
    )


def decode_ranks(host: str, value: bytes) -> list[tuple[RankInfo, str]]:
    """``host``'s ranks of an incident, each with the fleet name of the user
    besides root who may read its stack (empty: root alone)."""
    ranks = _decode(_ranks_decoder, value, MAX_RANKS_BYTES)
    decoded: list[tuple[RankInfo, str]] = []
    for rank in ranks:
        if rank.host != host:
            raise Rejected("mismatch", f"a rank of host {rank.host!r} under host {host}")
        if rank.reader and not fleet_user(rank.reader):
            raise Rejected("name", "a rank whose reader is not a valid name")
        _check_text(
            rank.scope,
            rank.policy,
            rank.reason,
            rank.frame,
            rank.note,
            rank.evidence,
            rank.unblocked,
        )
        if len(rank.stack.encode()) > MAX_STACK_BYTES:
            raise Rejected("size", f"a stack over {MAX_STACK_BYTES} bytes")
        info = RankInfo(**{name: getattr(rank, name) for name in _SHARED_FIELDS})
        if info.role == "hung":
            info = msgspec.structs.replace(info, role="expired")
        decoded.append((info, rank.reader))
    return decoded


def encode_ranks(ranks: list[tuple[RankInfo, str]], limit: int) -> bytes:
    """``ranks``, each with its reader's fleet name, as the fleet holds them; their
    stacks cut, evenly, so that they encode to at most about ``limit`` bytes."""
    shaped = [
        FleetRank(**{name: getattr(rank, name) for name in _SHARED_FIELDS}, reader=reader)
        for rank, reader in ranks[:MAX_RANKS]
    ]
    value = _encoder.encode(shaped)
    if len(value) <= limit:
        return value
    share = max(1024, limit // max(1, len(shaped)) - 1024)
    return _encoder.encode(
        [
            msgspec.structs.replace(rank, stack=rank.stack.encode()[:share].decode(errors="ignore"))
            if len(rank.stack.encode()) > share
            else rank
            for rank in shaped
        ]
    )


def _decode(decoder: msgspec.json.Decoder[_T], value: bytes, limit: int) -> _T:
    if len(value) > limit:
        raise Rejected("size", f"{len(value)} bytes, over the bound of {limit}")
    try:
        return decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Rejected("decode", str(exc)) from None


def _job(job: str) -> bool:
    return bool(job) and "\0" not in job and len(job.encode()) <= MAX_JOB_BYTES


def _check_text(*texts: str) -> None:
    for text in texts:
        if len(text.encode()) > MAX_TEXT_BYTES + MAX_SCOPE_BYTES:
            raise Rejected("size", "a text over its bound")
