"""The whole path a user walks: workers arm timers through the module-level
``expires()`` and the daemon kills the hung ones, on time, and only those."""

from __future__ import annotations

import signal
import subprocess
import time

from helpers.daemon import RunningDaemon
from helpers.processes import python_worker, reap, wait_ready
from helpers.waiting import PATIENCE, wait_until


def finish(worker: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = worker.communicate(timeout=PATIENCE)
    return worker.returncode, err


def test_a_hung_worker_dies_by_sigkill_about_one_second_after_arming(daemon: RunningDaemon) -> None:
    worker = python_worker(
        """
        import time
        from watchdogd_client import expires
        began = time.monotonic()
        with expires(after=1.0):
            print("ready", flush=True)
            print(began, flush=True)
            time.sleep(30)
        """,
        socket=daemon.socket_path,
    )
    try:
        wait_ready(worker)
        assert worker.stdout is not None
        # Its deadline is a second after the daemon read the arm, itself after this:
        # the time the test reads the line may come later than either.
        began = float(worker.stdout.readline())
        status, _ = finish(worker)
        lived = time.monotonic() - began
    finally:
        reap(worker)
    assert status == -signal.SIGKILL
    assert 0.9 < lived < 3.0
    wait_until(lambda: "event=expired" in daemon.log(), what="the expiry's log line")
    assert "policy=kill" in daemon.log()


def test_workers_that_release_raise_or_renew_live_on(daemon: RunningDaemon) -> None:
    programs = {
        "release twice": """
            import time
            from watchdogd_client import expires
            with expires(after=0.5) as timer:
                timer.release()
                timer.release()
                time.sleep(1.5)  # unprotected, and not killed
            print("ready", flush=True)
        """,
        "exception": """
            import time
            from watchdogd_client import expires
            try:
                with expires(after=0.5):
                    raise ValueError("leaves the block")
            except ValueError:
                pass
            time.sleep(1.5)
            print("ready", flush=True)
        """,
        "renew": """
            import time
            from watchdogd_client import expires
            with expires(after=0.5) as timer:
                for _ in range(15):  # 1.5 s of work in 0.1 s steps
                    time.sleep(0.1)
                    timer.renew()
            print("ready", flush=True)
        """,
    }
    workers = {
        name: python_worker(source, socket=daemon.socket_path) for name, source in programs.items()
    }
    try:
        results = {name: finish(worker) for name, worker in workers.items()}
    finally:
        for worker in workers.values():
            reap(worker)
    assert {name: status for name, (status, _) in results.items()} == dict.fromkeys(programs, 0), (
        results
    )
    with daemon.client() as client:
        assert client.status().daemon.expired == 0


def test_many_workers_with_several_scopes_keep_their_timers_apart(daemon: RunningDaemon) -> None:
    source = """
        import sys, time
        from watchdogd_client import default_client
        client = default_client()
        for scope in ("load", "step", "save"):
            client.acquire(scope, 60)
        if int(sys.argv[1]) % 2 == 0:
            client.acquire("step", 0.5)  # this one will hang in "step"
            print("ready", flush=True)
            time.sleep(30)
        client.release("step")
        print("ready", flush=True)
        sys.stdin.readline()
    """
    workers = [python_worker(source, str(rank), socket=daemon.socket_path) for rank in range(6)]
    try:
        for worker in workers:
            wait_ready(worker)
        for worker in workers[::2]:
            assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        assert all(worker.poll() is None for worker in workers[1::2])
        with daemon.client() as client:
            deadline = time.monotonic() + PATIENCE
            while True:
                armed = sorted((t.pid, t.scope) for t in client.status().timers)
                expected = sorted(
                    (w.pid, scope) for w in workers[1::2] for scope in ("load", "save")
                )
                # An expiry is counted once its outcome is known: the daemon sees
                # the SIGKILLed worker exit a moment after this test does.
                expired = client.status().daemon.expired
                if (armed, expired) == (expected, 3) or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert armed == expected
            assert expired == 3
        for worker in workers[1::2]:
            worker.communicate("done\n", timeout=PATIENCE)
            assert worker.returncode == 0
    finally:
        for worker in workers:
            reap(worker)
