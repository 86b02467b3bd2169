"""The blocking client against a real daemon: requests, expires(), failures."""

from __future__ import annotations

import logging
import math
import os
import pickle
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import watchdogd_client
from watchdogd_client import (
    Client,
    DaemonUnavailable,
    ErrorCode,
    NoOpTimer,
    NullClient,
    RequestRefused,
    WatchdogdError,
    configure,
    expires,
    release,
)
from watchdogd_client.outage import OnUnavailable
from watchdogd_client.paths import SYSTEM_SOCKET, Place
from watchdogd_client.trio import open_client
from watchdogd_protocol import MAX_REPLY_BYTES, MAX_REPLY_FRAME, Error, encode_frame

from helpers.daemon import SHORT_RESTART, RunningDaemon
from helpers.fake_daemon import fake_daemon_as
from helpers.namespaces import in_private_mounts
from helpers.per_user import (
    AFTER,
    HUNG,
    IMPOSTOR,
    PER_USER,
    daemon_of_other,
    worker_of_other,
)
from helpers.users import NOBODY
from helpers.waiting import PATIENCE


def my_timers(client: Client) -> dict[str, float]:
    return {t.scope: t.remaining for t in client.status().timers if t.pid == os.getpid()}


def test_acquire_release_status(client: Client) -> None:
    assert client.acquire("step", 60) == 60
    assert client.acquire("other", 30, policy="kill") == 30
    timers = my_timers(client)
    assert set(timers) == {"step", "other"}
    assert 59 < timers["step"] <= 60
    assert client.release("step") is True
    assert client.release("step") is False
    assert set(my_timers(client)) == {"other"}
    status = client.status()
    assert status.daemon.version == watchdogd_client.__version__
    assert status.daemon.timers == 1


def test_refusals_carry_their_code(client: Client) -> None:
    with pytest.raises(RequestRefused) as caught:
        client.acquire("s", 5, policy="no-such-policy")
    assert caught.value.code == ErrorCode.UNKNOWN_POLICY
    with pytest.raises(RequestRefused) as caught:
        client.acquire("s", 5, pid=1)
    assert caught.value.code == ErrorCode.PERMISSION_DENIED
    assert client.ping() >= 0  # still usable


def test_unavailable_says_which_socket_and_how_to_start(tmp_path: Path) -> None:
    path = tmp_path / "none.sock"
    with pytest.raises(DaemonUnavailable) as caught:
        Client(path).acquire("s", 5)
    message = str(caught.value)
    assert str(path) in message
    assert "no socket there" in message
    assert "watchdogd" in message
    assert "WATCHDOGD_SOCKET" in message
    assert caught.value.socket_path == str(path)


def test_unavailable_when_nothing_listens(socket_path: Path) -> None:
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(socket_path))
    dead.close()
    with pytest.raises(DaemonUnavailable, match="nothing is listening"):
        Client(socket_path).ping()


def test_silent_daemon_times_out(socket_path: Path) -> None:
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(str(socket_path))
    mute.listen()  # accepts into the backlog, never answers
    try:
        with pytest.raises(DaemonUnavailable, match=r"no reply within 0\.2 s"):
            Client(socket_path, timeout=0.2).ping()
    finally:
        mute.close()


def test_unavailable_is_a_connection_error() -> None:
    # Code that handles OSError for its other connections handles this one too.
    with pytest.raises(ConnectionError) as caught:
        Client("/nonexistent/watchdogd.sock").ping()
    assert isinstance(caught.value, DaemonUnavailable)
    assert isinstance(caught.value, OSError)
    assert caught.value.errno is None
    assert str(caught.value).startswith("watchdogd is not reachable at /nonexistent/")


def test_warn_mode_runs_unprotected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    client = Client(tmp_path / "none.sock", on_unavailable="warn")
    with caplog.at_level(logging.WARNING, logger="watchdogd_client"), client.expires(5) as timer:
        timer.renew()
    assert "running unprotected" in caplog.text
    with pytest.raises(DaemonUnavailable):
        client.status()  # only arming and releasing degrade


def test_warn_mode_warns_once_per_outage(
    socket_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(socket_path, on_unavailable="warn", reconnect_timeout=0.2)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    with caplog.at_level(logging.DEBUG, logger="watchdogd_client"):
        for _ in range(5):
            with client.expires(5):
                pass
        [warning] = warnings()
        assert warning.startswith("running unprotected until the daemon answers again")
        assert sum("still running unprotected" in r.getMessage() for r in caplog.records) == 9

        config = tmp_path / "watchdogd.toml"
        config.write_text(SHORT_RESTART)
        daemon = RunningDaemon(socket_path, tmp_path / "log", ["--config", str(config)])
        daemon.start()
        try:
            with client.expires(5):
                pass
            assert f"watchdogd answers again at {socket_path}" in caplog.text
            caplog.clear()
            daemon.stop()
            for _ in range(3):
                with client.expires(5):
                    pass
            [again] = warnings()  # a new outage is worth a new warning
            assert again.startswith("running unprotected")
        finally:
            daemon.stop()
            client.close()


def test_reconnects_after_a_daemon_restart(daemon: RunningDaemon) -> None:
    with daemon.client() as client:
        client.ping()
        assert daemon.stop() == 0
        daemon.start()
        assert client.acquire("after-restart", 60) == 60  # the old connection broke
        assert "after-restart" in my_timers(client)


def test_an_interrupted_request_does_not_leave_the_connection_out_of_step(client: Client) -> None:
    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        client.acquire("job", 60)
        last = client.events(limit=1).last
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # Ctrl-C, or a caller's own alarm
        with pytest.raises(Interrupted):
            client.events(after=last, wait=5)  # interrupted while waiting for the reply
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert client.release("job") is True  # a fresh connection, not the stale reply
    assert my_timers(client) == {}


def test_threads_share_one_client(client: Client) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(100):
                scope = f"t{n}-{i % 5}"
                assert client.acquire(scope, 60) == 60
                assert client.release(scope) is True
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert my_timers(client) == {}


def test_parent_and_forked_child_hammer_one_client(client: Client) -> None:
    """Threads of the parent keep the client busy while it forks: the child must
    neither inherit a held lock nor write into the parent's connection."""

    def hammer(tag: str, rounds: int) -> None:
        for i in range(rounds):
            scope = f"{tag}-{i % 4}"
            if client.acquire(scope, 60) != 60 or client.release(scope) is not True:
                raise AssertionError(f"wrong reply for {scope}")

    errors: list[BaseException] = []

    def in_thread(tag: str) -> None:
        try:
            hammer(tag, 300)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=in_thread, args=(f"parent{n}",)) for n in range(2)]
    for thread in threads:
        thread.start()
    children = []
    for n in range(3):
        child = os.fork()
        if child == 0:  # pragma: no cover - reports through its exit status
            status = 0
            try:
                hammer(f"child{n}", 300)
                if any(t.pid == os.getpid() for t in client.status().timers):
                    status = 2  # a timer of its own was left armed
            except BaseException:
                status = 1
            os._exit(status)
        children.append(child)
    for thread in threads:
        thread.join()
    statuses = [os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) for child in children]
    assert statuses == [0, 0, 0]
    assert errors == []
    assert client.status().timers == []  # no stray timer, in parent or children


def test_forked_child_gets_its_own_connection(client: Client) -> None:
    client.acquire("parent", 60)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        try:
            ok = client.acquire("child", 60) == 60 and client.release("parent") is False
            ok = ok and client.release("child") is True
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert set(my_timers(client)) == {"parent"}  # the child touched only its own


class TestExpires:
    def test_arms_for_the_block_and_releases_after(self, client: Client) -> None:
        with client.expires(30) as timer:
            assert my_timers(client) == {timer.scope: pytest.approx(30, abs=1)}
            assert timer.armed
        assert my_timers(client) == {}
        assert not timer.armed

    def test_default_scope_is_the_callers_line(self, client: Client) -> None:
        line = _line_of_next_statement()
        with client.expires(30) as timer:
            pass
        assert timer.scope == f"{__file__}:{line}"

    def test_default_scope_names_the_thread(self, client: Client) -> None:
        scopes: list[str] = []

        def in_thread() -> None:
            with client.expires(30) as timer:
                scopes.append(timer.scope)

        thread = threading.Thread(target=in_thread, name="loader-3")
        thread.start()
        thread.join()
        assert scopes[0].endswith("@loader-3")
        assert scopes[0].startswith(__file__ + ":")

    def test_release_early_is_idempotent(self, client: Client) -> None:
        with client.expires(30, "early") as timer:
            timer.release()
            timer.release()
            assert my_timers(client) == {}
        assert my_timers(client) == {}

    def test_renew_rearms(self, client: Client) -> None:
        with client.expires(30, "renewed") as timer:
            timer.renew(90)
            assert my_timers(client)["renewed"] > 80
            timer.release()
            timer.renew()  # re-arms after release too
            assert "renewed" in my_timers(client)
        assert my_timers(client) == {}

    def test_exception_propagates_and_releases(self, client: Client) -> None:
        with pytest.raises(KeyError, match="boom"), client.expires(30, "raises"):
            raise KeyError("boom")
        assert my_timers(client) == {}

    def test_daemon_gone_at_exit_of_a_good_block_raises(
        self, short_lived_daemon: RunningDaemon
    ) -> None:
        daemon = short_lived_daemon
        client = daemon.client(reconnect_timeout=0.2)  # gone, not restarting
        with pytest.raises(DaemonUnavailable), client.expires(30):
            daemon.stop()
        client.close()

    def test_daemon_gone_never_masks_the_blocks_exception(
        self, short_lived_daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
    ) -> None:
        daemon = short_lived_daemon
        client = daemon.client(reconnect_timeout=0.2)  # gone, not restarting

        def failing_block() -> None:
            with client.expires(30):
                daemon.stop()
                raise ValueError("the real problem")

        with pytest.raises(ValueError, match="the real problem"):
            failing_block()
        assert "could not release" in caplog.text
        client.close()


class TestModuleLevel:
    def test_configure_and_expires(self, client: Client) -> None:
        configure(client)
        try:
            with expires(after=30, scope="module") as timer:
                assert timer.client is client
                assert "module" in my_timers(client)
            line = _line_of_next_statement()
            with expires(30) as timer:
                assert timer.scope == f"{__file__}:{line}"
        finally:
            configure(None)
        assert my_timers(client) == {}

    def test_explicit_client_wins(self, client: Client) -> None:
        configure(NullClient())
        try:
            with expires(30, "explicit", client=client):
                assert "explicit" in my_timers(client)
        finally:
            configure(None)

    def test_disable_makes_the_default_a_null_client(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("WATCHDOGD_DISABLE", "1")
        configure(None)
        try:
            assert isinstance(watchdogd_client.default_client(), NullClient)
            with expires(1) as timer:
                timer.renew(5)
        finally:
            configure(None)

    def test_default_client_uses_the_environment(
        self, daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("WATCHDOGD_SOCKET", str(daemon.socket_path))
        monkeypatch.delenv("WATCHDOGD_DISABLE", raising=False)
        configure(None)
        try:
            default = watchdogd_client.default_client()
            assert isinstance(default, Client)
            assert default.socket_path == str(daemon.socket_path)
            default.ping()
            default.close()
        finally:
            configure(None)


def test_null_client_accepts_everything() -> None:
    null = NullClient()
    assert null.acquire("s", 5, policy="anything", pid=1) == 5
    assert null.release("s") is False
    assert null.status().timers == []
    with null.expires(0.001) as timer:
        timer.release()


class TestNoOpTimer:
    def test_its_block_yields_a_handle_that_does_nothing(self) -> None:
        with NoOpTimer() as timer:
            assert not timer.armed
            timer.renew(after=5)
            timer.release()
            assert not timer.armed
        with NoOpTimer().expires(after=5) as timer:
            timer.renew()
            assert not timer.armed

    def test_it_takes_a_timer_clients_acquire_and_release(self) -> None:
        noop = NoOpTimer()
        assert isinstance(noop, NullClient)  # it never connects
        assert noop.acquire("scope", 5) == 5
        assert noop.release("scope") is False
        with pytest.raises(TypeError, match="'polcy'"):
            noop.expires(5, polcy="kill")  # type: ignore[call-arg]

    def test_an_exception_leaves_its_block_unchanged(self) -> None:
        with pytest.raises(ValueError, match="the real problem"), NoOpTimer():
            raise ValueError("the real problem")

    def test_one_may_hold_blocks_of_one_no_op_timer_inside_each_other(self) -> None:
        noop = NoOpTimer()
        with noop as outer:
            with noop as inner:
                assert inner is not outer
            with noop:
                pass
        assert release() is False  # every one of them ended

    def test_it_arms_nothing_and_shields_the_block_around_it(self, client: Client) -> None:
        with client.expires(60, "around"):
            with NoOpTimer():
                assert release() is False  # the no-op block: nothing to release
            with NoOpTimer().expires(after=5):
                assert release() is False
            assert set(my_timers(client)) == {"around"}
        configure(NoOpTimer())
        try:
            with expires(after=60):
                assert my_timers(client) == {}
        finally:
            configure(None)


def test_client_rejects_nonsense_options() -> None:
    with pytest.raises(ValueError, match="on_unavailable"):
        Client("/x", on_unavailable="ignore")  # type: ignore[arg-type]
    for timeout in (0, math.inf, 1e-9):
        with pytest.raises(ValueError, match="timeout"):
            Client("/x", timeout=timeout)


def _line_of_next_statement() -> int:
    import sys

    return sys._getframe(1).f_lineno + 1


def test_a_refusal_sent_before_the_hello_was_read_is_still_a_refusal(socket_path: Path) -> None:
    # A daemon (an older one) that answers and closes without reading the hello:
    # the client must report the refusal, never an unreachable daemon.
    refusal = encode_frame(Error(code=ErrorCode.LIMIT_EXCEEDED, message="over the limit"))
    hasty = socket.socket(socket.AF_UNIX)
    hasty.bind(str(socket_path))
    hasty.listen()
    hasty.settimeout(PATIENCE)
    rounds = 50

    def serve() -> None:
        for _ in range(rounds):
            conn, _ = hasty.accept()
            with conn:
                conn.sendall(refusal)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    codes = []
    try:
        for _ in range(rounds):
            with Client(socket_path, timeout=PATIENCE) as client:
                try:
                    client.ping()
                except WatchdogdError as exc:
                    codes.append(getattr(exc, "code", repr(exc)))
    finally:
        server.join(timeout=PATIENCE)
        hasty.close()
    assert codes == [ErrorCode.LIMIT_EXCEEDED] * rounds


def test_a_frame_over_the_bound_is_refused_not_unreachable(client: Client) -> None:
    # The daemon refuses after the header and closes with the rest unread, so the
    # client's send fails part way; the refusal it sent is still what the client sees.
    client.ping()
    with pytest.raises(RequestRefused) as caught:
        client.acquire("x" * (4 * 1024 * 1024), 5)
    assert caught.value.code == ErrorCode.FRAME_TOO_LARGE
    client.ping()  # a new connection serves the next request


def test_a_client_sent_to_another_process_judges_its_socket_as_found_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # multiprocessing's spawn pickles it: a path the client found stays one it found,
    # never one the caller named, which would be trusted as named.
    monkeypatch.delenv("WATCHDOGD_SOCKET", raising=False)
    client = Client()
    assert client.place == Place(SYSTEM_SOCKET, "host")
    assert pickle.loads(pickle.dumps(client)).place == client.place


def test_a_client_can_read_any_reply_a_daemon_sends() -> None:
    assert MAX_REPLY_FRAME >= MAX_REPLY_BYTES
    with pytest.raises(ValueError, match="max_reply must be at least"):
        Client("/nowhere", max_reply=MAX_REPLY_BYTES - 1)


# A worker of uid 4321 without XDG_RUNTIME_DIR nor WATCHDOGD_SOCKET finds the socket
# at /tmp/watchdogd-4321 by itself; uid 65534 made that directory first and listens
# there, answering every acquire. The block `with expires(after=AFTER): sleep(HUNG)`.


def hung_block(on_unavailable: OnUnavailable) -> None:
    with Client(on_unavailable=on_unavailable).expires(after=AFTER):
        time.sleep(HUNG)


def against_an_impostor(on_unavailable: OnUnavailable) -> tuple[dict[str, Any], dict[str, Any]]:
    """The block run by the worker while uid 65534 listens at its path: how the
    worker ended, and what the impostor saw."""

    def scenario() -> Any:
        with fake_daemon_as(NOBODY, PER_USER, directory_mode=0o755) as impostor:
            return worker_of_other(lambda: hung_block(on_unavailable)), impostor()

    outcome, seen = in_private_mounts(scenario)
    return dict(outcome), dict(seen)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: other users, mounts")
def test_a_worker_never_sends_its_acquire_to_another_users_socket_at_its_own_path() -> None:
    outcome, seen = against_an_impostor("raise")
    assert outcome["raised"].startswith(IMPOSTOR), outcome
    assert outcome["owner"] == NOBODY
    assert outcome["status"] == 1
    assert outcome["seconds"] < AFTER  # told at once, not after an unprotected block
    assert seen["connections"] == 0  # not even a hello
    assert seen["hellos"] == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: other users, mounts")
def test_a_warning_worker_runs_unprotected_saying_whose_socket_it_refused() -> None:
    outcome, seen = against_an_impostor("warn")
    assert (outcome["status"], outcome["raised"]) == (0, None)
    [warning] = outcome["logged"]
    assert warning.startswith("running unprotected until the daemon answers again")
    assert IMPOSTOR in warning
    assert seen["connections"] == 0


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: other users, mounts")
def test_the_users_own_daemon_at_that_path_kills_the_hung_worker_on_time() -> None:
    def scenario() -> Any:
        with daemon_of_other():
            return worker_of_other(lambda: hung_block("raise"))

    outcome = in_private_mounts(scenario)
    assert outcome["status"] == -signal.SIGKILL, outcome
    assert AFTER <= outcome["seconds"] < HUNG


#: Values of ``after`` that are no timeout: what each should raise.
BAD_AFTER = [
    (-1, ValueError),
    (0, ValueError),
    (math.nan, ValueError),
    (math.inf, ValueError),
    ("abc", TypeError),
    (None, TypeError),
    (True, TypeError),
]


class TestArguments:
    """Arguments are checked where they are written, before anything is sent, in
    every client, the one that does nothing included; a `NoOpTimer` checks no value."""

    @pytest.mark.parametrize(("after", "error"), BAD_AFTER)
    def test_a_bad_after_raises_naming_it_in_every_client(
        self, daemon: RunningDaemon, after: object, error: type[Exception], tmp_path: Path
    ) -> None:
        clients = [
            NullClient(),
            Client(tmp_path / "none.sock", on_unavailable="warn"),
            daemon.client(),
        ]
        for client in clients:
            with pytest.raises(error, match=r"^after must be"):
                client.expires(after)  # type: ignore[arg-type]
            with pytest.raises(error, match=r"^timeout must be"):
                client.acquire("s", after)  # type: ignore[arg-type]
        with pytest.raises(error, match=r"^after must be"):
            watchdogd_client.expires(after, client=NullClient())  # type: ignore[arg-type]

        async def in_trio() -> None:
            async with open_client(str(daemon.socket_path)) as client:
                with pytest.raises(error, match=r"^after must be"):
                    client.expires(after)  # type: ignore[arg-type]
                with pytest.raises(error, match=r"^timeout must be"):
                    await client.acquire("s", after)  # type: ignore[arg-type]

        trio.run(in_trio)

    @pytest.mark.parametrize(
        ("arguments", "error", "says"),
        [
            ({"scope": ""}, ValueError, "scope must not be empty"),
            ({"scope": 3}, TypeError, "scope must be a string"),
            ({"pid": 0}, ValueError, "pid must be at least 1"),
            ({"pid": True}, TypeError, "pid must be an int"),
            ({"progress": -1}, ValueError, "progress must be at least 0"),
            ({"policy": 5}, TypeError, "policy must be a non-empty string"),
            ({"rank": -2}, ValueError, "rank must be at least 0"),
            ({"floor": -1}, ValueError, "floor must be a finite number of seconds, 0 or more"),
            ({"ceiling": 0}, ValueError, "ceiling must be a positive, finite number"),
        ],
    )
    def test_every_argument_of_acquire_is_checked(
        self, daemon: RunningDaemon, arguments: dict[str, Any], error: type[Exception], says: str
    ) -> None:
        arguments = {"scope": "s", **arguments}
        scope = arguments.pop("scope")
        for client in (NullClient(), daemon.client()):
            with pytest.raises(error, match=says):
                client.acquire(scope, 5, **arguments)

        async def in_trio() -> None:
            async with open_client(str(daemon.socket_path)) as client:
                with pytest.raises(error, match=says):
                    await client.acquire(scope, 5, **arguments)

        trio.run(in_trio)

    def test_a_timeout_over_the_daemons_maximum_says_it_in_days(
        self, daemon: RunningDaemon
    ) -> None:
        with daemon.client() as client:
            # Refused by the daemon, before the client knows its maximum...
            with pytest.raises(RequestRefused, match="at most 30 days here"):
                client.acquire("s", 40 * 86400)
            # ...and by the client itself, once its handshake told it.
            with pytest.raises(ValueError, match=r"^after is 40 days; the daemon arms at most 30"):
                client.expires(40 * 86400)

    def test_a_no_op_timer_checks_no_value(self) -> None:
        with NoOpTimer().expires("whatever"):  # type: ignore[arg-type]
            pass
        assert NoOpTimer().acquire("", -1) == -1
