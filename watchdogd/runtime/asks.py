"""Asking a worker's responder for evidence, or to unblock its process, and waiting
for its answer.

Each responder's connection (`watchdogd.core.responders`) is bound here to the
handle on the process that opened it (a pidfd), once its `Respond` is taken.
`Asks.ask` sends an `EvidenceWanted` only to the responder whose process is the
ask's target: bound under the target's pid, started at the target's start time, and
not exited (its pidfd not readable) when the ask goes out. It then waits, at most a
short bound, for the `Evidence` that answers it: one taken only on the connection
asked, for the ask sent there, and only while that process has still not exited.
So no other process, no other connection of the same process, and no child of a
fork that kept the socket after its parent exited can answer for it. A responder
that does not answer in time (a thread holding the GIL in C code, a process
stopped) costs its ask the bound and nothing else: the caller falls back to a dump
from outside (py-spy).

A process has one responder here, as in the core: a connection bound for a process
replaces the one bound before it, whose waiting asks end unanswered.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import trio

from watchdogd_protocol import (
    Evidence,
    EvidenceWanted,
    Unblocked,
    UnblockWanted,
    Wanted,
    encode_frame,
)

from ..host.process import Process


class Channel(Protocol):
    """What a responder's connection offers an ask: a frame sent now, or not."""

    def send_now(self, frame: bytes) -> bool:
        """Send ``frame`` whole without waiting; False when it cannot go now."""
        ...


@dataclass(eq=False, slots=True)
class _Bound:
    """A responder's connection, and the process it answers for."""

    process: Process
    channel: Channel


#: What a responder answers an ask with.
Answer = Evidence | Unblocked


@dataclass(eq=False, slots=True)
class _Waiting:
    bound: _Bound
    #: The kind of answer the ask takes.
    kind: type[Answer]
    done: trio.Event = field(default_factory=trio.Event)
    answer: Answer | None = None


class Asks:
    """The responders' connections by pid, and the asks waiting on them."""

    def __init__(self) -> None:
        self._bound: dict[int, _Bound] = {}
        self._waiting: dict[int, _Waiting] = {}
        self._numbers = itertools.count(1)

    def attach(self, process: Process, channel: Channel) -> None:
        """``channel`` is the responder of ``process`` (the process that opened it,
        alive when its `Respond` was taken) from now on; the asks waiting on a
        connection it replaces end unanswered."""
        bound = self._bound.get(process.pid)
        if bound is not None and bound.channel is not channel:
            self._end(bound.channel)
        self._bound[process.pid] = _Bound(process, channel)

    def detach(self, process: Process, channel: Channel) -> None:
        """``channel`` no longer answers for ``process``: it closed, or the process
        exited. Its asks end unanswered."""
        self._end(channel)
        bound = self._bound.get(process.pid)
        if bound is not None and bound.channel is channel:
            del self._bound[process.pid]

    def _end(self, channel: Channel) -> None:
        for ask, waiting in list(self._waiting.items()):
            if waiting.bound.channel is channel:
                waiting.done.set()
                del self._waiting[ask]

    async def ask(
        self, pid: int, start_time: int, incident: str, timeout: float
    ) -> Evidence | None:
        """The evidence the responder of process ``pid``, started at ``start_time``
        (clock ticks since boot), gives within ``timeout`` seconds; None when that
        process has none, has exited, cannot be written to now, or does not answer."""
        answer = await self._ask(pid, start_time, EvidenceWanted(ask=0, incident=incident), timeout)
        assert answer is None or isinstance(answer, Evidence)
        return answer

    async def unblock(
        self, pid: int, start_time: int, wanted: UnblockWanted, timeout: float
    ) -> Unblocked | None:
        """What the responder of process ``pid``, started at ``start_time``, did with
        ``wanted`` (its ``ask`` is this object's to number), said within ``timeout``
        seconds; None as for `ask`."""
        answer = await self._ask(pid, start_time, wanted, timeout)
        assert answer is None or isinstance(answer, Unblocked)
        return answer

    async def _ask(
        self, pid: int, start_time: int, wanted: Wanted, timeout: float
    ) -> Answer | None:
        bound = self._bound.get(pid)
        # A pid and a start time name one process, and its pidfd says whether it
        # still lives: a responder bound under the pid that is of another process
        # (the one before it, or after it) is never asked.
        if bound is None or bound.process.start_time != start_time or bound.process.exited():
            return None
        ask = next(self._numbers)
        kind = Unblocked if isinstance(wanted, UnblockWanted) else Evidence
        waiting = _Waiting(bound, kind)
        self._waiting[ask] = waiting
        try:
            frame = encode_frame(msgspec.structs.replace(wanted, ask=ask))
            if not bound.channel.send_now(frame):
                return None
            with trio.move_on_after(timeout):
                await waiting.done.wait()
            return waiting.answer
        finally:
            self._waiting.pop(ask, None)

    def answered(self, channel: Channel, answer: Answer) -> bool:
        """``answer`` came on ``channel``: taken when it answers an ask of its kind
        sent there and still waiting, and the process asked has not exited (its
        answer would be a forked child's that kept the socket); otherwise dropped.
        An ask whose process has exited ends unanswered."""
        waiting = self._waiting.get(answer.ask)
        if (
            waiting is None
            or waiting.bound.channel is not channel
            or not isinstance(answer, waiting.kind)
        ):
            return False
        del self._waiting[answer.ask]
        if not waiting.bound.process.exited():
            waiting.answer = answer
        waiting.done.set()
        return waiting.answer is not None
