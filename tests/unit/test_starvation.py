"""The starvation rule (`watchdogd.core.starvation.judge`) on numbers, and the
service carrying it out on a fake host: who is measured, the one extension, its
event and metric, and what a re-arm and a restart do to it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from watchdogd.core.config import Config, PolicyConfig
from watchdogd.core.service import Service
from watchdogd.core.starvation import UNMEASURED, Pressure, Sample, judge
from watchdogd.core.timers import Timer, Watch
from watchdogd.storage import schema
from watchdogd.storage.store import Store
from watchdogd_protocol import Acquire, EventInfo

from helpers.fakes import ALICE, FakeHost, FakeProcess, World, make_world

CGROUP = "/jobs/rank0"


def quiet(cpu: int = 0, memory: int = 0, io: int = 0) -> Pressure:
    return Pressure(cpu, memory, io)


def sample(
    at: float,
    cpu: float = 0.0,
    *,
    group: Pressure | None = None,
    host: Pressure | None = None,
    cgroup: str = CGROUP,
) -> Sample:
    return Sample(
        at=at, cpu=cpu, host=quiet() if host is None else host, cgroup=cgroup, group=group
    )


#: The target's cgroup waited for the CPU 98% of 2 s (in microseconds of PSI).
WAITED = 1_960_000


def verdict_over_two_seconds(
    *,
    group: Pressure | None,
    ran: float,
    host: Pressure | None = None,
    cgroup: str = CGROUP,
    pressure: float = 50.0,
    cpu: float = 25.0,
) -> tuple[bool, str]:
    """The verdict on a target armed at 10 s and due at 12 s, whose counters all
    started at 0 (``None`` for a pressure that could not be read at either end)."""
    before = sample(
        10.0, 5.0, group=None if group is None else quiet(), host=quiet(), cgroup=cgroup
    )
    after = sample(12.0, 5.0 + ran, group=group, host=host or quiet(), cgroup=cgroup)
    verdict = judge(before, after, pressure=pressure, cpu=cpu)
    return verdict.starved, verdict.note


class TestRule:
    def test_a_target_that_waited_and_barely_ran_was_starved(self) -> None:
        starved, note = verdict_over_two_seconds(
            group=quiet(cpu=WAITED), ran=0.03, host=quiet(cpu=1_500_000)
        )
        assert starved
        assert note == (
            f"starved: over the 2.00s it was armed, its cgroup {CGROUP} waited for cpu 98% "
            "of the time (cpu 98%, memory 0.0%, io 0.0%; the host: cpu 75%, memory 0.0%, "
            "io 0.0%), and it ran 1.5% of one CPU"
        )

    def test_a_hang_in_a_quiet_cgroup_is_not_starved_however_busy_the_host(self) -> None:
        starved, note = verdict_over_two_seconds(
            group=quiet(cpu=2000), ran=0.0, host=quiet(cpu=1_900_000, io=1_500_000)
        )
        assert not starved
        assert note.startswith("not starved: ")
        assert note.endswith("under starvation_pressure 50%")

    def test_a_target_that_causes_its_own_pressure_is_not_starved(self) -> None:
        starved, note = verdict_over_two_seconds(group=quiet(cpu=2_000_000), ran=2.0)
        assert not starved
        assert "it ran 100% of one CPU" in note
        assert note.endswith("over starvation_cpu 25%: it had the CPU and used it")

    @pytest.mark.parametrize("resource", ["memory", "io"])
    def test_memory_and_io_stalls_count_as_well(self, resource: str) -> None:
        group = quiet(**{resource: 1_200_000})
        starved, note = verdict_over_two_seconds(group=group, ran=0.0)
        assert starved
        assert f"waited for {resource} 60% of the time" in note

    def test_the_thresholds_are_inclusive_and_the_policys_own(self) -> None:
        at_threshold = quiet(cpu=1_000_000)  # 50% of 2 s
        assert verdict_over_two_seconds(group=at_threshold, ran=0.5)[0]  # 25% of one CPU
        assert not verdict_over_two_seconds(group=at_threshold, ran=0.52)[0]
        assert not verdict_over_two_seconds(group=at_threshold, ran=0.0, pressure=51)[0]
        assert verdict_over_two_seconds(group=quiet(cpu=400_000), ran=0.0, pressure=20)[0]
        assert verdict_over_two_seconds(group=at_threshold, ran=1.5, cpu=400)[0]

    def test_without_a_cgroup_the_host_decides(self) -> None:
        starved, note = verdict_over_two_seconds(
            group=None, ran=0.0, host=quiet(cpu=WAITED), cgroup=""
        )
        assert starved
        assert "the host (its cgroup is unknown) waited for cpu 98%" in note

    def test_in_the_root_cgroup_the_host_is_not_listed_twice(self) -> None:
        starved, note = verdict_over_two_seconds(group=quiet(cpu=WAITED), ran=0.0, cgroup="/")
        assert starved
        assert (
            "its cgroup / waited for cpu 98% of the time (cpu 98%, memory 0.0%, io 0.0%)," in note
        )

    def test_what_cannot_be_judged_is_not_starved(self) -> None:
        after = sample(12.0, group=quiet(cpu=WAITED))
        assert judge(None, after, pressure=50, cpu=25) == UNMEASURED
        cases = {
            "its measurements are out of order": sample(13.0, group=quiet()),
            "it moved from cgroup /elsewhere to /jobs/rank0 while armed": sample(
                10.0, group=quiet(), cgroup="/elsewhere"
            ),
            "the pressure of cgroup /jobs/rank0 is unreadable": sample(10.0, group=None),
        }
        for why, before in cases.items():
            verdict = judge(before, after, pressure=50, cpu=25)
            assert (verdict.starved, verdict.note) == (False, f"starvation not judged: {why}")
        no_psi = Sample(at=10.0, cpu=0.0)
        verdict = judge(no_psi, msgspec.structs.replace(no_psi, at=12.0), pressure=50, cpu=25)
        assert verdict.note == "starvation not judged: this kernel reports no pressure (PSI)"

    def test_counters_that_went_backwards_count_no_stall(self) -> None:
        before = sample(10.0, group=quiet(cpu=50_000_000))  # a cgroup made again since
        verdict = judge(before, sample(12.0, group=quiet(cpu=10)), pressure=50, cpu=25)
        assert not verdict.starved
        assert "waited for cpu 0.0% of the time" in verdict.note


def patient_world(grace: float = 5.0) -> World:
    """A world whose policy ``patient`` kills, with ``starvation_grace``."""
    world = make_world()
    world.service.reconfigure(
        Config(
            policies={
                "patient": PolicyConfig(steps=[], starvation_grace=grace),
                "ops": PolicyConfig(steps=[], root_only=True),
            }
        )
    )
    return world


def starving(host: FakeHost, pid: int, at: float) -> None:
    """From ``at`` on, ``pid`` has waited for the CPU all the time and never ran."""
    total = int(at * 1e6)
    host.samples[pid] = sample(at, 1.0, group=quiet(cpu=total), host=quiet(cpu=total))


def events_of(service: Service[FakeProcess], kind: str) -> list[EventInfo]:
    return [event for event in service.events.page(None, 100, 0) if event.kind == kind]


class TestService:
    def test_other_policies_read_nothing_from_the_system(self) -> None:
        world = patient_world()
        world.service.handle(Acquire(id=1, scope="a", timeout=1.0), world.alice, 0.0)
        timer = world.service.table.get(ALICE.pid, "a")
        assert timer is not None
        assert timer.watched is None
        [fired] = world.service.firing.expire_due(1.0)
        assert fired.note == ""
        assert world.host.sampled == []
        fired.process.close()

    def test_a_starved_process_is_given_its_grace_once(self) -> None:
        world = patient_world(grace=5.0)
        service, host = world.service, world.host
        starving(host, ALICE.pid, 0.0)
        service.handle(Acquire(id=1, scope="a", timeout=2.0, policy="patient"), world.alice, 0.0)
        armed = service.table.get(ALICE.pid, "a")
        assert armed is not None
        assert armed.watch == Watch(baseline=host.samples[ALICE.pid])
        starving(host, ALICE.pid, 2.0)
        assert service.firing.expire_due(2.5) == []
        extended = service.table.get(ALICE.pid, "a")
        assert extended is not None
        assert (extended.deadline, extended.armed_at) == (7.5, armed.armed_at)
        assert extended.watch == msgspec.structs.replace(armed.watch, extended=5.0)
        assert world.notified[-1] == 7.5
        assert host.tracked == {ALICE.pid}
        [event] = events_of(service, "extended")
        assert (event.pid, event.scope, event.policy) == (ALICE.pid, "a", "patient")
        assert event.note.startswith(f"starved: over the 2.00s it was armed, its cgroup {CGROUP}")
        assert event.note.endswith("; given 5s more, once")
        assert event.deadline == 1_700_000_000.0 + 5.0
        assert event.command == f"cmd-{ALICE.pid}"
        assert service.metrics.extensions["patient"] == 1
        assert 'watchdogd_extensions_total{policy="patient"} 1.0' in service.metrics_text()
        samples = len(host.sampled)
        [fired] = service.firing.expire_due(7.5)  # still starved: it fires all the same
        assert len(host.sampled) == samples
        assert fired.timer.watched is not None
        assert fired.timer.watched.extended == 5.0
        assert fired.note == ""
        assert not service.table.get(ALICE.pid, "a")
        fired.process.close()

    def test_a_process_not_starved_fires_on_time_and_its_expiry_says_why(self) -> None:
        world = patient_world()
        service = world.service
        world.host.samples[ALICE.pid] = sample(0.0, group=quiet(), host=quiet())
        service.handle(Acquire(id=1, scope="a", timeout=2.0, policy="patient"), world.alice, 0.0)
        world.host.samples[ALICE.pid] = sample(2.0, group=quiet(), host=quiet(cpu=WAITED))
        [fired] = service.firing.expire_due(2.0)
        assert fired.note.startswith("not starved: over the 2.00s it was armed")
        assert events_of(service, "extended") == []
        assert service.metrics.extensions["patient"] == 0
        fired.process.close()

    def test_a_rearm_measures_anew_and_has_its_grace_back(self) -> None:
        world = patient_world(grace=5.0)
        service, host = world.service, world.host
        request = Acquire(id=1, scope="a", timeout=2.0, policy="patient")
        starving(host, ALICE.pid, 0.0)
        service.handle(request, world.alice, 0.0)
        starving(host, ALICE.pid, 2.0)
        assert service.firing.expire_due(2.0) == []
        starving(host, ALICE.pid, 3.0)
        service.handle(request, world.alice, 3.0)
        rearmed = service.table.get(ALICE.pid, "a")
        assert rearmed is not None
        assert rearmed.watch == Watch(baseline=host.samples[ALICE.pid])
        starving(host, ALICE.pid, 5.0)
        assert service.firing.expire_due(5.0) == []
        assert len(events_of(service, "extended")) == 2

    def test_a_timer_armed_before_its_policy_had_a_grace_is_not_judged(self) -> None:
        world = make_world()
        world.service.handle(Acquire(id=1, scope="a", timeout=1.0, policy="ops"), world.root, 0.0)
        world.service.reconfigure(
            Config(policies={"ops": PolicyConfig(steps=[], starvation_grace=5.0)})
        )
        [fired] = world.service.firing.expire_due(1.0)
        assert fired.note == UNMEASURED.note
        assert world.host.sampled == []
        fired.process.close()

    def test_an_extended_timer_keeps_its_process_in_the_table(self) -> None:
        """Its other timer fell due in the same pass and was the last one popped:
        the process, back in the table, stays tracked, and no reference is lost."""
        world = patient_world()
        service, host = world.service, world.host
        starving(host, ALICE.pid, 0.0)
        service.handle(Acquire(id=1, scope="a", timeout=1.0, policy="patient"), world.alice, 0.0)
        service.handle(Acquire(id=2, scope="b", timeout=1.0), world.alice, 0.0)
        starving(host, ALICE.pid, 1.0)
        [fired] = service.firing.expire_due(1.0)
        assert (fired.timer.scope, fired.orphaned) == ("b", False)
        assert host.tracked == {ALICE.pid}
        assert service.table.process(ALICE.pid) is fired.process
        assert fired.process.refs == 3  # the table's, the action's, alice's connection's
        fired.process.close()
        process = service.table.process(ALICE.pid)
        assert process is not None
        assert len(service.lifecycle.process_exited(process, 0.0)) == 1
        assert host.tracked == set()
        assert process.refs == 1

    def test_a_process_gone_by_its_deadline_is_not_judged(self) -> None:
        world = patient_world()
        world.service.handle(
            Acquire(id=1, scope="a", timeout=1.0, policy="patient"), world.alice, 0.0
        )
        world.host.dead.add(ALICE.pid)
        [fired] = world.service.firing.expire_due(1.0)
        assert fired.note == ""
        fired.process.close()


def test_a_restart_keeps_what_was_measured(tmp_path: Path) -> None:
    """The baseline and the extension are part of the stored timer: a daemon
    restarted on the same boot judges by the baseline taken before it."""
    world = patient_world()
    starving(world.host, ALICE.pid, 0.0)
    world.service.handle(Acquire(id=1, scope="a", timeout=2.0, policy="patient"), world.alice, 0.0)
    stored, _ = Store.open(str(tmp_path / "state.db"))
    for timer in world.service.snapshot():
        stored.put(timer)
    stored.write_now()
    stored.close()
    _, loaded = Store.open(str(tmp_path / "state.db"))
    assert loaded.timers == world.service.snapshot()

    restarted = patient_world()
    restarted.host.opened = list(world.host.opened)  # the same process holds the pid
    restarted.service.lifecycle.restore(loaded.timers)
    starving(restarted.host, ALICE.pid, 2.0)
    assert restarted.service.firing.expire_due(2.0) == []
    [event] = events_of(restarted.service, "extended")
    assert "over the 2.00s it was armed" in event.note


def test_a_watch_stored_before_it_had_these_fields_still_loads() -> None:
    """A `Watch` of four fields (what schema 4 first wrote) decodes with no
    baseline and no extension."""
    old = Timer(deadline=1.0, pid=10, scope="a", policy="kill", uid=0, owner=0,
                timeout=1.0, armed_at=0.0)  # fmt: skip
    encoded = msgspec.msgpack.encode(old)
    fields = msgspec.msgpack.decode(encoded)
    fields[-1] = [None, 0.0, 0.0, ""]  # the watch: the last field
    [decoded] = schema.decode_timers(msgspec.msgpack.encode([fields]), 4)
    assert decoded.watch == Watch()
