"""Carrying out a policy when a timer expires.

Each expiry runs in a task of its own, started the moment the scheduler finds it
due: a long ``wait``, a slow hook or an unkillable target never delays another
expiry, the scheduler or a request. Invariants:

- Nothing here raises into the scheduler. A process that is already gone, a signal
  the kernel refuses, a hook that fails or hangs: each becomes the recorded result
  of its step. A bug is logged and costs only that expiry's record.
- Steps after the target has exited are skipped. So is every step when the uid
  that armed the timer may no longer signal its process (its uids changed since;
  see `watchdogd.targets`): the event says why, and its outcome is ``alive``.
- A timer whose policy was removed by a reload runs the default policy, and its
  event says so.
- A target still alive ``unkillable_after`` seconds after SIGKILL is reported as
  ``unkillable`` with its /proc state and wait channel; the task then ends.
- Every expiry ends in one ``expired`` event (one log line): the pid, uid, command,
  scope, policy, when it was armed, its deadline, when it fired, how late, each
  step's result and output, and the outcome.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import msgspec
import trio

from watchdogd_client.protocol import EventInfo, StepResult

from .core.policies import Dump, Exec, Policy, Signal, Step, Wait
from .core.service import Service
from .core.timers import Expired, Timer
from .hooks import run_hook, substitute
from .logs import log
from .process import Process
from .targets import Target, open_target


def _resume_point(timer: Timer, policy: Policy, note: str) -> tuple[Timer, str]:
    """Where a resumed expiry goes on: at the step it had reached, unless its
    policy was changed or removed while the daemon was down (the step means
    nothing in another policy): then from the first step, and its event says so."""
    if not (timer.step or timer.step_end) or (timer.plan == policy.plan and not note):
        return timer, note
    again = "its policy changed across a restart; started again from its first step"
    timer = msgspec.structs.replace(timer, step=0, step_end=0.0)
    return timer, "; ".join(text for text in (note, again) if text)


class Actions:
    """Starts a task for every expired timer in ``nursery``."""

    def __init__(
        self,
        service: Service[Process],
        nursery: trio.Nursery,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._service = service
        self._nursery = nursery
        self._clock = clock
        self._wall = wall
        self._daemon_pgid = os.getpgrp()

    def carry_out(self, expired: list[Expired[Process]]) -> None:
        """Start carrying out each expiry (or resuming it, from the step its timer
        records); returns at once."""
        for item in expired:
            self._nursery.start_soon(self._expire, item.timer, item.process)

    async def _expire(self, timer: Timer, process: Process) -> None:
        try:
            policy, note = self._service.policy_for(timer.policy)
            command = process.command()
            target = open_target(policy.target, process, self._daemon_pgid, timer.owner)
        except Exception:
            log.exception("could not start the policy of %r", timer)
            self._service.expiry_finished(timer)
            return
        finally:
            process.close()  # the target holds pidfds of its own
        try:
            await self._run(timer, policy, target, command=command, note=note)
        except Exception:
            log.exception("the policy of %r failed", timer)
            self._service.expiry_finished(timer)
        finally:
            target.close()

    async def _run(
        self, timer: Timer, policy: Policy, target: Target, *, command: str, note: str
    ) -> None:
        """Carry out ``policy`` from the step ``timer`` reached (0, or where a
        daemon that stopped left it). Each step is recorded in the state as it
        starts; cancelled (the daemon stops), the timer stays firing there."""
        settings = self._service.config
        values = {"pid": str(timer.pid), "scope": timer.scope}
        env = {
            "WATCHDOG_PID": str(timer.pid),
            "WATCHDOG_SCOPE": timer.scope,
            "WATCHDOG_POLICY": policy.name,
            "WATCHDOG_UID": str(timer.uid),
        }
        timer, note = _resume_point(timer, policy, note)
        resumed_at = timer.step
        gone_at_start = not target.alive()
        results: list[StepResult] = []
        signalled = resumed_at > 0
        killed = False
        for index, step in enumerate(policy.steps):
            if index < resumed_at:
                results.append(StepResult(step=step.describe(), result="done before a restart"))
                killed = killed or (isinstance(step, Signal) and step.signum == signal.SIGKILL)
                continue
            if target.denied:
                results.append(StepResult(step=step.describe(), result="skipped: not allowed"))
                continue
            if not target.alive():
                results.append(StepResult(step=step.describe(), result="skipped: target exited"))
                continue
            if isinstance(step, Wait):
                end = timer.step_end if index == timer.step and timer.step_end else 0.0
                end = end or self._clock() + step.seconds
                timer = self._service.step_started(timer, index, end)
                results.append(await self._wait(step, target, end))
                continue
            timer = self._service.step_started(timer, index)
            results.append(await self._step(step, target, values, env))
            if isinstance(step, Signal):
                if not signalled:
                    signalled = True
                    self._service.observe_lateness(self._clock() - timer.deadline)
                # A SIGKILL the kernel refused (EPERM) makes no target "unkillable".
                sent = results[-1].result.startswith("sent")
                killed = killed or (step.signum == signal.SIGKILL and sent)
        alive = target.alive()
        if alive and killed:
            alive = not await target.wait_exit(settings.unkillable_after)
        if gone_at_start:
            outcome = "gone"
        elif alive:
            outcome = "unkillable" if killed else "alive"
        else:
            outcome = "exited"
        downtime = (
            "fell due while the daemon was not running"
            if timer.deadline < self._service.started <= timer.fired_at
            else ""
        )
        resumed = f"resumed at step {resumed_at + 1} after a restart" if resumed_at else ""
        notes = [text for text in (note, target.denied, target.note, downtime, resumed) if text]
        self._service.record_expiry(
            EventInfo(
                seq=0,
                kind="expired",
                time=self._wall(),
                pid=timer.pid,
                uid=timer.uid,
                scope=timer.scope,
                policy=policy.name,
                command=command,
                armed_at=self._as_wall(timer.armed_at),
                deadline=self._as_wall(timer.deadline),
                fired_at=self._as_wall(timer.fired_at),
                late=timer.fired_at - timer.deadline,
                outcome=outcome,
                steps=results,
                note="; ".join(notes),
            )
        )
        self._service.expiry_finished(timer)
        if outcome == "unkillable":
            self._report_unkillable(timer, policy, target, settings.unkillable_after)

    async def _wait(self, step: Wait, target: Target, end: float) -> StepResult:
        """A wait that ends at ``end`` on the daemon's clock (its original end, when
        it resumes after a restart), or once the target has exited."""
        exited = await target.wait_exit(max(0.0, end - self._clock()))
        result = "exited" if exited else f"still running after {step.seconds:g}s"
        return StepResult(step=step.describe(), result=result)

    @staticmethod
    async def _step(
        step: Step, target: Target, values: dict[str, str], env: dict[str, str]
    ) -> StepResult:
        match step:
            case Signal(signum):
                return StepResult(step=step.describe(), result=target.signal(signum))
            case Wait():
                raise AssertionError("waits are carried out by Actions._wait")
            case Exec(argv, timeout) | Dump(argv, timeout):
                hook = await run_hook(substitute(argv, values), env, timeout)
                return StepResult(step=step.describe(), result=hook.result, output=hook.output)

    def _report_unkillable(
        self, timer: Timer, policy: Policy, target: Target, after: float
    ) -> None:
        pid, state, wchan = target.survivor()
        self._service.record_unkillable(
            EventInfo(
                seq=0,
                kind="unkillable",
                time=self._wall(),
                pid=pid,
                uid=timer.uid,
                scope=timer.scope,
                policy=policy.name,
                state=state,
                wchan=wchan,
                note=f"still alive {after:g}s after SIGKILL",
            )
        )

    def _as_wall(self, monotonic: float) -> float:
        return self._wall() - (self._clock() - monotonic)
