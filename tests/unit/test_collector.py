"""The cyclic garbage collector is held off during a burst of expiries, for a
bounded time, and given back when the burst is over."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from watchdogd.runtime.daemon import Collector


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    gc.enable()
    yield
    gc.enable()


def test_held_through_a_burst_and_given_back_after_it() -> None:
    collector = Collector()
    collector.hold(10.0)
    assert not gc.isenabled()
    collector.hold(10.5)
    assert not gc.isenabled()
    collector.release()
    assert gc.isenabled()


def test_a_long_burst_gets_it_back_and_keeps_it_until_the_burst_ends() -> None:
    collector = Collector()
    collector.hold(10.0)
    collector.hold(11.5)  # past the hold's bound
    assert gc.isenabled()
    collector.hold(11.6)
    assert gc.isenabled()
    collector.release()
    collector.hold(20.0)  # the next burst holds it again
    assert not gc.isenabled()
    collector.release()


def test_a_collector_disabled_by_someone_else_stays_disabled() -> None:
    gc.disable()
    collector = Collector()
    collector.hold(1.0)
    collector.release()
    assert not gc.isenabled()
