"""The form the state is stored in: a timer, under its store key.

A record of the state is a timer (`watchdogd.core.timers.Timer`, the one shape of a
timer in memory, in the journal and in the database) or the removal of one, under
its store key ``(pid, scope, firing)``: an armed timer, and one whose policy is in
progress. Schema 4 stores a `Timer` as the array of its fields, ``deadline`` and
``seq`` first, a firing timer's progress through its policy (`Run`) and what only
some timers keep (`Watch`) each an array of their own in the last two.

Invariants:

- Every file of the state names the boot it was written in (`boot_id`): a file of
  another boot is never restored, since its pids and start times mean nothing now.
- Loaded timers share their repeated values (`share_values`): a restarted daemon
  holds its timers in as little memory as one that armed them.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from typing import Final

import msgspec

from ..core.timers import StoreKey, Timer

SCHEMA: Final = 4
_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"

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


def decode_timers(array: bytes) -> list[Timer]:
    """The timers of a msgpack array of stored timers; raises msgspec's errors."""
    return _timers_decoder.decode(array)


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
