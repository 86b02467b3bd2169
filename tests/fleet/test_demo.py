"""`make demo`: a local etcd, two daemons as two hosts and a job whose hung rank
opens an incident, printed as it fills; nothing left behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demo" / "two_hosts.py"


def test_make_demo_runs_the_demo() -> None:
    recipe = re.search(r"^demo: .*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert recipe is not None
    assert recipe.group(1) == "$(BIN)/python demo/two_hosts.py"


def test_the_demo_shows_the_incident_of_a_hung_rank_across_two_hosts() -> None:
    ran = subprocess.run(
        [sys.executable, str(DEMO)], capture_output=True, text=True, timeout=120, check=False
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    out = ran.stdout
    assert "$ watchdogctl incident host-" in out
    assert "verdict: odd_frame (by the stacks): rank 3 on host host-b" in out
    assert "it is in rank.py:7 read_shard; they are in rank.py:10 train_step" in out
    for rank, host in ((0, "host-a"), (1, "host-a"), (2, "host-b")):
        assert re.search(rf"^{host}\s+{rank}\s+\d+\s+peer\s+done", out, re.MULTILINE), out
    assert re.search(r"^host-b\s+3\s+\d+\s+expired\s+done", out, re.MULTILINE), out
    assert "the incident is whole" in out
    # Every file it made is gone (its processes are checked by the suite's guard).
    [directory] = re.findall(r"^demo: working in (\S+)", out, re.MULTILINE)
    assert not Path(directory).exists()
