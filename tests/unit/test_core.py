"""The core is sans-IO: it imports nothing that does I/O, reads a clock, writes a log
or draws randomness, and of watchdogd only the core, its errors and its version."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import watchdogd.core

#: What no core module may import, directly or by a module it loads (the protocol
#: package it imports loads no thread, log or socket: tests/unit/test_import.py).
LOADED = ("trio", "sqlite3", "socket", "subprocess", "prometheus_client", "select",
          "secrets", "random", "threading", "logging", "watchdogd_client")  # fmt: skip
#: What no core module may import itself. ``os`` and ``time`` are loaded in every
#: interpreter (its start imports them), so only the core's own imports can show
#: their use.
FORBIDDEN = (*LOADED, "time", "os")
#: The modules of watchdogd outside the core that the core may import.
ALLOWED = ("watchdogd.errors", "watchdogd._version")
CORE_DIR = Path(watchdogd.core.__file__).parent
CORE = ("bridge", "config", "context", "counters", "deadlines", "effects", "events",
        "evidence_budget", "expiry", "fingerprint", "firing", "hangs", "history", "identity",
        "incidents", "interning", "kept_evidence", "lifecycle", "logline", "pages", "policies",
        "ports", "process_pages", "ranks", "repeats", "responders", "rules", "service",
        "session", "shares", "slot", "slot_shares", "slots", "starvation", "timer_requests",
        "timers", "tomlkeys", "unblocks", "user_frames", "verdict", "viewing",
        "writer")  # fmt: skip


def test_the_core_imports_nothing_that_does_io() -> None:
    code = (
        "import sys\n"
        + "".join(f"import watchdogd.core.{name}\n" for name in CORE)
        + f"print(' '.join(sorted(set({LOADED!r}) & set(sys.modules))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def _imports(name: str) -> set[str]:
    """Every module that core module ``name`` imports, anywhere in it, absolute."""
    tree = ast.parse((CORE_DIR / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["watchdogd", "core"][: 2 - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
    return found


def test_no_core_module_reads_a_clock_logs_draws_or_leaves_the_core() -> None:
    wrong: dict[str, list[str]] = {}
    for name in CORE:
        for module in _imports(name):
            top = module.split(".")[0]
            outside = (
                top == "watchdogd"
                and not module.startswith("watchdogd.core")
                and module not in ALLOWED
            )
            if top in FORBIDDEN or outside:
                wrong.setdefault(name, []).append(module)
    assert wrong == {}


def test_the_import_check_sees_relative_imports() -> None:
    assert "watchdogd.errors" in _imports("service") | _imports("timer_requests")
    assert "watchdogd.core.timers" in _imports("firing")


def test_no_core_module_opens_a_file() -> None:
    opened = [
        name
        for name in CORE
        for node in ast.walk(ast.parse((CORE_DIR / f"{name}.py").read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id == "open"
    ]  # fmt: skip
    assert opened == []


def test_every_core_module_is_checked() -> None:
    found = {path.stem for path in CORE_DIR.glob("*.py") if path.stem != "__init__"}
    assert found == set(CORE)
