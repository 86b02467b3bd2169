"""The core is sans-IO: importing it loads no module that does I/O."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("trio", "sqlite3", "socket", "subprocess", "prometheus_client", "select")
CORE = ("config", "counters", "events", "expiry", "heap", "history", "identity", "incidents",
        "policies", "service", "session", "shares", "starvation", "timers")  # fmt: skip


def test_the_core_imports_nothing_that_does_io() -> None:
    code = (
        "import sys\n"
        + "".join(f"import watchdogd.core.{name}\n" for name in CORE)
        + f"print(' '.join(sorted(set({FORBIDDEN!r}) & set(sys.modules))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_every_core_module_is_checked() -> None:
    from pathlib import Path

    import watchdogd.core

    found = {
        path.stem
        for path in Path(watchdogd.core.__file__).parent.glob("*.py")
        if path.stem != "__init__"
    }
    assert found == set(CORE)
