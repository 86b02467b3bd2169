"""How xdist hands the suite's tests out to its workers (``--dist loadgroup``)."""

from __future__ import annotations

from typing import Final

from xdist.scheduler import LoadScopeScheduling

#: The modules whose tests start jobs of several torch processes (torchrun, the
#: demo, gloo ranks): their tests run one after another on one worker, since two or
#: three such jobs at once beside a busy machine starve their ranks.
TORCH_JOBS: Final = frozenset(
    {
        "tests/e2e/test_torch.py",
        "tests/e2e/test_torchrun.py",
        "tests/e2e/test_unblock_step.py",
        "tests/fleet/test_demo.py",
        "tests/fleet/test_torchrun_verdict.py",
        "tests/fleet/test_unblocking_across_hosts.py",
        "tests/host/test_flight_recorder.py",
        "tests/host/test_unblocking_at_exit.py",
        "tests/host/test_unblocking_gloo.py",
    }
)


class TorchJobsTogether(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no types
    """xdist's load scheduling, each test a unit of its own but the torch jobs one
    unit, handed out first as the largest (xdist orders units by size): one worker
    runs them while the others share out the rest. Not xdist's ``xdist_group``
    marks, which reach the scheduler by a rename of each test that pytest 9 no
    longer takes; and not a lock each torch job waits on, its worker idle meanwhile."""

    def _split_scope(self, nodeid: str) -> str:
        return "torch jobs" if nodeid.split("::", 1)[0] in TORCH_JOBS else nodeid
