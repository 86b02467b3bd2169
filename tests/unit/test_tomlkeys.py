"""The line of a TOML text that sets a key, found by the key's whole path."""

from __future__ import annotations

import pytest

from watchdogd.core.tomlkeys import line_of, split_path, value_of

TEXT = """\
# a comment = not a key
[daemon]
log_level = "info"
socket_mode = 0o660  # rw for the group

[policies.a]
stall = 3
steps = [
  { signal = "SIGTERM" },
  { wait = 5 },
]

[ policies . "b" ]   # spaced and quoted
stall = 4
fleet.lease = 3
"""


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("daemon.log_level", 3),
        ("daemon.socket_mode", 4),
        ("daemon.max_timers", 2),  # not set: its table's header
        ("policies.a.stall", 7),
        ("policies.b.stall", 14),
        ("policies.a.steps[1].wait", 8),  # inside the array: the key holding it
        ("policies.b.fleet.lease", 15),
        ("policies.c.stall", None),  # the text sets nothing of policies.c
        ("history.keys", None),
    ],
)
def test_the_line_of_a_path(path: str, line: int | None) -> None:
    assert line_of(TEXT, split_path(path)) == line


def test_a_key_before_any_table_and_a_dotted_top_level_key() -> None:
    assert line_of("x = 1\ndaemon.log_level = 'debug'\n", ["daemon", "log_level"]) == 2
    assert line_of("x = 1\n", ["x"]) == 1


def test_the_value_as_written() -> None:
    assert value_of(TEXT, ["daemon", "socket_mode"]) == "0o660"
    assert value_of(TEXT, ["daemon", "max_timers"]) is None  # only its header
    assert value_of(TEXT, ["policies", "b", "stall"]) == "4"


def test_split_path() -> None:
    assert split_path("policies.rank.steps[0].signal") == ["policies", "rank", "steps", "signal"]
    assert split_path("") == []
