"""Asks to responders (`watchdogd.runtime.asks.Asks`) about real processes,
through real pidfds: an ask goes only to the responder of the process it names,
alive, and an answer is taken only while that process has not exited."""

from __future__ import annotations

import subprocess
from collections.abc import Awaitable, Callable, Iterator

import pytest
import trio

from watchdogd.host.process import Process, open_process
from watchdogd.runtime.asks import Asks
from watchdogd_protocol import (
    Evidence,
    EvidenceWanted,
    FrameReader,
    Unblocked,
    UnblockWanted,
    Wanted,
    decode_for_responder,
)

from helpers.processes import reap, sleeper

#: Far longer than any ask below should wait.
BOUND = 30.0


class Connection:
    """A responder's connection as an ask sees it: the asks sent on it."""

    def __init__(self) -> None:
        self.asks: list[Wanted] = []

    def send_now(self, frame: bytes) -> bool:
        [body] = FrameReader(len(frame)).feed(frame)
        wanted = decode_for_responder(body)
        assert isinstance(wanted, EvidenceWanted | UnblockWanted)
        self.asks.append(wanted)
        return True


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    process = sleeper()
    yield process
    reap(process)


@pytest.fixture
def process(victim: subprocess.Popen[bytes]) -> Iterator[Process]:
    opened = open_process(victim.pid)
    yield opened
    opened.close()


async def first_ask(connection: Connection) -> int:
    """The number of the first ask sent on ``connection``, once one is."""
    while not connection.asks:
        await trio.sleep(0.001)
    return connection.asks[0].ask


async def ask_beside(
    asks: Asks, process: Process, meanwhile: Callable[[], Awaitable[None]], incident: str = ""
) -> Evidence | None:
    """Ask about ``process`` while ``meanwhile`` runs: the answer, which comes (or
    does not) well within the ask's bound."""
    with trio.fail_after(BOUND / 2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(meanwhile)
            return await asks.ask(process.pid, process.start_time, incident, BOUND)


async def test_an_ask_goes_only_to_the_responder_of_the_process_it_names(
    process: Process,
) -> None:
    asks = Asks()
    connection = Connection()
    asks.attach(process, connection)
    # The pid, started at another time: another process of that pid.
    assert await asks.ask(process.pid, process.start_time + 1, "", BOUND) is None
    assert await asks.ask(process.pid + 1, process.start_time, "", BOUND) is None
    assert connection.asks == []

    async def answer() -> None:
        assert asks.answered(connection, Evidence(id=1, ask=await first_ask(connection)))

    assert await ask_beside(asks, process, answer, "incident-1") is not None
    assert [wanted.incident for wanted in connection.asks] == ["incident-1"]


async def test_an_unblock_is_answered_by_an_unblocked_and_by_nothing_else(
    process: Process,
) -> None:
    asks = Asks()
    connection = Connection()
    asks.attach(process, connection)
    wanted = UnblockWanted(ask=0, waited=10, group="0", seq=3, incident="incident-2")

    async def answer() -> None:
        ask = await first_ask(connection)
        assert not asks.answered(connection, Evidence(id=1, ask=ask))
        assert asks.answered(connection, Unblocked(id=2, ask=ask, outcome="not_waiting"))

    with trio.fail_after(BOUND / 2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            got = await asks.unblock(process.pid, process.start_time, wanted, BOUND)
    assert got is not None
    assert (got.id, got.outcome) == (2, "not_waiting")
    [sent] = connection.asks
    assert isinstance(sent, UnblockWanted)
    assert (sent.group, sent.seq, sent.waited, sent.incident) == ("0", 3, 10, "incident-2")
    assert sent.ask > 0  # numbered here, whatever the caller gave


async def test_a_responder_whose_process_has_exited_is_never_asked(
    victim: subprocess.Popen[bytes], process: Process
) -> None:
    asks = Asks()
    connection = Connection()
    asks.attach(process, connection)
    victim.kill()
    with trio.fail_after(BOUND):
        while not process.exited():
            await trio.sleep(0.001)
    assert process.alive()  # a zombie, not reaped: its pid is still its own
    assert await asks.ask(process.pid, process.start_time, "", BOUND) is None
    assert connection.asks == []


async def test_an_answer_that_comes_once_its_process_exited_is_dropped(
    victim: subprocess.Popen[bytes], process: Process
) -> None:
    """What a child of a fork that kept the socket would send for its parent: the
    ask ends with it, unanswered, rather than at its bound."""
    asks = Asks()
    connection = Connection()
    asks.attach(process, connection)

    async def exit_then_answer() -> None:
        ask = await first_ask(connection)
        victim.kill()
        while not process.exited():
            await trio.sleep(0.001)
        assert not asks.answered(connection, Evidence(id=1, ask=ask))

    assert await ask_beside(asks, process, exit_then_answer) is None


async def test_an_answer_is_taken_only_on_the_connection_asked(process: Process) -> None:
    asks = Asks()
    asked, other = Connection(), Connection()
    asks.attach(process, asked)

    async def answer_on_both() -> None:
        ask = await first_ask(asked)
        assert not asks.answered(other, Evidence(id=1, ask=ask))
        assert asks.answered(asked, Evidence(id=2, ask=ask))

    given = await ask_beside(asks, process, answer_on_both)
    assert given is not None
    assert given.id == 2


async def test_a_new_connection_of_the_process_ends_the_asks_on_the_one_it_replaces(
    process: Process,
) -> None:
    asks = Asks()
    old, new = Connection(), Connection()
    asks.attach(process, old)

    async def replace() -> None:
        await first_ask(old)
        asks.attach(process, new)

    assert await ask_beside(asks, process, replace) is None
    asks.detach(process, old)  # the old one closes: the new one stays bound

    async def answer() -> None:
        assert asks.answered(new, Evidence(id=1, ask=await first_ask(new)))

    assert await ask_beside(asks, process, answer) is not None
