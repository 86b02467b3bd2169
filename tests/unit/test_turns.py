"""The event loop's turns, as the store counts them to check its journal's name
once a turn: the first ask of a turn is told so, the others are not."""

from __future__ import annotations

import trio

from watchdogd.runtime.daemon import Turns


async def test_the_first_ask_of_each_turn_and_only_it() -> None:
    turns = Turns()
    trio.lowlevel.add_instrument(turns)
    try:
        await trio.lowlevel.checkpoint()  # a turn of the loop begins
        assert [turns.first_ask() for _ in range(3)] == [True, False, False]
        await trio.lowlevel.checkpoint()
        assert [turns.first_ask() for _ in range(2)] == [True, False]
    finally:
        trio.lowlevel.remove_instrument(turns)
