"""The thin client stays thin, and the wire protocol thinner: `watchdogd_protocol`
imports msgspec and standard-library modules that load nothing else, so the
daemon's sans-IO core that imports it loads no thread, log, clock or socket."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import watchdogd_protocol

PROTOCOL_DIR = Path(watchdogd_protocol.__file__).parent
#: The standard-library modules the protocol may import: none starts a thread,
#: writes a log, reads a clock or does I/O, and each loads only modules of this kind.
PROTOCOL_STDLIB = frozenset({"__future__", "enum", "math", "struct", "typing"})
#: What importing the protocol must not load in a fresh interpreter.
NOT_LOADED = ("threading", "logging", "socket", "trio", "click", "watchdogd", "watchdogd_client")


def test_importing_the_client_pulls_in_neither_trio_nor_click() -> None:
    code = (
        "import sys, watchdogd_client, watchdogd_protocol, watchdogd_client.paths\n"
        "print(' '.join(sorted({'trio', 'click', 'watchdogd'} & set(sys.modules))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def _loaded_by(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return {name.split(".")[0] for name in result.stdout.split()}


def test_importing_the_protocol_loads_no_thread_log_socket_or_other_package() -> None:
    modules = sorted(path.stem for path in PROTOCOL_DIR.glob("*.py") if path.stem != "__init__")
    statement = "import watchdogd_protocol\n" + "".join(
        f"import watchdogd_protocol.{name}\n" for name in modules
    )
    loaded = _loaded_by(statement)
    assert "watchdogd_protocol" in loaded
    assert sorted(loaded & set(NOT_LOADED)) == []


def test_the_load_check_sees_what_the_client_loads() -> None:
    # The same check on the client (its at-fork hook needs threading) finds it.
    assert {"threading", "watchdogd_client"} <= _loaded_by("import watchdogd_client")


def _protocol_imports(path: Path) -> set[str]:
    """The top-level names of the modules ``path`` imports, relative imports aside."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_protocol_module_imports_only_msgspec_and_listed_standard_modules() -> None:
    allowed = PROTOCOL_STDLIB | {"msgspec"}
    paths = sorted(PROTOCOL_DIR.glob("*.py"))
    assert len(paths) >= 7
    wrong = {
        path.name: sorted(_protocol_imports(path) - allowed)
        for path in paths
        if _protocol_imports(path) - allowed
    }
    assert wrong == {}
    assert PROTOCOL_STDLIB - {"__future__"} <= sys.stdlib_module_names


def test_the_protocol_import_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "from . import frames\ndef f():\n    import threading\n    from os import path\n"
    )
    assert _protocol_imports(module) == {"threading", "os"}
