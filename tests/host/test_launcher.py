"""The suite's launcher (`helpers.launcher`): what it forks is told apart from an
earlier process that had the same pid, as a `subprocess.Popen` child is."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers.launcher import Forked, launcher, start_python
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


def test_a_forked_python_runs_its_script_as_python_c_does_and_ends_as_it_does() -> None:
    """A torch rank forked from the torch launcher: its script runs in a
    ``__main__`` of its own with ``sys.argv[0]`` ``-c``, in a session of its own
    if asked, and its end reaches `poll` without a wait."""
    pytest.importorskip("torch")
    source = """
        import os, sys
        print(__name__, sys.argv, "torch" in sys.modules, os.getsid(0) == os.getpid())
        print(sys.stdin.readline().strip(), flush=True)
        sys.exit(int(sys.argv[1]))
    """
    process = start_python(
        textwrap.dedent(source), ["3", "x"], env=dict(os.environ), new_session=True
    )
    assert process.stdin is not None
    assert process.stdout is not None
    process.stdin.write("echo\n")
    process.stdin.flush()
    assert process.stdout.readline().split(" ", 1) == ["__main__", "['-c', '3', 'x'] True True\n"]
    assert process.stdout.readline() == "echo\n"
    wait_until(lambda: process.poll() is not None, what="the script to end")
    assert process.returncode == 3
    out, err = process.communicate(timeout=PATIENCE)
    assert (out, err) == ("", "")

    failing = start_python("raise ValueError('no')", [], env=dict(os.environ))
    out, err = failing.communicate(timeout=PATIENCE)
    assert failing.returncode == 1
    assert err.splitlines()[-1] == "ValueError: no"
