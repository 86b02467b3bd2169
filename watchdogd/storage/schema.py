"""The form the state is stored in, and how the files of an older form are read.

A record of the state is a timer (`watchdogd.core.timers.Timer`, the one shape of a
timer in memory, in the journal and in the database) or the removal of one, under
its store key ``(pid, scope, firing)``: an armed timer, and one whose policy is in
progress. Schema 4 stores a `Timer` as the array of its fields, ``deadline`` and
``seq`` first, a firing timer's progress through its policy (`Course`) and what only
some timers keep (`Watch`) each an array of their own in the last two. Schema 5
stores the same records, and its database says by when a start must load each
(`watchdogd.storage.database`): its migration from 4 leaves a timer as it is, and
the first fold writes the new column. Schema 6 adds a timer's ``arm``, the number
its client gave the arming, as the last field: its migration from 5 gives every
timer 0, the arming of no number. Schema 7 numbers armings by the daemon, by
their arming time (`Timer.arm`), and stores no number of the client's: its
migration from 6 moves a client's number into the timer's `Watch`
(``client_arm``, the last field of an array of 11), for the release of the client
that armed it before the upgrade, and drops the 0 of an arming of no number.
Schema 8 adds to a `Watch` when the restart grace of its arming ends
(``held_until``), the last of 12 fields: its migration from 7 leaves a timer as
it is, its watch read as one given no grace yet. Schema 9 adds to a `Watch` the
slot of a scope registered for the fast path (``slot``, a `SlotRef`), the last of
13: its migration from 8 leaves a timer as it is, registered nowhere. Schema 10
stores a `Watch` and a `SlotRef` each led by its tag, so that a registration that
needs nothing else of a `Watch` keeps its bare `SlotRef` in its place: its
migration from 9 leads each with its tag.

Invariants:

- Every file of the state names its schema (the database in its ``meta`` table, a
  journal in its first record) and the boot it was written in (`boot_id`): a file
  of another boot is never restored, since its pids and start times mean nothing
  now.
- Every change of the stored form is a new `SCHEMA`, and ships a forward
  migration from the schema before it (`MIGRATIONS`) and a state written by the
  code before it, in ``tests/data/``, on which a daemon must start with every
  timer armed. Schema 4 is that of the first release: no migration leads to it.
- Loading walks the migrations in order from a file's schema to this one
  (`decode_timers`); the first fold then writes the whole state in this schema. A
  file of a schema they do not reach (newer than this one, or older than any
  release) is never decoded: `SchemaError`, and the store moves it aside.
- Loaded timers share their repeated values (`share_values`): a restarted daemon
  holds its timers in as little memory as one that armed them.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

import msgspec

from ..core import StoreKey, Timer
from .faults import Unreadable

SCHEMA: Final = 10
_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"

#: A timer as a schema stores it: the plain array of its fields, as msgpack
#: decodes it without a type.
Fields = list[Any]
#: Makes the stored fields of a timer of schema N those of schema N + 1. A
#: migration is given a timer alone: the state holds nothing else, and a timer's
#: store key is the same in every schema. A schema that stores more (events,
#: incidents), or keys timers otherwise, widens what a migration is given.
Migration = Callable[[Fields], Fields]
#: A `Watch` of schemas 4 to 6 with every field at its default: ``progress``,
#: ``progressed_at``, ``stall``, ``timeout_from``, ``job``, the three ranks,
#: ``baseline`` and ``extended``.
_WATCH_6: Final = (None, 0.0, 0.0, "", "", None, None, None, None, 0.0)
#: The fields of a `Watch` of schema 9, its `SlotRef` the last; and the tags that
#: lead a `Watch` and a `SlotRef` from schema 10 on.
_WATCH_9_FIELDS: Final = 13
_WATCH_TAG: Final = 1
_SLOT_TAG: Final = 2


def _from_6(fields: Fields) -> Fields:
    """A timer of schema 6 in schema 7: its last field, the number its client gave
    the arming, moved to the end of its `Watch` (one made when it has none) when
    it is not 0."""
    *kept, watch, arm = fields
    if not arm:
        return [*kept, watch]
    watch = [] if watch is None else watch
    if not isinstance(watch, list) or len(watch) > len(_WATCH_6):
        raise ValueError(f"a watch of schema 6 is an array of at most 10, not {watch!r}")
    return [*kept, [*watch, *_WATCH_6[len(watch) :], arm]]


def _from_9(fields: Fields) -> Fields:
    """A timer of schema 9 in schema 10: its `Watch`, and the `SlotRef` in it, each
    led by its tag."""
    *kept, watch = fields
    if watch is None:
        return fields
    if not isinstance(watch, list) or len(watch) > _WATCH_9_FIELDS:
        raise ValueError(f"a watch of schema 9 is an array of at most 13, not {watch!r}")
    if len(watch) == _WATCH_9_FIELDS and watch[-1] is not None:
        watch = [*watch[:-1], [_SLOT_TAG, *watch[-1]]]
    return [*kept, [_WATCH_TAG, *watch]]


#: The forward migrations, keyed by the schema each one migrates from. Schema 4
#: is that of the first release: no migration leads to it.
MIGRATIONS: Final[Mapping[int, Migration]] = MappingProxyType(
    {
        4: lambda fields: fields,
        5: lambda fields: [*fields, 0],
        6: _from_6,
        7: lambda fields: fields,
        # 9 adds a registration's `SlotRef` at the end of its `Watch`: an older
        # timer has none.
        8: lambda fields: fields,
        9: _from_9,
    }
)

#: Changes to the state, or the state itself: the latest timer of each store key,
#: None for one that is gone.
Changes = dict[StoreKey, Timer | None]
#: Per load, per kind of value: one object for each distinct value.
Shared = dict[str, dict[object, object]]
#: The fields whose values repeat from timer to timer, with the kind of value
#: each holds: a process's pid and start time, policies, uids and timeouts.
#: (Decoding makes every one of a field's values of its
#: declared type, so an int never stands in for an equal float.)
_SHARED_FIELDS: Final = (
    ("pid", "pid"),
    ("start_time", "start_time"),
    ("policy", "policy"),
    ("uid", "uid"),
    ("owner", "uid"),
    ("timeout", "time"),
)

_timers_decoder = msgspec.msgpack.Decoder(list[Timer])
_fields_decoder = msgspec.msgpack.Decoder(list[Fields])


class SchemaError(Unreadable):
    """A state file of a schema this daemon cannot read: newer than `SCHEMA`, or
    older than any the migrations start from. It is moved aside, never decoded."""

    event = "state_schema_unreadable"

    def __init__(self, schema: int, why: str) -> None:
        super().__init__(f"schema {schema}, {why}: none of its timers are restored")
        self.suffix = f"schema-{schema}"


def check(stored: int) -> None:
    """Raise `SchemaError` unless the files of schema ``stored`` can be read: it
    is this schema, or the migrations lead from it to this one."""
    if stored > SCHEMA:
        raise SchemaError(stored, f"newer than this daemon's {SCHEMA}")
    if any(older not in MIGRATIONS for older in range(stored, SCHEMA)):
        oldest = min((*MIGRATIONS, SCHEMA))
        raise SchemaError(stored, f"older than any this daemon reads (from {oldest} on)")


def decode_timers(array: bytes, stored: int) -> list[Timer]:
    """The timers of a msgpack array of timers stored in schema ``stored``, which
    `check` accepts; raises msgspec's errors for an array that is not one.

    This schema's are decoded straight into `Timer`; an older schema's as plain
    arrays, each migrated in turn to this schema and then converted."""
    if stored == SCHEMA:
        return _timers_decoder.decode(array)
    timers = _fields_decoder.decode(array)
    try:
        for schema in range(stored, SCHEMA):
            timers = list(map(MIGRATIONS[schema], timers))
    except (LookupError, TypeError, ValueError) as exc:
        raise msgspec.ValidationError(
            f"a timer of schema {stored} does not migrate: {exc}"
        ) from exc
    return msgspec.convert(timers, list[Timer])


def share_values(timers: list[Timer], shared: Shared) -> None:
    """Make equal values of the repeating fields one object across ``timers``
    and every batch loaded before with ``shared``.

    A decoded record holds a copy of each value: timers of a few processes would
    each hold their own pid, policy name, timeout and zeroes, where timers armed
    by requests share them (see `watchdogd.core.timers`), and the copies would be
    most of what a loaded timer costs. Done on records nobody else holds yet
    (hence ``force_setattr`` on frozen Structs), batch by batch, in C loops
    (``map``), so that a start pays little for it; bench/scale.py measures the
    memory of loaded timers against armed ones."""
    for name, kind in _SHARED_FIELDS:
        values = list(map(operator.attrgetter(name), timers))
        one = list(map(shared.setdefault(kind, {}).setdefault, values, values))
        deque(map(msgspec.structs.force_setattr, timers, itertools.repeat(name), one), maxlen=0)


def boot_id() -> str:
    """The kernel's id of this boot ("unknown" where it cannot be read)."""
    try:
        with open(_BOOT_ID) as boot:
            return boot.read().strip()
    except OSError:
        return "unknown"
