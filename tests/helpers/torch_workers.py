"""Worker functions for the torch tests, importable by spawned processes: each
configures torch's timer with the watchdogd adapter, as a user's worker would."""

from __future__ import annotations

import time

from torch.distributed.elastic import timer

from watchdogd_client.torch import WatchdogdTimerClient


def hang(rank: int = 0) -> None:
    """Sleeps far past its timer: must be killed."""
    timer.configure(WatchdogdTimerClient())
    with timer.expires(after=1):
        time.sleep(30)


def finish(rank: int = 0) -> None:
    """Finishes well within its timer: must live."""
    timer.configure(WatchdogdTimerClient())
    with timer.expires(after=5):
        time.sleep(0.5)


def hang_on_even_ranks(rank: int) -> None:
    (hang if rank % 2 == 0 else finish)(rank)


def nested(depth: int, configure: bool = True) -> None:
    """torch's recursion case: every level re-arms the same default scope, so only
    the innermost timer counts, and the sleep after its release is unprotected: the
    outer levels sleep longer than the timeout in all (and the innermost well
    within it, with room for a loaded machine)."""
    if configure:
        timer.configure(WatchdogdTimerClient())
    if depth > 0:
        with timer.expires(after=0.5):
            nested(depth - 1, configure=False)
            time.sleep(0.2)


def nested_and_stuck(depth: int, configure: bool = True) -> None:
    """As `nested`, but each level sleeps inside its block: the inner timer fires."""
    if configure:
        timer.configure(WatchdogdTimerClient())
    if depth > 0:
        with timer.expires(after=0.5):
            nested_and_stuck(depth - 1, configure=False)
            time.sleep(1.0)


def many_requests(depth: int, configure: bool = True) -> None:
    """torch's multiple-clients case: ``depth`` nested acquire/release pairs."""
    if configure:
        timer.configure(WatchdogdTimerClient())
    if depth > 0:
        with timer.expires(after=100):
            many_requests(depth - 1, configure=False)
            time.sleep(0.01)
