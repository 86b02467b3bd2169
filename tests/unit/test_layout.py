"""The suite is laid out as the code is: unit tests of the core with fakes, host tests
with real processes, end-to-end tests with a daemon, fleet tests with etcd, and the
documentation's tests, each in its directory; what two of them share is in
``helpers``, and no test module imports another."""

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
