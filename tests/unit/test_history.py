"""What the daemon learns of how long scopes are held: the histogram, its bounds, the
suggestion rule, and the file that keeps it across restarts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from watchdogd.core import history as history_module
from watchdogd.core.history import MAX_BUCKETS, Histogram, History, bucket_of, upper_edge
from watchdogd.storage.history_file import HistoryFile

from helpers.special_files import each_special, freed_after, make_special, moved_aside

KEY = (1000, "/usr/bin/python3", "train.py:42")


def test_a_bucket_holds_what_its_edges_say() -> None:
    for seconds in (0.0005, 0.001, 0.0123, 0.2, 1.0, 3600.0, 10**9):
        bucket = bucket_of(seconds)
        assert 0 <= bucket < MAX_BUCKETS
        if 0.001 < seconds < history_module.LARGEST:
            assert upper_edge(bucket - 1) < seconds <= upper_edge(bucket) * (1 + 1e-12)
            # Some 9 % wide: a percentile is never more than that above the truth.
            assert upper_edge(bucket) / upper_edge(bucket - 1) == pytest.approx(2 ** (1 / 8))


def test_percentiles_and_the_largest() -> None:
    histogram = Histogram()
    for index in range(100):
        histogram.add(0.1 + index * 0.001)  # 0.100 .. 0.199
    assert histogram.total == 100
    assert histogram.largest == pytest.approx(0.199)
    assert 0.149 <= histogram.quantile(0.5) <= 0.149 * 1.1
    assert 0.198 <= histogram.quantile(0.99) <= 0.199
    assert Histogram().quantile(0.99) == 0.0


def test_a_suggestion_needs_enough_samples_then_is_margin_times_p99() -> None:
    history = History(min_samples=20, margin=2.0)
    for _ in range(19):
        history.record(KEY, 0.2)
    first = history.suggestion(KEY)
    assert first is not None
    assert first.count == 19
    assert first.suggested is None
    timeout, source = history.timeout(KEY, 0.0, 30.0)
    assert timeout == 30.0
    assert source == "ceiling: 19 of the 20 releases a suggestion needs"
    history.record(KEY, 0.2)
    suggestion = history.suggestion(KEY)
    assert suggestion is not None
    assert suggestion.suggested == pytest.approx(0.4)
    timeout, source = history.timeout(KEY, 0.0, 30.0)
    assert timeout == pytest.approx(0.4)
    assert source.startswith("learned: 0.4 s suggested by 20 releases")
    # Held between the floor and the ceiling, and says so.
    assert history.timeout(KEY, 1.0, 30.0)[0] == 1.0
    assert history.timeout(KEY, 1.0, 30.0)[1].endswith("held to the floor 1 s")
    assert history.timeout(KEY, 0.0, 0.3) == (0.3, source + ", held to the ceiling 0.3 s")


def test_the_suggestion_is_never_below_the_longest_release() -> None:
    history = History(min_samples=1, margin=1.0)
    for _ in range(200):
        history.record(KEY, 1.0)
    history.record(KEY, 7.5)  # an outlier past the 99th percentile
    suggestion = history.suggestion(KEY)
    assert suggestion is not None
    assert suggestion.suggested == 7.5


def test_older_samples_weigh_less() -> None:
    histogram = Histogram()
    for _ in range(history_module.DECAY_AT - 1):
        histogram.add(0.1)
    histogram.add(5.0)
    assert histogram.total < history_module.DECAY_AT
    assert histogram.counts[bucket_of(5.0)] == 1  # halved, rounding up: still seen
    for _ in range(histogram.total):
        histogram.add(0.5)
    assert histogram.quantile(0.5) == pytest.approx(upper_edge(bucket_of(0.5)))


def test_keys_are_bounded_per_uid_and_in_all() -> None:
    history = History(keys=5, keys_per_uid=3)
    for index in range(10):
        history.record((1000, "/bin/x", f"s{index}"), 0.1)
    assert [row.scope for row in history.suggestions()] == ["s7", "s8", "s9"]
    # Another uid's history is not what one uid's new keys replace.
    history.record((0, "/bin/y", "root"), 0.1)
    history.record((2000, "/bin/z", "bob"), 0.1)
    for index in range(10, 20):
        history.record((1000, "/bin/x", f"s{index}"), 0.1)
    assert len(history) == 5
    assert {row.uid for row in history.suggestions()} == {0, 1000, 2000}
    assert [row.scope for row in history.suggestions(1000)] == ["s17", "s18", "s19"]
    # A key used again is the most recently used: it stays.
    history.record((1000, "/bin/x", "s17"), 0.1)
    history.record((1000, "/bin/x", "s20"), 0.1)
    assert [row.scope for row in history.suggestions(1000)] == ["s17", "s19", "s20"]


def test_the_history_survives_encoding_and_a_smaller_bound() -> None:
    history = History()
    for index in range(30):
        history.record((1000, "/bin/x", f"s{index % 3}"), 0.1 * (index + 1))
    again = History()
    again.load(history.encode())
    assert list(again.suggestions()) == list(history.suggestions())
    smaller = History(keys=2)
    smaller.load(history.encode())
    assert [row.scope for row in smaller.suggestions()] == ["s1", "s2"]


def test_the_file_keeps_it_and_a_damaged_one_is_moved_aside(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db.history")
    history = History()
    history.record(KEY, 0.25)
    HistoryFile(path, history).write_now()
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    loaded = History()
    HistoryFile(path, loaded).load()
    assert list(loaded.suggestions()) == list(history.suggestions())

    Path(path).write_bytes(b"\x93not a history")
    fresh = History()
    HistoryFile(path, fresh).load()
    assert len(fresh) == 0
    assert not os.path.exists(path)
    assert os.path.exists(path + ".damaged")


@each_special
def test_a_history_that_is_no_regular_file_is_moved_aside_unread_and_written_anew(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db.history"
    make_special(kind, path)
    history = History()
    file = HistoryFile(str(path), history)
    with freed_after(path):
        file.load()
    moved_aside(path, kind, caplog.text)
    history.record(KEY, 0.25)
    file.write_now()
    loaded = History()
    HistoryFile(str(path), loaded).load()
    assert list(loaded.suggestions()) == list(history.suggestions())


def test_a_write_that_fails_keeps_the_history_and_is_tried_again(tmp_path: Path) -> None:
    directory = tmp_path / "gone"
    history = History()
    history.record(KEY, 0.25)
    file = HistoryFile(str(directory / "state.db.history"), history)
    file.write_now()  # the directory does not exist: the write fails
    assert not directory.exists()
    directory.mkdir()
    file.write_now()
    assert (directory / "state.db.history").exists()
