"""The core's parts share one context, `Service` forwards nothing to them, and the
wiring that makes them is cut along what each piece does."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import watchdogd
from watchdogd.core.bridge import FleetBridge
from watchdogd.core.firing import Firing
from watchdogd.core.hangs import JobHangs
from watchdogd.core.lifecycle import Lifecycle
from watchdogd.core.pages import Pages
from watchdogd.core.slots import Slots
from watchdogd.core.timer_requests import Arming

from helpers.fakes import make_world

PACKAGE = Path(watchdogd.__file__).parent
#: What the context holds: no part takes any of these as an argument of its own.
SHARED = {"rules", "table", "processes", "journal", "events", "metrics", "history",
          "incidents", "responders", "log", "wall", "daemon_pid", "started",
          "on_deadline"}  # fmt: skip
#: The wiring, and the longest functions it had: each within `LINES`.
WIRING = {
    "core/service.py": ("Service.__init__",),
    "runtime/daemon.py": ("run", "Daemon.__init__", "Daemon.start"),
    "core/pages.py": ("Pages.status",),
    "core/timer_requests.py": ("Arming.acquire",),
}
LINES = 60


@pytest.mark.parametrize("part", [Arming, Pages, Firing, Lifecycle, Slots, FleetBridge, JobHangs])
def test_each_part_takes_the_context_and_no_shared_part_of_its_own(part: type) -> None:
    parameters = list(inspect.signature(part).parameters)
    assert parameters[0] == "context"
    assert SHARED & set(parameters) == set()


def test_every_part_of_a_service_is_made_on_its_one_context() -> None:
    service = make_world().service
    context = service.context
    assert context.writer is service.writer
    assert context.table is service.table
    assert (context.rules, context.events, context.incidents) == (
        service.rules,
        service.events,
        service.incidents,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.rules = service.rules  # type: ignore[misc]


def _forwarding(cls: ast.ClassDef) -> list[str]:
    """The methods and properties of ``cls`` whose body only passes a call, an
    attribute or a length on to one of its parts (``self.part.x``)."""
    found = []
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef) or node.name == "__init__":
            continue
        body = [s for s in node.body if not isinstance(s, ast.Expr) or not isinstance(
            s.value, ast.Constant)]  # fmt: skip
        if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr, ast.Assign)):
            continue
        statement = body[0]
        value = statement.targets[0] if isinstance(statement, ast.Assign) else statement.value
        if isinstance(value, ast.Call):
            if isinstance(value.func, ast.Name) and value.func.id == "len":
                value = value.args[0]
            else:
                value = value.func
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Attribute):
            found.append(node.name)
    return found


def _class(path: Path, name: str) -> ast.ClassDef:
    return next(
        node
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == name
    )


def test_the_service_forwards_no_call_to_its_parts() -> None:
    assert _forwarding(_class(PACKAGE / "core" / "service.py", "Service")) == []


def test_the_check_of_forwarding_sees_a_method_that_forwards() -> None:
    code = (
        "class Service:\n"
        "    def close(self):\n        'Closes.'\n        self.lifecycle.close()\n"
        "    @property\n    def firing(self):\n        return len(self.expiries.held)\n"
        "    def handle(self):\n        x = 1\n        return self.arming.go(x)\n"
    )
    [cls] = ast.parse(code).body
    assert isinstance(cls, ast.ClassDef)
    assert _forwarding(cls) == ["close", "firing"]


def _lengths(path: Path) -> dict[str, int]:
    """The length in lines of each function of ``path``, by qualified name."""
    lengths: dict[str, int] = {}
    tree = ast.parse(path.read_text())
    for node in tree.body:
        inner = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for function in inner:
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                assert function.end_lineno is not None
                lengths[prefix + function.name] = function.end_lineno - function.lineno + 1
    return lengths


def test_the_wiring_is_cut_into_functions_of_sixty_lines_at_most() -> None:
    long = {}
    for module, names in WIRING.items():
        lengths = _lengths(PACKAGE / module)
        for name in names:
            if lengths[name] > LINES:
                long[name] = lengths[name]
    assert long == {}
