"""The layout of a slot page: the memory a daemon shares with one process, where
the blocks of that process's registered scopes arm and release their timers with
single aligned 64-bit stores.

A page is a sealed memfd of `PAGE_BYTES` (it can be neither shrunk nor grown, so
neither side's mapping can fault), made by the daemon and handed to the process
over its socket (`MapPage`). It holds up to `SLOTS` slots, one per registered
``(pid, scope)``. Every value is a little-endian unsigned integer, naturally
aligned, so a store of one is whole to a reader on another CPU.

The kernel gives a memfd its memory a `SHMEM_PAGE` at a time, at the first write
(or the first read through a mapping) of each, so the layout keeps what is written
together in few of them: the header, the slots' control parts and the first
`FIRST_ROWS` rows of counts fill the first; every later one holds `ROWS_PER_PAGE`
rows. A page whose blocks all last a few milliseconds costs one `SHMEM_PAGE`.

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
  store, in microseconds, and how many blocks were released by a store.
- `TAKEN`, written by the daemon: the `BLOCKS` it read at its last harvest.

The counts of those blocks' durations, in the daemon's history buckets
(`bucket_of`), are kept by bucket, not by slot: row ``b`` holds bucket ``b``'s
32-bit count of every slot (`count_of`, written by the process at each release),
then what the daemon took of each at its last harvest (`taken_of`, written by the
daemon). The scopes of a page whose blocks last about as long share the same few
rows, and a row no block was counted in is never written, so it costs no memory;
the daemon reads only the rows the kernel holds memory for. What the daemon took
lives in the page, as the counts do, so a daemon that restarts takes what its
predecessor had not.

Nothing a process writes is trusted: the daemon bounds every value it reads, and
the process can only move its own deadlines later, as its socket already lets it.
"""

from __future__ import annotations

import math
from typing import Final

#: The unit the kernel gives a memfd its memory in.
SHMEM_PAGE: Final = 4096
#: Bytes before the first slot's control part: the page's header.
HEADER_BYTES: Final = 64
#: 64-bit words in one slot's control part.
SLOT_WORDS: Final = 6
#: Slots in one page.
SLOTS: Final = 63
#: Duration buckets a slot counts: the daemon's history buckets from the first, 1 ms
#: and under, to the 240th, some 12 days and over.
BUCKETS: Final = 240
#: Bytes of one bucket's row: the count of each slot, then what the daemon took of each.
ROW_BYTES: Final = SLOTS * 2 * 4
#: Where the control parts end and the rows begin, in bytes.
ROWS_OFFSET: Final = HEADER_BYTES + SLOTS * SLOT_WORDS * 8
#: Rows in the rest of the first `SHMEM_PAGE`, and in each of the others.
FIRST_ROWS: Final = (SHMEM_PAGE - ROWS_OFFSET) // ROW_BYTES
ROWS_PER_PAGE: Final = SHMEM_PAGE // ROW_BYTES
#: The size of a page.
PAGE_BYTES: Final = SHMEM_PAGE * (1 + math.ceil((BUCKETS - FIRST_ROWS) / ROWS_PER_PAGE))

#: The header's first word: what a page is, and its layout's version.
MAGIC: Final = int.from_bytes(b"WDSLOTS2", "little")
#: Header words: `MAGIC`, then the slots a page holds.
HEADER_MAGIC: Final = 0
HEADER_SLOTS: Final = 1

#: Words of a slot's control part (see the module docstring).
DEADLINE: Final = 0
PERIOD: Final = 1
AUTO: Final = 2
LARGEST: Final = 3
BLOCKS: Final = 4
TAKEN: Final = 5

#: The history's buckets: `BUCKETS_PER_DOUBLING` to a doubling of the time held,
#: from `SMALLEST` seconds (in microseconds here).
BUCKETS_PER_DOUBLING: Final = 8
SMALLEST_MICROSECONDS: Final = 1000
#: A deadline or duration is at most 2**62 microseconds: no clock gets there, and
#: a daemon refuses a word past it as scribbled.
MAX_MICROSECONDS: Final = 2**62


def _row_of(bucket: int) -> int:
    if bucket < FIRST_ROWS:
        offset = ROWS_OFFSET + bucket * ROW_BYTES
    else:
        page, row = divmod(bucket - FIRST_ROWS, ROWS_PER_PAGE)
        offset = SHMEM_PAGE * (1 + page) + row * ROW_BYTES
    return offset // 4


#: Where each bucket's row begins, in the page seen as 32-bit words.
ROWS: Final = tuple(_row_of(bucket) for bucket in range(BUCKETS))

assert FIRST_ROWS >= 1
assert ROWS_OFFSET % 8 == 0
assert ROWS[-1] * 4 + ROW_BYTES <= PAGE_BYTES


def word_of(slot: int, word: int) -> int:
    """The index of ``word`` of ``slot`` in the page seen as 64-bit words."""
    return (HEADER_BYTES // 8) + slot * SLOT_WORDS + word


def moved_slots(words: memoryview) -> list[int]:
    """The slots whose `BLOCKS` word differs from their `TAKEN` word, in the page
    seen as 64-bit words ``words``: those released by a store since the daemon's
    last harvest of them, read two slices at a time."""
    first, end = word_of(0, 0), word_of(SLOTS, 0)
    blocks = words[first + BLOCKS : end : SLOT_WORDS].tolist()
    taken = words[first + TAKEN : end : SLOT_WORDS].tolist()
    pairs = enumerate(zip(blocks, taken, strict=True))
    return [slot for slot, (count, took) in pairs if count != took]


def count_of(slot: int, bucket: int) -> int:
    """The index of ``slot``'s count of ``bucket`` in the page seen as 32-bit words."""
    return ROWS[bucket] + slot


def taken_of(slot: int, bucket: int) -> int:
    """The index of what the daemon took of ``slot``'s count of ``bucket``, in the
    page seen as 32-bit words."""
    return ROWS[bucket] + SLOTS + slot


def buckets_in(shmem_page: int) -> range:
    """The buckets whose rows lie in the page's ``shmem_page``-th `SHMEM_PAGE`."""
    if shmem_page == 0:
        return range(FIRST_ROWS)
    first = FIRST_ROWS + (shmem_page - 1) * ROWS_PER_PAGE
    return range(min(first, BUCKETS), min(first + ROWS_PER_PAGE, BUCKETS))


def bucket_of(microseconds: int) -> int:
    """The bucket that counts a block of ``microseconds``: the daemon's history
    bucket of that many seconds, the last counting every longer block."""
    if microseconds <= SMALLEST_MICROSECONDS:
        return 0
    bucket = math.ceil(BUCKETS_PER_DOUBLING * math.log2(microseconds / SMALLEST_MICROSECONDS))
    return bucket if bucket < BUCKETS else BUCKETS - 1
