"""Both clients against a daemon of protocol 1, played by the test on a real Unix
socket: it refuses their hello of version 2, and they greet it again in version 1."""

from __future__ import annotations

from pathlib import Path

import trio

from watchdogd_client.trio import open_client
from watchdogd_protocol import PROTOCOL_VERSION

from helpers.fake_daemon import FakeDaemon
from helpers.processes import python_worker
from helpers.waiting import PATIENCE


def client_hellos(fake: FakeDaemon, client: str) -> list[int]:
    return [hello.version for hello in fake.hellos if hello.client.split("/")[0] == client]


def test_the_blocking_client_greets_a_daemon_of_protocol_1_again_and_stays_with_it(
    socket_path: Path,
) -> None:
    with FakeDaemon(socket_path, versions=(1, 1)) as fake:
        worker = python_worker(
            """
            from watchdogd_client import Client

            client = Client()
            assert client.acquire("step", 600) == 600
            client.close()  # the next request connects anew
            assert client.release("step")
            """,
            socket=socket_path,
        )
        _, err = worker.communicate(timeout=PATIENCE)
        assert worker.returncode == 0, err
    assert PROTOCOL_VERSION == 2
    assert client_hellos(fake, "python") == [2, 1, 1]


def test_the_trio_client_greets_a_daemon_of_protocol_1_again(socket_path: Path) -> None:
    async def arm() -> float:
        async with open_client(str(socket_path)) as client:
            return await client.acquire("trio", 60)

    with FakeDaemon(socket_path, versions=(1, 1)) as fake:
        assert trio.run(arm) == 60
    assert client_hellos(fake, "python-trio") == [2, 1]


def test_a_daemon_that_refuses_the_oldest_version_too_is_a_refusal(socket_path: Path) -> None:
    with FakeDaemon(socket_path, versions=(3, 4)) as fake:
        worker = python_worker(
            """
            from watchdogd_client import Client, RequestRefused

            try:
                Client().ping()
            except RequestRefused as refused:
                print(refused.code)
            """,
            socket=socket_path,
        )
        out, err = worker.communicate(timeout=PATIENCE)
    assert (out.strip(), worker.returncode) == ("unsupported_version", 0), err
    assert client_hellos(fake, "python") == [2, 1]
