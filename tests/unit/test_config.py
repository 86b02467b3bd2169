"""Config files: defaults, bounds, and errors that name the file and the key."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from watchdogd.cli.watchdogd import daemon_socket_path
from watchdogd.core.config import Config, PolicyConfig, parse_config
from watchdogd.core.policies import Unblock
from watchdogd.errors import ConfigError
from watchdogd.runtime.reload import MAX_CONFIG_BYTES, load_config

from helpers.cgroups import HYBRID, V1_ONLY
from helpers.special_files import NAMED, each_special, freed_after, make_special


def test_no_file_means_every_default() -> None:
    config = parse_config(b"", "empty.toml")
    assert config == Config()
    assert config.daemon.max_frame_bytes == 64 * 1024
    assert config.daemon.max_scope_bytes == 256
    assert config.daemon.max_timeout == 30 * 86400
    assert config.daemon.socket_mode == 0o666


def test_a_full_daemon_table(tmp_path: Path) -> None:
    path = tmp_path / "watchdogd.toml"
    path.write_text(
        """
        [daemon]
        socket = "/run/custom.sock"
        socket_mode = 0o660
        log_level = "debug"
        max_timers_per_uid = 50
        max_timeout = 3600
        """
    )
    daemon = load_config(str(path)).daemon
    assert (daemon.socket, daemon.socket_mode, daemon.log_level) == (
        "/run/custom.sock",
        0o660,
        "debug",
    )
    assert (daemon.max_timers_per_uid, daemon.max_timeout) == (50, 3600.0)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("[daemon]\nmax_timerz = 5\n", "unknown field `max_timerz`"),
        ("[daemon]\nmax_timers = 0\n", "daemon.max_timers: Expected `int` >= 1"),
        ('[daemon]\nlog_level = "loud"\n', "daemon.log_level"),
        ("\n[deamon]\n", "unknown field `deamon`"),
        ("[daemon\n", "not valid TOML"),
        ("[daemon]\nsocket_mode = 0o1777\n", "daemon.socket_mode"),
    ],
)
def test_errors_name_the_file_and_the_key(document: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document, "/etc/watchdogd.toml")
    message = str(caught.value)
    assert message.startswith(("/etc/watchdogd.toml: ", "/etc/watchdogd.toml, line 2: "))
    assert expected in message


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        (
            '[daemon]\nlog_levle = "debug"\n',
            "x.toml, line 2: daemon.log_levle: Object contains unknown field `log_levle`; "
            "did you mean `log_level`?",
        ),
        (
            "\n[deamon]\n",
            "x.toml, line 2: deamon: Object contains unknown field `deamon`; "
            "did you mean `daemon`?",
        ),
        (
            '[daemon]\nlog_level = "debgu"\n',
            "x.toml, line 2: daemon.log_level: Invalid enum value 'debgu'; valid: 'debug', "
            "'info', 'warning', 'error'; did you mean `debug`?",
        ),
        (
            "[daemon]\nsocket_mode = 666  # rw for all\n",
            "x.toml, line 2: daemon.socket_mode: 666 is a decimal number; a file mode is "
            "octal in TOML: write socket_mode = 0o666",
        ),
        (
            "daemon.socket_mode = 660\n",
            "x.toml, line 1: daemon.socket_mode: 660 is a decimal number; a file mode is "
            "octal in TOML: write socket_mode = 0o660",
        ),
        # The same key in two tables: the line is the one in the table at fault.
        (
            '[policies.a]\nstall = 3\nsteps = [ { signal = "SIGKILL" } ]\n\n'
            "[policies.b]\nstall = -1\n",
            "x.toml, line 6: policies.b.stall: Expected `float` > 0.0",
        ),
        (
            '[policies.a]\nsteps = [ { signal = "SIGKILL" } ]\n\n'
            '[policies.b]\nsteps = [\n  { signal = "SIGKILL", timeot = 3 },\n]\n',
            "x.toml, line 5: policies.b.steps[0].timeot: Object contains unknown field "
            "`timeot`; did you mean `timeout`?",
        ),
        (
            '[policies.a]\nsteps = [ { signal = "SIGKILL" } ]\n'
            '[policies.b]\nsteps = [ { signal = "SIGKIL" } ]\n',
            "x.toml, line 4: policies.b.steps[0].signal: no signal named 'SIGKIL'; "
            "did you mean `SIGKILL`?",
        ),
        (
            '[policies.p]\ntarget = "grup"\n',
            "x.toml, line 2: policies.p.target: Invalid enum value 'grup'; valid: 'process', "
            "'group', 'tree', 'cgroup'; did you mean `group`?",
        ),
    ],
)
def test_errors_give_the_line_and_the_nearest_valid_key(document: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(document, "x.toml")
    assert str(caught.value) == expected


#: A file with an error in nearly every table, the tables in another order than
#: the config model's, and a step with two.
MANY_ERRORS = """\
[fleet]
lease = 1
etcd = ["http://etcd:2379", 5]

[policies.graceful]
steps = [ { signal = "SIGTREM" }, { wait = 10 }, { signal = "SIGKILL" } ]
peers = "peer_dmp"

[policies.other]
steps = [ { sigal = "SIGKILL" }, { wait = -3 } ]
starvation_cpu = 10

[daemon]
max_timers = 0
default_policy = "trem"
socket_mode = 666

[histroy]
"""


def test_every_error_of_a_file_is_reported_at_once_in_the_files_order() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(MANY_ERRORS, "x.toml")
    assert str(caught.value).splitlines() == [
        "x.toml, line 2: fleet.lease: Expected `int` >= 2",
        "x.toml, line 3: fleet.etcd[1]: Expected `str`, got `int`",
        "x.toml, line 6: policies.graceful.steps[0].signal: no signal named 'SIGTREM'; "
        "did you mean `SIGTERM`?",
        "x.toml, line 7: policies.graceful.peers: no policy 'peer_dmp'; known: abort, "
        "graceful, kill, log, other, peer_dump, term, none; did you mean `peer_dump`?",
        # A step whose key is wrong is not also said to have no kind.
        "x.toml, line 10: policies.other.steps[0].sigal: Object contains unknown field "
        "`sigal`; did you mean `signal`?",
        "x.toml, line 10: policies.other.steps[1].wait: Expected `float` >= 0.0",
        "x.toml, line 11: policies.other.starvation_cpu: applies only with starvation_grace",
        "x.toml, line 14: daemon.max_timers: Expected `int` >= 1",
        "x.toml, line 15: daemon.default_policy: no policy 'trem'; known: abort, graceful, "
        "kill, log, other, peer_dump, term; did you mean `term`?",
        "x.toml, line 16: daemon.socket_mode: 666 is a decimal number; a file mode is octal "
        "in TOML: write socket_mode = 0o666",
        "x.toml, line 18: histroy: Object contains unknown field `histroy`; did you mean "
        "`history`?",
    ]


@pytest.mark.parametrize(
    ("step", "suggested"),
    [
        ('signal = "SIGTREM"', "SIGTERM"),
        ('signal = "trem"', "SIGTERM"),
        ('signal = "HUPP"', "SIGHUP"),
        ('signal = "TERMINATE"', "SIGTERM"),
    ],
)
def test_a_misspelt_signal_gets_the_nearest_name(step: str, suggested: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"[policies.p]\nsteps = [ {{ {step} }} ]\n", "x.toml")
    assert str(caught.value).endswith(f"; did you mean `{suggested}`?")


def test_a_signal_name_far_from_any_gets_no_suggestion() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config('[policies.p]\nsteps = [ { signal = "SIGBOOM" } ]\n', "x.toml")
    assert (
        str(caught.value) == "x.toml, line 2: policies.p.steps[0].signal: no signal named 'SIGBOOM'"
    )


def test_an_unknown_peer_policy_gets_the_nearest_name() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config('[policies.p]\npeers = "lgo"\n', "x.toml")
    assert str(caught.value).endswith("; did you mean `log`?")


def test_the_errors_of_a_reload_are_one_per_line_of_the_message() -> None:
    config = Config(policies={"p": PolicyConfig(peers="trem", starvation_cpu=1)})
    with pytest.raises(ConfigError) as caught:
        config.policy_set("reloaded.toml")
    assert str(caught.value).splitlines() == [
        "reloaded.toml: policies.p.starvation_cpu: applies only with starvation_grace",
        "reloaded.toml: policies.p.peers: no policy 'trem'; known: abort, kill, log, p, "
        "peer_dump, term, none; did you mean `term`?",
    ]


def test_a_mode_written_in_octal_or_as_zero_is_taken() -> None:
    assert parse_config("[daemon]\nsocket_mode = 0o600\n", "x").daemon.socket_mode == 0o600
    assert parse_config("[daemon]\nsocket_mode = 0\n", "x").daemon.socket_mode == 0


def test_starvation_settings_of_a_policy() -> None:
    policies = parse_config(
        """
        [policies.patient]
        steps = [ { signal = "SIGKILL" } ]
        starvation_grace = 30

        [policies.tuned]
        starvation_grace = 2.5
        starvation_pressure = 80
        starvation_cpu = 150
        """,
        "x.toml",
    ).policy_set()
    patient, tuned, kill = policies["patient"], policies["tuned"], policies["kill"]
    assert (patient.starvation_grace, patient.starvation_pressure, patient.starvation_cpu) == (
        30.0,
        50.0,
        25.0,
    )
    assert (tuned.starvation_grace, tuned.starvation_pressure, tuned.starvation_cpu) == (
        2.5,
        80.0,
        150.0,
    )
    assert kill.starvation_grace == 0.0


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ("starvation_pressure = 60", "policies.p.starvation_pressure: applies only with"),
        ("starvation_cpu = 10", "policies.p.starvation_cpu: applies only with starvation_grace"),
        ("starvation_grace = 0", "policies.p.starvation_grace: Expected `float` > 0"),
        ("starvation_grace = 1\nstarvation_pressure = 0", "starvation_pressure: Expected"),
        ("starvation_grace = 1\nstarvation_pressure = 101", "starvation_pressure: Expected"),
        ("starvation_grace = 1\nstarvation_cpu = -1", "starvation_cpu: Expected `float` >= 0"),
    ],
)
def test_starvation_settings_are_checked(table: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"[policies.p]\n{table}\n", "x.toml")
    assert expected in str(caught.value)
    assert str(caught.value).startswith("x.toml")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(str(tmp_path / "missing.toml"))


#: What the daemon calls each kind at the config's path: a symlink is followed.
FOLLOWED = {**NAMED, "symlink": "a character device"}


@each_special
def test_a_config_that_is_no_regular_file_is_refused_without_blocking(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "watchdogd.toml"
    make_special(kind, path)
    with freed_after(path), pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert str(caught.value) == (
        f"{path}: cannot read the config file: it is {FOLLOWED[kind]}, not a regular file"
    )


def test_a_config_is_read_through_a_symlink_and_bounded(tmp_path: Path) -> None:
    # ConfigMap mounts and config managers place the file through symlinks.
    target = tmp_path / "..data" / "watchdogd.toml"
    target.parent.mkdir()
    target.write_text("[daemon]\nevents = 50\n")
    link = tmp_path / "watchdogd.toml"
    link.symlink_to(target)
    assert load_config(str(link)).daemon.events == 50
    target.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=f"it is over {MAX_CONFIG_BYTES} bytes"):
        load_config(str(link))


def test_socket_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    from_file = parse_config('[daemon]\nsocket = "/from/file.sock"\n', "x")
    monkeypatch.setenv("WATCHDOGD_SOCKET", "/from/env.sock")
    assert daemon_socket_path("/from/option.sock", from_file) == "/from/option.sock"
    assert daemon_socket_path(None, from_file) == "/from/env.sock"
    monkeypatch.delenv("WATCHDOGD_SOCKET")
    assert daemon_socket_path(None, from_file) == "/from/file.sock"
    assert daemon_socket_path(None, Config()).endswith("watchdogd.sock")


CGROUP_POLICIES = """
[policies.job]
target = "cgroup"
steps = [ { signal = "SIGKILL" } ]

[policies.plain]
steps = [ { signal = "SIGKILL" } ]
"""


def test_a_cgroup_target_needs_cgroup_v2_on_the_host(tmp_path: Path) -> None:
    config = tmp_path / "watchdogd.toml"
    config.write_text(CGROUP_POLICIES)
    hybrid = tmp_path / "hybrid-mountinfo"
    hybrid.write_text(HYBRID)
    v1_only = tmp_path / "v1-mountinfo"
    v1_only.write_text(V1_ONLY)
    assert load_config(str(config), mountinfo=str(hybrid)).policies["job"].target == "cgroup"
    with pytest.raises(ConfigError) as caught:
        load_config(str(config), mountinfo=str(v1_only))
    assert str(caught.value).startswith(
        f"{config}: policies.job.target: 'cgroup' needs the cgroup v2 hierarchy, and this "
        "host has none mounted"
    )
    # A file without cgroup targets loads on such a host.
    config.write_text(CGROUP_POLICIES.replace('target = "cgroup"', 'target = "tree"'))
    assert load_config(str(config), mountinfo=str(v1_only)).policies["job"].target == "tree"


def test_the_targets_are_named_when_one_is_wrong() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config('[policies.x]\ntarget = "slice"\n', "w.toml")
    assert "valid: 'process', 'group', 'tree', 'cgroup'" in str(caught.value)


def test_an_unblock_step_takes_a_timeout_and_a_fallback_signal() -> None:
    config = parse_config(
        "[policies.keep]\n"
        'steps = [ { dump = true }, { unblock = "peers", fallback = "TERM", timeout = 30 } ]\n'
        "[fleet]\nunblock_after = 2.5\n",
        "x.toml",
    )
    policy = config.policy_set()["keep"]
    assert policy.steps[1] == Unblock(fallback=signal.SIGTERM, timeout=30.0)
    assert policy.describe() == ["dump py-spy dump --pid {pid}", "unblock peers, else SIGTERM"]
    assert config.fleet.unblock_after == 2.5
    assert Config().fleet.unblock_after == 10.0


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        ('unblock = "all"', "Invalid enum value 'all'"),
        ('unblock = "peers", signal = "KILL"', "exactly one of signal, wait, exec, dump, unblock"),
        ('signal = "KILL", fallback = "TERM"', "fallback applies to unblock steps only"),
        ('unblock = "peers", fallback = "SIGTREM"', "fallback: no signal named 'SIGTREM'"),
    ],
)
def test_a_wrong_unblock_step_is_refused_with_what_is_wrong(step: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"[policies.p]\nsteps = [ {{ {step} }} ]\n", "x.toml").policy_set()
    assert expected in str(caught.value)


@pytest.mark.parametrize("after", ["0", "-1", "86401"])
def test_unblock_after_is_bounded(after: str) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.unblock_after"):
        parse_config(f"[fleet]\nunblock_after = {after}\n", "x.toml")
