"""exec and dump programs: environment, whole-argument substitution, bounds; and, with
a real daemon, that a scope is never an option and a hook's output is root's only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from watchdogd.core.counters import Counters
from watchdogd.core.effects import HookResult
from watchdogd.core.policies import substitute
from watchdogd.runtime.hooks import OUTPUT_LIMIT, DumpPool, run_hook
from watchdogd_client import Client
from watchdogd_protocol import EventInfo

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.hooks import RECORDING_DUMPER, most_at_once
from helpers.processes import reap
from helpers.users import as_nobody, nobody_sleeper
from helpers.waiting import PATIENCE, wait_until


def test_substitution_is_whole_arguments_only() -> None:
    values = {"pid": "42", "scope": "a b; rm -rf /"}
    argv = ["tool", "{pid}", "--scope", "{scope}", "pid={pid}", "{nope}"]
    assert substitute(argv, values) == [
        "tool",
        "42",
        "--scope",
        "a b; rm -rf /",  # one argument, never a shell word
        "pid={pid}",
        "{nope}",
    ]


async def test_environment_and_output() -> None:
    env = {"WATCHDOG_PID": "42", "WATCHDOG_SCOPE": "s", "WATCHDOG_POLICY": "p", "WATCHDOG_UID": "0"}
    result = await run_hook(["sh", "-c", "env | sort; echo oops >&2; exit 3"], env, 5)
    assert result.status == 3
    assert result.result == "exit 3"
    lines = result.output.splitlines()
    for key, value in env.items():
        assert f"{key}={value}" in lines
    assert "oops" in lines
    # Nothing of the daemon's own environment leaks but PATH.
    assert {line.split("=")[0] for line in lines if "=" in line} <= {
        *env,
        "PATH",
        "PWD",
        "SHLVL",
        "_",
    }


async def test_a_hanging_hook_and_everything_it_started_are_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    started = time.monotonic()
    result = await run_hook(
        ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; echo started; wait"], {}, 0.5
    )
    assert time.monotonic() - started < 5
    assert result.status is None
    assert result.result == "killed after 0.5s"
    assert "started" in result.output
    child = int(pidfile.read_text())
    with trio.fail_after(5):
        while (
            os.path.exists(f"/proc/{child}")
            and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]
        ):
            await trio.sleep(0.01)


async def test_output_is_bounded() -> None:
    result = await run_hook(["sh", "-c", f"yes x | head -c {OUTPUT_LIMIT * 3}"], {}, 5)
    assert result.status == 0
    assert result.output.startswith("x\nx\n")
    assert len(result.output.split("\n[")[0]) == OUTPUT_LIMIT
    assert result.output.endswith(f"[{OUTPUT_LIMIT * 2} more bytes dropped]")


async def test_missing_program_is_a_result_not_an_error() -> None:
    result = await run_hook(["no-such-dumper-anywhere"], {}, 5)
    assert result.status is None
    assert result.result == "not found: no-such-dumper-anywhere"


async def test_killed_by_a_signal() -> None:
    result = await run_hook(["sh", "-c", "kill -TERM $$"], {}, 5)
    assert (result.status, result.result) == (143, "killed by SIGTERM")


async def test_the_dump_pool_runs_a_few_at_once(tmp_path: Path) -> None:
    counters = Counters()
    pool = DumpPool(3, counters)
    record = tmp_path / "dumps"
    results: dict[int, HookResult] = {}
    seen: list[tuple[int, int]] = []

    async def dump(number: int) -> None:
        argv = ["sh", "-c", RECORDING_DUMPER, str(record), str(number), "0.3"]
        results[number] = await pool.run(argv, {}, 30)

    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            for number in range(10):
                nursery.start_soon(dump, number)
            while len(results) < 10:
                seen.append((counters.dumps_running, counters.dumps_waiting))
                await trio.sleep(0.02)
    assert most_at_once(record) == 3
    assert max(seen) == (3, 7)
    assert (counters.dumps_running, counters.dumps_waiting, counters.dumps_not_run) == (0, 0, 0)
    assert sorted(int(line.split()[2]) for line in record.read_text().splitlines()) == sorted(
        [*range(10), *range(10)]
    )
    assert all(result.status == 0 for result in results.values())
    waited = [result for result in results.values() if result.result != "exit 0"]
    assert len(waited) == 7
    assert all(result.result.endswith("for a turn (max_dumps = 3)") for result in waited)


async def test_dumps_take_their_turns_first_come_first_served(tmp_path: Path) -> None:
    pool = DumpPool(1, Counters())
    record = tmp_path / "dumps"

    async def dump(number: int) -> None:
        argv = ["sh", "-c", RECORDING_DUMPER, str(record), str(number), "0.05"]
        await pool.run(argv, {}, 30)

    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            for number in range(8):
                nursery.start_soon(dump, number)
                await trio.sleep(0.005)  # arrive in this order
    starts = [int(line.split()[2]) for line in record.read_text().splitlines() if "start" in line]
    assert starts == list(range(8))


async def test_a_dumps_timeout_bounds_its_wait_and_its_run(tmp_path: Path) -> None:
    counters = Counters()
    pool = DumpPool(1, counters)
    record = tmp_path / "dumps"
    results: list[tuple[str, HookResult]] = []

    async def dump(name: str, seconds: str, timeout: float) -> None:
        argv = ["sh", "-c", RECORDING_DUMPER, str(record), name, seconds]
        results.append((name, await pool.run(argv, {}, timeout)))

    started = trio.current_time()
    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            # Long enough that the patient one, run once the pool grows, ends first
            # even on a loaded machine.
            nursery.start_soon(dump, "long", "5", 30.0)
            await trio.sleep(0.1)
            nursery.start_soon(dump, "hasty", "0", 0.5)  # no turn within its timeout
            await trio.sleep(0.1)
            nursery.start_soon(dump, "patient", "0.5", 30.0)
            while not results:
                await trio.sleep(0.01)
            assert trio.current_time() - started < 1.5
            pool.resize(2)  # a larger pool gives the next waiter its turn now
    hasty, patient, long = (result for _, result in results)
    assert [name for name, _ in results] == ["hasty", "patient", "long"]
    assert (hasty.status, hasty.result) == (
        None,
        "not run: no turn within 0.5s (max_dumps = 1, all running)",
    )
    assert counters.dumps_not_run == 1
    assert patient.status == 0
    assert patient.result.startswith("exit 0; waited ")
    assert long.result == "exit 0"
    assert "hasty" not in record.read_text()  # it never started


def test_a_daemon_refuses_at_start_a_hook_that_could_take_a_scope_as_an_option(
    tmp_path: Path, socket_path: Path
) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text(
        '[policies.listing]\nsteps = [{ signal = "SIGTERM" }, { exec = ["ls", "{scope}"] }]\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "watchdogd", "--socket", str(socket_path), "--config", str(config)],
        capture_output=True,
        text=True,
        check=False,
        timeout=PATIENCE,
    )
    assert result.returncode == 1
    assert f"{config}, line 2: policies.listing.steps[1].exec: {{scope}} may stand only" in (
        result.stderr
    )
    assert not socket_path.exists()


HOOKS = """
[policies.listing]
steps = [ { exec = ["ls", "--", "{scope}"] }, { dump = ["echo", "dumped", "{pid}"] } ]
"""

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as uid 65534")


@pytest.fixture
def hook_daemon(socket_path: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    with configured_daemon(socket_path, tmp_path, HOOKS, for_everyone=True) as running:
        yield running


def _expiry_armed_by_nobody(daemon: RunningDaemon, scope: str) -> EventInfo:
    """uid 65534 arms ``scope`` with the ``listing`` policy on a process of its own;
    returns the expiry as root sees it."""
    victim = nobody_sleeper()
    try:
        outcome = as_nobody(
            lambda c: c.acquire(scope, 0.1, pid=victim.pid, policy="listing"),
            daemon.socket_path,
        )
        assert outcome == {"ok": 0.1}
        found: list[EventInfo] = []
        with daemon.client() as client:

            def expired() -> bool:
                found[:] = [e for e in client.events().events if e.pid == victim.pid]
                return bool(found)

            wait_until(expired, what="the expiry")
    finally:
        reap(victim)
    [event] = found
    return event


@needs_root
def test_a_scope_that_looks_like_an_option_is_an_operand(hook_daemon: RunningDaemon) -> None:
    event = _expiry_armed_by_nobody(hook_daemon, "--version")
    listing, dump = event.steps
    assert listing.step == "exec ls -- --version"  # named for what ran
    assert listing.result == "exit 2"
    assert "cannot access '--version'" in listing.output
    assert "coreutils" not in listing.output  # what `ls --version` prints
    assert dump.output == f"dumped {event.pid}\n"


@needs_root
def test_a_hooks_output_is_shown_to_root_only(hook_daemon: RunningDaemon, tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "secret-file-name").touch()
    event = _expiry_armed_by_nobody(hook_daemon, str(private))
    listing, dump = event.steps
    assert listing.output == "secret-file-name\n"  # the hook ran as root; root sees it
    assert dump.output == f"dumped {event.pid}\n"

    def read_events(client: Client) -> list[Any]:
        return [(e.kind, e.scope, msgspec.to_builtins(e.steps)) for e in client.events().events]

    seen = as_nobody(read_events, hook_daemon.socket_path)["ok"]
    # The owner sees its expiry, each step and its exit status, and no output.
    assert seen == [
        [
            "expired",
            str(private),
            [
                {"step": f"exec ls -- {private}", "result": "exit 0", "output": ""},
                {"step": f"dump echo dumped {event.pid}", "result": "exit 0", "output": ""},
            ],
        ]
    ]
    with hook_daemon.client() as client:  # the record itself still holds it
        [kept] = client.events().events
        assert kept.steps[0].output == "secret-file-name\n"
