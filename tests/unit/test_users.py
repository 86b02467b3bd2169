"""Fleet names of users: valid names, nameless uids as #UID, lookups off the loop
and cached, misses included (watchdogd.host.users)."""

from __future__ import annotations

import pwd
import threading

import pytest
import trio

from watchdogd.host.users import UserNames, fleet_user, valid_name


def test_the_valid_names_are_the_strict_user_name_syntax() -> None:
    for name in ("root", "alice", "_apt", "svc-1", "A" * 32):
        assert valid_name(name), name
    for name in ("", "1user", "\u00b2", "al\0ice", "a b", "a/b", "a:b", "A" * 33, "#12"):
        assert not valid_name(name), name
    assert fleet_user("#0")
    assert fleet_user("#4294967294")
    assert not fleet_user("#4294967295")  # (uid_t)-1 is no uid
    assert not fleet_user("#012")
    assert not fleet_user("#\u00b2")


async def test_real_lookups_run_off_the_loop_and_misses_are_cached() -> None:
    names = UserNames()
    nameless = 4_000_000_000
    with pytest.raises(KeyError):
        pwd.getpwuid(nameless)
    assert await names.resolve_name(0) == pwd.getpwuid(0).pw_name
    assert await names.resolve_name(nameless) == f"#{nameless}"
    assert await names.resolve_uid("root") == 0
    assert await names.resolve_uid(f"#{nameless}") == nameless
    # A named uid's number is somebody else's: #0 is not root.
    assert await names.resolve_uid("#0") is None
    assert await names.resolve_uid("no-such-user-here") is None
    before = names.lookups
    for _ in range(100):
        assert await names.resolve_uid("no-such-user-here") is None
        assert await names.resolve_name(nameless) == f"#{nameless}"
    assert names.lookups == before  # a forged name costs one lookup, not one a record
    assert await names.resolve_uid("\u00b2") is None
    assert names.lookups == before  # not even one: not a valid name


async def test_name_of_never_waits_and_asks_for_the_lookup() -> None:
    threads: list[str] = []

    def name_of_uid(uid: int) -> str:
        threads.append(threading.current_thread().name)
        return "alice" if uid == 1001 else f"#{uid}"

    names = UserNames(name_of_uid=name_of_uid, uid_of_name=lambda name: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(names.run)
        assert names.name_of(1001) is None
        with trio.fail_after(5):
            while names.name_of(1001) is None:
                await trio.sleep(0.01)
        assert names.name_of(1001) == "alice"
        nursery.cancel_scope.cancel()
    assert threads
    assert threading.main_thread().name not in threads


async def test_answers_expire_after_their_ttl_and_the_cache_is_bounded() -> None:
    now = [0.0]
    calls: list[int] = []

    def name_of_uid(uid: int) -> str:
        calls.append(uid)
        return f"#{uid}"

    names = UserNames(ttl=10.0, size=3, clock=lambda: now[0], name_of_uid=name_of_uid)
    for uid in (1, 2, 3, 1):
        await names.resolve_name(uid)
    assert calls == [1, 2, 3]
    await names.resolve_name(4)  # the least recently used (2) goes
    await names.resolve_name(3)
    await names.resolve_name(2)
    assert calls == [1, 2, 3, 4, 2]
    now[0] = 11.0
    await names.resolve_name(3)
    assert calls == [1, 2, 3, 4, 2, 3]
