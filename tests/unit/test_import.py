"""The thin client stays thin, and the wire protocol thinner: `watchdogd_protocol`
imports msgspec and standard-library modules that load nothing else, so the
daemon's sans-IO core that imports it loads no thread, log, clock or socket; and the
daemon's core is reached through its door alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import watchdogd
import watchdogd.core
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


PACKAGE = Path(watchdogd.__file__).parent
CORE_DIR = PACKAGE / "core"


def _past_the_door(text: str, name: str) -> list[str]:
    """The core modules that the code ``text`` of module ``name`` imports past the
    core's door (``watchdogd.core``), by line."""
    parts = name.split(".")
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level] if node.level else []
            modules = [".".join([*base, *([node.module] if node.module else [])])]
            if modules == ["watchdogd.core"]:
                # A module of the core named as a name of its package.
                modules = [
                    f"watchdogd.core.{alias.name}"
                    for alias in node.names
                    if (CORE_DIR / f"{alias.name}.py").exists()
                ]
        else:
            continue
        found += [f"{node.lineno} {m}" for m in modules if m.startswith("watchdogd.core.")]
    return found


def test_nothing_outside_the_core_imports_a_core_module_past_its_door() -> None:
    outside = [path for path in PACKAGE.rglob("*.py") if CORE_DIR not in path.parents]
    assert len(outside) > 40
    past = {
        str(path.relative_to(PACKAGE)): found
        for path in outside
        if (
            found := _past_the_door(
                path.read_text(),
                ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts),
            )
        )
    }
    assert past == {}


def test_the_door_check_sees_every_way_past_the_door() -> None:
    code = (
        "from ..core.timers import Timer\n"
        "from ..core import service\n"
        "import watchdogd.core.config\n"
        "from watchdogd.core.rules import Rules\n"
        "from ..core import Config\n"
        "from ..storage.store import Store\n"
    )
    assert _past_the_door(code, "watchdogd.runtime.daemon") == [
        "1 watchdogd.core.timers",
        "2 watchdogd.core.service",
        "3 watchdogd.core.config",
        "4 watchdogd.core.rules",
    ]


def test_the_door_declares_each_name_where_it_lives() -> None:
    where = watchdogd.core._WHERE
    assert sorted(where) == sorted(watchdogd.core.__all__)
    tree = ast.parse((CORE_DIR / "__init__.py").read_text())
    [checking] = [node for node in tree.body if isinstance(node, ast.If)]
    typed = {
        alias.name: str(node.module)
        for node in checking.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == where
    for name, module in where.items():
        assert getattr(watchdogd.core, name) is getattr(
            __import__(f"watchdogd.core.{module}", fromlist=[name]), name
        )


def test_the_door_loads_a_module_of_the_core_only_when_a_name_of_it_is_used() -> None:
    code = (
        "import sys\n"
        "from watchdogd.core import TargetKind\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('watchdogd.core.'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded = set(result.stdout.split())
    assert "watchdogd.core.policies" in loaded
    assert "watchdogd.core.service" not in loaded
