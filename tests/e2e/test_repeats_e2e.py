"""A hang that repeats stops its job's restarts, on a real daemon with real workers:
the same hang three times in a job gives one fingerprint and marks the job
repeating (``watchdogctl job`` exits 3), ``--reset`` clears the mark (and it stays
cleared, the hangs kept, through a SIGKILL of the daemon the moment it said so),
another hang has another fingerprint, and a job is its owner's to ask about and
to reset."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from watchdogd_protocol import EventInfo, HangsReply, IncidentInfo

from helpers.daemon import RunningDaemon, configured_daemon, ctl
from helpers.jobs import incidents, run_job, settled_after
from helpers.processes import reap, sleeper
from helpers.users import NOBODY, ctl_as

#: An incident's window of a second: each run of the job below is an incident of
#: its own, as runs minutes apart are.
CONFIG = """
[daemon]
incident_window = 1

[policies.rank]
steps = [ { dump = true }, { signal = "SIGKILL" } ]
"""


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, CONFIG, for_everyone=True) as running:
        yield running


def hang(daemon: RunningDaemon, job: str, culprit: str) -> IncidentInfo:
    """One run of ``job`` that hangs: rank 0's timer expires while rank 2 is stuck
    where ``culprit`` says; its incident once its verdict settled, its ranks gone."""
    known = {incident.id for incident in incidents(daemon.socket_path)}
    ranks = run_job(daemon.socket_path, job, culprit)
    try:
        return settled_after(daemon.socket_path, known, 3)
    finally:
        for rank in ranks:
            reap(rank)


def job(daemon: RunningDaemon, *args: str) -> tuple[int, HangsReply | None]:
    """``watchdogctl job ARGS --json``: its exit status and its reply."""
    shown = ctl(daemon.socket_path, "job", *args, "--json")
    reply = msgspec.json.decode(shown.stdout, type=HangsReply) if shown.stdout else None
    return shown.returncode, reply


def events_of(daemon: RunningDaemon, kind: str) -> list[EventInfo]:
    with daemon.client() as client:
        return [event for event in client.events(limit=1000).events if event.kind == kind]


def test_the_same_hang_three_times_marks_its_job_until_it_is_reset(
    daemon: RunningDaemon,
) -> None:
    first = hang(daemon, "train-r", "elsewhere")
    assert first.verdict is not None
    assert first.verdict.kind == "odd_frame"
    fingerprint = first.verdict.fingerprint
    assert len(fingerprint) == 16
    assert first.repeat == "counted"
    status, reply = job(daemon, "train-r")
    assert status == 0
    assert reply is not None
    assert (reply.repeating, [h.fingerprint for h in reply.hangs]) == ("", [fingerprint])
    [described] = reply.fingerprints
    assert (described.kind, described.frames, described.hangs) == (
        "odd_frame",
        ["<string> read_shard"],
        1,
    )

    second = hang(daemon, "train-r", "elsewhere")
    status, reply = job(daemon, "train-r")
    assert (status, reply and [h.incident for h in reply.hangs]) == (0, [first.id, second.id])

    third = hang(daemon, "train-r", "elsewhere")
    fingerprints = {i.verdict.fingerprint for i in (first, second, third) if i.verdict}
    assert fingerprints == {fingerprint}
    status, reply = job(daemon, "train-r")
    assert status == 3
    assert reply is not None
    assert (reply.repeating, reply.fingerprints[0].hangs) == (fingerprint, 3)
    text = ctl(daemon.socket_path, "job", "train-r")
    assert text.returncode == 3
    assert "repeating since" in text.stdout
    assert "odd_frame at <string> read_shard" in text.stdout
    listed = ctl(daemon.socket_path, "incidents")
    assert f"{fingerprint[:8]} repeating" in listed.stdout
    [marked] = events_of(daemon, "repeating")
    assert (marked.job, marked.outcome, marked.incident) == ("train-r", fingerprint, third.id)
    metrics = ctl(daemon.socket_path, "metrics").stdout
    assert 'watchdogd_job_repeating{job="train-r",uid="0"} 1.0' in metrics

    # A fix went in: the mark is cleared, and the next hang counts from one. The
    # daemon killed the moment it said so (well within its record's interval
    # between writes) keeps it cleared: the reply waited for its write.
    with daemon.client() as client:
        assert client.hangs("train-r", reset=True).repeating == ""
    assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
    daemon.start()
    # Its hangs are the daemon's record, kept across its crash, and each
    # incident's fingerprint with it.
    status, reply = job(daemon, "train-r")
    assert (status, reply and [h.incident for h in reply.hangs]) == (
        0,
        [first.id, second.id, third.id],
    )
    kept = {
        i.id: (i.verdict and i.verdict.fingerprint, i.repeat) for i in incidents(daemon.socket_path)
    }
    assert kept == {i.id: (fingerprint, "counted") for i in (first, second, third)}
    assert [event.outcome for event in events_of(daemon, "repeat_reset")] == [fingerprint]

    # Another hang of the job: another fingerprint, counted apart.
    other = hang(daemon, "train-r", "loads")
    assert other.verdict is not None
    assert other.verdict.fingerprint not in ("", fingerprint)
    status, reply = job(daemon, "train-r")
    assert status == 0
    assert reply is not None
    counts = {shown.id: shown.hangs for shown in reply.fingerprints}
    assert counts == {fingerprint: 0, other.verdict.fingerprint: 1}


def test_a_job_is_its_owners_to_ask_about_and_to_reset(daemon: RunningDaemon) -> None:
    held = sleeper()  # root's job train-o is known here: it holds a timer
    try:
        with daemon.client() as client:
            client.acquire("step", 120, pid=held.pid, job="train-o")
        assert job(daemon, "train-o")[0] == 0
        assert job(daemon, "train-o", "--user", "root")[0] == 0
        # Another user names root's job: not theirs, refused before anything is
        # said of it, whether it exists or not.
        for name, args in (("train-o", ("--user", "root")), ("none", ("--user", "0", "--reset"))):
            status, _, err = ctl_as(NOBODY, daemon.socket_path, "job", name, *args)
            assert status == 1, err
            assert "your own jobs only" in err
        # Their own job of that name is another job, which they have not run.
        status, _, err = ctl_as(NOBODY, daemon.socket_path, "job", "train-o")
        assert status == 4, err
        assert job(daemon, "no-such-job")[0] == 4
        assert job(daemon, "train-o", "--user", "nobody")[0] == 4
    finally:
        reap(held)


def test_with_no_daemon_watchdogctl_job_says_so_with_a_status_of_its_own(tmp_path: Path) -> None:
    shown = ctl(tmp_path / "none.sock", "job", "train-x")
    assert shown.returncode == 5, shown.stderr
    assert shown.stderr.count("\n") == 1, shown.stderr
