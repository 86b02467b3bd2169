"""The requests behind the clients' methods, written once: both clients offer the
same methods with the same parameters, every ``acquire()`` takes the one
declaration of its keywords, and a paged method follows the daemon's cursor."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from watchdogd_client import queries
from watchdogd_client.arming import Acquiring, Arming, acquire_request
from watchdogd_client.base import BaseClient, NoOpTimer, NullClient
from watchdogd_client.client import Client
from watchdogd_client.engine import Connected, Engine, Exchange, Step, drive
from watchdogd_client.trio import AsyncClient
from watchdogd_protocol import (
    Acquire,
    Acquired,
    DaemonInfo,
    Status,
    StatusReply,
    TimerInfo,
    Welcome,
    decode_request,
    encode_frame,
)

#: The blocking client's names for what the trio client names after trio's way.
RENAMED = {"close": "aclose"}


def public(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        RENAMED.get(name, name): member
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    } | {
        name: member
        for base in cls.__mro__[1:]
        if base.__module__.startswith("watchdogd_client")
        for name, member in vars(base).items()
        if callable(member) and not name.startswith("_") and name not in vars(cls)
    }


def parameters(method: Callable[..., Any]) -> list[tuple[str, str, object, object]]:
    return [
        (p.name, p.kind.name, p.default, p.annotation)
        for p in inspect.signature(method).parameters.values()
    ]


def test_both_clients_offer_the_same_methods_with_the_same_parameters() -> None:
    blocking, trio = public(Client), public(AsyncClient)
    assert sorted(blocking) == sorted(trio)
    assert {"events", "incident", "incidents", "metrics", "policies", "why"} <= set(trio)
    differing = {
        name: (parameters(blocking[name]), parameters(trio[name]))
        for name in blocking
        if parameters(blocking[name]) != parameters(trio[name])
    }
    assert differing == {}
    # Each of the trio client's requests is a coroutine, as each of the blocking
    # client's blocks; a block's handle is made without waiting in both.
    awaited = {name for name, method in trio.items() if inspect.iscoroutinefunction(method)}
    assert awaited == set(trio) - {"expires"}


def test_every_acquire_takes_the_one_declaration_of_its_keywords() -> None:
    acquires: list[Callable[..., Any]] = [
        BaseClient.acquire,
        NullClient.acquire,
        NoOpTimer.acquire,
        Client.acquire,
        AsyncClient.acquire,
    ]
    for acquire in acquires:
        assert parameters(acquire) == [
            ("self", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty, inspect.Parameter.empty),
            ("scope", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty, "str"),
            ("timeout", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty, "After"),
            ("acquiring", "VAR_KEYWORD", inspect.Parameter.empty, "Unpack[Acquiring]"),
        ], acquire.__qualname__
    assert parameters(acquire_request)[-1][1:] == (
        "VAR_KEYWORD",
        inspect.Parameter.empty,
        "Unpack[Acquiring]",
    )
    # An acquire's keywords are the arming parameters and three of its own.
    assert Acquiring.__optional_keys__ - Arming.__optional_keys__ == {
        "pid",
        "progress",
        "exit_releases",
    }


def test_an_acquires_keywords_are_checked_where_they_are_given() -> None:
    client = NullClient()
    # The type: ignore comments of this test are part of the test: mypy --strict (with
    # unused ignores reported) holds that a misspelt or mistyped keyword fails the
    # type check too.
    assert client.acquire("s", 5, pid=7, progress=1, exit_releases=True, policy="log") == 5
    with pytest.raises(TypeError, match="unexpected keyword argument 'pidd'"):
        client.acquire("s", 5, pidd=7)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="exit_releases must be a bool"):
        client.acquire("s", 5, exit_releases=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pid must be at least 1"):
        client.acquire("s", 5, pid=0)


def test_status_follows_the_daemons_cursor_page_after_page() -> None:
    engine = Engine("/run/test.sock", client="test/1", reconnect_timeout=5.0)
    connection = engine.connect()
    welcome = Welcome(id=connection.hello_id, version=2, server="s", pid=1)
    connection.receive_data(encode_frame(welcome))
    info = DaemonInfo(
        version="v",
        pid=1,
        uptime=1.0,
        timers=3,
        processes=1,
        connections=1,
        requests=1,
        expired=0,
        exited=0,
    )
    timers = [
        TimerInfo(pid=9, scope=f"s{n}", remaining=1.0, policy="kill", uid=0) for n in range(3)
    ]
    cursors: list[str | None] = []

    def take(step: Step) -> object:
        if isinstance(step, Connected):
            return connection
        assert isinstance(step, Exchange)
        request = decode_request(step.frame[4:])
        assert isinstance(request, Status)
        cursors.append(request.cursor)
        start = int(request.cursor or 0)
        cursor = str(start + 1) if start < 2 else None
        page = StatusReply(
            id=request.id, daemon=info, timers=timers[start : start + 1], cursor=cursor
        )
        [answer] = connection.receive_data(encode_frame(page))
        return answer

    status = drive(queries.status(engine), take)
    assert status.timers == timers
    assert cursors == [None, "1", "2"]


@pytest.mark.parametrize("lost", [False, True])
def test_an_arm_whose_slot_page_could_not_be_had_is_armed_again_without_a_slot(
    lost: bool,
) -> None:
    engine = Engine("/run/test.sock", client="test/1", reconnect_timeout=5.0)
    connection = engine.connect()
    welcome = Welcome(id=connection.hello_id, version=2, server="s", pid=1)
    connection.receive_data(encode_frame(welcome))
    sent: list[Acquire] = []
    granted: list[Acquired] = []

    def take(step: Step) -> object:
        if isinstance(step, Connected):
            return connection
        if isinstance(step, queries.Grant):
            granted.append(step.reply)
            return lost
        assert isinstance(step, Exchange)
        request = decode_request(step.frame[4:])
        assert isinstance(request, Acquire)
        sent.append(request)
        reply = Acquired(id=request.id, remaining=30.0, rearmed=False, arm=len(sent))
        [answer] = connection.receive_data(encode_frame(reply))
        return answer

    first = acquire_request(engine.next_id(), "step", 30.0, slot=True)
    reply = drive(queries.acquire(engine, first, {}, fast=True), take)
    assert [request.slot for request in sent] == ([True, False] if lost else [True])
    assert len({request.id for request in sent}) == len(sent)
    assert [answer.arm for answer in granted] == [1]  # the second arm's reply is not handed
    assert reply.arm == len(sent)
    # Without a fast path, nothing is handed to one.
    sent.clear()
    granted.clear()
    plain = acquire_request(engine.next_id(), "plain", 30.0)
    drive(queries.acquire(engine, plain, {}, fast=False), take)
    assert (len(sent), granted) == (1, [])
