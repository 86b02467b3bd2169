"""The scrape endpoint's `HeldConnections`, over real sockets: which connection gives way
when it is full."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from watchdogd.runtime.scrape import HeldConnections


@pytest.fixture
def pairs() -> Iterator[list[socket.socket]]:
    """Our ends of socket pairs made by `conn` (closed at the end, both)."""
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


def conn(pairs: list[socket.socket]) -> socket.socket:
    ours, theirs = socket.socketpair()
    pairs += [ours, theirs]
    return ours


def dropped(sock: socket.socket) -> bool:
    return sock.fileno() == -1


async def test_a_full_room_drops_the_oldest_waiting_connection_of_the_busiest_address(
    pairs: list[socket.socket],
) -> None:
    room = HeldConnections(capacity=4)
    scraper = conn(pairs)
    room.enter(scraper, "10.0.0.9", 10.0)
    flood = [conn(pairs) for _ in range(3)]
    for sock in flood:
        room.enter(sock, "127.0.0.1", 10.0)
    newest = conn(pairs)
    room.enter(newest, "127.0.0.1", 10.0)
    assert [dropped(sock) for sock in (scraper, *flood, newest)] == [
        False, True, False, False, False
    ]  # fmt: skip
    assert len(room) == 4


async def test_a_connection_whose_page_is_being_sent_gives_way_only_when_none_waits(
    pairs: list[socket.socket],
) -> None:
    room = HeldConnections(capacity=2)
    sending, waiting = conn(pairs), conn(pairs)
    room.enter(sending, "127.0.0.1", 10.0).answering = True
    room.enter(waiting, "127.0.0.1", 10.0)
    third = conn(pairs)
    room.enter(third, "127.0.0.1", 10.0).answering = True
    assert dropped(waiting)
    assert not dropped(sending)
    room.enter(conn(pairs), "127.0.0.1", 10.0)
    assert dropped(sending)
    assert not dropped(third)


async def test_between_addresses_holding_as_many_the_one_that_came_first_gives_way(
    pairs: list[socket.socket],
) -> None:
    room = HeldConnections(capacity=2)
    first, second = conn(pairs), conn(pairs)
    room.enter(first, "10.0.0.1", 10.0)
    room.enter(second, "10.0.0.2", 10.0)
    room.enter(conn(pairs), "10.0.0.3", 10.0)
    assert dropped(first)
    assert not dropped(second)


async def test_a_connection_that_left_frees_its_room_and_leaves_once(
    pairs: list[socket.socket],
) -> None:
    room = HeldConnections(capacity=1)
    gone = room.enter(conn(pairs), "127.0.0.1", 10.0)
    room.leave(gone)
    room.leave(gone)
    kept = conn(pairs)
    room.enter(kept, "127.0.0.1", 10.0)
    assert len(room) == 1
    assert not dropped(kept)
