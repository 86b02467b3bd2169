"""Starved or hung: the rule a policy's ``starvation_grace`` applies before its first step.

A worker that misses its deadline because the machine gave it no chance to run is
not hung, and killing it loses its work for nothing. The kernel says which it was:
the pressure stall information (PSI) of the target's cgroup v2 (its ``cpu.pressure``,
``memory.pressure`` and ``io.pressure``) and of the host (``/proc/pressure/*``), whose
``some`` lines count, in ``total=`` microseconds, the time during which at least one
task of that scope waited for the resource; and the target's own CPU time (user and
system, all its threads, from /proc/PID/stat). A `Sample` is those figures at one
instant. A timer whose policy has ``starvation_grace`` keeps the sample taken when it
was armed (`watchdogd.core.timers.Watch.baseline`); at its deadline, before the
first step, another is taken and `judge` compares the two over exactly the period
the timer was armed.

The rule. Over the armed period:

- the **stall** is the largest of the cpu, memory and io ``some`` fractions (Δtotal
  / Δwall) of the target's cgroup. The host's figures are reported beside them but
  decide only when the target's cgroup is unknown (no cgroup v2 hierarchy the
  daemon can read): the host's pressure counts every process's waits, and on a busy
  host a target sleeping in a hang would look starved by its neighbours' load. A
  target whose cgroup changed during the period is not judged (its two samples are
  of different cgroups);
- the target **ran** Δcpu / Δwall of one CPU.

It was starved when the stall is at least ``starvation_pressure`` percent (default
50: its cgroup waited for most of the period) **and** it ran at most
``starvation_cpu`` percent of one CPU (default 25). The second condition keeps a
target that causes its own pressure (a hang loop in threads that outnumber their
CPUs, a spin beside an equal competitor) from counting as starved: it had the CPU
and used it. A target that shares its cgroup with others can be judged starved by
their waits; the grace is bounded and granted once, so that costs at most
``starvation_grace`` seconds of a real hang.

Pure: samples come from the process port; nothing here reads a file or a clock.
Whatever cannot be judged (no sample at arming, a kernel without PSI, counters that
went backwards because a cgroup was made anew) is not starved: a timer is extended
only on evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

import msgspec

#: The stall, in percent of the armed period, from which a target may be starved.
DEFAULT_PRESSURE: Final = 50.0
#: The most CPU time, in percent of one CPU over the armed period, that a starved
#: target may have had.
DEFAULT_CPU: Final = 25.0
#: The resources PSI reports, in the order `Pressure` keeps them.
RESOURCES: Final = ("cpu", "memory", "io")


class Pressure(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The ``total=`` of the ``some`` lines of one scope's PSI files (the host, or a
    cgroup), in microseconds: how long at least one of its tasks waited for each
    resource since the scope began."""

    cpu: int
    memory: int
    io: int


class Sample(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """What the kernel said of a process at one instant.

    ``at`` is when it was read on CLOCK_MONOTONIC (the daemon's clock across its
    restarts, on one boot); ``cpu`` the process's CPU time so far in seconds;
    ``host`` the host's pressure, None on a kernel without PSI; ``cgroup`` its cgroup
    v2 path (``/`` for the root), empty when unknown, and ``group`` that cgroup's
    pressure, None when its files could not be read. (Stored in the state as part
    of its timer: new fields only at the end, with defaults.)
    """

    at: float
    cpu: float
    host: Pressure | None = None
    cgroup: str = ""
    group: Pressure | None = None


@dataclass(frozen=True, slots=True)
class Starvation:
    """What `judge` found: whether the target was starved, and why, in words for
    the event (empty when there is nothing to say)."""

    starved: bool
    note: str = ""


#: The verdict on a timer armed with nothing measured (its policy had no grace
#: then, or its process could not be read).
UNMEASURED: Final = Starvation(
    False, "starvation not judged: nothing was measured when it was armed"
)


class Armed(Protocol):
    """What a timer keeps for the rule (`watchdogd.core.timers.Watch`)."""

    @property
    def baseline(self) -> Sample | None: ...

    @property
    def extended(self) -> float: ...


def judge_due(
    armed: Armed | None, sample: Callable[[], Sample | None], *, pressure: float, cpu: float
) -> Starvation:
    """Whether the process of a timer due now, armed with ``armed`` kept, was
    starved since (`judge`); ``sample`` measures it now, called only when there
    is something to judge. Not judged (no words) once the timer was extended: its
    expiry says so."""
    if armed is not None and armed.extended:
        return Starvation(False)
    if armed is None or armed.baseline is None:
        return UNMEASURED
    now = sample()
    if now is None:
        return Starvation(False)  # it has exited: its policy finds it gone
    return judge(armed.baseline, now, pressure=pressure, cpu=cpu)


def judge(armed: Sample | None, now: Sample, *, pressure: float, cpu: float) -> Starvation:
    """Whether the process measured by ``armed`` when its timer was armed and by
    ``now`` at its deadline was starved, by the module's rule with thresholds
    ``pressure`` and ``cpu`` (percent)."""
    if armed is None:
        return UNMEASURED
    period = now.at - armed.at
    if period <= 0:
        return Starvation(False, "starvation not judged: its measurements are out of order")
    if armed.cgroup != now.cgroup:
        return Starvation(
            False,
            f"starvation not judged: it moved from cgroup {armed.cgroup or '?'} to "
            f"{now.cgroup or '?'} while armed",
        )
    host = _stalls(armed.host, now.host, period)
    if now.cgroup:
        stalls = _stalls(armed.group, now.group, period)
        scope = f"its cgroup {now.cgroup}"
        if stalls is None:
            return Starvation(
                False, f"starvation not judged: the pressure of cgroup {now.cgroup} is unreadable"
            )
    else:
        stalls, scope = host, "the host (its cgroup is unknown)"
        if stalls is None:
            return Starvation(False, "starvation not judged: this kernel reports no pressure (PSI)")
    ran = max(0.0, now.cpu - armed.cpu) / period
    worst = max(RESOURCES, key=stalls.__getitem__)
    listed = _listed(stalls)
    if now.cgroup not in ("", "/") and host is not None:
        listed += f"; the host: {_listed(host)}"
    measured = (
        f"over the {period:.2f}s it was armed, {scope} waited for {worst} "
        f"{_percent(stalls[worst])} of the time ({listed}), and it ran {_percent(ran)} "
        "of one CPU"
    )
    if stalls[worst] * 100 < pressure:
        return Starvation(
            False, f"not starved: {measured}, under starvation_pressure {pressure:g}%"
        )
    if ran * 100 > cpu:
        return Starvation(
            False,
            f"not starved: {measured}, over starvation_cpu {cpu:g}%: it had the CPU and used it",
        )
    return Starvation(True, f"starved: {measured}")


def _stalls(
    before: Pressure | None, after: Pressure | None, period: float
) -> dict[str, float] | None:
    """Each resource's stall over ``period`` seconds, as a fraction in [0, 1]; a
    counter that went backwards (a cgroup removed and made again) counts none."""
    if before is None or after is None:
        return None
    return {
        resource: min(
            1.0, max(0, getattr(after, resource) - getattr(before, resource)) / 1e6 / period
        )
        for resource in RESOURCES
    }


def _listed(stalls: dict[str, float]) -> str:
    return ", ".join(f"{resource} {_percent(stalls[resource])}" for resource in RESOURCES)


def _percent(fraction: float) -> str:
    return f"{fraction:.1%}" if fraction < 0.1 else f"{fraction:.0%}"
