"""The suite's launcher (`helpers.launcher`): what it forks is told apart from an
earlier process that had the same pid, as a `subprocess.Popen` child is."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers.launcher import Forked, launcher
from helpers.waiting import PATIENCE, wait_until

#: Where Linux takes the last pid it gave, so that the next fork gets the one after
#: it when that one is free (root only).
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def start(command: str, args: list[str]) -> Forked:
    with open(os.devnull, "rb") as devnull, open(os.devnull, "wb") as sink:
        return launcher().start(
            command, args, stdin=devnull.fileno(), stdout=sink.fileno(), stderr=sink.fileno()
        )


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may set the next pid")
def test_a_new_process_with_an_earlier_ones_pid_is_not_taken_for_ended(tmp_path: Path) -> None:
    """The exit of a process nobody waited for reaches the test process while it
    waits for another; the next start that gets the same pid must not be taken for
    that process (the pid space here is 32,768: a suite reuses pids)."""
    daemon = ["--socket", str(tmp_path / "watchdogd.sock"), "--no-state"]
    for _ in range(20):
        ended = start("watchdogctl", ["--version"])
        wait_until(lambda pid=ended.pid: gone(pid), what="the short process to end")
        running = start("watchdogd", daemon)
        try:
            # Its wait reads the launcher's news meanwhile: the ended one's exit.
            with pytest.raises(subprocess.TimeoutExpired):
                running.wait(timeout=0.3)
        finally:
            running.kill()
            running.wait(PATIENCE)
        NS_LAST_PID.write_text(str(ended.pid - 1))
        reused = start("watchdogd", daemon)
        try:
            if reused.pid != ended.pid:
                continue  # another process took the pid first: try again
            assert reused.poll() is None
        finally:
            reused.send_signal(signal.SIGKILL)
            assert reused.wait(PATIENCE) == -signal.SIGKILL
        return
    pytest.fail("no start got the pid of the one before it in 20 tries")
