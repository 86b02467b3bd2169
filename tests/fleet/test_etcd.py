"""The etcd client against a real etcd: every operation, leases that lapse, watches,
endpoints that fail, an etcd killed, frozen and restarted, TLS, and the bounds."""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio

from watchdogd.errors import ConfigError
from watchdogd.fleet.etcd import Backoff, EtcdClient, Limits, prefix_end
from watchdogd.fleet.gateway import EtcdCompacted, EtcdUnavailable, LeaseNotFound, WatchBroken
from watchdogd.fleet.watch import EtcdWatch, Event

from helpers.etcd import EtcdServer, TlsFiles, free_ports, running_cluster, running_etcd, urls
from helpers.waiting import PATIENCE

#: What a call may take past its timeout before the test calls it unbounded: the
#: time to notice the deadline and close a connection, on a loaded machine.
SLACK = 1.0


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> bytes:
    """Keys of this test's own on the shared etcd."""
    return f"/test/{request.node.name}/".encode()


@pytest.fixture
async def etcd_client(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.url]) as client:
        yield client


def dead_url() -> str:
    """An endpoint where nothing listens: connecting is refused at once."""
    return f"http://127.0.0.1:{free_ports(1)[0]}"


async def next_events(watch: EtcdWatch, count: int) -> list[Event]:
    with trio.fail_after(PATIENCE):
        return [await anext(watch) for _ in range(count)]


async def test_put_get_and_revisions(etcd_client: EtcdClient, prefix: bytes) -> None:
    first = await etcd_client.put(prefix + b"k", b"one")
    second = await etcd_client.put(prefix + b"k", b"two")
    assert second > first
    found = await etcd_client.get(prefix + b"k")
    assert found is not None
    assert (found.value, found.mod_revision, found.create_revision) == (b"two", second, first)
    assert found.lease == 0
    assert await etcd_client.get(prefix + b"absent") is None


async def test_keys_and_values_are_bytes_and_str_is_utf8(
    etcd_client: EtcdClient, prefix: bytes
) -> None:
    binary = bytes(range(256))
    await etcd_client.put(prefix + b"\x00\xff", binary)
    found = await etcd_client.get(prefix + b"\x00\xff")
    assert found is not None
    assert found.value == binary
    await etcd_client.put(prefix.decode() + "é", "ü")
    found = await etcd_client.get(prefix + "é".encode())
    assert found is not None
    assert (found.key, found.value) == (prefix + "é".encode(), "ü".encode())


async def test_range_is_every_key_under_the_prefix(etcd_client: EtcdClient, prefix: bytes) -> None:
    await etcd_client.put(prefix + b"a/2", b"2")
    await etcd_client.put(prefix + b"a/1", b"1")
    last = await etcd_client.put(prefix + b"ab", b"not under a/")
    found = await etcd_client.range(prefix + b"a/")
    assert [(kv.key, kv.value) for kv in found.kvs] == [
        (prefix + b"a/1", b"1"),
        (prefix + b"a/2", b"2"),
    ]
    assert found.revision >= last
    assert (await etcd_client.range(prefix + b"none/")).kvs == []


async def test_range_and_watch_through_a_later_prefix(
    etcd_client: EtcdClient, prefix: bytes
) -> None:
    for key in (b"a/1", b"b", b"c/1", b"c/2", b"c0", b"d/1"):
        await etcd_client.put(prefix + key, key)
    found = await etcd_client.range(prefix + b"a/", through=prefix + b"c/")
    assert [kv.value for kv in found.kvs] == [b"a/1", b"b", b"c/1", b"c/2"]
    async with etcd_client.open_watch(prefix + b"a/", through=prefix + b"c/") as watch:
        for key in (b"d/2", b"c0", b"c/3", b"a/2"):
            await etcd_client.put(prefix + key, key)
        events = await next_events(watch, 2)
    assert [e.value for e in events] == [b"c/3", b"a/2"]


async def test_closed_in_a_cancelled_scope_it_closes_every_idle_connection(
    etcd: EtcdServer, prefix: bytes
) -> None:
    client = EtcdClient([etcd.url])
    async with trio.open_nursery() as nursery:  # two calls at once: two connections
        nursery.start_soon(client.put, prefix + b"a", b"1")
        nursery.start_soon(client.put, prefix + b"b", b"2")
    with trio.CancelScope() as scope:
        scope.cancel()
        await client.aclose()
    # A connection left open warns when it is collected, which fails the test.
    gc.collect()


def test_prefix_end() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"") == b"\0"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_delete_a_key_or_a_prefix(etcd_client: EtcdClient, prefix: bytes) -> None:
    for name in (b"x", b"d/1", b"d/2", b"d/3"):
        await etcd_client.put(prefix + name, b"v")
    assert await etcd_client.delete(prefix + b"x") == 1
    assert await etcd_client.delete(prefix + b"x") == 0
    assert await etcd_client.delete(prefix + b"d/", prefix=True) == 3
    assert (await etcd_client.range(prefix)).kvs == []


async def test_put_if_absent_creates_once(etcd_client: EtcdClient, prefix: bytes) -> None:
    assert await etcd_client.put_if_absent(prefix + b"k", b"first") is True
    assert await etcd_client.put_if_absent(prefix + b"k", b"second") is False
    found = await etcd_client.get(prefix + b"k")
    assert found is not None
    assert found.value == b"first"


async def test_lease_grant_keepalive_revoke(etcd_client: EtcdClient, prefix: bytes) -> None:
    lease = await etcd_client.grant(30)
    assert 0 < await etcd_client.keepalive_once(lease) <= 30
    await etcd_client.put(prefix + b"leased", b"v", lease=lease)
    assert await etcd_client.put_if_absent(prefix + b"also", b"v", lease=lease)
    found = await etcd_client.get(prefix + b"leased")
    assert found is not None
    assert found.lease == lease
    await etcd_client.revoke(lease)
    assert (await etcd_client.range(prefix)).kvs == []
    assert await etcd_client.keepalive_once(lease) == 0
    await etcd_client.revoke(lease)  # gone already: no error
    with pytest.raises(LeaseNotFound):
        await etcd_client.put(prefix + b"leased", b"v", lease=lease)


async def test_a_lease_not_kept_alive_lapses_and_takes_its_keys(
    etcd_client: EtcdClient, prefix: bytes
) -> None:
    kept = await etcd_client.grant(1)
    lapsing = await etcd_client.grant(1)
    await etcd_client.put(prefix + b"kept", b"v", lease=kept)
    await etcd_client.put(prefix + b"lapsing", b"v", lease=lapsing)
    with trio.fail_after(PATIENCE):
        while await etcd_client.get(prefix + b"lapsing") is not None:
            assert await etcd_client.keepalive_once(kept) > 0
            await trio.sleep(0.25)
    assert await etcd_client.keepalive_once(lapsing) == 0
    assert await etcd_client.get(prefix + b"kept") is not None
    await etcd_client.revoke(kept)


async def test_watch_sees_puts_and_deletes_of_another_client(
    etcd: EtcdServer, etcd_client: EtcdClient, prefix: bytes
) -> None:
    await etcd_client.put(prefix + b"before", b"not seen")
    async with EtcdClient([etcd.url]) as other, etcd_client.open_watch(prefix) as watch:
        put = await other.put(prefix + b"a", b"1")
        await other.put(prefix.rstrip(b"/") + b"-outside", b"not under the prefix")
        deleted = await other.put(prefix + b"b", b"2")
        gone = await other.delete(prefix + b"a")
        events = await next_events(watch, 3)
    assert [(e.kind, e.key, e.value) for e in events] == [
        ("put", prefix + b"a", b"1"),
        ("put", prefix + b"b", b"2"),
        ("delete", prefix + b"a", b""),
    ]
    assert [e.revision for e in events[:2]] == [put, deleted]
    assert gone == 1
    assert events[2].revision > deleted
    assert watch.revision == events[2].revision


async def test_watch_from_a_revision_replays_what_came_since(
    etcd_client: EtcdClient, prefix: bytes
) -> None:
    first = await etcd_client.put(prefix + b"a", b"1")
    await etcd_client.put(prefix + b"a", b"2")
    await etcd_client.delete(prefix + b"a")
    async with etcd_client.open_watch(prefix, start_revision=first) as watch:
        assert watch.revision == first - 1
        events = await next_events(watch, 3)
    assert [(e.kind, e.value) for e in events] == [("put", b"1"), ("put", b"2"), ("delete", b"")]
    assert events[0].revision == first


async def test_a_watch_leaves_a_value_over_its_bound_undecoded(
    etcd_client: EtcdClient, prefix: bytes
) -> None:
    """Every size of a value's base64 (with two, one or no "=" of padding) around
    the bound: within it the value, over it only its size."""
    values = [bytes([n]) * size for n, size in enumerate((1, 2, 3, 100, 101, 102, 0))]
    async with etcd_client.open_watch(prefix, max_value=100) as watch:
        for number, value in enumerate(values):
            await etcd_client.put(prefix + str(number).encode(), value)
        events = await next_events(watch, len(values))
    assert [(e.value, e.oversize) for e in events] == [
        (b"\0", 0),
        (b"\1\1", 0),
        (b"\2\2\2", 0),
        (b"\3" * 100, 0),
        (b"", 101),
        (b"", 102),
        (b"", 0),
    ]


async def test_watch_from_a_compacted_revision_says_so(
    etcd: EtcdServer, etcd_client: EtcdClient, prefix: bytes
) -> None:
    first = await etcd_client.put(prefix + b"a", b"1")
    last = await etcd_client.put(prefix + b"a", b"2")
    etcd.compact(last)
    async with etcd_client.open_watch(prefix, start_revision=first) as watch:
        with pytest.raises(EtcdCompacted) as caught, trio.fail_after(PATIENCE):
            await anext(watch)
    assert caught.value.compact_revision == last


async def test_a_dead_first_endpoint_is_passed_over(etcd: EtcdServer, prefix: bytes) -> None:
    dead = dead_url()
    async with EtcdClient([dead, etcd.url]) as client:
        assert client.endpoint == dead
        await client.put(prefix + b"k", b"v")
        assert client.endpoint == etcd.url
        found = await client.get(prefix + b"k")
        assert found is not None
        assert found.value == b"v"
        async with client.open_watch(prefix):
            pass
    async with EtcdClient([dead, etcd.url]) as client, client.open_watch(prefix) as watch:
        await client.delete(prefix + b"k")
        assert [e.kind for e in await next_events(watch, 1)] == ["delete"]


async def test_no_endpoint_answering_is_etcd_unavailable() -> None:
    dead = [dead_url(), dead_url()]
    async with EtcdClient(dead) as client:
        with pytest.raises(EtcdUnavailable, match="Connection refused"):
            await client.get(b"k")
        with pytest.raises(EtcdUnavailable):
            async with client.open_watch(b"k"):
                pass


async def test_killed_etcd_fails_each_call_within_its_timeout_and_restarted_works_again(
    own_etcd: EtcdServer,
) -> None:
    timeout = 0.5
    async with EtcdClient([own_etcd.url], timeout=timeout) as client:
        lease = await client.grant(60)
        await client.put(b"k", b"before", lease=lease)
        own_etcd.kill()
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: client.get(b"k"),
            lambda: client.put(b"k", b"v"),
            lambda: client.put_if_absent(b"n", b"v"),
            lambda: client.range(b""),
            lambda: client.delete(b"k"),
            lambda: client.grant(5),
            lambda: client.keepalive_once(lease),
            lambda: client.revoke(lease),
        ]
        for call in calls:
            start = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                await call()
            assert time.monotonic() - start < timeout + SLACK
        own_etcd.start()
        # The pooled connection died with the old process; the client dials again.
        await client.put(b"k", b"after")
        found = await client.get(b"k")
        assert found is not None
        assert found.value == b"after"
        assert await client.keepalive_once(lease) > 0


async def test_a_restarted_etcd_is_used_at_once_through_a_pooled_connection(
    own_etcd: EtcdServer,
) -> None:
    async with EtcdClient([own_etcd.url]) as client:
        await client.put(b"k", b"before")  # leaves its connection idle in the pool
        own_etcd.kill()
        own_etcd.start()
        # A put is not repeated on another connection: this one must not go out on
        # the dead pooled one.
        await client.put(b"k", b"after")


async def test_a_frozen_etcd_fails_each_call_within_its_timeout(own_etcd: EtcdServer) -> None:
    timeout = 0.5
    async with EtcdClient([own_etcd.url], timeout=timeout) as client:
        await client.put(b"k", b"v")
        own_etcd.pause()
        try:
            for call in (lambda: client.get(b"k"), lambda: client.put(b"k", b"w")):
                start = time.monotonic()
                with pytest.raises(EtcdUnavailable, match=r"within 0\.5 s"):
                    await call()
                assert time.monotonic() - start < timeout + SLACK
            start = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                async with client.open_watch(b"k"):
                    pass
            assert time.monotonic() - start < timeout + SLACK
        finally:
            own_etcd.resume()
        found = await client.get(b"k")
        assert found is not None
        # The put that timed out had gone out: etcd may apply it once it runs again.
        assert found.value in (b"v", b"w")


async def test_a_frozen_first_endpoint_fails_one_call_and_the_next_goes_on(
    own_etcd: EtcdServer, etcd: EtcdServer, prefix: bytes
) -> None:
    async with EtcdClient([own_etcd.url, etcd.url], timeout=0.5) as client:
        own_etcd.pause()
        try:
            start = time.monotonic()
            with pytest.raises(EtcdUnavailable, match=r"within 0\.5 s"):
                await client.put(prefix + b"k", b"v")
            assert time.monotonic() - start < 0.5 + SLACK
            assert client.endpoint == etcd.url
            await client.put(prefix + b"k", b"v")
        finally:
            own_etcd.resume()


async def test_a_watch_broken_by_a_kill_is_resumed_from_its_revision(
    own_etcd: EtcdServer,
) -> None:
    async with EtcdClient([own_etcd.url]) as client:
        async with client.open_watch(b"/p/") as watch:
            await client.put(b"/p/a", b"1")
            assert [e.key for e in await next_events(watch, 1)] == [b"/p/a"]
            own_etcd.kill()
            with pytest.raises(WatchBroken), trio.fail_after(PATIENCE):
                await anext(watch)
        own_etcd.start()
        # What the resumed watch must see, as etcd numbers it: a put and a delete
        # right after the last event seen. A restart that lost that event would fail
        # here, not as a watch that never yields.
        assert await client.put(b"/p/b", b"2") == watch.revision + 1
        assert await client.delete(b"/p/a") == 1
        async with client.open_watch(b"/p/", start_revision=watch.revision + 1) as again:
            events = await next_events(again, 2)
    assert [(e.kind, e.key) for e in events] == [("put", b"/p/b"), ("delete", b"/p/a")]


async def test_cluster_members_lost_are_passed_over(tmp_path: Path) -> None:
    with running_cluster(tmp_path) as members:
        leader = next(m for m in members if m.is_leader())
        follower, other = (m for m in members if m is not leader)
        async with EtcdClient(urls([follower, leader, other]), timeout=1) as client:
            await client.put(b"k", b"1")
            follower.kill()
            await client.put(b"k", b"2")
            assert client.endpoint == leader.url
            # Losing the leader too loses the quorum: calls fail within their timeout.
            leader.kill()
            start = time.monotonic()
            with pytest.raises(EtcdUnavailable):
                await client.put(b"k", b"3")
            assert time.monotonic() - start < 1 + SLACK
            # A member back makes a quorum again; the same client finds it.
            follower.start(wait=False)
            backoff = Backoff()
            with trio.fail_after(PATIENCE):
                while True:
                    try:
                        await client.put(b"k", b"4")
                        break
                    except EtcdUnavailable:
                        await backoff.wait()
            found = await client.get(b"k")
            assert found is not None
            assert found.value == b"4"


async def test_tls_with_a_client_certificate(tmp_path: Path) -> None:
    tls = TlsFiles(tmp_path / "tls")
    with running_etcd(tmp_path / "etcd", tls=tls) as server:
        secure = EtcdClient(
            [server.url], ca=str(tls.ca), cert=str(tls.client_cert), key=str(tls.client_key)
        )
        async with secure as client:
            await client.put(b"k", b"v")
            async with client.open_watch(b"k", start_revision=1) as watch:
                assert [e.value for e in await next_events(watch, 1)] == [b"v"]
        async with EtcdClient([server.url], ca=str(tls.ca), timeout=1) as client:
            with pytest.raises(EtcdUnavailable):
                await client.get(b"k")
        async with EtcdClient([server.url], timeout=1) as client:
            with pytest.raises(EtcdUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(b"k")


def test_bad_endpoints_and_tls_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least one"):
        EtcdClient([])
    for url in ("127.0.0.1:2379", "ftp://h:1", "http://h", "http://h:1/v3", "http://h:x"):
        with pytest.raises(ConfigError, match="etcd endpoint"):
            EtcdClient([url])
    with pytest.raises(ConfigError, match="CA file"):
        EtcdClient(["https://h:1"], ca=str(tmp_path / "none.pem"))
    with pytest.raises(ConfigError, match="needs its certificate"):
        EtcdClient(["https://h:1"], key=str(tmp_path / "key.pem"))
    EtcdClient(["http://h:1"], ca=str(tmp_path / "unused: no https endpoint"))


async def test_a_reply_over_the_bound_is_refused(
    etcd_client: EtcdClient, etcd: EtcdServer, prefix: bytes
) -> None:
    await etcd_client.put(prefix + b"big", b"x" * 4096)
    async with EtcdClient([etcd.url], limits=Limits(max_body=2048)) as small:
        with pytest.raises(EtcdUnavailable, match="over the bound"):
            await small.get(prefix + b"big")
        assert await small.get(prefix + b"small") is None


async def test_a_watch_message_over_the_bound_breaks_the_watch(
    etcd_client: EtcdClient, etcd: EtcdServer, prefix: bytes
) -> None:
    small = EtcdClient([etcd.url], limits=Limits(max_line=2048))
    async with small, small.open_watch(prefix) as watch:
        await etcd_client.put(prefix + b"big", b"x" * 4096)
        with pytest.raises(WatchBroken, match="over the bound"), trio.fail_after(PATIENCE):
            await anext(watch)


async def test_connections_are_bounded(etcd: EtcdServer, prefix: bytes) -> None:
    async with EtcdClient([etcd.url], max_connections=1, timeout=0.5) as client:
        async with client.open_watch(prefix):
            with pytest.raises(EtcdUnavailable, match="no etcd connection was free"):
                await client.get(prefix + b"k")
        assert await client.get(prefix + b"k") is None


def test_backoff_doubles_to_its_most_with_jitter_and_resets() -> None:
    backoff = Backoff(0.1, 1.0, jitter=0.2, uniform=lambda low, high: high)
    assert [round(backoff.delay(), 3) for _ in range(6)] == [0.12, 0.24, 0.48, 0.96, 1.2, 1.2]
    backoff.reset()
    assert round(backoff.delay(), 3) == 0.12
    spread = Backoff(1.0, 1.0, jitter=0.2)
    assert all(0.8 <= spread.delay() <= 1.2 for _ in range(100))
