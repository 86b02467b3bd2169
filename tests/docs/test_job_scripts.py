"""The scripts of docs/jobs.md ("A hang that repeats") run as written, against a
real daemon and a job of real ranks that hangs the same way every time: the
launcher's retry loop restarts it until its hang repeats, then stops with 3; the
Slurm batch script requeues it until its hang repeats, then does not (``srun``
and ``scontrol`` stand in for Slurm's, which this machine has not: ``srun`` runs
the step's command as step 0 of the job, ``scontrol`` writes down what it was
asked). The page's ``watchdogctl job`` commands then exit as the page says.

A ```bash block of a page is a whole script: this module runs every one of
docs/jobs.md's (tests/docs/test_readme.py runs the other kinds, and leaves these
to it). The daemon marks a job at its second hang here (``repeat_limit = 2``),
to keep the runs few.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.pages import fenced

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "jobs.md"
VENV_BIN = str(Path(sys.executable).parent)
SCRIPTS = list(fenced(PAGE, "bash"))

CONFIG = """
[daemon]
incident_window = 1
repeat_limit = 2

[policies.rank]
steps = [ { dump = true }, { signal = "SIGKILL" } ]
"""

#: The job's command: ranks 1 and 2, then rank 0, whose timer expires in a
#: second while rank 2 is stuck in ``read_shard``; it fails once rank 0 is
#: killed, every time alike. Its job is the one its environment names.
TRAIN = '''
import subprocess, sys
RANK = """
import sys, time
from watchdogd_client import expires
rank, how, after = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])

def wait_in_all_reduce():
    time.sleep(300)

def read_shard():
    time.sleep(300)

if how == "elsewhere":
    with expires(after=60, scope="warmup", rank=rank):
        pass
    time.sleep(0.3)  # its responder connects
    print("ready", flush=True)
    read_shard()
with expires(after=after, scope="step", policy="rank", rank=rank):
    print("ready", flush=True)
    wait_in_all_reduce()
"""

def start(rank, how, after):
    return subprocess.Popen([sys.executable, "-c", RANK, str(rank), how, str(after)],
                            stdout=subprocess.PIPE, text=True)

with open("attempts", "a") as attempts:
    attempts.write("1")
ranks = [start(1, "waits", 60), start(2, "elsewhere", 60)]
for rank in ranks:
    rank.stdout.readline()
ranks.append(start(0, "waits", 1))
ranks[-1].wait()
for rank in ranks:
    rank.kill()
    rank.wait()
sys.exit(1)
'''


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG) as running:
        yield running


def script(marker: str) -> str:
    [found] = [text for text in SCRIPTS if marker in text]
    return found


def environment(daemon: RunningDaemon, *before: Path) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("WATCHDOGD_", "TORCHELASTIC_", "SLURM_"))
    }
    path = os.pathsep.join([*map(str, before), VENV_BIN, env.get("PATH", "/usr/bin:/bin")])
    return {**env, "PATH": path, "WATCHDOGD_SOCKET": str(daemon.socket_path)}


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=120
    )


def test_the_page_shows_a_retry_loop_and_a_slurm_script() -> None:
    assert len(SCRIPTS) == 2
    assert "watchdogctl job" in script("retry.sh")
    assert "watchdogctl job" in script("#SBATCH")


def test_the_retry_loop_stops_restarting_a_hang_that_repeats(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    (tmp_path / "retry.sh").write_text(script("retry.sh"))
    (tmp_path / "train.py").write_text(TRAIN)
    env = environment(daemon)
    done = run(["bash", "retry.sh", "run-7", "python", "train.py"], tmp_path, env)
    assert done.returncode == 3, done.stdout + done.stderr
    assert (tmp_path / "attempts").read_text() == "11"
    assert "restarting it" in done.stderr
    assert "retry.sh: run-7 hangs the same way again; not restarting it" in done.stderr
    # The page's own commands, with the status it says each exits with.
    [console] = [block for block in fenced(PAGE, "console") if "watchdogctl job" in block]
    commands = re.findall(r"^\$ (watchdogctl job .*?)\s+# exits (\d)", console, re.M)
    assert len(commands) == 2
    for command, status in commands:
        shown = run(["bash", "-c", command], tmp_path, env)
        assert shown.returncode == int(status), f"{command}\n{shown.stdout}{shown.stderr}"


def test_the_slurm_script_requeues_its_job_until_its_hang_repeats(
    daemon: RunningDaemon, tmp_path: Path
) -> None:
    (tmp_path / "train.sbatch").write_text(script("#SBATCH"))
    (tmp_path / "train.py").write_text(TRAIN)
    slurm = tmp_path / "slurm"
    slurm.mkdir()
    (slurm / "srun").write_text('#!/bin/sh\nSLURM_STEP_ID=0 SLURM_PROCID=0 exec "$@"\n')
    (slurm / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    for fake in ("srun", "scontrol"):
        (slurm / fake).chmod(0o755)
    env = {**environment(daemon, slurm), "SLURM_JOB_ID": "4242"}
    first = run(["bash", "train.sbatch"], tmp_path, env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    # Requeued, it runs again as job 4242 and hangs the same way.
    again = run(["bash", "train.sbatch"], tmp_path, env)
    assert again.returncode == 3, again.stdout + again.stderr
    assert "job 4242 hangs the same way again: not requeued" in again.stderr
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert (tmp_path / "attempts").read_text() == "11"
