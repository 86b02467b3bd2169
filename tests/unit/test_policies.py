"""The policy model: built-ins, signal names, config tables turned into policies, and
the policies named for another target."""

from __future__ import annotations

import signal

import pytest

from watchdogd.core.config import parse_config
from watchdogd.core.policies import (
    BUILTIN,
    Dump,
    Exec,
    Signal,
    Wait,
    on_target,
    signal_number,
    split_target,
)
from watchdogd.errors import ConfigError


def test_builtins_are_the_documented_ones() -> None:
    assert {name: policy.describe() for name, policy in BUILTIN.items()} == {
        "kill": ["SIGKILL"],
        "term": ["SIGTERM", "wait 10s", "SIGKILL"],
        "abort": ["SIGABRT", "wait 10s", "SIGKILL"],
        "log": [],
        "peer_dump": ["dump py-spy dump --pid {pid}"],
    }
    assert all(policy.target == "process" and policy.builtin for policy in BUILTIN.values())
    assert BUILTIN["peer_dump"].peers == "none"
    assert {policy.peers for name, policy in BUILTIN.items() if name != "peer_dump"} == {
        "peer_dump"
    }


@pytest.mark.parametrize(("value", "number"), [("SIGTERM", 15), ("term", 15), ("KILL", 9), (6, 6)])
def test_signal_names_and_numbers(value: str | int, number: int) -> None:
    assert signal_number(value) == number


def test_unknown_signal() -> None:
    with pytest.raises(ValueError, match="no signal named 'SIGNOPE'"):
        signal_number("SIGNOPE")


def test_config_adds_and_overrides_policies() -> None:
    config = parse_config(
        """
        [daemon]
        default_policy = "graceful"

        [policies.graceful]
        target = "tree"
        steps = [
            { exec = ["/usr/bin/logger", "{pid}"], timeout = 2 },
            { dump = true },
            { signal = "TERM" },
            { wait = 5 },
            { signal = 9 },
        ]
        root_only = true

        [policies.kill]
        steps = [ { dump = ["gdb", "-p", "{pid}"] }, { signal = "SIGKILL" } ]
        """,
        "x.toml",
    )
    policies = config.policy_set()
    graceful = policies["graceful"]
    assert graceful.target == "tree"
    assert graceful.root_only
    assert graceful.steps == (
        Exec(("/usr/bin/logger", "{pid}"), 2.0),
        Dump(),
        Signal(signal.SIGTERM),
        Wait(5.0),
        Signal(signal.SIGKILL),
    )
    assert policies["kill"].steps[0] == Dump(("gdb", "-p", "{pid}"))
    assert not policies["kill"].builtin
    assert policies["term"] == BUILTIN["term"]  # untouched built-ins stay


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (
            "[policies.x]\nsteps = [{ signal = 'SIGNOPE' }]",
            "policies.x.steps[0].signal: no signal named",
        ),
        (
            "[policies.x]\nsteps = [{ wait = 1, signal = 9 }]",
            "policies.x.steps[0]: a step has exactly one",
        ),
        ("[policies.x]\nsteps = [{}]", "policies.x.steps[0]: a step has exactly one of signal"),
        (
            "[policies.x]\nsteps = [{ wait = 1, timeout = 2 }]",
            "timeout applies to exec, dump and unblock",
        ),
        (
            "[policies.x]\nsteps = [{ wiat = 1 }]",
            "policies.x.steps[0].wiat: Object contains unknown field `wiat`",
        ),
        ("[policies.x]\ntarget = 'world'", "policies.x.target"),
        ("[policies.x]\nsteps = [{ exec = [] }]", "policies.x.steps[0].exec"),
        ("[daemon]\ndefault_policy = 'nope'", "daemon.default_policy: no policy 'nope'"),
        (
            "[policies.x]\nsteps = [{ signal = 9 }, { exec = ['ls', '{scope}'] }]",
            "policies.x.steps[1].exec: {scope} may stand only after a '--' argument",
        ),
        (
            "[policies.x]\nsteps = [{ exec = ['ls', '{scope}', '--'] }]",
            "policies.x.steps[0].exec: {scope} may stand only after a '--' argument",
        ),
        (
            "[policies.x]\nsteps = [{ dump = ['gdb', '-p', '{pid}', '{scope}'] }]",
            "policies.x.steps[0].dump: {scope} may stand only after a '--' argument",
        ),
        (
            "[policies.x]\nsteps = [{ exec = ['{scope}', '--'] }]",
            "policies.x.steps[0].exec: the program '{scope}' must be named literally",
        ),
        (
            "[policies.x]\nsteps = [{ exec = ['tool', '--', '--scope={scope}'] }]",
            "policies.x.steps[0].exec: '--scope={scope}': {pid} and {scope} are replaced only",
        ),
        ("[policies.'two words']\nsteps = []", "policies.two words: not a name"),
    ],
)
def test_bad_policies_name_file_and_key(document: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document, "/etc/watchdogd.toml")
    assert str(caught.value).startswith(
        ("/etc/watchdogd.toml: ", "/etc/watchdogd.toml, line 2: ", "/etc/watchdogd.toml, line 1: ")
    )
    assert expected in str(caught.value)


def test_scope_after_end_of_options_and_pid_anywhere_are_accepted() -> None:
    config = parse_config(
        """
        [policies.page]
        steps = [
            { exec = ["page-oncall", "--pid", "{pid}", "--", "{scope}", "{pid}"] },
            { dump = ["py-spy", "dump", "--pid", "{pid}"] },
            { dump = true },
        ]
        """,
        "x.toml",
    )
    exec_step, custom, default = config.policy_set()["page"].steps
    assert exec_step == Exec(("page-oncall", "--pid", "{pid}", "--", "{scope}", "{pid}"))
    assert custom == default == Dump()  # the default dumper passes its own rule


@pytest.mark.parametrize("step", [Exec, Dump])
def test_no_step_can_be_built_with_a_scope_that_could_be_an_option(step: type) -> None:
    # The rule holds however a step is made, not only when a file is loaded.
    with pytest.raises(ValueError, match="after a '--' argument"):
        step(("tool", "{scope}"))


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("group:term", ("group", "term")),
        ("tree:signal:USR1", ("tree", "signal:USR1")),
        ("process:kill", ("process", "kill")),
        ("cgroup:kill", None),
        ("signal:TERM", None),
        ("groupie:kill", None),
        ("kill", None),
    ],
)
def test_a_name_asks_for_a_target_by_its_prefix(name: str, split: tuple[str, str] | None) -> None:
    assert split_target(name) == split


def test_a_name_for_another_target_replaces_the_target_it_had() -> None:
    assert on_target("group", "kill") == "group:kill"
    assert on_target("process", "group:term") == "process:term"
    assert on_target("tree", "signal:USR1") == "tree:signal:USR1"
