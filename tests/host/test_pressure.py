"""Samples read from this host's kernel: CPU time, and the host's and a cgroup's
pressure (where the cgroup v2 hierarchy is mounted: tests/host/test_cgroups.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from watchdogd.core.starvation import Sample
from watchdogd.host.cgroups import cgroup_of, host_hierarchy
from watchdogd.host.pressure import PressureGauge, read_pressure
from watchdogd.host.process import open_process

from helpers.processes import reap, sleeper
from helpers.waiting import wait_until


def test_a_sample_of_this_process() -> None:
    gauge = PressureGauge()
    process = open_process(os.getpid())
    try:
        first = gauge.sample(process)
        until = time.thread_time() + 0.05
        while time.thread_time() < until:
            pass
        second = gauge.sample(process)
    finally:
        process.close()
    assert first is not None
    assert second is not None
    assert second.at > first.at
    assert second.cpu >= first.cpu + 0.03  # in clock ticks: 10 ms each
    assert first.cgroup == cgroup_of(os.getpid())
    assert first.host is not None
    assert second.host is not None
    assert second.host.cpu >= first.host.cpu
    if first.cgroup == "/":  # the root cgroup's pressure is the host's
        assert first.group == first.host


def test_a_sample_reads_the_processs_own_cgroup(cgroup: Path) -> None:
    worker = sleeper()
    process = open_process(worker.pid)
    try:
        (cgroup / "cgroup.procs").write_text(str(worker.pid))
        before = read_pressure(str(cgroup / "{}.pressure"))
        sample = PressureGauge().sample(process)
        after = read_pressure(str(cgroup / "{}.pressure"))
    finally:
        process.close()
        reap(worker)
    hierarchy = host_hierarchy()
    assert hierarchy is not None
    path = "/" + str(cgroup.relative_to(hierarchy.mount))
    assert sample is not None
    assert sample.cgroup == path
    assert before is not None
    assert after is not None
    assert sample.group is not None
    assert before.cpu <= sample.group.cpu <= after.cpu
    assert sample.group.cpu < 1_000_000  # a sleeper waits for nothing


def test_no_sample_of_a_process_that_exited() -> None:
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    process = open_process(worker.pid)
    try:
        reap(worker)
        wait_until(lambda: not process.alive(), what="the worker's exit")
        assert PressureGauge().sample(process) is None
    finally:
        process.close()


def test_what_cannot_be_read_is_unknown(tmp_path: Path) -> None:
    assert read_pressure(str(tmp_path / "{}.pressure")) is None
    gauge = PressureGauge(mountinfo=str(tmp_path / "mountinfo"), host_pressure=str(tmp_path))
    process = open_process(os.getpid())
    try:
        sample = gauge.sample(process)
    finally:
        process.close()
    assert isinstance(sample, Sample)
    assert (sample.host, sample.cgroup, sample.group) == (None, "", None)
