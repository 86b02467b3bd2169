"""bench/crossings.py, whose figures docs/how-it-works.md gives: its reduction of a
trace to layers and crossings, on frames made up here, and the tool itself against
a real daemon of this checkout."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "bench" / "crossings.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crossings", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("crossings", module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


crossings = _load()


@dataclass
class FakeFrame:
    """A frame as the hook reads one: its module and its caller."""

    module: str
    f_back: FakeFrame | None = None
    f_globals: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.f_globals = {"__name__": self.module}


def test_a_layer_is_the_package_under_watchdogd_or_the_client_distributions_package() -> None:
    layer_of = crossings.layer_of
    assert layer_of("watchdogd.core.writer") == "core"
    assert layer_of("watchdogd.runtime.server") == "runtime"
    assert layer_of("watchdogd.logs") == "logs"
    assert layer_of("watchdogd_protocol.frames") == "watchdogd_protocol"
    assert layer_of("watchdogd_client.protocol.frames") == "watchdogd_client"
    assert layer_of("watchdogd") is None
    assert layer_of("trio._core._run") is None
    assert layer_of("json.decoder") is None


def test_a_resumed_task_crossing_three_layers_through_the_standard_library() -> None:
    recorder = crossings.Recorder()
    loop = FakeFrame("trio._core._run", FakeFrame("watchdogd.cli.watchdogd"))
    server = FakeFrame("watchdogd.runtime.server", loop)
    session = FakeFrame("watchdogd.core.session", server)
    between = FakeFrame("json.decoder", session)
    store = FakeFrame("watchdogd.storage.store", between)
    helper = FakeFrame("watchdogd.storage.files", store)
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        recorder.start()
        recorder(server, "call", None)
        recorder(server, "c_call", reader.recv)  # the frame is read: the acquire begins
        recorder(session, "call", None)
        recorder(between, "call", None)  # the standard library's: skipped
        recorder(store, "call", None)  # core -> storage, json.decoder between
        recorder(helper, "call", None)  # storage -> storage: no crossing
        recorder(helper, "return", None)
        recorder(store, "return", None)
        recorder(between, "return", None)
        recorder(session, "return", None)
        recorder(server, "c_call", reader.send)  # the reply is written
        recorder(session, "call", None)  # after the reply: not the acquire's
        recorder(session, "return", None)
        recorder(server, "return", None)
        events = recorder.stop()
    finally:
        reader.close()
    whole = crossings.crossings(events)
    assert whole.path == ("runtime", "core", "storage", "core", "runtime", "core", "runtime")
    assert whole.count == 3
    acquire = crossings.crossings(events, start="read", end="write")
    assert acquire.path == ("runtime", "core", "storage", "core", "runtime")
    assert acquire.count == 2
    assert str(acquire) == "runtime -> core -> storage -> core -> runtime: 2 crossings"


def test_a_task_woken_by_its_own_sleep_and_a_worker_thread_are_told_apart() -> None:
    recorder = crossings.Recorder()
    loop = FakeFrame("trio._core._run")
    ticking = FakeFrame("watchdogd.storage.record_file", loop)
    sleeping = FakeFrame("trio._timeouts", ticking)
    events = FakeFrame("watchdogd.core.events", ticking)
    worker = FakeFrame("trio._core._thread_cache")  # no caller of the project's
    written = FakeFrame("watchdogd.storage.files", worker)
    recorder.start()
    for frame in (ticking, sleeping):  # resumed in trio.sleep: its own period
        recorder(frame, "call", None)
    recorder(sleeping, "return", None)
    recorder(events, "call", None)
    recorder(events, "return", None)
    recorder(ticking, "return", None)
    recorder(written, "call", None)  # a worker thread's function: called by the runtime
    recorder(written, "return", None)
    traced = crossings.crossings(recorder.stop())
    assert traced.path == ("runtime", "storage", "runtime")
    assert traced.count == 1


def test_nothing_is_recorded_outside_a_window() -> None:
    recorder = crossings.Recorder()
    frame = FakeFrame("watchdogd.core.writer", FakeFrame("watchdogd.runtime.server"))
    recorder(frame, "call", None)
    recorder.start()
    assert recorder.stop() == []
    recorder(frame, "call", None)
    assert recorder.stop() == []


def test_the_tool_traces_an_acquire_and_an_expiry_of_a_real_daemon() -> None:
    result = subprocess.run(
        [sys.executable, str(TOOL), "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5, result.stdout
    for what, counted, path in (("acquire", *lines[1:3]), ("expiry", *lines[3:5])):
        assert counted.startswith(f"{what}: "), result.stdout
        count = int(counted.split()[1])
        layers = path.strip().split(" -> ")
        assert layers[0] == "runtime", path
        assert {"core", "storage"} <= set(layers), path
        assert count >= len(layers) // 2, (counted, path)  # a call out, a return back
    assert "host" in lines[4]  # the signal goes through a pidfd
