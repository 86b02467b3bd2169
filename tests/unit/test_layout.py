"""The suite is laid out as the code is: unit tests of the core with fakes, host tests
with real processes, end-to-end tests with a daemon, fleet tests with etcd, and the
documentation's tests, each in its directory; what two of them share is in
``helpers``, and no test module imports another. The code stays in parts of one
responsibility each: no module over `MODULE_LINES` lines, no class over `CLASS_LINES`.
Its names say one thing each: no module name twice across the daemon, the client and
the protocol (`CONVENTIONAL` names aside), and no class name twice within one of them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers.scheduling import TORCH_JOBS

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


#: The packages whose module names are one namespace to a reader: the daemon, the
#: client and the protocol they share.
PACKAGES = ("watchdogd", "client/watchdogd_client", "client/watchdogd_protocol")
#: Module names every package may have, by convention.
CONVENTIONAL = frozenset({"__init__", "__main__", "_version", "errors"})


def _sources(package: str) -> list[Path]:
    return sorted((TESTS.parent / package).rglob("*.py"))


#: The bounds of one responsibility: a module of the daemon, the client or the
#: protocol, and a class.
MODULE_LINES = 700
CLASS_LINES = 450
#: And a function, its wiring included: cut along a responsibility past it.
FUNCTION_LINES = 60


def test_no_module_or_class_outgrows_one_responsibility() -> None:
    root = TESTS.parent
    sources = [path for package in PACKAGES for path in _sources(package)]
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


def test_no_function_outgrows_sixty_lines() -> None:
    root = TESTS.parent
    too_long: dict[str, int] = {}
    for path in (path for package in PACKAGES for path in _sources(package)):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    too_long[f"{path.relative_to(root)}::{node.name}"] = lines
    assert too_long == {}


def _same_names(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: where for name, where in sorted(found.items()) if len(where) > 1}


def test_no_module_name_is_used_twice_across_the_daemon_the_client_and_the_protocol() -> None:
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in _sources(package):
            if path.stem not in CONVENTIONAL:
                found.setdefault(path.stem, []).append(str(path.relative_to(TESTS.parent)))
    assert len(found) > 100
    assert _same_names(found) == {}


def _classes(package: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _sources(package):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                where = f"{path.relative_to(TESTS.parent)}:{node.lineno}"
                found.setdefault(node.name, []).append(where)
    return found


def test_no_class_name_is_used_twice_within_one_package() -> None:
    for package in PACKAGES:
        assert _classes(package), package
        assert (package, _same_names(_classes(package))) == (package, {})


def test_the_daemon_names_no_class_as_the_protocol_names_its_verdict() -> None:
    # The daemon imports the protocol's `Verdict` (where an incident's ranks wait);
    # its own judgement of starvation is a `Starvation`.
    assert "Verdict" in _classes("client/watchdogd_protocol")
    assert "Verdict" not in _classes("watchdogd")


#: What a test module writes to start a job of several torch processes.
TORCH_JOB_STARTS = re.compile(
    r'gloo_job\(|ranks_on_a_fake_daemon\(|torch_worker\(|/ "torchrun"|two_hosts\.py|torch_mp\.'
)


def test_every_module_that_starts_torch_jobs_has_them_run_together() -> None:
    """The scheduler keeps the torch jobs on one worker by their modules' paths
    (`helpers.scheduling.TORCH_JOBS`): a module that starts one and is not named
    there would run its jobs beside the others."""
    starting = {
        str(path.relative_to(TESTS.parent))
        for path in TESTS.rglob("test_*.py")
        if path != Path(__file__).resolve() and TORCH_JOB_STARTS.search(path.read_text())
    }
    assert starting == TORCH_JOBS
