"""A policy's unblock step on one daemon, with real gloo ranks (torch, the Flight
Recorder on): rank 2 hangs in its block under a policy that dumps it, then has its
peers unblocked, with SIGTERM for a rank no responder can unblock; rank 0, waiting
in the all_reduce with a responder, is cut out of it; rank 1, waiting in it inside
a block with no responder, gets SIGTERM; rank 2 lives."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from helpers.daemon import configured_daemon, expired_event
from helpers.gloo_job import gloo_job
from helpers.waiting import PATIENCE, wait_until

pytest.importorskip("torch")


CONFIG = """
[policies.kept]
steps = [ { dump = true, timeout = 20 }, { unblock = "peers", fallback = "SIGTERM" } ]

[fleet]
unblock_after = 2
"""


def test_an_unblock_step_cuts_out_the_peers_that_respond_and_signals_the_others(
    socket_path: Path, tmp_path: Path
) -> None:
    with configured_daemon(socket_path, tmp_path, CONFIG) as daemon:
        placement = {0: (daemon, "waits"), 1: (daemon, "blocked"), 2: (daemon, "hangs")}
        without = {1: {"WATCHDOGD_RESPONDER": "0"}}
        with gloo_job("run-fallback", tmp_path, placement, env=without) as ranks:
            wait_until(
                lambda: ranks[1].process.poll() is not None and ranks[0].raised() is not None,
                what="rank 1 signalled and rank 0 raising",
                timeout=PATIENCE * 3,
            )
            assert ranks[1].process.returncode == -signal.SIGTERM
            assert ranks[2].process.poll() is None  # the culprit lives
            with daemon.client() as client:
                expired = expired_event(client, ranks[2].process.pid)
                cut = [e for e in client.events(limit=1000).events if e.kind == "unblocked"]
            unblock = expired.steps[-1]
            assert unblock.step == "unblock peers, else SIGTERM", expired.steps
            assert unblock.result.startswith("asked for the ranks waiting in gloo:all_reduce")
            assert f"rank 1 (pid {ranks[1].process.pid}): sent SIGTERM" in unblock.result
            assert expired.outcome == "alive"
            # Rank 0 is cut out by its responder, unless rank 1's end came first.
            assert [e.rank for e in cut] in ([0], []), cut
