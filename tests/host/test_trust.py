"""Whom the client talks to (`watchdogd_client.trust`): real directories, real
sockets listened on by real other users (uid 65534, uid 4321, a service's uid as
systemd's DynamicUser= gives one), each test in a mount namespace of its own with
fresh /tmp and /run, so the host's fixed paths are the test's to make."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from watchdogd_client import Client, DaemonUnavailable, UntrustedSocket, __version__
from watchdogd_client.paths import SYSTEM_SOCKET, Place
from watchdogd_client.trust import vet

from helpers.fake_daemon import FakeDaemon, fake_daemon_as
from helpers.namespaces import in_private_mounts
from helpers.users import NOBODY, OTHER, run_as
from helpers.waiting import wait_until

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root: other users, mounts")

#: The per-user path of uid 4321 without XDG_RUNTIME_DIR.
PER_USER = Path(f"/tmp/watchdogd-{OTHER}/watchdogd.sock")
HOST = Path(SYSTEM_SOCKET)
#: A service's own uid, as systemd's DynamicUser= allocates one (61184-65519).
SERVICE = 61234


def ping(place: Place) -> dict[str, Any]:
    """How a client's ping to ``place`` ended: ``ok``, ``untrusted`` (with the
    message and the socket's owner) or ``unavailable``."""
    try:
        with Client(place, timeout=2.0) as client:
            client.ping()
    except UntrustedSocket as exc:
        return {"untrusted": str(exc), "owner": exc.owner}
    except DaemonUnavailable as exc:
        return {"unavailable": str(exc)}
    return {"ok": True}


def pinged(
    daemon: AbstractContextManager[Callable[[], dict[str, Any]]], place: Place
) -> tuple[dict[str, Any], dict[str, Any]]:
    """How a ping of uid 4321 to ``place`` ended, and what the fake ``daemon``
    (entered here) saw."""
    with daemon as report:
        return dict(run_as(OTHER, partial(ping, place))), report()


@contextmanager
def listening(uid: int, path: Path) -> Iterator[Callable[[], dict[str, Any]]]:
    """A fake daemon of ``uid`` listening at ``path``, whatever the directory's
    owner: bound in a directory of its own on the same file system, then moved
    there by root (as a hard link to a socket, or a directory writable by both,
    would put it). Yields its report (`fake_daemon_as`)."""
    staging = Path("/", path.parts[1], f"staging-{uid}-{path.parent.name}")
    make_directory(staging, 0o755, uid)
    with fake_daemon_as(uid, staging / "watchdogd.sock") as report:
        os.rename(staging / "watchdogd.sock", path)
        yield report


def make_directory(path: Path, mode: int, owner: int = 0) -> None:
    path.mkdir(mode=mode)
    os.chmod(path, mode)
    os.chown(path, owner, owner)


# A per-user path, found by the client itself.


@pytest.mark.parametrize("listener", [OTHER, 0], ids=["the-user", "root"])
def test_the_users_own_private_directory_and_listener_are_trusted(listener: int) -> None:
    def scenario() -> Any:
        make_directory(PER_USER.parent, 0o700, OTHER)
        return pinged(listening(listener, PER_USER), Place(str(PER_USER), "user"))

    outcome, seen = in_private_mounts(scenario)
    assert outcome == {"ok": True}
    assert seen["hellos"] == [f"python/{__version__}"]


def test_a_per_user_directory_another_user_made_gets_no_connection_at_all() -> None:
    def scenario() -> Any:
        return pinged(
            fake_daemon_as(NOBODY, PER_USER, directory_mode=0o755), Place(str(PER_USER), "user")
        )

    outcome, seen = in_private_mounts(scenario)
    assert outcome["owner"] == NOBODY
    assert outcome["untrusted"].startswith(
        f"watchdogd's socket {PER_USER}, owned by uid 65534 (nobody), is not trusted: its "
        f"directory {PER_USER.parent} belongs to uid 65534 (nobody), not to you (uid 4321)."
    )
    assert seen["connections"] == 0


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_per_user_directory_others_may_write_gets_no_connection(mode: int) -> None:
    def scenario() -> Any:
        return pinged(
            fake_daemon_as(OTHER, PER_USER, directory_mode=mode), Place(str(PER_USER), "user")
        )

    outcome, seen = in_private_mounts(scenario)
    assert (
        f"others than its owner may write to its directory {PER_USER.parent} (mode {mode:04o})"
        in outcome["untrusted"]
    )
    assert seen["connections"] == 0


def test_another_users_listener_in_the_users_own_directory_hears_not_even_a_hello() -> None:
    def scenario() -> Any:
        make_directory(PER_USER.parent, 0o755, OTHER)
        return pinged(listening(NOBODY, PER_USER), Place(str(PER_USER), "user"))

    outcome, seen = in_private_mounts(scenario)
    assert (
        "the process listening on it runs as uid 65534 (nobody), neither root nor you "
        "(uid 4321)." in outcome["untrusted"]
    )
    assert (seen["connections"], seen["received"]) == (1, 0)


# A path named by the caller.


@pytest.mark.parametrize(
    ("mode", "trusted"), [(0o755, True), (0o1777, True), (0o777, False), (0o775, False)]
)
def test_a_named_socket_is_trusted_as_named_unless_others_may_replace_it(
    mode: int, trusted: bool
) -> None:
    named = Path("/tmp/shared/watchdogd.sock")

    def scenario() -> Any:
        return pinged(
            fake_daemon_as(NOBODY, named, directory_mode=mode), Place(str(named), "named")
        )

    outcome, seen = in_private_mounts(scenario)
    if trusted:
        assert outcome == {"ok": True}
        assert len(seen["hellos"]) == 1
    else:
        assert outcome["untrusted"].endswith(
            f"others than its owner may write to its directory /tmp/shared (mode {mode:04o}) "
            "and it has no sticky bit: anyone could replace it. Nothing was sent to it. "
            "Remove it if no daemon of yours made it, or name the socket of a daemon you "
            "trust with WATCHDOGD_SOCKET (or --socket)."
        )
        assert seen["connections"] == 0


def test_the_directory_judged_is_the_one_that_holds_the_socket_not_a_link_to_it() -> None:
    def scenario() -> Any:
        make_directory(Path("/tmp/mine"), 0o755)
        with fake_daemon_as(
            NOBODY, Path("/tmp/open/watchdogd.sock"), directory_mode=0o777
        ) as report:
            Path("/tmp/mine/watchdogd.sock").symlink_to("/tmp/open/watchdogd.sock")
            outcome = ping(Place("/tmp/mine/watchdogd.sock", "named"))
            return outcome, report()

    outcome, seen = in_private_mounts(scenario)
    assert "may write to its directory /tmp/open (mode 0777)" in outcome["untrusted"]
    assert seen["connections"] == 0


def test_the_connect_goes_through_the_directory_judged_even_if_it_is_swapped_after() -> None:
    def scenario() -> Any:
        judged = Path("/tmp/judged")
        make_directory(judged, 0o755)
        place = Place(str(judged / "watchdogd.sock"), "named")
        with FakeDaemon(judged / "watchdogd.sock") as first, vet(place) as vetted:
            judged.rename("/tmp/judged.old")
            make_directory(judged, 0o777)  # another's, in its place
            with FakeDaemon(judged / "watchdogd.sock") as second:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(vetted.address)
                    vetted.admit(sock)
                    sock.sendall(b"\0")
                    first_saw = wait_for_bytes(first)
                return first_saw, second.seen()["connections"]

    first_saw, second_connections = in_private_mounts(scenario)
    assert first_saw == 1
    assert second_connections == 0


# The host's path.


@pytest.mark.parametrize(
    ("owner", "listener"),
    [(0, 0), (SERVICE, SERVICE), (SERVICE, 0)],
    ids=["root-as-root", "service-user-bound-it", "systemd-bound-it"],
)
def test_the_hosts_daemon_is_found_and_trusted(owner: int, listener: int) -> None:
    def scenario() -> Any:
        make_directory(HOST.parent, 0o755, owner)
        return pinged(listening(listener, HOST), Place(SYSTEM_SOCKET, "host"))

    outcome, seen = in_private_mounts(scenario)
    assert outcome == {"ok": True}
    assert len(seen["hellos"]) == 1


def test_the_hosts_directory_kept_by_systemd_behind_a_link_is_judged_where_it_is() -> None:
    # DynamicUser= with RuntimeDirectoryPreserve=yes: /run/watchdogd is a link to
    # /run/private/watchdogd, and /run/private is root's alone, mode 0700.
    def scenario() -> Any:
        make_directory(Path("/run/private"), 0o700)
        make_directory(Path("/run/private/watchdogd"), 0o755, SERVICE)
        HOST.parent.symlink_to("private/watchdogd")
        with listening(SERVICE, Path("/run/private/watchdogd/watchdogd.sock")) as report:
            outcome = ping(Place(SYSTEM_SOCKET, "host"))
            return outcome, report()

    outcome, seen = in_private_mounts(scenario)
    assert outcome == {"ok": True}
    assert len(seen["hellos"]) == 1


@pytest.mark.parametrize(
    ("owner", "listener", "reason"),
    [
        (0, NOBODY, "the process listening on it runs as uid 65534 (nobody), not root."),
        (
            SERVICE,
            NOBODY,
            "the process listening on it runs as uid 65534 (nobody), neither root nor "
            f"uid {SERVICE}, who owns /run/watchdogd.",
        ),
    ],
)
def test_a_listener_that_is_neither_root_nor_the_service_hears_not_even_a_hello(
    owner: int, listener: int, reason: str
) -> None:
    def scenario() -> Any:
        make_directory(HOST.parent, 0o755, owner)
        return pinged(listening(listener, HOST), Place(SYSTEM_SOCKET, "host"))

    outcome, seen = in_private_mounts(scenario)
    assert f"owned by uid 65534 (nobody), is not trusted: {reason}" in outcome["untrusted"]
    assert (seen["connections"], seen["received"]) == (1, 0)


@pytest.mark.parametrize(
    ("run_mode", "owner", "mode", "reason"),
    [
        (
            0o1777,
            SERVICE,
            0o755,
            f"its directory /run/watchdogd belongs to uid {SERVICE}, and others than root "
            "may write to /run, so root did not give it to them",
        ),
        (0o755, 0, 0o777, "others than its owner may write to its directory /run/watchdogd"),
        (0o755, SERVICE, 0o775, "others than its owner may write to its directory"),
    ],
    ids=["not-given-by-root", "open-to-all", "open-to-a-group"],
)
def test_a_host_directory_that_others_may_write_gets_no_connection(
    run_mode: int, owner: int, mode: int, reason: str
) -> None:
    def scenario() -> Any:
        os.chmod("/run", run_mode)
        make_directory(HOST.parent, mode, owner)
        return pinged(listening(owner, HOST), Place(SYSTEM_SOCKET, "host"))

    outcome, seen = in_private_mounts(scenario)
    assert reason in outcome["untrusted"]
    assert seen["connections"] == 0


def test_evidence_goes_to_the_service_user_on_the_hosts_path_only() -> None:
    # A responder gives its stacks to a daemon of root, of its own user, or of the
    # user root gave the host's directory to; a path named elsewhere in a directory
    # root gave someone is trusted by the client, not by the responder.
    def scenario() -> Any:
        outcomes = {}
        for path in (HOST, Path("/run/elsewhere/watchdogd.sock")):
            make_directory(path.parent, 0o755, SERVICE)
            with listening(SERVICE, path):
                place = Place(str(path), "named")
                outcomes[str(path)] = run_as(OTHER, partial(admitted, place))
        return outcomes

    outcomes = in_private_mounts(scenario)
    assert outcomes[SYSTEM_SOCKET] == "admitted"
    assert outcomes["/run/elsewhere/watchdogd.sock"].endswith(
        f"runs as uid {SERVICE}, neither root nor you (uid 4321)"
    )


def admitted(place: Place) -> str:
    """Whether a responder would answer the daemon at ``place``: ``admitted``, or
    why not."""
    try:
        with vet(place, evidence=True) as vetted, socket.socket(socket.AF_UNIX) as sock:
            sock.connect(vetted.address)
            vetted.admit(sock)
    except UntrustedSocket as exc:
        return str(exc).split(" is not trusted: ")[1].split(". Nothing was sent")[0]
    return "admitted"


def test_a_missing_directory_is_no_daemon_not_an_untrusted_one() -> None:
    outcome = in_private_mounts(lambda: ping(Place(SYSTEM_SOCKET, "host")))
    assert outcome == {
        "unavailable": f"watchdogd is not reachable at {SYSTEM_SOCKET}: no socket there. "
        "Start it with `watchdogd` (or `systemctl start watchdogd.socket`), or point "
        "WATCHDOGD_SOCKET at the socket it listens on."
    }


def wait_for_bytes(daemon: FakeDaemon) -> int:
    """The connections of ``daemon``, once one of them sent something."""
    wait_until(lambda: daemon.seen()["received"] > 0, what="a byte at the judged socket")
    return int(daemon.seen()["connections"])
