"""The slot page's layout and its duration buckets, the same on both sides: what a
process counts in its page is what the daemon's history counts for a release."""

from __future__ import annotations

import mmap

import pytest

from watchdogd.core.history import bucket_of as history_bucket
from watchdogd_client.fastpath import FastPath, _Page, _Slot
from watchdogd_protocol.slot_page import (
    BUCKETS,
    COUNTS_OFFSET,
    HEADER_BYTES,
    PAGE_BYTES,
    PERIOD,
    SLOT_WORDS,
    SLOTS,
    bucket_of,
    counts_of,
    word_of,
)

#: Durations across every bucket the page counts, bucket edges among them.
DURATIONS = sorted(
    {1, 999, 1000, 1001, 1090, 1091, 2000, 2001, 123_456, 10**6, 10**9, 10**12}
    | {int(1000 * 2 ** (bucket / 8)) + delta for bucket in range(0, 260, 7) for delta in (0, 1)}
)


def test_the_slots_and_their_counts_fit_the_page() -> None:
    assert word_of(SLOTS - 1, SLOT_WORDS - 1) * 8 < COUNTS_OFFSET
    assert counts_of(SLOTS - 1) * 4 + BUCKETS * 4 <= PAGE_BYTES
    assert word_of(0, 0) * 8 == HEADER_BYTES


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
    counted = [at for at in range(BUCKETS) if page.counts[counts_of(3) + at]]
    assert counted == [bucket_of(microseconds)]
