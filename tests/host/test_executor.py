"""The executor carries out policy runs on real processes. A bug in one run, such
as an observation that does not answer its run's pending effect, is logged with
its traceback and fails that run alone: its timer leaves the state, nothing
reaches the nursery, and the other runs go on."""

from __future__ import annotations

import logging
import os
import subprocess
import time

import pytest
import trio

from watchdogd.core.config import Config, DaemonConfig, PolicyConfig, StepConfig
from watchdogd.core.effects import Seen, WrongObservation
from watchdogd.core.expiry import Run
from watchdogd.core.identity import Peer
from watchdogd.core.service import Service
from watchdogd.host.exits import ExitWatcher
from watchdogd.host.process import Process
from watchdogd.host.users import UserNames
from watchdogd.runtime.executor import Executor
from watchdogd.runtime.host_processes import HostProcesses
from watchdogd.runtime.metrics import exposition
from watchdogd_protocol import Acquire


def _service() -> Service[Process]:
    config = Config(
        daemon=DaemonConfig(),
        policies={
            "later": PolicyConfig(steps=[StepConfig(wait=5.0), StepConfig(signal="SIGKILL")])
        },
    )
    return Service(
        config,
        HostProcesses(ExitWatcher(), UserNames()),
        daemon_pid=os.getpid(),
        now=time.monotonic(),
        wall=time.time,
        clock=time.monotonic,
        render_metrics=exposition,
    )


async def test_a_wrong_observation_is_logged_and_fails_its_run_alone(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = subprocess.Popen(["sleep", "60"])
    killed = subprocess.Popen(["sleep", "60"])
    try:
        service = _service()
        for victim, policy in ((waiting, "later"), (killed, "kill")):
            caller = service.arming.open_connection(Peer(pid=victim.pid, uid=0, gid=0))
            acquire = Acquire(id=1, scope="step", timeout=0.01, policy=policy)
            service.handle(acquire, caller, time.monotonic())

        # A bug: the wait's end answered as if the target had been polled.
        async def wrong_wait(self: Executor, run: Run, *args: object) -> None:
            await trio.sleep(0.01)
            run.observe(Seen(True))

        monkeypatch.setattr(Executor, "_wait", wrong_wait)
        await trio.sleep(0.05)
        async with trio.open_nursery() as nursery:
            executor = Executor(service, nursery, clock=time.monotonic)
            await nursery.start(executor.run)  # watches the target sent SIGKILL
            executor.carry_out(service.firing.take_due(time.monotonic(), 10))
            with trio.fail_after(10):
                while executor.settle(time.monotonic() + 1.0) or len(service.firing):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        # The wrong run failed alone, logged with its traceback; the kill went.
        [failed] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert failed.getMessage().startswith("the policy failed of Timer(")
        assert failed.exc_info is not None
        assert isinstance(failed.exc_info[1], WrongObservation)
        assert "does not answer WaitUntil" in str(failed.exc_info[1])
        assert killed.wait(timeout=5) == -9
        assert waiting.poll() is None  # never signalled: its run failed at the wait
        assert len(service.firing) == 0
    finally:
        for victim in (waiting, killed):
            victim.kill()
            victim.wait()


async def test_a_first_signal_goes_in_the_pass_and_its_run_takes_it_when_it_settles() -> None:
    """The pass sends a burst's first signals and nothing more: what each signal
    was observed (when it went) is handed to its run when it settles, so the
    event's lateness is the pass's, however late the settling."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        service = _service()
        caller = service.arming.open_connection(Peer(pid=victim.pid, uid=0, gid=0))
        service.handle(Acquire(id=1, scope="pass", timeout=0.01), caller, time.monotonic())
        await trio.sleep(0.05)
        async with trio.open_nursery() as nursery:
            executor = Executor(service, nursery, clock=time.monotonic)
            await nursery.start(executor.run)
            executor.carry_out(service.firing.take_due(time.monotonic(), 10))
            assert victim.wait(timeout=5) == -9  # before anything settled
            assert executor.settling == 1
            await trio.sleep(0.3)
            with trio.fail_after(10):
                while executor.settle(time.monotonic() + 1.0) or len(service.firing):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        [event] = service.context.events.since(0)
        assert event.steps[0].result == "sent SIGKILL"
        assert event.outcome == "exited"
        assert event.late is not None
        assert event.late < 0.3
    finally:
        victim.kill()
        victim.wait()
