"""The layout of a slot page: the memory a daemon shares with one process, where
the blocks of that process's registered scopes arm and release their timers with
single aligned 64-bit stores.

A page is a sealed memfd of `PAGE_BYTES` (it can be neither shrunk nor grown, so
neither side's mapping can fault), made by the daemon and handed to the process
over its socket (`MapPage`). It holds up to `SLOTS` slots, one per registered
``(pid, scope)``. Every value is a little-endian unsigned integer, naturally
aligned, so a store of one is whole to a reader on another CPU.

Each slot has a control part of `SLOT_WORDS` 64-bit words:

- `DEADLINE`, written by the process: the deadline of the block in progress, in
  microseconds of CLOCK_MONOTONIC, or 0 once released. The daemon reads it lazily:
  at least once every `PERIOD` microseconds, and never later than the deadline it
  last read, so a store is seen in time if the deadline it stores is at least a
  period away. A store with a nearer deadline goes over the socket instead.
- `PERIOD`, written by the daemon: that period, in microseconds; 0 once the slot
  is closed (the daemon no longer reads it: the scope must be armed over the
  socket again). The process reads it before its store and checks it again after,
  so a store that crossed a closing is never the only word on a block.
- `AUTO`, written by the daemon: for a scope armed with ``after="auto"``, the
  timeout the daemon learned for it, in microseconds.
- `LARGEST` and `BLOCKS`, written by the process: the longest block released by a
  store, in microseconds, and how many blocks were released by a store; and beside
  the control parts, `BUCKETS` 32-bit counts per slot of those blocks' durations,
  in the daemon's history buckets (`bucket_of`), which the daemon harvests.

Nothing a process writes is trusted: the daemon bounds every value it reads, and
the process can only move its own deadlines later, as its socket already lets it.
"""

from __future__ import annotations

import math
from typing import Final

#: The size of a page: its header, its slots' control parts, then their counts.
PAGE_BYTES: Final = 64 * 1024
#: Bytes before the first slot's control part: the page's header.
HEADER_BYTES: Final = 64
#: 64-bit words in one slot's control part.
SLOT_WORDS: Final = 8
#: Slots in one page.
SLOTS: Final = 63
#: Where the counts of slot 0 begin, in bytes; each slot's follow the one before.
COUNTS_OFFSET: Final = 4096
#: Duration buckets a slot counts: the daemon's history buckets from the first, 1 ms
#: and under, to the 240th, some 12 days and over.
BUCKETS: Final = 240

#: The header's first word: what a page is, and its layout's version.
MAGIC: Final = int.from_bytes(b"WDSLOTS1", "little")
#: Header words: `MAGIC`, then the slots a page holds.
HEADER_MAGIC: Final = 0
HEADER_SLOTS: Final = 1

#: Words of a slot's control part (see the module docstring).
DEADLINE: Final = 0
PERIOD: Final = 1
AUTO: Final = 2
LARGEST: Final = 3
BLOCKS: Final = 4

#: The history's buckets: `BUCKETS_PER_DOUBLING` to a doubling of the time held,
#: from `SMALLEST` seconds (in microseconds here).
BUCKETS_PER_DOUBLING: Final = 8
SMALLEST_MICROSECONDS: Final = 1000
#: A deadline or duration is at most 2**62 microseconds: no clock gets there, and
#: a daemon refuses a word past it as scribbled.
MAX_MICROSECONDS: Final = 2**62

assert HEADER_BYTES + SLOTS * SLOT_WORDS * 8 <= COUNTS_OFFSET
assert COUNTS_OFFSET + SLOTS * BUCKETS * 4 <= PAGE_BYTES


def word_of(slot: int, word: int) -> int:
    """The index of ``word`` of ``slot`` in the page seen as 64-bit words."""
    return (HEADER_BYTES // 8) + slot * SLOT_WORDS + word


def counts_of(slot: int) -> int:
    """The index of ``slot``'s first count in the page seen as 32-bit words."""
    return (COUNTS_OFFSET // 4) + slot * BUCKETS


def bucket_of(microseconds: int) -> int:
    """The bucket that counts a block of ``microseconds``: the daemon's history
    bucket of that many seconds, the last counting every longer block."""
    if microseconds <= SMALLEST_MICROSECONDS:
        return 0
    bucket = math.ceil(BUCKETS_PER_DOUBLING * math.log2(microseconds / SMALLEST_MICROSECONDS))
    return bucket if bucket < BUCKETS else BUCKETS - 1
