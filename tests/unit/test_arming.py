"""The arming parameters: one declaration, checked where every expires() takes them."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import trio

import watchdogd_client
from watchdogd_client import Client, NullClient
from watchdogd_client.arming import (
    JOB_VARIABLES,
    RANK_VARIABLES,
    Arming,
    acquire_request,
    arming_timeout,
    forget_environment,
)
from watchdogd_client.trio import open_client
from watchdogd_protocol import Acquire, Auto


def test_a_misspelt_parameter_fails_at_the_call_of_every_expires() -> None:
    misspelt: dict[str, Any] = {"polcy": "term"}
    client = Client("/nowhere/watchdogd.sock")  # never connects: the call fails first
    module_level = functools.partial(watchdogd_client.expires, client=client)
    for expires in (client.expires, NullClient().expires, module_level):
        with pytest.raises(TypeError, match="unexpected keyword argument 'polcy'"):
            expires(30, "s", **misspelt)


def test_the_trio_client_checks_them_as_well() -> None:
    async def main() -> None:
        async with open_client("/nowhere/watchdogd.sock") as client:
            with pytest.raises(TypeError, match="'polcy'"):
                client.expires(30, polcy="term")  # type: ignore[call-arg]

    trio.run(main)


def test_auto_needs_a_ceiling_and_arms_it() -> None:
    with pytest.raises(ValueError, match="needs a ceiling"):
        arming_timeout("auto", {})
    assert arming_timeout("auto", {"ceiling": 60.0, "floor": 1.0}) == 60.0
    assert arming_timeout(5.0, {}) == 5.0


def test_one_function_builds_the_acquire(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (*JOB_VARIABLES, *RANK_VARIABLES, "SLURM_STEP_ID"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    forget_environment()
    arming: Arming = {"policy": "term", "floor": 2.0, "ceiling": 90.0, "job": "run-7", "rank": 3}
    built = acquire_request(7, "step", "auto", pid=42, progress=5, **arming)
    assert built == Acquire(
        id=7,
        scope="step",
        timeout=90.0,
        policy="term",
        pid=42,
        progress=5,
        auto=Auto(floor=2.0),
        job="run-7",
        rank=3,
        local_rank=2,
    )
    plain = acquire_request(8, "plain", 30.0)
    assert plain == Acquire(id=8, scope="plain", timeout=30.0, local_rank=2)


def test_the_job_is_read_at_the_first_timer_and_again_after_a_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in (*JOB_VARIABLES, *RANK_VARIABLES, "SLURM_STEP_ID"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WATCHDOGD_JOB", "first")
    forget_environment()
    assert acquire_request(1, "s", 5.0).job == "first"
    monkeypatch.setenv("WATCHDOGD_JOB", "changed")
    assert acquire_request(2, "s", 5.0).job == "first"  # read once per process
    assert acquire_request(3, "s", 5.0, job="given").job == "given"
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        os.write(writing, (acquire_request(4, "s", 5.0).job or "").encode())
        os._exit(0)
    os.close(writing)
    assert os.read(reading, 100) == b"changed"
    os.close(reading)
    assert os.waitpid(child, 0)[1] == 0
    forget_environment()
