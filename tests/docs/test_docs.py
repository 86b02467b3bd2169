"""The names the documentation cites exist: every backticked dotted name of
``watchdogd``, ``watchdogd_client`` or ``watchdogd_protocol`` in a docstring, a
comment or a Markdown page
(``watchdogd.host.process``, `watchdogd.core.policies.check_argv`) is imported, its
module first and then its attributes, so a module that moves or an object that is
renamed cannot leave a page or a docstring pointing at nothing."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Where names are cited: both packages, the tests, the benchmarks and the pages.
SOURCES = ["watchdogd", "client", "tests", "bench", "docs"]
PAGES = ["README.md", "SECURITY.md"]
#: A name alone between backticks (one or two), with ``()`` after a callable.
CITED = re.compile(r"(?<!`)`{1,2}(watchdogd(?:_client|_protocol)?(?:\.\w+)+)(?:\(\))?`{1,2}(?!`)")
#: Names that are files, not modules: systemd's units (`watchdogd.socket`,
#: `watchdogd.service`) and the daemon's own files (`watchdogd.toml`, the state's
#: `watchdogd.state.db`, its log and its metrics).
FILES = re.compile(r"^watchdogd\.(socket|service|sock|toml|state|log|prom)\b")


#: What is not the project's own text: byte code, a package's build tree, the old
#: state files kept as test data.
_NOT_TEXT = frozenset({"__pycache__", "build", "data"})


def _texts() -> list[Path]:
    found = [ROOT / page for page in PAGES]
    for source in SOURCES:
        for path in sorted((ROOT / source).rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if path.suffix in (".py", ".md") and not _NOT_TEXT & parts:
                found.append(path)
    return found


def cited_names() -> dict[str, list[str]]:
    """Every name cited, with where (``path:line``)."""
    names: dict[str, list[str]] = {}
    for path in _texts():
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            for match in CITED.finditer(line):
                name = match.group(1)
                if not FILES.match(name):
                    where = f"{path.relative_to(ROOT)}:{number}"
                    names.setdefault(name, []).append(where)
    return names


def resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute (of an attribute...) of one."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_every_module_and_object_the_docs_name_exists() -> None:
    missing = {name: where for name, where in cited_names().items() if not resolves(name)}
    assert missing == {}


def test_the_check_reads_the_citations_and_would_fail_on_a_moved_one() -> None:
    names = cited_names()
    assert len(names) > 50  # the pattern still finds the docs' citations
    assert "watchdogd.core.identity.may_signal" in names
    assert "watchdogd_protocol.RESTART_GRACE" in names  # the protocol's names too
    assert resolves("watchdogd.core.policies.check_argv")
    assert not resolves("watchdogd.policies.check_argv")  # a module that moved
    assert not resolves("watchdogd.core.policies.no_such_name")


@pytest.mark.parametrize("name", ["watchdogd.socket", "watchdogd.state.db", "watchdogd.toml"])
def test_file_names_are_not_taken_for_modules(name: str) -> None:
    assert FILES.match(name)


#: A test cited by its path, as SECURITY.md cites the test behind each claim:
#: ``tests/DIR/test_x.py::test_name`` or ``tests/DIR/test_x.py::TestClass::test_name``.
CITED_TEST = re.compile(r"(tests/[\w/]+\.py)((?:::\w+)*)")


def cited_tests() -> dict[str, list[str]]:
    """Every test file (with its class and test, where given) cited, with where."""
    cited: dict[str, list[str]] = {}
    for path in _texts():
        if path == Path(__file__).resolve():
            continue  # its own examples of what a citation is
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITED_TEST.finditer(line):
                where = f"{path.relative_to(ROOT)}:{number}"
                cited.setdefault(match.group(0), []).append(where)
    return cited


def _test_exists(cited: str) -> bool:
    file, *names = cited.split("::")
    path = ROOT / file
    if not path.is_file():
        return False
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    for name in names:
        found = [
            node
            for node in scope
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name == name
        ]
        if not found:
            return False
        scope = found[0].body
    return True


def test_every_test_the_docs_cite_exists() -> None:
    cited = cited_tests()
    assert len(cited) > 20  # SECURITY.md's citations are still found
    assert {test: where for test, where in cited.items() if not _test_exists(test)} == {}
    assert not _test_exists("tests/docs/test_docs.py::test_no_such_test")
    assert not _test_exists("tests/test_docs.py::test_every_test_the_docs_cite_exists")
