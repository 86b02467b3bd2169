"""Asking a worker's responder for evidence, and waiting for its answer.

Each responder's connection (`watchdogd.core.responders`) is attached here by the
process it comes from, as the kernel reported it at connect. `Asks.ask` sends that
connection an `EvidenceWanted` and waits, at most a short bound, for the `Evidence`
that answers it: one taken only on the connection asked, for the ask sent there,
so no other process, and no other connection of the same process, can answer for
it. A responder that does not answer in time (a thread holding the GIL in C code,
a process stopped) costs its ask the bound and nothing else: the caller falls back
to a dump from outside (py-spy).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

import trio

from watchdogd_client.protocol import Evidence, EvidenceWanted, encode_frame


class Channel(Protocol):
    """What a responder's connection offers an ask: a frame sent now, or not."""

    def send_now(self, frame: bytes) -> bool:
        """Send ``frame`` whole without waiting; False when it cannot go now."""
        ...


@dataclass(eq=False, slots=True)
class _Waiting:
    channel: Channel
    done: trio.Event = field(default_factory=trio.Event)
    answer: Evidence | None = None


class Asks:
    """The responders' connections by pid, and the asks waiting on them."""

    def __init__(self) -> None:
        self._channels: dict[int, Channel] = {}
        self._waiting: dict[int, _Waiting] = {}
        self._numbers = itertools.count(1)

    def attach(self, pid: int, channel: Channel) -> None:
        """``channel`` is the responder of process ``pid`` from now on (a newer one of
        the same process replaces the older)."""
        self._channels[pid] = channel

    def detach(self, pid: int, channel: Channel) -> bool:
        """``channel`` closed; whether it was ``pid``'s responder until then. Its asks
        end unanswered."""
        for ask, waiting in list(self._waiting.items()):
            if waiting.channel is channel:
                waiting.done.set()
                del self._waiting[ask]
        if self._channels.get(pid) is channel:
            del self._channels[pid]
            return True
        return False

    def has(self, pid: int) -> bool:
        return pid in self._channels

    async def ask(self, pid: int, incident: str, timeout: float) -> Evidence | None:
        """The evidence process ``pid``'s responder gives within ``timeout`` seconds;
        None when it has none, cannot be written to now, or does not answer."""
        channel = self._channels.get(pid)
        if channel is None:
            return None
        ask = next(self._numbers)
        waiting = _Waiting(channel)
        self._waiting[ask] = waiting
        try:
            if not channel.send_now(encode_frame(EvidenceWanted(ask=ask, incident=incident))):
                return None
            with trio.move_on_after(timeout):
                await waiting.done.wait()
            return waiting.answer
        finally:
            self._waiting.pop(ask, None)

    def answered(self, channel: Channel, evidence: Evidence) -> bool:
        """``evidence`` came on ``channel``: taken when it answers an ask sent there
        and still waiting; otherwise dropped (late, or not asked)."""
        waiting = self._waiting.get(evidence.ask)
        if waiting is None or waiting.channel is not channel:
            return False
        waiting.answer = evidence
        waiting.done.set()
        del self._waiting[evidence.ask]
        return True
