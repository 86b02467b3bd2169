"""``make run`` and ``make test`` side by side, in a copy of the checkout: the test
tools are added to the venv beside what ``make run`` installed, never in its place,
so a ``make run`` in use keeps its daemon and its watchdogctl meanwhile.

What the Makefile would run is read with ``make -n`` (in the suite at every size);
the whole of it, a venv made by ``make run`` and the test tools added while its
daemon answers, takes a minute of pip's work, and runs under ``WATCHDOGD_SOAK=1``
(``make soak``) with a small package standing for the test tools.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.waiting import PATIENCE, wait_until

ROOT = Path(__file__).resolve().parents[2]
SOAK = os.environ.get("WATCHDOGD_SOAK") == "1"

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def checkout_copy(into: Path) -> Path:
    """The files ``make run`` and ``make test`` install from, copied into ``into``."""
    listed = subprocess.run(
        [
            "git",
            "ls-files",
            "Makefile",
            "pyproject.toml",
            "README.md",
            "client",
            "docs",
            "watchdogd",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in listed:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, into / name)
    return into


def planned(checkout: Path, target: str) -> list[str]:
    """The commands ``make target`` would run now (``make -n``)."""
    result = subprocess.run(
        ["make", "-n", target], cwd=checkout, capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()


@needs_make
def test_make_test_adds_the_test_tools_without_installing_the_packages_again(
    tmp_path: Path,
) -> None:
    checkout = checkout_copy(tmp_path)
    # The venv as `make run` left it: its python, and its stamp newer than both
    # pyproject.toml files.
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".venv" / "bin" / "python").symlink_to(shutil.which("python3") or "/bin/false")
    (checkout / ".venv" / ".installed").touch()
    later = time.time() + 10
    os.utime(checkout / ".venv" / ".installed", (later, later))
    installs = [line for line in planned(checkout, ".venv/.installed-test") if "pip" in line]
    assert len(installs) == 1, installs
    assert " install --no-compile -r .venv/test-requirements.txt" in installs[0]
    # From a fresh clone, the packages first (as `make run` installs them), then
    # the test tools alone.
    (checkout / ".venv" / ".installed").unlink()
    fresh = [line for line in planned(checkout, ".venv/.installed-test") if "pip" in line]
    assert [line.split("pip install")[1] for line in fresh] == [
        " -e ./client -e .",
        " --no-compile -r .venv/test-requirements.txt",
    ]


@needs_make
def test_the_test_tools_are_read_from_the_test_extra(tmp_path: Path) -> None:
    checkout = checkout_copy(tmp_path)
    (checkout / ".venv").mkdir()
    [read] = [
        line
        for line in planned(checkout, ".venv/.installed-test")
        if "> .venv/test-requirements.txt" in line
    ]
    subprocess.run(
        ["sh", "-c", read.replace(".venv/bin/python", "python3")], cwd=checkout, check=True
    )
    listed = (checkout / ".venv" / "test-requirements.txt").read_text().splitlines()
    assert "pytest>=8.0" in listed
    assert any(line.startswith("torch==") for line in listed)


@pytest.fixture
def made_run(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes], Path]]:
    """A copy of the checkout whose test extra is one small package, its venv made
    by ``make .venv/.installed``, and ``make run`` running in it: (the copy, make
    run's process, its socket)."""
    checkout = checkout_copy(tmp_path / "checkout")
    pyproject = checkout / "pyproject.toml"
    text = pyproject.read_text()
    start = text.index("test = [")
    pyproject.write_text(text[:start] + 'test = ["six"]' + text[text.index("]\n", start) + 1 :])
    subprocess.run(["make", ".venv/.installed"], cwd=checkout, capture_output=True, check=True)
    socket = tmp_path / "wd.sock"
    run = subprocess.Popen(
        ["make", "run", f"ARGS=--socket {socket} --no-state"],
        cwd=checkout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(socket.exists, what="make run's daemon to listen")
        yield checkout, run, socket
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(timeout=PATIENCE)


@needs_make
@pytest.mark.skipif(not SOAK, reason="a minute of pip's work: WATCHDOGD_SOAK=1 (make soak)")
def test_make_test_beside_a_running_make_run_leaves_it_its_tools(
    made_run: tuple[Path, subprocess.Popen[bytes], Path],
) -> None:
    checkout, run, socket = made_run
    tools = [checkout / ".venv" / "bin" / name for name in ("watchdogctl", "watchdogd")]
    before = [tool.stat().st_ino for tool in tools]
    missing: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            missing.extend(str(tool) for tool in tools if not tool.exists())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        subprocess.run(
            ["make", ".venv/.installed-test"], cwd=checkout, capture_output=True, check=True
        )
    finally:
        done.set()
        watcher.join()
    assert missing == []
    assert [tool.stat().st_ino for tool in tools] == before  # not installed again
    assert run.poll() is None
    ping = subprocess.run(
        [str(tools[0]), "--socket", str(socket), "ping"], capture_output=True, check=False
    )
    assert ping.returncode == 0, ping.stderr
    python = str(checkout / ".venv" / "bin" / "python")
    assert subprocess.run([python, "-c", "import six"], check=False).returncode == 0
