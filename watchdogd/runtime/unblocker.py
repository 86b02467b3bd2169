"""Asking ranks' responders to unblock their processes, as the core owes it
(`watchdogd.core.unblocks`).

One task, `Unblocker.run`, sleeps until the next unblock is due or the core says
one may be (a host was lost, a policy asked for a job's ranks to be unblocked),
looking every `_LOOK_EVERY` seconds while an incident's verdict may come to name
what to cut; it has the core order what verdicts now name (`Unblocks.check`), takes what is
due and asks each rank's responder in a task of its own
(`watchdogd.runtime.asks.Asks.unblock`: the responder of that very process,
alive), handing the answer back to the core. An ask waits for its answer at most
``evidence_timeout`` seconds: a responder that does not answer (its process
stopped, a thread holding the GIL) costs that and nothing else, and is not asked
again. Nothing here raises into the daemon: a bug costs the unblock it was about.

A policy's unblock step is carried out here too (`unblock_step`), for the
executor: it asks for the job's waiting ranks to be unblocked and waits, up to
its timeout, for the verdict to name their collective; its fallback signal goes
only to ranks of this host that hold a timer of the job, through that timer's
pidfd, and that the timer's owner may still signal.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Final

import trio

from ..core import (
    Delivery,
    OwedUnblock,
    PeersUnblocked,
    Run,
    Service,
    SignalResult,
    UnblockPeers,
)
from ..host.process import Process
from ..logs import log, logfmt
from .asks import Asks

#: How often an incident whose ranks are to be unblocked is looked at while its
#: verdict does not name what to cut yet: every change of its evidence may.
_LOOK_EVERY: Final = 0.25
#: How often an unblock step looks whether the verdict names the collective yet.
_STEP_POLL: Final = 0.05


class Unblocker:
    """Carries out the core's unblocks (see the module docstring)."""

    def __init__(
        self, service: Service[Process], asks: Asks, *, clock: Callable[[], float]
    ) -> None:
        self._service = service
        self._asks = asks
        self._clock = clock
        self._wake = trio.Event()
        service.unblocks.on_owed = self.wake

    def wake(self) -> None:
        """Look again now: an unblock may be due sooner, or a verdict name one."""
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        unblocks = self._service.unblocks
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self._wake = trio.Event()
                now = self._clock()
                try:
                    unblocks.check(now)
                    for unblock in unblocks.take(now):
                        nursery.start_soon(self._ask, unblock)
                except Exception:
                    log.exception("ordering unblocks failed")
                due = unblocks.next_due()
                wait = float("inf") if due is None else due - now
                if unblocks.waiting:  # an incident's verdict may name what to cut
                    wait = min(wait, _LOOK_EVERY)
                with trio.move_on_after(max(wait, 0.0)):
                    await self._wake.wait()

    async def _ask(self, unblock: OwedUnblock) -> None:
        responder = unblock.responder
        unblocks = self._service.unblocks
        try:
            wanted = unblock.wanted(unblocks.waited, self._clock())
            answer = await self._asks.unblock(
                responder.pid,
                responder.start_time,
                wanted,
                self._service.rules.daemon.evidence_timeout,
            )
            unblocks.answered(unblock, answer, self._clock())
        except Exception:
            log.exception("unblocking pid %d failed", responder.pid)
            return
        if answer is not None:
            log.info(
                logfmt(
                    "unblock",
                    pid=responder.pid,
                    incident=unblock.incident,
                    cause=unblock.cause,
                    outcome=answer.outcome,
                    waited=round(answer.waited, 3),
                )
            )


async def unblock_step(
    service: Service[Process], run: Run, effect: UnblockPeers, clock: Callable[[], float]
) -> None:
    """An ``unblock = "peers"`` step of ``run``: the incident asks, on every host,
    for its job's ranks waiting in the collective its verdict names to be unblocked
    (`watchdogd.core.unblocks`, which orders them once it does). The step waits for
    that, up to its timeout, looking every `_STEP_POLL` seconds, then sends its
    fallback signal to the ranks here that no responder can unblock."""
    unblocks, timer = service.unblocks, run.timer
    if not effect.incident:
        run.observe(PeersUnblocked("skipped: its timer names no job, so there is no incident"))
        return
    unblocks.want(effect.incident, timer.pid, timer.uid, clock())
    until = clock() + effect.step.timeout
    while (verdict := unblocks.named(effect.incident)) is None and clock() < until:
        await trio.sleep(_STEP_POLL)
    if verdict is None or verdict.collective is None:
        run.observe(
            PeersUnblocked(
                f"asked; the verdict named no collective within {effect.step.timeout:g}s "
                "(the ranks waiting in it are unblocked if it comes to)"
            )
        )
        return
    collective = verdict.collective
    said = (
        f"asked for the ranks waiting in {collective.op} #{collective.seq} of group "
        f"{collective.group} to be unblocked"
    )
    fallback = effect.step.fallback
    if fallback is not None:
        sent = [
            f"rank {'?' if rank.rank is None else rank.rank} (pid {rank.pid}): "
            + _signal_rank(service, rank.pid, timer.owner, fallback)
            for rank in unblocks.unanswered(effect.incident, verdict, timer.pid)
        ]
        said += "; without a responder that unblocks, " + (", ".join(sent) or "none")
    run.observe(PeersUnblocked(said))


def _signal_rank(service: Service[Process], pid: int, owner: int, signum: int) -> str:
    """Send ``signum`` to process ``pid`` of a job, through the pidfd its timer
    holds, if ``owner`` may still signal it; what came of it."""
    process = service.table.process(pid)
    if process is None:
        return "holds no timer here: not signalled"
    if owner and not process.signallable_by(owner):
        return "not permitted"
    try:
        signal.pidfd_send_signal(process.fd, signum)
    except ProcessLookupError:
        return "gone"
    except OSError as exc:
        return f"not signalled: {exc.strerror}"
    return str(SignalResult(Delivery.SENT, signum))
