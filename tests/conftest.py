"""The suite's fixtures: a real daemon on a socket under /tmp, a real etcd, a scratch
cgroup. What tests share besides fixtures is in the ``helpers`` package."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import Scheduling

from watchdogd.host.cgroups import host_hierarchy
from watchdogd_client import Client
from watchdogd_client.responder import decline_responder

from helpers.cgroups import ScratchCgroup, remove_cgroup
from helpers.daemon import SHORT_RESTART, RunningDaemon, configured_daemon
from helpers.etcd import EtcdServer, running_etcd
from helpers.launcher import close_launcher
from helpers.processes import left_behind
from helpers.scheduling import TorchJobsTogether

# The test process arms timers on itself against many daemons: a responder of its
# own would stay bound to the first of them. Workers the tests start (processes of
# their own) start theirs as any worker does.
decline_responder()

# pytest-xdist's workers run with COLUMNS=80 and LINES=24 set: every watchdogctl a
# test starts would fit its tables to 80 columns even in a pipe. A test that wants
# a width sets one.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> Scheduling | None:
    """The torch jobs kept together under ``--dist loadgroup`` (`TorchJobsTogether`)."""
    return TorchJobsTogether(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A process a test left running in the suite's process group fails the run,
    and is killed: the suite ends with none of its own still running."""
    close_launcher()
    orphans_too = "PYTEST_XDIST_WORKER" not in os.environ
    leftovers = left_behind(orphans_too=orphans_too)
    if leftovers:
        # One caught in the middle of its exit (its command line already gone) is
        # a zombie a moment later: only what is still running then was left behind.
        time.sleep(0.5)
        leftovers = left_behind(orphans_too=orphans_too)
    for pid, _ in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if leftovers:
        shown = "\n".join(f"  {pid}: {command[:200]}" for pid, command in leftovers)
        print(f"\nprocesses the tests left running (killed now):\n{shown}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="wd-", dir="/tmp"))
    yield directory / "watchdogd.sock"
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    running = RunningDaemon(socket_path, tmp_path / "watchdogd.log", [])
    running.start()
    yield running
    status = running.stop()
    assert status == 0, f"watchdogd exited {status}:\n{running.log()}"


@pytest.fixture
def short_lived_daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    """A daemon for tests that stop it for good (`SHORT_RESTART`)."""
    with configured_daemon(socket_path, tmp_path, SHORT_RESTART) as running:
        yield running


@pytest.fixture
def client(daemon: RunningDaemon) -> Iterator[Client]:
    with daemon.client() as connected:
        yield connected


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A single-member etcd shared by the tests of a module: each test keeps to keys
    of its own, and none stops it (`own_etcd` is for that)."""
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A single-member etcd for one test, which may stop, kill and start it again."""
    with running_etcd(tmp_path / "etcd") as server:
        yield server


@pytest.fixture
def scratch_cgroup() -> Iterator[ScratchCgroup]:
    """A new cgroup v2; at the end every process left in it (or below) is killed and
    it is removed. Skips where there is no cgroup v2 hierarchy to write to."""
    hierarchy = host_hierarchy()
    if os.getuid() != 0 or hierarchy is None or hierarchy.root != "/":
        pytest.skip("needs root and a cgroup v2 hierarchy mounted at its root")
    name = f"watchdogd-test-{os.getpid()}-{os.urandom(4).hex()}"
    directory = Path(hierarchy.mount) / name
    directory.mkdir()
    try:
        yield ScratchCgroup(directory, f"/{name}")
    finally:
        remove_cgroup(directory)


@pytest.fixture
def cgroup(scratch_cgroup: ScratchCgroup) -> Path:
    """The directory of a scratch cgroup (`scratch_cgroup`) with pressure (PSI)
    files; skips on a kernel whose cgroups have none."""
    if not (scratch_cgroup.directory / "cpu.pressure").exists():
        pytest.skip("this kernel's cgroups have no pressure (PSI) files")
    return scratch_cgroup.directory
