"""The suite is laid out as the code is: unit tests of the core with fakes, host tests
with real processes, end-to-end tests with a daemon, fleet tests with etcd, and the
documentation's tests, each in its directory; what two of them share is in
``helpers``, and no test module imports another. The code stays in parts of one
responsibility each: no module over `MODULE_LINES` lines, no class over `CLASS_LINES`."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
KINDS = {"unit", "host", "e2e", "fleet", "docs"}


def _modules() -> list[Path]:
    return sorted(
        path for path in TESTS.rglob("*.py") if "data" not in path.relative_to(TESTS).parts
    )


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_test_module_is_in_the_directory_of_its_kind() -> None:
    tests = [path.relative_to(TESTS) for path in _modules() if path.name.startswith("test_")]
    assert len(tests) > 50
    assert [str(path) for path in tests if path.parts[0] not in KINDS or len(path.parts) != 2] == []


def test_test_modules_have_unique_names() -> None:
    # pytest imports each test module by its file name: two of one name would clash.
    names = [path.name for path in _modules() if path.name.startswith("test_")]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_no_test_module_imports_another_or_the_fixtures() -> None:
    offending = {
        str(path.relative_to(TESTS)): sorted(
            name
            for name in _imported(path)
            if name.split(".")[0].startswith("test_") or name.split(".")[0] == "conftest"
        )
        for path in _modules()
    }
    assert {path: names for path, names in offending.items() if names} == {}


#: The bounds of one responsibility: a module of the daemon or the client, and a class.
MODULE_LINES = 700
CLASS_LINES = 450


def test_no_module_or_class_outgrows_one_responsibility() -> None:
    root = TESTS.parent
    sources = sorted((root / "watchdogd").rglob("*.py")) + sorted(
        (root / "client" / "watchdogd_client").rglob("*.py")
    )
    assert len(sources) > 40
    too_long: dict[str, int] = {}
    for path in sources:
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(root))
        if len(text.splitlines()) > MODULE_LINES:
            too_long[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > CLASS_LINES:
                    too_long[f"{name}::{node.name}"] = lines
    assert too_long == {}
