"""Policies carried out by a real daemon on real workers: escalation, groups, trees,
hooks, dumps, faulthandler, simultaneous expiries, events, metrics and reloads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from watchdogd_client import Client
from watchdogd_protocol import (
    Acquire,
    Acquired,
    EventInfo,
    FrameReader,
    Hello,
    ReplyMessage,
    decode_reply,
    encode_frame,
)

from helpers.daemon import RunningDaemon, configured_daemon, ctl, ctl_command, expired_event
from helpers.hooks import RECORDING_DUMPER, most_at_once
from helpers.processes import gone, python_worker, reap, sleeper, wait_ready
from helpers.waiting import PATIENCE, wait_until

CONFIG = """
[daemon]
unkillable_after = 1.0
metrics_interval = 0.2

[policies.term_quick]
steps = [ {{ signal = "SIGTERM" }}, {{ wait = 1.0 }}, {{ signal = "SIGKILL" }} ]

[policies.long_wait]
steps = [ {{ signal = "SIGTERM" }}, {{ wait = 3 }}, {{ signal = "SIGKILL" }} ]

[policies.group_kill]
target = "group"
steps = [ {{ signal = "SIGKILL" }} ]

[policies.tree_kill]
target = "tree"
steps = [ {{ signal = "SIGKILL" }} ]

[policies.hook]
root_only = true
steps = [
    {{ exec = ["sh", "-c", 'env > "$0"; echo "arg=$1" >> "$0"', "{envfile}", "{{pid}}"] }},
    {{ signal = "SIGKILL" }},
]

[policies.hanging_hook]
steps = [ {{ exec = ["sleep", "300"], timeout = 0.5 }}, {{ signal = "SIGKILL" }} ]

[policies.dumpy]
root_only = true
steps = [ {{ dump = true, timeout = 30 }}, {{ signal = "SIGKILL" }} ]
"""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="wd-pol-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(workdir: Path) -> Iterator[RunningDaemon]:
    config = workdir / "watchdogd.toml"
    config.write_text(CONFIG.format(envfile=workdir / "hook-env.txt"))
    metrics = workdir / "watchdogd.prom"
    running = RunningDaemon(
        workdir / "watchdogd.sock",
        workdir / "watchdogd.log",
        ["--config", str(config), "--metrics-textfile", str(metrics)],
    )
    running.start()
    yield running
    assert running.stop() == 0, running.log()


def hang(policy: str, *, timeout: float = 0.3, before: str = "") -> str:
    """A worker that arms ``timeout`` with ``policy`` and hangs inside the block."""
    return f"""
        import os, signal, sys, time
        from watchdogd_client import expires
        {before}
        with expires(after={timeout}, policy={policy!r}, scope="hung"):
            print("ready", flush=True)
            time.sleep(30)
        """


def test_term_lets_a_worker_clean_up_and_exit_0(
    daemon: RunningDaemon, tmp_path: Path, client: Client
) -> None:
    marker = tmp_path / "cleaned"
    before = textwrap.dedent(
        f"""
        def cleanup(*_):
            open({str(marker)!r}, "w").write("cleaned")
            sys.exit(0)
        signal.signal(signal.SIGTERM, cleanup)
        """
    ).replace("\n", "\n        ")
    worker = python_worker(hang("term", before=before), socket=daemon.socket_path)
    try:
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == 0
    finally:
        reap(worker)
    assert marker.read_text() == "cleaned"
    event = expired_event(client, worker.pid)
    assert [(s.step, s.result) for s in event.steps] == [
        ("SIGTERM", "sent SIGTERM"),
        ("wait 10s", "exited"),
        ("SIGKILL", "skipped: target exited"),
    ]
    assert event.outcome == "exited"


def test_term_kills_a_worker_that_ignores_sigterm_after_the_wait(
    daemon: RunningDaemon, client: Client
) -> None:
    before = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    worker = python_worker(hang("term_quick", before=before), socket=daemon.socket_path)
    try:
        wait_ready(worker)
        armed = time.monotonic()
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        lived = time.monotonic() - armed
    finally:
        reap(worker)
    # 0.3 s to the deadline, then the configured 1 s wait, and not before.
    assert 1.25 < lived < 1.3 + PATIENCE
    event = expired_event(client, worker.pid)
    assert [s.result for s in event.steps] == [
        "sent SIGTERM",
        "still running after 1s",
        "sent SIGKILL",
    ]


def test_group_target_kills_the_whole_process_group(daemon: RunningDaemon) -> None:
    before = textwrap.dedent(
        """
        kids = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                time.sleep(300)
                os._exit(0)
            kids.append(pid)
        print(*kids, flush=True)
        """
    ).replace("\n", "\n        ")
    worker = python_worker(
        hang("group_kill", before=before), socket=daemon.socket_path, new_session=True
    )
    try:
        assert worker.stdout is not None
        kids = [int(pid) for pid in worker.stdout.readline().split()]
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        wait_until(lambda: all(gone(kid) for kid in kids), what="the worker's group to die")
    finally:
        reap(worker)


def test_tree_target_kills_a_descendant_that_called_setsid(daemon: RunningDaemon) -> None:
    before = textwrap.dedent(
        """
        kid = os.fork()
        if kid == 0:
            os.setsid()
            time.sleep(300)
            os._exit(0)
        print(kid, flush=True)
        """
    ).replace("\n", "\n        ")
    worker = python_worker(hang("tree_kill", before=before), socket=daemon.socket_path)
    try:
        assert worker.stdout is not None
        kid = int(worker.stdout.readline())
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        wait_until(lambda: gone(kid), what="the setsid() descendant to die")
    finally:
        reap(worker)


def test_exec_step_sees_the_documented_environment(
    daemon: RunningDaemon, workdir: Path, client: Client
) -> None:
    worker = python_worker(hang("hook"), socket=daemon.socket_path)
    try:
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
    finally:
        reap(worker)
    event = expired_event(client, worker.pid)
    assert [s.result for s in event.steps] == ["exit 0", "sent SIGKILL"]
    lines = (workdir / "hook-env.txt").read_text().splitlines()
    assert f"WATCHDOG_PID={worker.pid}" in lines
    assert "WATCHDOG_SCOPE=hung" in lines
    assert "WATCHDOG_POLICY=hook" in lines
    assert f"WATCHDOG_UID={os.getuid()}" in lines
    assert f"arg={worker.pid}" in lines  # {pid} as a whole argument


def test_a_hanging_hook_is_killed_at_its_limit_and_the_expiry_completes(
    daemon: RunningDaemon, client: Client
) -> None:
    worker = python_worker(hang("hanging_hook"), socket=daemon.socket_path)
    try:
        wait_ready(worker)
        armed = time.monotonic()
        assert worker.wait(timeout=PATIENCE) == -signal.SIGKILL
        assert time.monotonic() - armed > 0.75  # deadline 0.3 s + the hook's 0.5 s
    finally:
        reap(worker)
    event = expired_event(client, worker.pid)
    assert [s.result for s in event.steps] == ["killed after 0.5s", "sent SIGKILL"]


def test_log_records_the_expiry_and_leaves_the_worker_alone(
    daemon: RunningDaemon, client: Client
) -> None:
    worker = python_worker(
        """
        import time
        from watchdogd_client import expires
        with expires(after=0.2, policy="log"):
            time.sleep(0.8)
        print("ready", flush=True)
        """,
        socket=daemon.socket_path,
    )
    try:
        wait_ready(worker)
        assert worker.wait(timeout=PATIENCE) == 0
    finally:
        reap(worker)
    event = expired_event(client, worker.pid)
    assert event.policy == "log"
    assert event.outcome == "alive"
    assert event.steps == []


def test_abort_leaves_a_faulthandler_traceback(daemon: RunningDaemon) -> None:
    worker = python_worker(
        """
        import faulthandler, time
        from watchdogd_client import expires
        faulthandler.enable()
        def stuck_in_here():
            time.sleep(30)
        with expires(after=0.3, policy="abort"):
            print("ready", flush=True)
            stuck_in_here()
        """,
        socket=daemon.socket_path,
    )
    try:
        wait_ready(worker)
        _, err = worker.communicate(timeout=PATIENCE)
    finally:
        reap(worker)
    assert worker.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in err
    assert "stuck_in_here" in err


def test_dump_step_puts_the_hung_workers_stack_in_the_event(
    daemon: RunningDaemon, client: Client
) -> None:
    worker = python_worker(
        """
        import time
        from watchdogd_client import expires
        def deeply_stuck():
            time.sleep(30)
        with expires(after=0.3, policy="dumpy"):
            print("ready", flush=True)
            deeply_stuck()
        """,
        socket=daemon.socket_path,
    )
    try:
        wait_ready(worker)
        assert worker.wait(timeout=60) == -signal.SIGKILL
    finally:
        reap(worker)
    event = expired_event(client, worker.pid)
    dump, kill = event.steps
    # A worker of the client library gives its stacks itself: no py-spy is run,
    # and the step says so.
    assert (dump.step, dump.result) == ("dump by the worker's responder", "ok"), dump.output
    assert "deeply_stuck" in dump.output
    assert kill.result == "sent SIGKILL"


def test_ten_simultaneous_expiries_all_fire_on_time(daemon: RunningDaemon, client: Client) -> None:
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "print('ready', flush=True); time.sleep(60)"
    )
    victims = [
        subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True)
        for _ in range(10)
    ]
    try:
        for victim in victims:
            assert victim.stdout is not None
            assert victim.stdout.readline().strip() == "ready"
        # One write: every deadline falls within the same millisecond.
        frames = [encode_frame(Hello(id=0, version=1))] + [
            encode_frame(
                Acquire(
                    id=i + 1,
                    scope="simultaneous",
                    timeout=0.5,
                    pid=victim.pid,
                    policy="long_wait" if i % 2 else "kill",
                )
            )
            for i, victim in enumerate(victims)
        ]
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(str(daemon.socket_path))
            raw.sendall(b"".join(frames))
            reader = FrameReader(1 << 20)
            replies: list[ReplyMessage] = []
            while len(replies) < 11:
                replies += [decode_reply(f) for f in reader.feed(raw.recv(65536))]
        assert all(isinstance(reply, Acquired) for reply in replies[1:])
        events = [expired_event(client, victim.pid) for victim in victims[::2]]
        for victim in victims:
            assert victim.wait(timeout=PATIENCE) == -signal.SIGKILL
        events += [expired_event(client, victim.pid) for victim in victims[1::2]]
    finally:
        for victim in victims:
            reap(victim)
    # The 3 s waits of half of them delayed none of the others' first signal.
    lateness = sorted(event.late or 0.0 for event in events)
    assert lateness[-1] < 0.05, lateness
    # They fell due together: well within one 3 s wait, which a first signal that
    # waited for another policy's step would show as lateness. (Each deadline is
    # taken as its request is handled, so a busy machine spreads them a little.)
    deadlines = [event.deadline or 0.0 for event in events]
    assert max(deadlines) - min(deadlines) < 0.25


def test_events_follow_prints_expiries_as_they_happen(daemon: RunningDaemon) -> None:
    follower = subprocess.Popen(
        ctl_command(daemon.socket_path, "events", "--follow", "--json", "--limit", "1"),
        stdout=subprocess.PIPE,
        text=True,
    )
    victim = sleeper()
    try:
        time.sleep(0.5)  # the follower is waiting for news
        with daemon.client() as client:
            client.acquire("followed", 0.2, pid=victim.pid)
        assert follower.stdout is not None
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            event = json.loads(follower.stdout.readline())
            assert {"kind", "time", "pid", "scope", "policy"} <= set(event)
            if event["kind"] == "expired" and event["pid"] == victim.pid:
                break
        else:
            pytest.fail("the follower never printed the expiry")
        assert event["scope"] == "followed"
        assert event["policy"] == "kill"
    finally:
        follower.terminate()
        reap(follower)
        reap(victim)


def test_metrics_parse_with_prometheus_clients_parser(daemon: RunningDaemon, workdir: Path) -> None:
    victim = sleeper()
    try:
        with daemon.client() as client:
            client.acquire("metered", 0.1, pid=victim.pid)
            victim.wait(timeout=PATIENCE)
            expired_event(client, victim.pid)
    finally:
        reap(victim)
    result = ctl(daemon.socket_path, "metrics")
    assert result.returncode == 0, result.stderr
    assert _kills_counted(result.stdout) >= 1
    # The textfile is rewritten every metrics_interval, so the expiry reaches it at
    # the next rewrite after the event, not at once.
    textfile = workdir / "watchdogd.prom"
    wait_until(lambda: _kills_counted(textfile.read_text()) >= 1, what="the kill in the textfile")


def _kills_counted(text: str) -> float:
    """The kills that ended with the process gone, from a metrics page that
    prometheus_client's parser reads whole with every family the daemon promises."""
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {
        "watchdogd_timers_armed",
        "watchdogd_requests",
        "watchdogd_expiries",
        "watchdogd_lateness_seconds",
        "watchdogd_connections_open",
    } <= set(families)
    kills = [
        sample.value
        for sample in families["watchdogd_expiries"].samples
        if sample.labels == {"policy": "kill", "outcome": "exited"}
    ]
    return kills[0] if kills else 0.0


def test_policies_are_listed_with_their_steps(daemon: RunningDaemon) -> None:
    result = ctl(daemon.socket_path, "policies")
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "SIGTERM, wait 1s, SIGKILL" in lines["term_quick"]
    assert lines["kill*"].split()[1:3] == ["process", "SIGKILL"]
    assert "root only" in lines["hook"]
    assert "group" in lines["group_kill"]
    as_json = json.loads(ctl(daemon.socket_path, "policies", "--json").stdout)
    assert as_json["default"] == "kill"


#: Dump steps that take two seconds each, three at once at most; and a policy whose
#: dump comes before its SIGKILL, with a short timeout.
POOLED = """
[daemon]
max_dumps = 3

[policies.slow_dump]
steps = [ {{ dump = ["sh", "-c", '{script}', "{record}", "{{pid}}", "2"], timeout = 30 }} ]

[policies.dump_then_kill]
steps = [
    {{ dump = ["sh", "-c", '{script}', "{record}", "{{pid}}", "0"], timeout = 0.5 }},
    {{ signal = "SIGKILL" }},
]
"""


def gauges(client: Client) -> dict[str, float]:
    """The daemon's metrics whose names begin with ``watchdogd_dumps``."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(client.metrics())
        for sample in family.samples
        if sample.name.startswith("watchdogd_dumps")
    }


def arm_at_once(socket_path: Path, timers: list[tuple[int, str, float]]) -> None:
    """Arm (pid, policy, timeout) timers in one write: equal timeouts fall due together."""
    frames = [encode_frame(Hello(id=0, version=1))] + [
        encode_frame(Acquire(id=n + 1, scope="pooled", timeout=timeout, pid=pid, policy=policy))
        for n, (pid, policy, timeout) in enumerate(timers)
    ]
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(socket_path))
        raw.sendall(b"".join(frames))
        reader = FrameReader(1 << 20)
        replies: list[ReplyMessage] = []
        while len(replies) < len(frames):
            replies += [decode_reply(f) for f in reader.feed(raw.recv(65536))]
    assert all(isinstance(reply, Acquired) for reply in replies[1:]), replies


def test_dumps_run_a_few_at_once_and_delay_no_kill(socket_path: Path, tmp_path: Path) -> None:
    """Ten timers under a slow dump policy fall due together: three dumps run at a
    time and all ten run; meanwhile a kill of another timer goes out on time, and a
    dump-then-kill timer's SIGKILL waits no longer than its dump step's timeout."""
    record = tmp_path / "dumps"
    config = POOLED.format(script=RECORDING_DUMPER, record=record)
    with configured_daemon(socket_path, tmp_path, config) as daemon:
        dumped = [sleeper() for _ in range(10)]
        killed, dump_killed = sleeper(), sleeper()
        seen: list[dict[str, float]] = []
        try:
            arm_at_once(daemon.socket_path, [(victim.pid, "slow_dump", 0.3) for victim in dumped])
            # The others fall due once three dumps hold every turn: due in the same
            # pass as those (a daemon woken late), the dump whose turn ends sooner
            # may take a turn first.
            wait_until(
                lambda: record.exists() and record.read_text().count("start ") >= 3,
                what="three dumps running",
            )
            arm_at_once(
                daemon.socket_path,
                [(killed.pid, "kill", 0.1), (dump_killed.pid, "dump_then_kill", 0.1)],
            )
            with daemon.client() as client:

                def every_dump_ran() -> bool:
                    seen.append(gauges(client))
                    return record.exists() and record.read_text().count("end ") == 10

                wait_until(every_dump_ran, what="every dump", timeout=PATIENCE * 2)

                def expired() -> dict[int, EventInfo]:
                    return {
                        e.pid: e for e in client.events(limit=100).events if e.kind == "expired"
                    }

                # A dumper wrote its last line just before it exited: the daemon
                # sees the exit, and records the expiry, a moment later.
                wait_until(lambda: len(expired()) == 12, what="every expiry recorded")
                events = expired()
                after = gauges(client)
        finally:
            for victim in [*dumped, killed, dump_killed]:
                reap(victim)
    lines = [line.split() for line in record.read_text().splitlines()]
    assert sorted(int(pid) for what, _, pid in lines if what == "start") == sorted(
        victim.pid for victim in dumped
    )
    assert most_at_once(record) == 3
    assert max(sample["watchdogd_dumps_running"] for sample in seen) == 3
    assert max(sample["watchdogd_dumps_waiting"] for sample in seen) >= 4
    assert after["watchdogd_dumps_max"] == 3
    assert (after["watchdogd_dumps_running"], after["watchdogd_dumps_waiting"]) == (0, 0)
    assert after["watchdogd_dumps_not_run_total"] == 1
    last_start = max(int(at) for what, at, _ in lines if what == "start") / 1e9
    # The kill went out at its deadline, while dumps still waited for their turn.
    kill = events[killed.pid]
    assert [step.result for step in kill.steps] == ["sent SIGKILL"]
    assert (kill.late or 0.0) < 1.0
    assert kill.time < last_start
    # The dump that got no turn within its 0.5 s gave way to its SIGKILL.
    dump, sigkill = events[dump_killed.pid].steps
    assert dump.result == "not run: no turn within 0.5s (max_dumps = 3, all running)"
    assert sigkill.result == "sent SIGKILL"
    assert events[dump_killed.pid].outcome == "exited"
    assert events[dump_killed.pid].time < last_start
    waited = [events[victim.pid].steps[0].result for victim in dumped]
    assert all(result.startswith("exit 0") for result in waited), waited
    assert sum("for a turn (max_dumps = 3)" in result for result in waited) == 7
