"""Per-uid shares: the constant-time bookkeeping against a plain model that scans
every uid, over random sequences of additions and resizes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from watchdogd.core.identity import ROOT
from watchdogd.core.shares import ByteShares, Shares

UIDS = st.sampled_from([ROOT, 1000, 1001, 1002, 1003, 65534])


class Model:
    """The rule as the module states it, by scanning every uid. Among uids tied at
    the most, the one that reached that count first gives way."""

    def __init__(self, size: int, per_uid: int) -> None:
        self.size, self.per_uid = size, per_uid
        self.held: dict[int, int] = {}
        self.since: dict[int, int] = {}
        self.clock = 0

    def others(self) -> int:
        return sum(count for uid, count in self.held.items() if uid != ROOT)

    def bound(self, uid: int) -> int:
        return self.size if uid == ROOT else min(self.per_uid, self.size)

    def count(self, uid: int, delta: int) -> None:
        self.clock += 1
        self.held[uid] = self.held.get(uid, 0) + delta
        self.since[uid] = self.clock

    def add(self, uid: int) -> int | None:
        if self.held.get(uid, 0) >= self.bound(uid):
            return uid
        victim = None
        if uid != ROOT and self.others() >= self.size:
            most = max(count for u, count in self.held.items() if u != ROOT)
            tied = [u for u, count in self.held.items() if u != ROOT and count == most]
            victim = uid if uid in tied else min(tied, key=self.since.__getitem__)
            self.count(victim, -1)
        self.count(uid, +1)
        return victim


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 8),
    per_uid=st.integers(1, 8),
    uids=st.lists(UIDS, max_size=200),
)
def test_the_bookkeeping_follows_the_rule(size: int, per_uid: int, uids: list[int]) -> None:
    shares, model = Shares(size, per_uid), Model(size, per_uid)
    for uid in uids:
        assert shares.add(uid) == model.add(uid)
        assert all(shares.held(u) == count for u, count in model.held.items())
    assert shares.held(ROOT) <= size
    assert len(shares) - shares.held(ROOT) <= size


@settings(max_examples=200, deadline=None)
@given(
    uids=st.lists(UIDS, max_size=100),
    size=st.integers(1, 6),
    per_uid=st.integers(1, 6),
)
def test_a_resize_names_what_must_go_to_fit(uids: list[int], size: int, per_uid: int) -> None:
    shares = Shares(10, 10)
    held: dict[int, int] = {}
    for uid in uids:
        victim = shares.add(uid)
        held[uid] = held.get(uid, 0) + 1
        if victim is not None:
            held[victim] -= 1
    for victim in shares.resize(size, per_uid):
        held[victim] -= 1
    assert all(shares.held(uid) == count for uid, count in held.items())
    assert shares.held(ROOT) <= size
    assert len(shares) - shares.held(ROOT) <= size
    assert all(count <= min(per_uid, size) for uid, count in held.items() if uid != ROOT)


def test_a_uid_within_its_fair_share_never_gives_way() -> None:
    shares = Shares(12)
    for uid in (1000, 1001, 1002):
        for _ in range(4):
            assert shares.add(uid) is None
    # Full: a flood of 1003 takes from the three until it holds as many, then from itself.
    victims = [shares.add(1003) for _ in range(100)]
    assert victims[:3] == [1000, 1001, 1002]
    assert set(victims[3:]) == {1003}
    assert sorted(shares.held(uid) for uid in (1000, 1001, 1002, 1003)) == [3, 3, 3, 3]
    assert [shares.add(ROOT) for _ in range(12)] == [None] * 12
    assert shares.add(ROOT) == ROOT


@settings(max_examples=200, deadline=None)
@given(
    changes=st.lists(st.tuples(UIDS, st.integers(-50, 200)), max_size=60),
    size=st.integers(50, 400),
    per_uid=st.integers(10, 200),
)
def test_bytes_given_back_as_named_fit_every_bound(
    changes: list[tuple[int, int]], size: int, per_uid: int
) -> None:
    """Each uid gives back a byte at a time whenever `ByteShares.over` names it:
    root within its own bound, every other uid within its own, all of them
    within the shared one, and a uid over nothing is never named."""
    shares = ByteShares(size, per_uid)
    held: dict[int, int] = {}
    for uid, wanted in changes:
        delta = max(wanted, -held.get(uid, 0))
        shares.add(uid, delta)
        held[uid] = held.get(uid, 0) + delta
        while (named := shares.over(uid)) is not None:
            others = sum(h for u, h in held.items() if u != ROOT)
            own = size if named == ROOT else min(per_uid, size)
            most = max((h for u, h in held.items() if u != ROOT), default=0)
            assert held[named] > own or (named != ROOT and others > size and held[named] == most)
            shares.add(named, -1)
            held[named] -= 1
    assert all(shares.held(uid) == count for uid, count in held.items())
    assert held.get(ROOT, 0) <= size
    assert sum(h for u, h in held.items() if u != ROOT) <= size
    assert all(h <= min(per_uid, size) for u, h in held.items() if u != ROOT)
