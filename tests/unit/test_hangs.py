"""What the service does with each hang: a settled verdict counted once toward its
job's repeats, its fingerprint kept with the incident, a job marked with an event
and a metric, the ``hangs`` request as its owner and root may make it, and the
incidents listed with their job's mark."""

from __future__ import annotations

import pytest

from watchdogd.core.config import DAY, Config, DaemonConfig, parse_config
from watchdogd.core.service import Service
from watchdogd.errors import ConfigError, Refusal
from watchdogd_protocol import (
    EventInfo,
    Hangs,
    HangsReply,
    IncidentInfo,
    Incidents,
    IncidentsReply,
    RankInfo,
    StepResult,
)

from helpers.fakes import FakeProcess, World, make_world

HOST = "localhost"
#: The fake wall clock of `make_world`'s service.
NOW = 1_700_000_000.0


#: Where each function of the ranks below is defined.
LINES = {"wait_in_all_reduce": 42, "read_shard": 61, "load_batch": 77}


def dump(function: str) -> str:
    return (
        'Thread 7 (idle): "MainThread"\n'
        f"    {function} (/srv/run/train.py:{LINES[function]})\n"
        "    <module> (/srv/run/train.py:120)\n"
    )


def hang(
    service: Service[FakeProcess], job: str, at: float, *, culprit: str = "read_shard",
    uid: int = 1000, user: str = "alice", reader: tuple[int, int] | None = (1000, 1000),
) -> IncidentInfo:  # fmt: skip
    """An incident of ``job`` at wall time ``at``: rank 0's timer expired here, and
    ranks 1 and 2 with it; rank 2 waits in ``culprit``. Its whole record, settled."""
    log = service.incidents
    ranks = [
        RankInfo(host=HOST, pid=10 + n, uid=uid, role="expired" if n == 0 else "peer",
                 scope="step", rank=n)
        for n in range(3)
    ]  # fmt: skip
    incident, _ = log.expired((uid, job), user, ranks[0], "timeout", at)
    for rank in ranks[1:]:
        log.add(incident, rank)
    for rank, function in zip(ranks, ("wait_in_all_reduce", "wait_in_all_reduce", culprit),
                              strict=True):  # fmt: skip
        log.dumped(incident, rank.pid, rank.role, reader)
        output = dump(function)
        kind = "expired" if rank.role == "expired" else "peer"
        log.finished(
            EventInfo(seq=0, kind=kind, time=at, pid=rank.pid, uid=uid, scope="step",
                      policy="rank", outcome="exited", incident=incident,
                      steps=[StepResult(step="dump py-spy dump", result="exit 0", output=output)])
        )  # fmt: skip
    found = log.get(incident, 0, 0)
    assert found is not None
    return found


def ask(world: World, job: str, *, who: str = "alice", **options: object) -> HangsReply:
    caller = {"alice": world.alice, "bob": world.bob, "root": world.root}[who]
    reply = world.service.handle(Hangs(id=1, job=job, **options), caller, 0.0)  # type: ignore[arg-type]
    assert isinstance(reply, HangsReply)
    return reply


def events(world: World, kind: str) -> list[EventInfo]:
    return [event for event in world.service.events.since(0) if event.kind == kind]


def test_the_same_hang_three_times_marks_its_job_and_its_owner_resets_it() -> None:
    world = make_world()
    service = world.service
    first = hang(service, "train", 1000.0)
    assert first.verdict is not None
    assert (first.verdict.kind, first.repeat) == ("odd_frame", "counted")
    fingerprint = first.verdict.fingerprint
    reply = ask(world, "train")
    assert (reply.repeating, reply.limit, reply.window) == ("", 3, 86_400.0)
    assert [shown.frames for shown in reply.fingerprints] == [["train.py read_shard"]]
    hang(service, "train", 2000.0)
    assert not events(world, "repeating")
    third = hang(service, "train", 3000.0)
    assert third.verdict is not None
    assert third.verdict.fingerprint == fingerprint
    reply = ask(world, "train")
    assert reply.repeating == fingerprint
    assert [h.incident for h in reply.hangs] == [first.id, reply.hangs[1].incident, third.id]
    [marked] = events(world, "repeating")
    assert (marked.uid, marked.job, marked.outcome) == (1000, "train", fingerprint)
    assert "read_shard" not in marked.note  # frames are for who may read the stacks
    # The reply names the event its state was written with: the mark.
    assert reply.event == marked.seq
    # Listed, each incident of the mark's fingerprint says so.
    listing = service.handle(Incidents(id=1), world.alice, 0.0)
    assert isinstance(listing, IncidentsReply)
    assert [incident.repeating for incident in listing.incidents] == [True, True, True]
    assert 'watchdogd_job_repeating{job="train",uid="1000"} 1.0' in service.metrics_text(1000)
    assert "watchdogd_job_repeating{" not in service.metrics_text(2000)
    assert "watchdogd_job_repeating{" not in service.metrics_text(None)
    # Another user may neither see nor reset it; its owner resets it.
    for options in ({"uid": 1000}, {"uid": 1000, "reset": True}):
        with pytest.raises(Refusal, match="your own jobs only"):
            ask(world, "train", who="bob", **options)
    assert ask(world, "train", reset=True).repeating == ""
    [cleared] = events(world, "repeat_reset")
    assert (cleared.uid, cleared.outcome) == (1000, fingerprint)
    assert ask(world, "train").event == cleared.seq
    # Again: nothing more to clear, no other event.
    ask(world, "train", reset=True)
    assert len(events(world, "repeat_reset")) == 1


def test_root_names_the_owner_and_a_job_is_known_by_a_timer_an_incident_or_a_hang() -> None:
    world = make_world()
    hang(world.service, "train", 1000.0)
    assert ask(world, "train", who="root", uid=1000).job == "train"
    # Root's own job of that name is another, unknown here.
    for who, options in (
        ("root", {}),
        ("bob", {}),
        ("alice", {"uid": 1000}),
        ("root", {"uid": 2000}),
    ):
        if who == "alice":
            assert ask(world, "train", who=who, **options).uid == 1000
            continue
        with pytest.raises(Refusal) as refused:
            ask(world, "train", who=who, **options)
        assert refused.value.code == "no_such_job"
    with pytest.raises(Refusal) as refused:
        ask(world, "j" * 200)
    assert refused.value.code == "invalid_request"


def test_a_fingerprints_frames_are_shown_to_who_may_read_the_culprits_stack() -> None:
    world = make_world()
    hang(world.service, "train", 1000.0, reader=None)
    [shown] = ask(world, "train").fingerprints
    assert (shown.frames, shown.hidden) == ([], True)
    [shown] = ask(world, "train", who="root", uid=1000).fingerprints
    assert (shown.frames, shown.hidden) == (["train.py read_shard"], False)


def test_another_hang_is_counted_apart_and_a_lost_host_not_at_all() -> None:
    world = make_world()
    service = world.service
    hang(service, "train", NOW - 3000)
    other = hang(service, "train", NOW - 2000, culprit="load_batch")
    lost = service.incidents.opened("host_lost", (1000, "train"), "alice", "host b", NOW - 1000)
    service.incidents.tick(NOW)  # its window has closed: it settles, with no ranks
    reply = ask(world, "train")
    assert {shown.frames[0]: shown.hangs for shown in reply.fingerprints} == {
        "train.py read_shard": 1,
        "train.py load_batch": 1,
    }
    assert other.verdict is not None
    assert len(reply.hangs) == 2
    [listed] = [i for i in reply.incidents if i.id == lost]
    assert listed.repeat.startswith("not counted: a host_lost incident")


def test_an_incidents_fingerprint_and_count_are_kept_across_a_restart() -> None:
    world = make_world()
    first = hang(world.service, "train", 1000.0)
    assert first.verdict is not None
    stored = world.service.incidents.everything()
    rows = world.service.repeats.everything()
    again = make_world()
    again.service.incidents.restore(stored, 1_700_000_000.0)
    again.service.repeats.restore(rows)
    kept = again.service.incidents.get(first.id, 0, 0)
    assert kept is not None
    assert kept.verdict is not None
    assert (kept.verdict.fingerprint, kept.repeat) == (first.verdict.fingerprint, "counted")
    assert [h.incident for h in ask(again, "train").hangs] == [first.id]


def test_incidents_and_events_that_give_way_leave_the_jobs_hangs_counted() -> None:
    """The incidents' and the events' bounds make room by dropping their own
    oldest: never a hang the table counted, nor a job's mark."""
    world = make_world(incidents=1, incidents_per_uid=1, events=2, events_per_uid=2)
    service = world.service
    for n in range(3):
        hang(service, "train", NOW - 3000 + n * 1000)
    assert len(service.incidents.listing(1000, 100)) == 1
    assert len(service.events.since(0)) <= 4
    reply = ask(world, "train")
    assert reply.repeating
    assert len(reply.hangs) == 3


def test_repeat_limit_and_window_are_the_configs_and_a_reload_applies_them() -> None:
    world = make_world(repeat_limit=2, repeat_window=600.0)
    service = world.service
    hang(service, "train", NOW - 5000)
    hang(service, "train", NOW - 4000)  # more than the window after the first
    assert ask(world, "train").repeating == ""
    service.reconfigure(Config(daemon=DaemonConfig(repeat_limit=1, repeat_window=DAY)))
    hang(service, "train", NOW - 3000)
    reply = ask(world, "train")
    assert (reply.repeating != "", reply.limit, reply.window) == (True, 1, DAY)
    with pytest.raises(ConfigError, match="repeat_limit"):
        parse_config("[daemon]\nrepeat_limit = 17\n", "watchdogd.toml")
