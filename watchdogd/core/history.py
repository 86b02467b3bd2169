"""How long timers were held before their release, per (uid, executable, scope), and
the timeouts that history suggests.

A release of a timer that was armed for ``held`` seconds (since its last arming, which
is what its timeout has to cover) adds one sample to the histogram of its key: the
uid of its process, the executable the process runs (/proc/PID/exe) and its scope.
An expiry adds nothing: a hang says nothing about how long the work takes.

Bounds, so that what callers make the daemon remember is fixed in size:

- A histogram counts samples in log-spaced buckets, `BUCKETS_PER_DOUBLING` to a
  doubling (each some 9 % wide), from `SMALLEST` to `LARGEST` seconds (samples
  outside count in the first or last): at most `MAX_BUCKETS` counts a key, however
  many samples. Its largest sample is kept exactly.
- Older samples weigh less: once a key has counted `DECAY_AT` samples, every count
  is halved (rounding up, so that no bucket seen empties), so a scope whose work got
  slower is suggested a longer timeout within some thousands of releases.
- At most ``keys`` keys in all and ``keys_per_uid`` for one uid; a new key past
  either bound replaces the key (that uid's, for the second) used least recently.
  One user arming scope after scope thus replaces only their own history.

The suggestion for a key with at least ``min_samples`` samples is ``margin`` times
its 99th percentile (the upper edge of the bucket that holds it), and never less
than the largest sample seen, rounded up to three significant digits.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Final

import msgspec

from watchdogd_protocol import SuggestionInfo

#: Buckets per doubling of the time held.
BUCKETS_PER_DOUBLING: Final = 8
SMALLEST: Final = 0.001
LARGEST: Final = 400 * 86_400.0
MAX_BUCKETS: Final = math.ceil(BUCKETS_PER_DOUBLING * math.log2(LARGEST / SMALLEST)) + 1
#: Counts are halved once a key has counted this many samples.
DECAY_AT: Final = 10_000

Key = tuple[int, str, str]


def bucket_of(seconds: float) -> int:
    """The bucket that counts a sample of ``seconds``."""
    if seconds <= SMALLEST:
        return 0
    return min(MAX_BUCKETS - 1, math.ceil(BUCKETS_PER_DOUBLING * math.log2(seconds / SMALLEST)))


def upper_edge(bucket: int) -> float:
    """The longest time bucket ``bucket`` counts."""
    return SMALLEST * math.pow(2.0, bucket / BUCKETS_PER_DOUBLING)


class Histogram(msgspec.Struct, kw_only=True, array_like=True):
    """The samples of one key: counts by bucket, their total and the largest."""

    counts: dict[int, int] = {}
    total: int = 0
    largest: float = 0.0

    def add(self, seconds: float) -> None:
        bucket = bucket_of(seconds)
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        self.total += 1
        self.largest = max(self.largest, seconds)
        if self.total >= DECAY_AT:
            self.counts = {bucket: (count + 1) // 2 for bucket, count in self.counts.items()}
            self.total = sum(self.counts.values())

    def add_counts(self, counts: dict[int, int], largest: float) -> None:
        """Add ``counts`` samples by bucket at once (a slot's harvest), the longest
        of them ``largest`` seconds."""
        for bucket, count in counts.items():
            if 0 <= bucket < MAX_BUCKETS and count > 0:
                self.counts[bucket] = self.counts.get(bucket, 0) + count
                self.total += count
        self.largest = max(self.largest, largest)
        while self.total >= DECAY_AT:
            self.counts = {bucket: (count + 1) // 2 for bucket, count in self.counts.items()}
            self.total = sum(self.counts.values())

    def quantile(self, q: float) -> float:
        """The upper edge of the bucket that holds the ``q`` quantile (0 for none),
        never past the largest sample."""
        if not self.total:
            return 0.0
        rank = max(1, math.ceil(q * self.total))
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return min(upper_edge(bucket), self.largest)
        return self.largest


class _Saved(msgspec.Struct, array_like=True):
    """The history as the state keeps it: keys least recently used first."""

    keys: list[Key]
    histograms: list[Histogram]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Saved)


class History:
    """Every key's histogram, least recently used first, in all and by uid (each
    an OrderedDict: moving a key to the end and finding the first are O(1))."""

    def __init__(
        self,
        *,
        keys: int = 10_000,
        keys_per_uid: int = 1_000,
        min_samples: int = 20,
        margin: float = 2.0,
    ) -> None:
        self.keys = keys
        self.keys_per_uid = keys_per_uid
        self.min_samples = min_samples
        self.margin = margin
        self._histograms: OrderedDict[Key, Histogram] = OrderedDict()
        self._by_uid: dict[int, OrderedDict[Key, None]] = {}
        #: Bumped by every change, so that a writer knows whether there is news.
        self.generation = 0

    def __len__(self) -> int:
        return len(self._histograms)

    def record(self, key: Key, held: float) -> None:
        """One release of ``key`` after ``held`` seconds."""
        self._histogram(key).add(held)
        self.generation += 1

    def record_counts(self, key: Key, counts: dict[int, int], largest: float) -> None:
        """Releases of ``key`` counted by bucket (`Histogram.add_counts`)."""
        self._histogram(key).add_counts(counts, largest)
        self.generation += 1

    def _histogram(self, key: Key) -> Histogram:
        """The histogram of ``key``, now the most recently used; a new one, in
        place of the least recently used past a bound, if it had none."""
        histogram = self._histograms.get(key)
        if histogram is not None:
            self._histograms.move_to_end(key)
            self._by_uid[key[0]].move_to_end(key)
            return histogram
        return self._add(key, Histogram())

    def _add(self, key: Key, histogram: Histogram) -> Histogram:
        own = self._by_uid.setdefault(key[0], OrderedDict())
        while own and len(own) >= self.keys_per_uid:
            self._forget(next(iter(own)))
        while len(self._histograms) >= self.keys:
            self._forget(next(iter(self._histograms)))
        self._histograms[key] = histogram
        self._by_uid.setdefault(key[0], OrderedDict())[key] = None
        return histogram

    def _forget(self, key: Key) -> None:
        del self._histograms[key]
        own = self._by_uid[key[0]]
        del own[key]
        if not own:
            del self._by_uid[key[0]]

    def suggestion(self, key: Key) -> SuggestionInfo | None:
        """What the history of ``key`` says, if there is one."""
        histogram = self._histograms.get(key)
        if histogram is None:
            return None
        return self._suggest(key, histogram)

    def _suggest(self, key: Key, histogram: Histogram) -> SuggestionInfo:
        p99 = histogram.quantile(0.99)
        suggested = None
        if histogram.total >= self.min_samples:
            suggested = _round_up(max(self.margin * p99, histogram.largest))
        return SuggestionInfo(
            uid=key[0],
            executable=key[1],
            scope=key[2],
            count=histogram.total,
            p50=histogram.quantile(0.5),
            p99=p99,
            max=histogram.largest,
            suggested=suggested,
        )

    def timeout(self, key: Key, floor: float, ceiling: float) -> tuple[float, str]:
        """The timeout to arm for ``key`` between ``floor`` and ``ceiling``, and
        where it came from, in words."""
        suggestion = self.suggestion(key)
        if suggestion is None or suggestion.suggested is None:
            seen = 0 if suggestion is None else suggestion.count
            return ceiling, f"ceiling: {seen} of the {self.min_samples} releases a suggestion needs"
        chosen = min(ceiling, max(floor, suggestion.suggested))
        source = (
            f"learned: {suggestion.suggested:g} s suggested by {suggestion.count} releases "
            f"(p99 {suggestion.p99:.3g} s, max {suggestion.max:.3g} s)"
        )
        if chosen != suggestion.suggested:
            source += f", held to the {'floor' if chosen == floor else 'ceiling'} {chosen:g} s"
        return chosen, source

    def suggestions(self, uid: int | None = None, start: int = 0) -> Iterator[SuggestionInfo]:
        """Every key's suggestion (``uid``'s only, when given), sorted by key, from
        the ``start``-th on: each made as it is asked for, so a page of them costs
        its own rows only."""
        keys: Iterable[Key] = self._histograms if uid is None else self._by_uid.get(uid, ())
        for key in itertools.islice(sorted(keys), start, None):
            yield self._suggest(key, self._histograms[key])

    def encode(self) -> bytes:
        return _encoder.encode(_Saved(list(self._histograms), list(self._histograms.values())))

    def load(self, data: bytes) -> None:
        """Take the history ``encode`` wrote, within this history's bounds (the
        most recently used keys are kept)."""
        saved = _decoder.decode(data)
        for key, histogram in zip(saved.keys, saved.histograms, strict=True):
            histogram.counts = {
                bucket: count
                for bucket, count in histogram.counts.items()
                if 0 <= bucket < MAX_BUCKETS and count > 0
            }
            histogram.total = sum(histogram.counts.values())
            if key in self._histograms:
                self._forget(key)
            self._add(key, histogram)


def _round_up(seconds: float) -> float:
    """``seconds`` rounded up to three significant digits."""
    if seconds <= 0:
        return SMALLEST
    scale = 10.0 ** (math.floor(math.log10(seconds)) - 2)
    return math.ceil(seconds / scale - 1e-9) * scale
