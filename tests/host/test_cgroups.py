"""The cgroup v2 hierarchy: finding its mount, and real cgroups read and killed."""

from __future__ import annotations

import signal
import subprocess

import pytest

from watchdogd.host.cgroups import Cgroup, Hierarchy, cgroup_of, contains, find_hierarchy

from helpers.cgroups import HYBRID, UNIFIED, V1_ONLY, ScratchCgroup
from helpers.processes import reap, sleeper
from helpers.waiting import PATIENCE


@pytest.mark.parametrize(
    ("mountinfo", "expected"),
    [
        (HYBRID, Hierarchy("/sys/fs/cgroup/unified")),
        (UNIFIED, Hierarchy("/sys/fs/cgroup")),
        (V1_ONLY, None),
        ("", None),
        # A mount point with a space, written by the kernel as \040.
        (
            "41 31 0:38 / /mnt/cgroup\\040two rw - cgroup2 none rw\n",
            Hierarchy("/mnt/cgroup two"),
        ),
        # A container's view (a part of the hierarchy) after the whole one.
        (
            "50 40 0:38 /kubepods/pod1 /sys/fs/cgroup ro master:9 - cgroup2 cgroup rw\n"
            "51 40 0:38 / /host/cgroup rw - cgroup2 cgroup rw\n",
            Hierarchy("/host/cgroup"),
        ),
    ],
)
def test_the_v2_mount_is_found_in_the_mount_table(
    mountinfo: str, expected: Hierarchy | None
) -> None:
    assert find_hierarchy(mountinfo) == expected


def test_a_cgroup_maps_to_a_directory_only_under_what_the_mount_shows() -> None:
    whole = Hierarchy("/sys/fs/cgroup")
    assert whole.directory("/") == "/sys/fs/cgroup"
    assert whole.directory("/job.slice/a") == "/sys/fs/cgroup/job.slice/a"
    part = Hierarchy("/sys/fs/cgroup", root="/kubepods/pod1")
    assert part.directory("/kubepods/pod1") == "/sys/fs/cgroup"
    assert part.directory("/kubepods/pod1/c") == "/sys/fs/cgroup/c"
    assert part.directory("/kubepods/pod12") is None
    assert part.directory("/") is None


def test_containment_is_by_whole_path_components() -> None:
    assert contains("/a", "/a")
    assert contains("/a", "/a/b")
    assert contains("/", "/a")
    assert not contains("/a", "/ab")
    assert not contains("/a/b", "/a")


def test_a_cgroup_lists_its_processes_and_those_below_it(scratch_cgroup: ScratchCgroup) -> None:
    below = scratch_cgroup.child("below")
    first, second = sleeper(), sleeper()
    try:
        scratch_cgroup.add(first.pid)
        below.add(second.pid)
        assert cgroup_of(second.pid) == below.path
        cgroup = Cgroup.open(scratch_cgroup.path, str(scratch_cgroup.directory))
        try:
            assert sorted(cgroup.pids(100)) == sorted([first.pid, second.pid])
            assert len(cgroup.pids(1)) == 1
            assert cgroup.kill() == ""
            assert first.wait(timeout=PATIENCE) == -signal.SIGKILL
            assert second.wait(timeout=PATIENCE) == -signal.SIGKILL
        finally:
            cgroup.close()
    finally:
        reap(first)
        reap(second)


def test_a_removed_cgroup_is_never_reached_through_a_new_one_of_its_name(
    scratch_cgroup: ScratchCgroup,
) -> None:
    below = scratch_cgroup.child("again")
    cgroup = Cgroup.open(below.path, str(below.directory))
    try:
        below.directory.rmdir()
        below.directory.mkdir()
        victim = subprocess.Popen(["sleep", "300"])
        try:
            below.add(victim.pid)
            assert cgroup.pids(100) == []
            assert cgroup.kill() == "no cgroup.kill"
            assert victim.poll() is None
        finally:
            reap(victim)
    finally:
        cgroup.close()


def test_a_gone_process_has_no_cgroup() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert cgroup_of(child.pid) is None
