"""exec and dump programs: environment, whole-argument substitution, bounds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio

from watchdogd.hooks import OUTPUT_LIMIT, run_hook, substitute


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
