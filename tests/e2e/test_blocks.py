"""The module-level `watchdogd_client.release`, and the blocks it finds
(`watchdogd_client.blocks`): the innermost ``expires()`` block open in the calling
thread, against a real daemon."""

from __future__ import annotations

import os
import threading
from collections.abc import Generator

import pytest

from watchdogd_client import Client, NullClient, expires, release


def armed(client: Client) -> set[str]:
    """The scopes of the timers armed for this process."""
    return {timer.scope for timer in client.status().timers if timer.pid == os.getpid()}


def test_release_with_no_block_open_does_nothing() -> None:
    assert release() is False


def test_release_disarms_the_innermost_block_and_its_exit_releases_nothing_more(
    client: Client,
) -> None:
    with expires(60, "outer", client=client) as outer:
        with expires(60, "inner", client=client) as inner:
            assert release() is True
            assert not inner.armed
            assert armed(client) == {"outer"}
            assert release() is False  # the inner block, released already
            assert armed(client) == {"outer"}
        assert outer.armed
        # The inner block ended: the outer one is now the innermost open block.
        assert release() is True
        assert armed(client) == set()
    assert release() is False


def test_a_block_renewed_after_its_release_is_released_again(client: Client) -> None:
    with expires(60, "renewed", client=client) as timer:
        assert release() is True
        timer.renew()
        assert armed(client) == {"renewed"}
        assert release() is True
        assert armed(client) == set()


def test_a_block_that_raised_is_no_longer_open(client: Client) -> None:
    with expires(60, "outside", client=client):
        with pytest.raises(ValueError, match="raised"), expires(60, "raised", client=client):
            raise ValueError("raised")
        assert armed(client) == {"outside"}
        assert release() is True
    assert release() is False


def test_the_blocks_of_every_client_count() -> None:
    with NullClient().expires(60) as timer:
        assert release() is True
        assert not timer.armed


def test_another_threads_blocks_are_never_touched(client: Client) -> None:
    answers: dict[str, bool] = {}

    def without_a_block() -> None:
        answers["without"] = release()

    def with_its_own_block() -> None:
        with expires(60, "thread", client=client):
            answers["own"] = release()
            answers["again"] = release()

    with expires(60, "main", client=client):
        for work in (without_a_block, with_its_own_block):
            thread = threading.Thread(target=work)
            thread.start()
            thread.join()
        assert answers == {"without": False, "own": True, "again": False}
        assert armed(client) == {"main"}
        assert release() is True


def test_a_forked_child_has_none_of_its_parents_blocks_open(client: Client) -> None:
    with expires(60, "parent", client=client):
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through its exit status
            os._exit(0 if release() is False else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert armed(client) == {"parent"}


def test_a_block_that_ends_out_of_turn_leaves_the_others_open(client: Client) -> None:
    def suspended() -> Generator[None]:
        with expires(60, "generator", client=client):
            yield

    generator = suspended()
    next(generator)
    with expires(60, "around", client=client):
        generator.close()  # its block ends while the one entered after it is open
        assert armed(client) == {"around"}
        assert release() is True
        assert armed(client) == set()
