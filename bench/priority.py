"""Root's timers beside another user's busy processes on the daemon's CPU; needs root.

Eight processes of uid 65534 spin on CPU 0, the daemon's, while root arms 100
timers on sleeping processes, due 5 ms apart: each one's lateness from deadline to
first signal, as the daemon recorded it. The daemon runs at nice 0 and at the
``Nice=`` of ``systemd/watchdogd.service`` in turn, in a hierarchy without the cpu
controller (every process competing with every other, as on a host where no unit
asks for CPU weights); the floor is the same timers with nothing spinning.
``--quick`` runs one round instead of three.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

from run import (
    NOBODY,
    SERVER_CPU,
    events_config,
    percentile,
    running_daemon,
    victims_lateness,
)

from watchdogd_client import Client

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "watchdogd.service"
SPINNERS = 8
TIMERS = 100


def unit_nice() -> int:
    """The ``Nice=`` the shipped unit runs the daemon at."""
    found = re.search(r"^Nice=(-?\d+)$", UNIT.read_text(), re.MULTILINE)
    assert found, f"no Nice= in {UNIT}"
    return int(found.group(1))


def spinners(count: int) -> list[int]:
    """``count`` busy processes of uid 65534 on the daemon's CPU."""
    children = []
    for _ in range(count):
        child = os.fork()
        if child == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.sched_setaffinity(0, {SERVER_CPU})
            while True:
                pass
        children.append(child)
    return children


def lateness(client: Client, scope: str) -> list[float]:
    """Arm a timer of ``scope`` on each of `TIMERS` sleeping processes, due 5 ms
    apart; each one's deadline -> first signal."""

    def arm(victims: list[int]) -> None:
        first = time.monotonic() + 0.5
        for index, pid in enumerate(victims):
            client.acquire(scope, max(first + index * 0.005 - time.monotonic(), 0.001), pid=pid)

    return victims_lateness(client, TIMERS, scope, arm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, for a smoke test")
    options = parser.parse_args()
    if os.geteuid() != 0:
        print("priority: skipped (needs root: its busy processes run as uid 65534)")
        return
    nice = unit_nice()
    rows: dict[tuple[int, str], list[list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="wd-bench-") as directory:
        path = Path(directory)
        daemon = running_daemon(path, "--config", str(events_config(path)))
        with daemon as (socket_path, _, pid), Client(socket_path) as client:
            for number in range(1 if options.quick else 3):
                for level in (0, nice):
                    os.setpriority(os.PRIO_PROCESS, pid, level)
                    for load in ("idle", "busy"):
                        busy = spinners(SPINNERS) if load == "busy" else []
                        try:
                            late = lateness(client, f"root-{number}-{level}-{load}")
                        finally:
                            for child in busy:
                                os.kill(child, signal.SIGKILL)
                                os.waitpid(child, 0)
                        rows.setdefault((level, load), []).append(late)
    print(
        f"{TIMERS} root timers 5 ms apart, {SPINNERS} busy processes of uid {NOBODY} "
        f"on the daemon's CPU; deadline -> first signal, median of the rounds (min-max)"
    )
    for (level, load), rounds in rows.items():
        figures = []
        for tag, fraction in (("p50", 0.5), ("worst", 1.0)):
            values = [percentile(late, fraction) * 1e3 for late in rounds]
            figures.append(
                f"{tag} {statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"
            )
        where = "nothing else busy" if load == "idle" else f"{SPINNERS} busy, uid {NOBODY}"
        print(f"daemon at nice {level:>3}, {where:<22} " + "  ".join(figures) + " ms")


if __name__ == "__main__":
    main()
