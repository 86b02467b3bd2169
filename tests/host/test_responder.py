"""The responder, against a daemon the test plays on a real Unix socket and real
worker processes: what it registers, the stacks it answers with, whom it answers,
how it lives through a daemon's restart, a fork, a daemon of protocol 1, and a
process too large for one frame."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from watchdogd_protocol import (
    MAX_EVIDENCE_BYTES,
    PROTOCOL_VERSION,
    Evidence,
    ThreadStack,
    decode_request,
)

from helpers.fake_daemon import FakeDaemon, fake_daemon_of_nobody
from helpers.processes import python_worker, reap, wait_ready
from helpers.waiting import PATIENCE, wait_until

#: A worker with a second thread, "loader", waiting in load_forever, that arms one
#: timer and then waits in wait_in_main until its stdin closes.
WAITING = """
    import sys, threading
    from watchdogd_client import Client

    def load_forever():
        threading.Event().wait()

    threading.Thread(target=load_forever, name="loader", daemon=True).start()
    Client().acquire("step", 600)

    def wait_in_main():
        print("ready", flush=True)
        sys.stdin.read()

    wait_in_main()
"""


@pytest.fixture
def fake(socket_path: Path) -> Iterator[FakeDaemon]:
    with FakeDaemon(socket_path) as daemon:
        yield daemon


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    """The test's workers, each in a session of its own: at the test's end its
    whole group is killed (what it forked too), then it is reaped."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for worker in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        reap(worker)


def start(
    workers: list[subprocess.Popen[str]],
    source: str,
    socket: Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    worker = python_worker(source, socket=socket, env=env, new_session=True)
    workers.append(worker)
    wait_ready(worker)
    return worker


def functions(thread: ThreadStack) -> list[str]:
    return [frame.function for frame in thread.frames]


def checked(evidence: Evidence) -> Evidence:
    """``evidence`` as the daemon would take it: within its bound and valid."""
    body = msgspec.msgpack.encode(evidence)
    assert len(body) <= MAX_EVIDENCE_BYTES
    assert decode_request(body) == evidence
    return evidence


def test_the_first_timer_registers_the_job_and_ranks_from_the_environment(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    env = {"WATCHDOGD_JOB": "run-7", "WATCHDOGD_RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "0"}
    worker = start(workers, WAITING, fake.path, env)
    line = fake.next_responder()
    assert line.pid == worker.pid
    assert line.hello.version == PROTOCOL_VERSION
    assert line.hello.client.startswith("python-responder/")
    assert (line.respond.job, line.respond.rank) == ("run-7", 3)
    assert (line.respond.local_rank, line.respond.group_rank) == (1, 0)


def test_the_evidence_is_every_threads_stack_with_the_main_thread_marked(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    start(workers, WAITING, fake.path)
    evidence = checked(fake.next_responder().ask(17, incident="host-1"))
    main, *others = evidence.threads
    assert main.main
    assert main.name == "MainThread"
    assert functions(main)[0] == "wait_in_main"  # innermost first: where it waits
    assert functions(main)[-1] == "<module>"
    [loader] = others  # the responder's own thread is not evidence
    assert loader.name == "loader"
    assert not loader.main
    assert "load_forever" in functions(loader)
    assert loader.frames[0].file.endswith("threading.py")
    assert evidence.flight is None  # no torch in this process
    assert evidence.note == ""


def test_a_process_stuck_in_a_function_names_that_function(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    start(
        workers,
        """
        from watchdogd_client import expires

        def read_shard():
            print("ready", flush=True)
            while True:  # spinning, holding the GIL but for the interpreter's switches
                pass

        with expires(after=600):
            read_shard()
        """,
        fake.path,
    )
    [main] = fake.next_responder().ask(1).threads
    assert main.main
    assert functions(main) == ["read_shard", "<module>"]
    assert main.frames[0].file == "<string>"
    assert 4 < main.frames[0].line < 8  # read_shard's body


def test_the_first_acquire_does_not_wait_for_the_responder(
    socket_path: Path, workers: list[subprocess.Popen[str]]
) -> None:
    with FakeDaemon(socket_path, stall_responders=True) as fake:
        start(workers, WAITING, fake.path)  # ready: its acquire was answered
        wait_until(
            lambda: any(hello.client.startswith("python-responder") for hello in fake.hellos),
            what="the responder's hello",
        )
        assert fake.respond_count == 0  # its hello is still unanswered


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to listen as uid 65534")
def test_a_daemon_listening_as_another_user_gets_nothing_from_the_responder(
    socket_path: Path, workers: list[subprocess.Popen[str]]
) -> None:
    def twice_refused(daemon: FakeDaemon) -> bool:
        # The responder's first attempt and the one after a pause; and the worker's
        # own acquire answered (a busy machine may run both attempts first).
        return daemon.silent >= 2 and daemon.acquired >= 1

    with fake_daemon_of_nobody(socket_path, twice_refused) as report:
        worker = start(workers, WAITING, socket_path)
        seen = report()
    assert seen["silent"] >= 2
    assert seen["responds"] == 0
    # The worker's own client spoke to it; its responder never said hello.
    assert not any(client.startswith("python-responder") for client in seen["hellos"])
    worker.kill()
    _, stderr = worker.communicate()
    assert "the process listening on it runs as uid 65534 (nobody), not root" in stderr


#: A worker that arms one timer with a client that warns when it may not reach the
#: daemon, and is ready once its responder said it does not answer either.
REFUSED = """
    import logging, sys, threading
    from watchdogd_client import Client

    said = threading.Event()

    class Heard(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("the responder does not answer"):
                said.set()

    logging.basicConfig()  # on stderr, as any program would log
    logging.getLogger("watchdogd_client").addHandler(Heard())
    Client(on_unavailable="warn").acquire("step", 600)
    assert said.wait(10), "the responder said nothing"
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_a_named_socket_others_may_replace_gets_no_connection_from_the_responder(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    os.chmod(fake.path.parent, 0o777)
    worker = start(workers, REFUSED, fake.path)
    worker.kill()
    _, stderr = worker.communicate()
    assert fake.seen()["connections"] == 0  # neither the client nor the responder
    untrusted = f"watchdogd's socket {fake.path}, owned by uid 0 (root), is not trusted"
    assert (
        f"running unprotected until the daemon answers again (further failures are "
        f"logged at debug level): {untrusted}" in stderr
    )
    assert f"the responder does not answer: {untrusted}" in stderr


def test_the_responder_registers_again_when_the_daemon_closes_its_connection(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    worker = start(workers, WAITING, fake.path, {"WATCHDOGD_JOB": "run-8"})
    first = fake.next_responder()
    assert first.ask(1).threads
    first.close()
    again = fake.next_responder()
    assert (again.pid, again.respond.job) == (worker.pid, "run-8")
    assert functions(again.ask(2).threads[0])[0] == "wait_in_main"


def test_a_forked_child_answers_for_itself_on_a_connection_of_its_own(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    worker = start(
        workers,
        """
        import json, os, sys, threading, time
        from watchdogd_client import Client

        client = Client()
        client.acquire("parent", 600)
        print("ready", flush=True)
        sys.stdin.readline()  # the test saw the parent's responder
        child = os.fork()
        if child == 0:
            # The child never runs on into the parent's code: there its kill of
            # "child", 0 here, would be kill(0), every process of the group.
            try:
                threads = [thread.name for thread in threading.enumerate()]
                client.acquire("child", 600)

                def child_waits():
                    print(json.dumps({"child": os.getpid(), "threads": threads}), flush=True)
                    time.sleep(600)

                child_waits()
            finally:
                os._exit(0)

        def parent_waits():
            print(json.dumps({"forked": child}), flush=True)
            sys.stdin.read()

        try:
            parent_waits()
        finally:
            os.kill(child, 9)
        """,
        fake.path,
    )
    parent = fake.next_responder()
    assert parent.pid == worker.pid
    assert worker.stdin is not None
    assert worker.stdout is not None
    worker.stdin.write("fork\n")
    worker.stdin.flush()
    said: dict[str, Any] = {}
    for _ in range(2):
        said.update(json.loads(worker.stdout.readline()))
    assert said["child"] == said["forked"] != worker.pid
    assert "watchdogd-responder" not in said["threads"]  # the parent's stayed behind
    child = fake.next_responder()
    assert child.pid == said["child"]
    assert functions(child.ask(1).threads[0])[0] == "child_waits"
    # The parent's connection outlived the child's copy of it.
    assert functions(parent.ask(2).threads[0])[0] == "parent_waits"


def test_evidence_too_large_for_a_frame_is_cut_and_says_so(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    start(
        workers,
        """
        import sys, threading
        from watchdogd_client import Client

        def deep(depth, event):
            return deep(depth - 1, event) if depth else event.wait()

        event = threading.Event()
        for n in range(200):
            threading.Thread(target=deep, args=(70, event), name=f"worker-{n}").start()
        Client().acquire("step", 600)

        def wait_in_main():
            print("ready", flush=True)
            sys.stdin.read()

        try:
            wait_in_main()
        finally:
            event.set()
        """,
        fake.path,
    )
    evidence = checked(fake.next_responder().ask(5))
    main = evidence.threads[0]
    assert main.main
    assert functions(main)[0] == "wait_in_main"
    assert "64 of 201 threads taken" in evidence.note
    assert "cut to their innermost 64 frames" in evidence.note
    assert "cut to fit" in evidence.note
    assert any(not thread.frames for thread in evidence.threads[1:])


def test_at_a_daemon_of_protocol_1_the_responder_stops_and_the_client_works(
    socket_path: Path, workers: list[subprocess.Popen[str]]
) -> None:
    with FakeDaemon(socket_path, versions=(1, 1)) as fake:
        worker = start(
            workers,
            """
            import time
            from watchdogd_client import Client
            from watchdogd_client.responder import process_responder

            client = Client()
            assert client.acquire("step", 600) == 600
            responder = process_responder()
            deadline = time.monotonic() + 10
            while responder.running and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.release("step")
            print("ready", flush=True)
            print("stopped" if not responder.running else "still running", flush=True)
            """,
            fake.path,
        )
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "stopped"
    versions = [(hello.client.split("/")[0], hello.version) for hello in fake.hellos]
    assert sorted(versions) == [("python", 1), ("python", 2), ("python-responder", 2)]
    assert fake.respond_count == 0


#: A worker that arms through a Client of the keywords in its argument (JSON) and says
#: whether it has a responder.
ARMS_AND_TELLS = """
    import json, sys, threading
    from watchdogd_client import Client
    from watchdogd_client.responder import process_responder

    client = Client(**json.loads(sys.argv[1]))
    client.acquire("step", 600)
    client.ping()
    threads = [thread.name for thread in threading.enumerate()]
    print(json.dumps({"responder": process_responder() is not None, "threads": threads}))
"""


@pytest.mark.parametrize(
    ("keywords", "env"),
    [({"responder": False}, {}), ({}, {"WATCHDOGD_RESPONDER": "0"})],
    ids=["Client(responder=False)", "WATCHDOGD_RESPONDER=0"],
)
def test_a_process_may_do_without_one(
    fake: FakeDaemon, keywords: dict[str, bool], env: dict[str, str]
) -> None:
    worker = python_worker(ARMS_AND_TELLS, json.dumps(keywords), socket=fake.path, env=env)
    out, err = worker.communicate(timeout=PATIENCE)
    assert worker.returncode == 0, err
    assert json.loads(out) == {"responder": False, "threads": ["MainThread"]}
    assert [hello.client.split("/")[0] for hello in fake.hellos] == ["python"]


def test_a_client_that_declines_stops_the_responder_that_runs(
    fake: FakeDaemon, workers: list[subprocess.Popen[str]]
) -> None:
    worker = start(
        workers,
        """
        import sys, threading, time
        from watchdogd_client import Client

        Client().acquire("step", 600)
        print("ready", flush=True)
        sys.stdin.readline()
        Client(responder=False).acquire("other", 600)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(threading.enumerate()) > 1:
            time.sleep(0.01)
        print([thread.name for thread in threading.enumerate()], flush=True)
        sys.stdin.read()
        """,
        fake.path,
    )
    line = fake.next_responder()
    assert worker.stdin is not None
    assert worker.stdout is not None
    worker.stdin.write("decline\n")
    worker.stdin.flush()
    assert line.ended.wait(PATIENCE)
    assert worker.stdout.readline().strip() == "['MainThread']"


#: A process whose responder's send lock is held by another thread when it forks:
#: the child's at-fork hook must not wait for a lock no thread of the child holds.
FORK_WHILE_SENDING = """
import os, sys, threading, time
from watchdogd_client import responder
from watchdogd_client.arming import JobLabels
own = responder.Responder("/nonexistent/watchdogd.sock", JobLabels())
responder._ThisProcess.responder = own
held, done = threading.Event(), threading.Event()

def send():
    with own._send_lock:  # as the responder's thread holds it while it sends
        held.set()
        done.wait()

sender = threading.Thread(target=send)
sender.start()
held.wait()
child = os.fork()
if child == 0:
    os._exit(0)  # past the at-fork hooks
done.set()
sender.join()
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
        print("exited", flush=True)
        break
    time.sleep(0.01)
else:
    os.kill(child, 9)
    print("hung", flush=True)
"""


def test_a_fork_while_the_responder_sends_leaves_the_child_free(tmp_path: Path) -> None:
    """The parent's responder thread holds its send lock while it sends (its hello,
    its evidence); a fork then must not leave the child waiting for it forever."""
    worker = python_worker(FORK_WHILE_SENDING, socket=tmp_path / "none.sock")
    out, err = worker.communicate(timeout=PATIENCE)
    assert out.strip() == "exited", err
