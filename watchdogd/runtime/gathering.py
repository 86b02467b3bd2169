"""Taking a rank's evidence: its stacks (and its Flight Recorder), from inside the
worker when its responder answers, from a dumper (py-spy) when it does not.

Two callers: a dump step of a policy run (`Gatherer.dump`), and a rank of an
incident that holds no timer of its job (`Gatherer.ask_rank`). Either way the
responder is asked first, within ``evidence_timeout``: the responder of the process
itself, named by its pid and start time (`watchdogd.runtime.asks.Asks.ask`),
never a connection that outlived a process of that pid; who besides root may read
what was taken is decided when it is taken: the one user ptrace's read rule let
read the process both just before and just after it was dumped
(`watchdogd.host.process.ptrace_reader`), stored with the stack, since the process
may be gone when someone looks.

Invariants:

- Dumpers share one `watchdogd.runtime.hooks.DumpPool` (``max_dumps`` at once,
  resized at each dump step after a reload).
- What was taken is handed to the service as it comes (`Service.dump_taken`,
  `Service.evidence_given`), never raised: a dumper that fails is a result.
- What is due fires (``tick``) before an answer is made into an incident's
  evidence: hundreds of ranks answering at once are as many tasks of a few
  milliseconds each, which a due timer would otherwise wait behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..core import (
    DEFAULT_DUMPER,
    DEFAULT_STEP_TIMEOUT,
    NONE,
    WORKER,
    Dumped,
    HookResult,
    Run,
    Service,
    TakeDump,
    flight_groups,
    stack_text,
    substitute,
)
from ..host.process import Process, ptrace_reader
from .asks import Asks
from .hooks import DumpPool


class Gatherer:
    """Takes the evidence of the service's ranks, through ``asks`` (the workers'
    responders) and one pool of dumpers; ``tick`` fires what is due."""

    def __init__(
        self, service: Service[Process], asks: Asks, tick: Callable[[], object] = lambda: None
    ) -> None:
        self._service = service
        self._asks = asks
        self._tick = tick
        self._dumps = DumpPool(service.rules.daemon.max_dumps, service.metrics)

    async def ask_rank(self, incident: str, pid: int, start_time: int) -> None:
        """The evidence of a rank of ``incident`` that holds no timer of its job
        (process ``pid``, started at ``start_time``): from its responder, or, when
        it does not answer, from py-spy."""
        before = ptrace_reader(pid)
        timeout = self._service.rules.daemon.evidence_timeout
        given = await self._asks.ask(pid, start_time, incident, timeout)
        self._tick()
        if given is not None:
            stack, taken, flight, note = stack_text(given), WORKER, flight_groups(given), ""
        else:
            argv = substitute(DEFAULT_DUMPER, {"pid": str(pid), "scope": ""})
            hook = await self._dumps.run(argv, {}, DEFAULT_STEP_TIMEOUT)
            stack, flight, note = hook.output, [], ""
            taken = os.path.basename(argv[0]) if hook.status == 0 else NONE
            if hook.status != 0:
                note = f"its responder did not answer, and {argv[0]}: {hook.result}"
        after = ptrace_reader(pid)
        self._service.firing.evidence_given(
            incident,
            pid,
            stack,
            evidence=taken,
            flight=flight,
            reader=before if before == after else None,
            note=note,
        )

    async def dump(self, run: Run, effect: TakeDump) -> None:
        """The dump step of ``run``: its responder is asked first, and a worker that
        answers within ``evidence_timeout`` gives its stacks (and its Flight
        Recorder) from inside, so the default dumper, py-spy, is not run. One that
        does not answer, or a dump step that names a dumper of its own, runs the
        dumper as before."""
        pid = run.timer.pid
        config = self._service.rules.daemon
        before = ptrace_reader(pid)
        incident = "" if run.timer.run is None else run.timer.run.incident
        given = await self._asks.ask(pid, run.timer.start_time, incident, config.evidence_timeout)
        self._tick()
        if given is not None and effect.step.argv == DEFAULT_DUMPER:
            after = ptrace_reader(pid)
            reader = before if before == after else None
            self._service.firing.dump_taken(run.timer, reader, WORKER, flight_groups(given))
            run.observe(Dumped(HookResult(0, "ok", stack_text(given)), responder=True))
            return
        argv = substitute(effect.step.argv, effect.values)
        self._dumps.resize(config.max_dumps)  # a reload may have changed it
        hook = await self._dumps.run(argv, effect.env, effect.step.timeout)
        after = ptrace_reader(pid)
        taken = os.path.basename(argv[0]) if hook.status == 0 else NONE
        output = hook.output
        if given is not None:
            output = stack_text(given) + output
            taken = WORKER
        flight = [] if given is None else flight_groups(given)
        self._service.firing.dump_taken(
            run.timer, before if before == after else None, taken, flight
        )
        run.observe(Dumped(HookResult(hook.status, hook.result, output)))
