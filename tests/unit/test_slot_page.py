"""The slot page's layout and its duration buckets, the same on both sides: what a
process counts in its page is what the daemon's history counts for a release."""

from __future__ import annotations

import itertools
import mmap

import pytest

from watchdogd.core.history import bucket_of as history_bucket
from watchdogd_client.fastpath import FastPath, _Page, _Slot
from watchdogd_protocol.slot_page import (
    BUCKETS,
    HEADER_BYTES,
    PAGE_BYTES,
    PERIOD,
    ROW_BYTES,
    ROWS,
    ROWS_OFFSET,
    SHMEM_PAGE,
    SLOT_WORDS,
    SLOTS,
    bucket_of,
    buckets_in,
    count_of,
    taken_of,
    word_of,
)

#: Durations across every bucket the page counts, bucket edges among them.
DURATIONS = sorted(
    {1, 999, 1000, 1001, 1090, 1091, 2000, 2001, 123_456, 10**6, 10**9, 10**12}
    | {int(1000 * 2 ** (bucket / 8)) + delta for bucket in range(0, 260, 7) for delta in (0, 1)}
)


def test_the_slots_and_their_counts_fit_the_page() -> None:
    assert word_of(0, 0) * 8 == HEADER_BYTES
    assert word_of(SLOTS - 1, SLOT_WORDS - 1) * 8 + 8 == ROWS_OFFSET
    assert ROWS[0] * 4 >= ROWS_OFFSET
    assert all(later * 4 >= row * 4 + ROW_BYTES for row, later in itertools.pairwise(ROWS))
    assert taken_of(SLOTS - 1, BUCKETS - 1) * 4 + 4 <= PAGE_BYTES
    assert PAGE_BYTES % SHMEM_PAGE == 0


def test_each_row_lies_in_one_kernel_page_that_says_it_holds_it() -> None:
    held = {bucket: page for page in range(PAGE_BYTES // SHMEM_PAGE) for bucket in buckets_in(page)}
    assert sorted(held) == list(range(BUCKETS))
    for bucket, page in held.items():
        first, last = count_of(0, bucket) * 4, taken_of(SLOTS - 1, bucket) * 4 + 3
        assert first // SHMEM_PAGE == last // SHMEM_PAGE == page


def test_a_full_page_whose_blocks_all_last_a_millisecond_is_one_kernel_page() -> None:
    touched = {
        at(slot, bucket) * 4 // SHMEM_PAGE
        for at in (count_of, taken_of)
        for slot in range(SLOTS)
        for bucket in (0, 1)
    }
    touched |= {
        word_of(slot, word) * 8 // SHMEM_PAGE for slot in range(SLOTS) for word in range(SLOT_WORDS)
    }
    assert touched == {0}
    assert bucket_of(1090) == 1


@pytest.mark.parametrize("microseconds", DURATIONS)
def test_a_blocks_bucket_is_the_historys_own(microseconds: int) -> None:
    assert bucket_of(microseconds) == min(BUCKETS - 1, history_bucket(microseconds / 1e6))


@pytest.mark.parametrize("microseconds", DURATIONS)
def test_a_release_counts_its_block_in_that_bucket(
    microseconds: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = mmap.mmap(-1, PAGE_BYTES)
    page = _Page(1, memory)
    slot = _Slot(page, 3, 1000, {})
    page.words[slot.deadline + PERIOD] = 1000
    fast = FastPath("/nowhere")
    fast._slots["s"] = slot
    slot.entered = 5_000_000
    monkeypatch.setattr("time.monotonic", lambda: (5_000_000 + microseconds) / 1e6)
    assert fast.release("s") is False
    counted = [bucket for bucket in range(BUCKETS) if page.counts[count_of(3, bucket)]]
    assert counted == [bucket_of(microseconds)]
