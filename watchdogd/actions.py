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

import trio

from watchdogd_client.protocol import EventInfo, StepResult

from .hooks import run_hook, substitute
from .logs import log
from .policies import Dump, Exec, Policy, Signal, Step, Wait
from .process import Process
from .service import Service
from .targets import Target, open_target
from .timers import Expired, Timer


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
        """Start carrying out each expiry; returns at once."""
        for item in expired:
            self._nursery.start_soon(self._expire, item.timer, item.process)

    def _policy_for(self, timer: Timer) -> tuple[Policy, str]:
        policies = self._service.policies
        policy = policies.get(timer.policy)
        if policy is not None:
            return policy, ""
        default = policies[self._service.default_policy]
        note = (
            f"policy {timer.policy!r} is no longer configured; "
            f"the default policy {default.name!r} was used"
        )
        return default, note

    async def _expire(self, timer: Timer, process: Process) -> None:
        fired = self._clock()
        try:
            policy, note = self._policy_for(timer)
            command = process.command()
            target = open_target(policy.target, process, self._daemon_pgid, timer.owner)
        except Exception:
            log.exception("could not start the policy of %r", timer)
            return
        finally:
            process.close()  # the target holds pidfds of its own
        try:
            await self._run(timer, policy, target, command=command, fired=fired, note=note)
        except Exception:
            log.exception("the policy of %r failed", timer)
        finally:
            target.close()

    async def _run(
        self, timer: Timer, policy: Policy, target: Target, *, command: str, fired: float, note: str
    ) -> None:
        settings = self._service.config
        values = {"pid": str(timer.pid), "scope": timer.scope}
        env = {
            "WATCHDOG_PID": str(timer.pid),
            "WATCHDOG_SCOPE": timer.scope,
            "WATCHDOG_POLICY": policy.name,
            "WATCHDOG_UID": str(timer.uid),
        }
        gone_at_start = not target.alive()
        results: list[StepResult] = []
        signalled = killed = False
        for step in policy.steps:
            if target.denied:
                results.append(StepResult(step=step.describe(), result="skipped: not allowed"))
                continue
            if not target.alive():
                results.append(StepResult(step=step.describe(), result="skipped: target exited"))
                continue
            results.append(await self._step(step, target, values, env))
            if isinstance(step, Signal):
                if not signalled:
                    signalled = True
                    self._service.metrics.observe_lateness(self._clock() - timer.deadline)
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
            if timer.deadline < self._service.started
            else ""
        )
        notes = [text for text in (note, target.denied, target.note, downtime) if text]
        self._service.metrics.expiries[(policy.name, outcome)] += 1
        self._service.events.record(
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
                fired_at=self._as_wall(fired),
                late=fired - timer.deadline,
                outcome=outcome,
                steps=results,
                note="; ".join(notes),
            )
        )
        if outcome == "unkillable":
            self._report_unkillable(timer, policy, target, settings.unkillable_after)

    @staticmethod
    async def _step(
        step: Step, target: Target, values: dict[str, str], env: dict[str, str]
    ) -> StepResult:
        match step:
            case Signal(signum):
                return StepResult(step=step.describe(), result=target.signal(signum))
            case Wait(seconds):
                exited = await target.wait_exit(seconds)
                result = "exited" if exited else f"still running after {seconds:g}s"
                return StepResult(step=step.describe(), result=result)
            case Exec(argv, timeout) | Dump(argv, timeout):
                hook = await run_hook(substitute(argv, values), env, timeout)
                return StepResult(step=step.describe(), result=hook.result, output=hook.output)

    def _report_unkillable(
        self, timer: Timer, policy: Policy, target: Target, after: float
    ) -> None:
        pid, state, wchan = target.survivor()
        self._service.metrics.unkillable += 1
        self._service.events.record(
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
