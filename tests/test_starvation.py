"""The starvation rule (`watchdogd.core.starvation.judge`) on numbers."""

from __future__ import annotations

import msgspec
import pytest

from watchdogd.core.starvation import UNMEASURED, Pressure, Sample, judge

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
