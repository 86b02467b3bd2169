"""The config in force: policies looked up by name (the families built in by name
included), chosen by a caller, and what a reload changes."""

from __future__ import annotations

import pytest

from watchdogd.core.config import parse_config
from watchdogd.core.rules import ABSENT, Change, Rules
from watchdogd.errors import Refusal

RETARGETED = parse_config(
    """
    [policies.graceful]
    target = "cgroup"
    root_only = true
    stall = 30
    steps = [ { signal = "TERM" }, { wait = 5 }, { signal = "KILL" } ]
    """,
    "x.toml",
)


@pytest.mark.parametrize("target", ["process", "group", "tree"])
def test_a_policy_on_another_target_is_that_policy_in_all_but_its_target(target: str) -> None:
    rules = Rules(RETARGETED)
    graceful = rules.named("graceful")
    retargeted = rules.named(f"{target}:graceful")
    assert graceful is not None
    assert retargeted is not None
    assert (retargeted.name, retargeted.target) == (f"{target}:graceful", target)
    assert retargeted.steps == graceful.steps
    assert (retargeted.root_only, retargeted.stall) == (True, 30)
    assert retargeted.plan != graceful.plan  # a resumed expiry goes on under its own
    # The one a timer armed with the name runs, after a reload as before it.
    assert rules.policy_for(f"{target}:graceful") == (retargeted, "")
    kill = rules.named(f"{target}:signal:KILL")
    assert kill is not None
    assert (kill.target, kill.describe()) == (target, ["SIGKILL"])


@pytest.mark.parametrize(
    "name", ["group:nope", "group:group:kill", "tree:process:kill", "cgroup:kill", "group:"]
)
def test_a_name_for_another_target_must_name_a_policy_of_one(name: str) -> None:
    rules = Rules(RETARGETED)
    assert rules.named(name) is None
    with pytest.raises(Refusal) as caught:
        rules.chosen(name, 1000)
    assert caught.value.code == "unknown_policy"
    assert "signal:NAME, process:NAME, group:NAME, tree:NAME" in caught.value.message


def test_a_root_only_policy_stays_root_only_on_another_target() -> None:
    rules = Rules(RETARGETED)
    with pytest.raises(Refusal) as caught:
        rules.chosen("group:graceful", 1000)
    assert caught.value.code == "permission_denied"
    assert rules.chosen("group:graceful", 0)[0] == "group:graceful"


def test_a_retargeted_policy_a_reload_removed_gives_way_to_the_default() -> None:
    rules = Rules(RETARGETED)
    rules.reconfigure(parse_config("", "x.toml"))
    policy, note = rules.policy_for("group:graceful")
    assert (policy.name, policy.target) == ("kill", "process")
    assert "'group:graceful' is no longer configured" in note


def test_a_reload_lists_each_setting_it_changed_in_the_order_of_the_file() -> None:
    rules = Rules(RETARGETED)
    changed = rules.reconfigure(
        parse_config(
            """
            [daemon]
            max_timers_per_uid = 500
            default_policy = "term"

            [history]
            margin = 3.0

            [policies.graceful]
            target = "tree"
            root_only = true
            stall = 30
            steps = [ { signal = "TERM" }, { wait = 5 }, { signal = "KILL" } ]

            [policies.kill]
            steps = [ { signal = "SIGTERM" } ]

            [policies.quick]
            steps = []
            """,
            "x.toml",
        )
    )
    assert changed == [
        Change("daemon.max_timers_per_uid", "10000", "500"),
        Change("daemon.default_policy", "kill", "term"),
        Change("history.margin", "2.0", "3.0"),
        Change("policies.graceful.target", "cgroup", "tree"),
        Change("policies.kill.steps", "SIGKILL", "SIGTERM"),
        Change("policies.kill.builtin", "True", "False"),  # the config's own from now on
        Change("policies.quick", ABSENT, "process: (record only)"),
    ]
    assert rules.reconfigure(RETARGETED)[-1] == Change(
        "policies.quick", "process: (record only)", ABSENT
    )
    assert rules.reconfigure(RETARGETED) == []


def test_a_request_naming_a_misspelt_policy_is_told_the_nearest() -> None:
    rules = Rules(RETARGETED)
    with pytest.raises(
        Refusal, match=r"no policy 'gracefull'; known: .*; did you mean `graceful`\?$"
    ):
        rules.chosen("gracefull", 0)
    with pytest.raises(Refusal, match=r"did you mean `group:graceful`\?$"):
        rules.chosen("group:gracefull", 0)
    with pytest.raises(Refusal) as far:
        rules.chosen("zzzzzz", 0)
    assert "did you mean" not in str(far.value)
