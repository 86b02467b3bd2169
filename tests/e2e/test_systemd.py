"""systemd: the units and the drop-ins the docs show checked by systemd's own tools
(and the commands that verify them, as the docs give them), sd_notify to a fake
manager, and socket activation by systemd-socket-activate."""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from watchdogd.cli.watchdogd import main as watchdogd_main
from watchdogd.runtime.scrape import parse_address
from watchdogd_client import Client

from helpers.daemon import RunningDaemon
from helpers.namespaces import in_private_mounts
from helpers.pages import fenced, fenced_with
from helpers.per_user import AFTER, HUNG, worker_of_other
from helpers.waiting import PATIENCE

ROOT = Path(__file__).parents[2]
UNITS = ROOT / "systemd"
OPERATIONS = ROOT / "docs" / "operations.md"
INSTALLED = "/usr/local/bin/watchdogd"
WATCHDOGD = str(Path(sys.executable).parent / "watchdogd")

needs_systemd_tools = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or shutil.which("systemd-socket-activate") is None,
    reason="systemd's tools are not installed",
)


@pytest.fixture
def units(tmp_path: Path) -> Path:
    """The units, pointed at this install instead of the documented path."""
    for unit in ("watchdogd.service", "watchdogd.socket"):
        text = (UNITS / unit).read_text()
        (tmp_path / unit).write_text(text.replace(INSTALLED, WATCHDOGD))
    assert f"ExecStart={INSTALLED} " in (UNITS / "watchdogd.service").read_text()
    return tmp_path


@needs_systemd_tools
def test_the_units_verify_clean(units: Path) -> None:
    result = verify(units)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def verify(units: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` of the two units in ``units`` (and their drop-ins)."""
    return subprocess.run(
        [
            "systemd-analyze",
            "verify",
            str(units / "watchdogd.socket"),
            str(units / "watchdogd.service"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


def exposure(units: Path) -> float:
    """``systemd-analyze security``'s rating of the service in ``units``."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(units / "watchdogd.service")],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.search(r"Overall exposure level for watchdogd.service: ([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1))


@needs_systemd_tools
def test_the_service_is_hardened(units: Path) -> None:
    assert exposure(units) <= 2.0


def _settings(drop_in: str) -> list[tuple[str, str]]:
    pairs = [line.split("=", 1) for line in drop_in.splitlines() if line and line[0] not in "#["]
    return [(key, value) for key, value in pairs]


@needs_systemd_tools
def test_the_scrape_drop_in_verifies_and_opens_the_port_to_prometheus_alone(units: Path) -> None:
    drop_in = fenced_with(OPERATIONS, "ini", "--metrics-listen")
    (units / "watchdogd.service.d").mkdir()
    (units / "watchdogd.service.d" / "metrics.conf").write_text(
        drop_in.replace(INSTALLED, WATCHDOGD)
    )
    result = verify(units)
    assert (result.returncode, result.stderr) == (0, "")
    # The figure the page gives, and still "OK".
    rating = exposure(units)
    assert f"rates the unit with this drop-in {rating:.1f}" in " ".join(
        OPERATIONS.read_text().split()
    )
    assert rating <= 2.0

    settings = _settings(drop_in)
    assert ("PrivateNetwork", "no") in settings
    [families] = [value for key, value in settings if key == "RestrictAddressFamilies"]
    assert set(families.split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    # The deny list stays (no empty IPAddressDeny=); what passes is addresses, not "any".
    assert "IPAddressDeny" not in dict(settings)
    [allowed] = [value for key, value in settings if key == "IPAddressAllow"]
    assert [ipaddress.ip_address(address) for address in allowed.split()]
    # Its command line is the daemon's, with an address --metrics-listen takes.
    [command] = [value for key, value in settings if key == "ExecStart" and value]
    program, *args = shlex.split(command)
    assert program == INSTALLED
    context = watchdogd_main.make_context("watchdogd", args)
    assert context.params["socket_option"] == "/run/watchdogd/watchdogd.sock"
    host, port = parse_address(context.params["metrics_listen"])
    assert ipaddress.ip_address(host)
    assert 0 < port < 65536


def _documented(words: str) -> str:
    """The command of the page's ```sh blocks that starts with ``words``."""
    commands = [line for block in fenced(OPERATIONS, "sh") for line in block.splitlines()]
    [command] = [line for line in commands if line.startswith(words)]
    return re.split(r"\s+#\s", command, maxsplit=1)[0]


@needs_systemd_tools
@pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("unshare") is None, reason="needs root's unshare"
)
def test_the_documented_verify_is_clean_once_the_daemon_is_where_the_unit_names_it(
    tmp_path: Path,
) -> None:
    """The page's line, as written, in a mount namespace of its own whose
    /usr/local/bin holds the daemon (as after the page's ``ln -s``), and without it
    (the error the page says it gives)."""
    line = _documented("systemd-analyze verify systemd/")
    installed = tmp_path / "bin"
    installed.mkdir()
    (installed / "watchdogd").symlink_to(WATCHDOGD)

    def verify_with(usr_local_bin: Path) -> subprocess.CompletedProcess[str]:
        inside = f"mount --bind {usr_local_bin} /usr/local/bin && {line}"
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", inside],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )

    after = verify_with(installed)
    assert (after.returncode, after.stderr) == (0, "")
    (tmp_path / "empty").mkdir()
    before = verify_with(tmp_path / "empty")
    assert before.returncode != 0
    said = "Command /usr/local/bin/watchdogd is not executable: No such file or directory"
    assert said in before.stderr
    assert said in " ".join(OPERATIONS.read_text().split())


def test_nothing_hides_the_hosts_processes_or_users() -> None:
    text = (UNITS / "watchdogd.service").read_text()
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert not [line for line in settings if line.startswith(("PrivatePIDs=", "PrivateUsers="))]
    assert "ProtectProc=default" in settings
    for required in ("Type=notify", "Restart=always", "RuntimeDirectoryPreserve=yes", "Nice=-10"):
        assert required in settings
    assert any(line.startswith("WatchdogSec=") for line in settings)
    assert any(line.startswith("LimitNOFILE=") for line in settings)
    assert "CapabilityBoundingSet=CAP_KILL CAP_SYS_PTRACE" in settings
    # Every setting of [Service] says why: a comment opens the group of lines it is in.
    service = text.split("[Service]", 1)[1].split("[Install]", 1)[0].splitlines()
    group_commented = False
    for line in service:
        if not line:
            group_commented = False
        elif line.startswith("#"):
            group_commented = True
        else:
            assert group_commented, f"no comment says why: {line}"


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[socket.socket]:
    """A fake service manager: a datagram socket to receive sd_notify messages."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(PATIENCE)
    yield listener
    listener.close()


def messages(manager: socket.socket, until: str) -> list[dict[str, str]]:
    received = []
    while True:
        fields = dict(line.split("=", 1) for line in manager.recv(4096).decode().splitlines())
        received.append(fields)
        if until in fields:
            return received


def test_readiness_watchdog_pings_and_stopping(
    manager: socket.socket, socket_path: Path, tmp_path: Path
) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "200000"}
    daemon = RunningDaemon(socket_path, tmp_path / "log", [], env=env)
    daemon.start()
    try:
        [ready] = [m for m in messages(manager, "READY") if "READY" in m]
        assert ready["READY"] == "1"
        assert ready["STATUS"] == "0 timers on 0 processes, 0 connections"
        with Client(socket_path) as client:
            client.ping()  # it answers once READY=1 was sent
        started = time.monotonic()
        pings = 0
        while pings < 5:
            if "WATCHDOG" in messages(manager, "WATCHDOG")[-1]:
                pings += 1
        # WatchdogSec=0.2 s: a ping every 0.1 s, from the scheduler's loop.
        assert time.monotonic() - started < 2.0
    finally:
        daemon.stop(signal.SIGTERM)
    assert any(m.get("STOPPING") == "1" for m in messages(manager, "STOPPING"))


def test_an_abstract_notify_socket(socket_path: Path, tmp_path: Path) -> None:
    name = f"watchdogd-test-{tmp_path.name}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind("\0" + name)
        manager.settimeout(PATIENCE)
        daemon = RunningDaemon(socket_path, tmp_path / "log", [], env={"NOTIFY_SOCKET": "@" + name})
        daemon.start()
        try:
            assert "READY=1" in manager.recv(4096).decode()
        finally:
            assert daemon.stop() == 0


@needs_systemd_tools
def test_socket_activation_serves_the_passed_socket(socket_path: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    daemon = RunningDaemon(
        socket_path,
        tmp_path / "log",
        ["--state", str(state)],
        command=["systemd-socket-activate", "-l", str(socket_path), "--", WATCHDOGD],
    )
    daemon.start()
    try:
        bound_by_the_activator = socket_path.stat().st_ino
        with Client(socket_path) as client:
            client.acquire("activated", 60)
            [timer] = client.status().timers
            assert timer.scope == "activated"
    finally:
        daemon.stop(signal.SIGTERM)
    log = daemon.log()
    assert f"socket={socket_path}" in log
    assert "event=stopped" in log
    # The socket is systemd's: the daemon served it as passed and never unlinked it.
    assert socket_path.stat().st_ino == bound_by_the_activator


@needs_systemd_tools
@pytest.mark.skipif(os.getuid() != 0, reason="needs root: other users, mounts")
def test_a_worker_finds_and_trusts_the_host_daemon_as_the_shipped_units_run_it() -> None:
    # /run/watchdogd belongs to the service's DynamicUser= uid (RuntimeDirectory=),
    # and the socket is systemd's: the listener's credentials are those of whoever
    # called listen(2), root, whatever user the daemon runs as.
    service = 61234

    def scenario() -> Any:
        directory = Path("/run/watchdogd")
        directory.mkdir(mode=0o755)
        os.chown(directory, service, service)
        path = directory / "watchdogd.sock"
        daemon = RunningDaemon(
            path,
            Path("/tmp/watchdogd.log"),
            ["--state", "/tmp/state.db"],
            command=["systemd-socket-activate", "-l", str(path), "--", WATCHDOGD],
        )
        daemon.start()
        os.chmod(path, 0o666)  # the unit's SocketMode=
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(path))
                pid, uid, _ = struct.unpack(
                    "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                )
            worker = worker_of_other(hung_block)
        finally:
            daemon.stop(signal.SIGTERM)
        return {"listener": [pid, uid], "daemon": daemon.pid, "worker": worker}

    seen = in_private_mounts(scenario)
    # The activator listened, as root, then became the daemon (exec: the same pid).
    assert seen["listener"] == [seen["daemon"], 0]
    assert seen["worker"]["status"] == -signal.SIGKILL, seen
    assert AFTER <= seen["worker"]["seconds"] < HUNG


def hung_block() -> None:
    with Client().expires(after=AFTER):
        time.sleep(HUNG)
