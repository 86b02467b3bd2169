"""The fleet's view of other hosts against a model that walks everything it holds:
the same holders of each job, the same ranks taken and the same refusals, whatever
the order of host keys, deletions and ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from watchdogd.fleet import view
from watchdogd.fleet.records import HostRecord, Rejected
from watchdogd.fleet.view import FleetView, Job

HOSTS = [f"host-{n}" for n in range(4)]
JOBS: list[Job] = [("root", "train"), ("root", "eval"), ("alice", "train")]
INCIDENTS = ["i-1", "i-2", "i-3"]


@dataclass
class Model:
    """What the view must say, by walking every host and every ranks key."""

    hosts: dict[str, tuple[str, frozenset[Job]]] = field(default_factory=dict)
    taken: dict[tuple[str, str], int] = field(default_factory=dict)

    def holders(self, job: Job) -> set[str]:
        return {host for host, (_, jobs) in self.hosts.items() if job in jobs}

    def take(self, incident: str, host: str, size: int, kept: set[str]) -> str | None:
        self.taken.pop((incident, host), None)
        if sum(self.taken.values()) + size > view.MAX_FLEET_RANK_BYTES:
            for key in [key for key in self.taken if key[0] not in kept]:
                del self.taken[key]
        if sum(n for (i, _), n in self.taken.items() if i == incident) + size > (
            view.MAX_INCIDENT_BYTES
        ):
            return "incident"
        if sum(self.taken.values()) + size > view.MAX_FLEET_RANK_BYTES:
            return "all"
        self.taken[(incident, host)] = size
        return None


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("seen"),
            st.sampled_from(HOSTS),
            st.sampled_from(["up", "stopped"]),
            st.sets(st.sampled_from(JOBS)),
        ),
        st.tuples(st.just("gone"), st.sampled_from(HOSTS)),
        st.tuples(
            st.just("ranks"),
            st.sampled_from(INCIDENTS),
            st.sampled_from(HOSTS),
            st.integers(0, 40),
            st.sets(st.sampled_from(INCIDENTS)),
        ),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_the_view_says_what_a_walk_over_everything_would(
    ops: list[tuple[object, ...]],
) -> None:
    # Small bounds, so that the refusals and the forgetting are reached.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(view, "MAX_INCIDENT_BYTES", 60)
        patch.setattr(view, "MAX_FLEET_RANK_BYTES", 100)
        fleet, model = FleetView(), Model()
        for op in ops:
            match op:
                case ("seen", str(host), str(state), set(jobs)):
                    fleet.host_seen(host, HostRecord(host, state, sorted(jobs)))  # type: ignore[arg-type]
                    model.hosts[host] = (state, frozenset(jobs))
                case ("gone", str(host)):
                    said = fleet.host_gone(host)
                    before = model.hosts.pop(host, None)
                    expected = None if before is None or before[0] == "stopped" else before[1]
                    assert said == expected
                case ("ranks", str(incident), str(host), int(size), set(kept)):
                    refused = model.take(incident, host, size, kept)
                    if refused is None:
                        fleet.take_ranks(incident, host, size, kept.__contains__)
                    else:
                        with pytest.raises(Rejected, match="ranks of"):
                            fleet.take_ranks(incident, host, size, kept.__contains__)
            for job in JOBS:
                assert fleet.holders(*job) == model.holders(job)
