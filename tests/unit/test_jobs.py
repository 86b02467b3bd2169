"""Timers know their job: the labels a client sends by default, their bounds, and
where the daemon shows them."""

from __future__ import annotations

import pytest

from watchdogd.errors import Refusal
from watchdogd_client.arming import JobLabels, job_of
from watchdogd_protocol import Acquire, ErrorCode, Status, StatusReply

from helpers.fakes import make_world

TORCHRUN = {"TORCHELASTIC_RUN_ID": "run-7", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1"}
#: What Slurm sets for each task of ``srun`` within job 4242's step 3.
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "3",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
}


@pytest.fixture(autouse=True)
def _no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WATCHDOGD_JOB", "WATCHDOGD_RANK", *TORCHRUN, *SLURM):
        monkeypatch.delenv(name, raising=False)


def test_the_job_comes_from_torchrun_unless_ours_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert job_of() == JobLabels()
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert job_of() == JobLabels("run-7", 3, 1, 1)
    monkeypatch.setenv("WATCHDOGD_JOB", "nightly")
    monkeypatch.setenv("WATCHDOGD_RANK", "5")
    assert job_of() == JobLabels("nightly", 5, 1, 1)
    assert job_of("given", 0) == JobLabels("given", 0, 1, 1)
    assert job_of("", None).job is None  # an empty job: none


def test_under_slurm_the_job_is_its_step_and_the_rank_its_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert job_of() == JobLabels("4242.3", 6, 2, 1)
    monkeypatch.delenv("SLURM_STEP_ID")  # a batch script's own processes
    assert job_of() == JobLabels("4242", 6, 2, 1)
    # torchrun inside an srun step names its own job and ranks; ours come first.
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert job_of() == JobLabels("run-7", 3, 1, 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without a run id
    assert job_of().job == "4242"
    monkeypatch.setenv("WATCHDOGD_JOB", "nightly")
    assert job_of().job == "nightly"


def test_torchruns_run_id_none_is_no_job_and_odd_ranks_are_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("RANK", "-1")
    monkeypatch.setenv("LOCAL_RANK", "x")
    monkeypatch.setenv("GROUP_RANK", str(2**40))
    assert job_of() == JobLabels()


def test_status_and_events_show_the_job_and_rank() -> None:
    world = make_world()
    request = Acquire(id=1, scope="step", timeout=1.0, job="run-7", rank=3, local_rank=1)
    world.service.handle(request, world.alice, 0.0)
    reply = world.service.handle(Status(id=2), world.alice, 0.5)
    assert isinstance(reply, StatusReply)
    [shown] = reply.timers
    assert (shown.job, shown.rank) == ("run-7", 3)
    [expired] = world.service.firing.expire_due(1.0)
    assert expired.timer.watched is not None
    assert (expired.timer.watched.job, expired.timer.watched.local_rank) == ("run-7", 1)
    expired.process.close()


def test_a_job_is_bounded() -> None:
    world = make_world()
    for job in ("x" * 129, "a\0b", "é" * 65):
        with pytest.raises(Refusal) as refused:
            world.service.handle(Acquire(id=1, scope="s", timeout=1.0, job=job), world.alice, 0.0)
        assert refused.value.code == ErrorCode.INVALID_REQUEST
        assert "at most 128 UTF-8 bytes" in refused.value.message
    world.service.handle(Acquire(id=1, scope="s", timeout=1.0, job="x" * 128), world.alice, 0.0)
