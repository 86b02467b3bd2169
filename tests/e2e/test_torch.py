"""torch.distributed.elastic.timer with watchdogd as its server: our own versions of
the meaningful cases of torch's timer tests, run through the adapter against a real
daemon, with assertions that fail when the feature breaks."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.multiprocessing as torch_mp  # noqa: E402
from torch.distributed.elastic import timer  # noqa: E402

from watchdogd_client import Client, DaemonUnavailable, NoOpTimer, configure  # noqa: E402
from watchdogd_client.torch import TimerServerUnavailable, WatchdogdTimerClient  # noqa: E402

from helpers import torch_workers  # noqa: E402
from helpers.daemon import RunningDaemon  # noqa: E402
from helpers.metrics import samples  # noqa: E402
from helpers.processes import (  # noqa: E402
    reap,
    released_while_frozen,
    sleeper,
)
from helpers.waiting import PATIENCE, TORCH_PATIENCE, wait_until  # noqa: E402


@pytest.fixture
def env_socket(daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningDaemon]:
    """Workers find the daemon through $WATCHDOGD_SOCKET, as deployed workers do."""
    monkeypatch.setenv("WATCHDOGD_SOCKET", str(daemon.socket_path))
    configure(None)
    yield daemon
    configure(None)
    timer.configure(None)


def exit_recorded(client: Client, pid: int | None) -> bool:
    return any(e.kind == "exited" and e.pid == pid for e in client.events().events)


def fork_context() -> multiprocessing.context.ForkContext:
    return multiprocessing.get_context("fork")


def test_torch_imports_without_a_warning() -> None:
    """The test tools include what torch needs to import quietly (numpy)."""
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import torch"],
        capture_output=True,
        text=True,
        check=False,
        timeout=TORCH_PATIENCE,
    )
    assert (result.returncode, result.stderr) == (0, "")


def test_the_adapter_is_a_torch_timer_client() -> None:
    from torch.distributed.elastic.timer.api import TimerClient

    adapter = WatchdogdTimerClient(policy="term")
    assert isinstance(adapter, TimerClient)
    assert pickle.loads(pickle.dumps(adapter)).policy == "term"  # spawn can send it


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, watchdogd_client; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_absolute_expiration_becomes_a_relative_timeout(env_socket: RunningDaemon) -> None:
    with Client(env_socket.socket_path) as client:
        adapter = WatchdogdTimerClient(client)
        adapter.acquire("absolute", time.time() + 30)
        [armed] = client.status().timers
        assert armed.scope == "absolute"
        assert 29 < armed.remaining <= 30
        long_scope = "/" + "deep/" * 100 + "train.py#12"
        adapter.acquire(long_scope, time.time() + 30)
        assert len(client.status().timers) == 2
        adapter.release(long_scope)  # the same shortening both ways
        adapter.release("absolute")
        adapter.release("never-acquired")  # torch: releasing an unknown scope is fine
        assert client.status().timers == []


def test_a_past_expiration_fires_at_once(env_socket: RunningDaemon) -> None:
    process = fork_context().Process(target=_arm_in_the_past)
    process.start()
    process.join(PATIENCE)
    assert process.exitcode == -signal.SIGKILL


def _arm_in_the_past() -> None:
    WatchdogdTimerClient().acquire("late", time.time() - 60)
    time.sleep(30)


def test_happy_path(env_socket: RunningDaemon) -> None:
    timer.configure(WatchdogdTimerClient())
    with env_socket.client() as client:
        # The block is the test process's own: a timeout a loaded machine could
        # outlast would have the daemon kill the test run.
        with timer.expires(after=60, scope="happy"):
            [armed] = client.status().timers
            assert (armed.pid, armed.scope) == (os.getpid(), "happy")
            time.sleep(0.1)
        # The release is sent as the block ends, on the adapter's own connection.
        wait_until(lambda: client.status().timers == [], what="the block's release")


#: A torch worker with one block through the adapter: once its responder is
#: connected it says "ready", waits for a line on stdin inside its block, and says
#: how long the block's exit took.
FROZEN_EXIT = """
import sys, time
import torch.distributed.elastic.timer as timer
from watchdogd_client import Client
from watchdogd_client.paths import client_socket_path
from watchdogd_client.responder import process_responder
from watchdogd_client.torch import WatchdogdTimerClient
timer.configure(WatchdogdTimerClient(Client(timeout=5.0)))
with timer.expires(after=60, scope="frozen"):
    while not process_responder().carries(client_socket_path()):
        time.sleep(0.005)
    print("ready", flush=True)
    sys.stdin.readline()
    ended = time.monotonic()
print(time.monotonic() - ended, flush=True)
time.sleep(600)
"""


def test_a_torch_blocks_exit_does_not_wait_for_the_daemon(env_socket: RunningDaemon) -> None:
    """Its release is sent, and its answer read with the next request's: a daemon
    that answers nothing for a while (frozen here) costs the block's exit nothing,
    and the release lands once it runs again."""
    [took] = released_while_frozen(env_socket, FROZEN_EXIT, 1)
    # A release that waited would wait out the client's 5 s timeout and raise.
    assert took < 2.0


def test_a_default_scope_is_the_users_call_site_for_acquire_and_release(
    env_socket: RunningDaemon,
) -> None:
    """torch names a timer without a scope after contextlib's frame; the adapter
    names it after the user's `with` line, so nested blocks are two timers, and
    each release ends its own."""
    timer.configure(WatchdogdTimerClient())
    here = __file__
    with env_socket.client() as client:

        def scopes() -> set[str]:
            return {armed.scope for armed in client.status().timers if armed.pid == os.getpid()}

        outer_line = sys._getframe().f_lineno + 1
        with timer.expires(after=30):
            assert scopes() == {f"{here}:{outer_line}"}
            with timer.expires(after=30):
                inner = f"{here}:{outer_line + 2}"
                assert scopes() == {f"{here}:{outer_line}", inner}
            assert scopes() == {f"{here}:{outer_line}"}
        assert scopes() == set()
        with pytest.raises(KeyError), timer.expires(after=30):
            raise KeyError("released all the same")
        assert scopes() == set()


def test_exceptions_propagate_unchanged_and_release(env_socket: RunningDaemon) -> None:
    timer.configure(WatchdogdTimerClient())
    with pytest.raises(ValueError, match=r"^foobar$"), timer.expires(after=1):
        raise ValueError("foobar")
    with env_socket.client() as client:
        assert client.status().timers == []


def test_an_explicit_client_is_used_for_acquire_and_release(env_socket: RunningDaemon) -> None:
    timer.configure(None)
    with env_socket.client() as client:
        with timer.expires(after=1, scope="test", client=WatchdogdTimerClient(client)):
            [armed] = client.status().timers
            assert armed.scope == "test"
            assert 0.5 < armed.remaining <= 1
        assert client.status().timers == []


def test_a_no_op_timer_stands_where_torch_takes_a_timer_client(env_socket: RunningDaemon) -> None:
    timer.configure(NoOpTimer())
    with env_socket.client() as client:
        with timer.expires(after=30):
            assert client.status().timers == []
        with timer.expires(after=30, scope="explicit", client=NoOpTimer()):
            assert client.status().timers == []


def test_a_spawned_worker_that_hangs_is_killed(env_socket: RunningDaemon) -> None:
    process = multiprocessing.get_context("spawn").Process(target=torch_workers.hang)
    started = time.monotonic()
    process.start()
    process.join(TORCH_PATIENCE)  # a new interpreter imports torch
    assert process.exitcode == -signal.SIGKILL
    assert time.monotonic() - started > 1  # not before its timer


def test_recursive_use_of_one_scope(env_socket: RunningDaemon) -> None:
    context = fork_context()
    survivor = context.Process(target=torch_workers.nested, args=(4,))
    stuck = context.Process(target=torch_workers.nested_and_stuck, args=(2,))
    for process in (survivor, stuck):
        process.start()
    for process in (survivor, stuck):
        process.join(PATIENCE)
    assert survivor.exitcode == 0
    assert stuck.exitcode == -signal.SIGKILL


def test_many_clients_with_nested_scopes_lose_no_request(
    env_socket: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every arm and release over the socket: the fast path would store most of them.
    monkeypatch.setenv("WATCHDOGD_FAST", "0")
    context = fork_context()
    processes = [context.Process(target=torch_workers.many_requests, args=(10,)) for _ in range(10)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(PATIENCE)
    assert [process.exitcode for process in processes] == [0] * 10
    with env_socket.client() as client:
        assert client.status().timers == []
        text = client.metrics()
    requests = {
        (labels["op"], labels["result"]): value
        for labels, value in samples(text, "watchdogd_requests_total")
    }
    # torch's expires() nests: each level re-arms the shared scope, each release
    # after the innermost finds nothing. Every one of the 200 requests arrived.
    assert requests[("acquire", "ok")] == 100
    assert requests[("release", "ok")] == 100


def test_a_worker_that_exits_before_release_leaves_nothing_armed(env_socket: RunningDaemon) -> None:
    process = fork_context().Process(target=_acquire_and_exit)
    process.start()
    process.join(PATIENCE)
    assert process.exitcode == 0
    with env_socket.client() as client:
        wait_until(lambda: exit_recorded(client, process.pid), what="the exit to be recorded")
        assert client.status().timers == []
        time.sleep(1.5)  # past the deadline
        assert not [e for e in client.events().events if e.kind == "expired"]


def _acquire_and_exit() -> None:
    WatchdogdTimerClient().acquire("test_scope", time.time() + 1)
    time.sleep(0.2)


@pytest.mark.skipif(
    os.getuid() != 0 or not Path("/proc/sys/kernel/ns_last_pid").exists(),
    reason="needs root to choose the next pid",
)
def test_a_process_that_inherits_the_pid_of_an_exited_worker_lives(
    env_socket: RunningDaemon,
) -> None:
    worker = fork_context().Process(target=_acquire_and_exit)
    worker.start()
    worker.join(PATIENCE)
    assert worker.pid is not None
    # Hand the worker's pid to a new process before its deadline passes.
    heir = None
    for _ in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(worker.pid - 1))
        candidate = sleeper()
        if candidate.pid == worker.pid:
            heir = candidate
            break
        reap(candidate)
    if heir is None:
        pytest.skip("another process kept taking the pid")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            heir.wait(timeout=2.0)  # the worker's deadline passed meanwhile
    finally:
        reap(heir)


def test_an_expiry_clears_every_scope_of_the_killed_process(env_socket: RunningDaemon) -> None:
    process = fork_context().Process(target=_two_scopes_then_hang)
    process.start()
    process.join(PATIENCE)
    assert process.exitcode == -signal.SIGKILL
    with env_socket.client() as client:
        wait_until(lambda: exit_recorded(client, process.pid), what="the other scope to be dropped")
        assert client.status().timers == []
        [exited] = [e for e in client.events().events if e.kind == "exited"]
        assert exited.timers == 1
        assert exited.scopes == ["long"]


def _two_scopes_then_hang() -> None:
    adapter = WatchdogdTimerClient()
    adapter.acquire("long", time.time() + 60)
    timer.configure(adapter)
    with timer.expires(after=0.2, scope="short"):
        time.sleep(30)


def test_six_torch_processes_even_ranks_hang(env_socket: RunningDaemon) -> None:
    # Forked, as torch's start_processes can: six spawned interpreters would each
    # import torch again, seconds of CPU apiece, for what this test asks of them.
    context = torch_mp.start_processes(
        torch_workers.hang_on_even_ranks, nprocs=6, join=False, start_method="fork"
    )
    for process in context.processes:
        process.join(TORCH_PATIENCE)
    assert [process.exitcode for process in context.processes] == [-9, 0, -9, 0, -9, 0]


def test_forked_workers_use_the_parents_configuration(env_socket: RunningDaemon) -> None:
    timer.configure(WatchdogdTimerClient())
    with env_socket.client() as client:
        client.ping()
        context = fork_context()
        hung = context.Process(target=_hang_with_configured_timer)
        fine = context.Process(target=_finish_with_configured_timer)
        for process in (hung, fine):
            process.start()
        for process in (hung, fine):
            process.join(PATIENCE)
        assert (hung.exitcode, fine.exitcode) == (-signal.SIGKILL, 0)
        assert client.status().timers == []


def _hang_with_configured_timer() -> None:
    with timer.expires(after=0.3):
        time.sleep(30)


def _finish_with_configured_timer() -> None:
    with timer.expires(after=5):
        time.sleep(0.1)


def test_no_daemon_raises_what_torchs_own_clients_raise(tmp_path: Path) -> None:
    adapter = WatchdogdTimerClient(Client(tmp_path / "absent.sock"))
    with pytest.raises(BrokenPipeError) as caught:
        adapter.acquire("s", time.time() + 5)
    assert isinstance(caught.value, DaemonUnavailable)
    assert isinstance(caught.value, TimerServerUnavailable)
    assert caught.value.socket_path == str(tmp_path / "absent.sock")
    assert "watchdogd is not reachable" in str(caught.value)
    with pytest.raises(BrokenPipeError):
        adapter.release("s")


def test_a_failed_release_never_replaces_the_blocks_exception(
    short_lived_daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = short_lived_daemon
    client = daemon.client(reconnect_timeout=0.2)
    adapter = WatchdogdTimerClient(client)
    with (  # noqa: PT012
        pytest.raises(ValueError, match=r"^the real problem$") as caught,
        timer.expires(after=30, scope="s", client=adapter),
    ):
        daemon.stop()
        raise ValueError("the real problem")
    assert caught.value.__context__ is None
    assert "could not release timer 's'" in caplog.text
    client.close()
    daemon.start()  # the fixture stops it again


def test_a_failed_release_after_a_good_block_raises(short_lived_daemon: RunningDaemon) -> None:
    daemon = short_lived_daemon
    client = daemon.client(reconnect_timeout=0.2)
    with (
        pytest.raises(BrokenPipeError),
        timer.expires(after=30, scope="s", client=WatchdogdTimerClient(client)),
    ):
        daemon.stop()
    client.close()
    daemon.start()


@pytest.mark.parametrize(
    ("signum", "policy"),
    [
        (signal.SIGKILL, "kill"),
        (signal.SIGTERM, "signal:SIGTERM"),
        (signal.SIGUSR1, "signal:SIGUSR1"),
        (9, "kill"),
    ],
)
def test_torchs_signal_option_chooses_the_policy_that_sends_it(signum: int, policy: str) -> None:
    assert WatchdogdTimerClient(signal=signum).policy == policy


def test_what_is_no_signal_is_refused() -> None:
    with pytest.raises(ValueError, match="not a signal number"):
        WatchdogdTimerClient(signal=999)
    with pytest.raises(ValueError, match="not both"):
        WatchdogdTimerClient(policy="term", signal=signal.SIGTERM)


def test_a_signal_policy_is_what_the_timer_runs(env_socket: RunningDaemon) -> None:
    with env_socket.client() as client:
        adapter = WatchdogdTimerClient(client, signal=signal.SIGTERM)
        adapter.acquire("graceful", time.time() + 30)
        [armed] = client.status().timers
        assert armed.policy == "signal:SIGTERM"
        adapter.release("graceful")


def test_a_signal_policy_sends_that_signal_once(env_socket: RunningDaemon) -> None:
    victim = subprocess.Popen(
        [sys.executable, "-c", "import signal, time\n"
         "signal.signal(signal.SIGUSR1, lambda *a: print('usr1', flush=True))\n"
         "print('ready', flush=True)\ntime.sleep(3)"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert victim.stdout is not None
        assert victim.stdout.readline() == "ready\n"
        with env_socket.client() as client:
            client.acquire("usr1", 0.1, policy="signal:SIGUSR1", pid=victim.pid)
        assert victim.stdout.readline() == "usr1\n"
        assert victim.wait(timeout=10) == 0  # sent once, then left alone
    finally:
        reap(victim)


def test_without_torch_the_import_error_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "try:\n"
        "    import watchdogd_client.torch\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("ImportError watchdogd_client.torch needs torch")
    assert "pip install './client[torch]'" in result.stdout
