"""The READMEs run: every shell command and Python example in README.md,
client/README.md and docs/torch.md runs here against a live daemon, so they cannot
drift from what the code does.

A fenced ```sh or ```console block is run one command at a time with bash (console:
the lines after ``$ ``; the sample output after them is not compared), with the
suite's venv first on PATH, ``WATCHDOGD_SOCKET`` naming a daemon on a temporary
socket and HOME a scratch directory. A ```python block runs in a fresh interpreter
after a prelude that defines what the examples call (``train_one_epoch`` and the
like), and must leave no timer armed. A ```toml block must be a config the daemon
accepts; a ```bash block is a whole script, run by tests/docs/test_job_scripts.py.
Commands that cannot run here are listed in `SKIPPED`, and commands that
run changed in `ADAPTED`, each with its reason; an entry that no longer matches a
README line fails the suite, so neither list goes stale. The Installing section's
commands build the wheels and have pip check every install command.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from watchdogd.runtime.reload import load_config
from watchdogd_client import Client
from watchdogd_protocol import EventInfo

from helpers.daemon import RunningDaemon, configured_daemon
from helpers.pages import anchors, links
from helpers.processes import in_session, reap, sleeper
from helpers.waiting import PATIENCE, wait_until

ROOT = Path(__file__).resolve().parents[2]
TORCH_PAGE = ROOT / "docs" / "torch.md"
#: The reference pages the README links to, whose examples run here as its own do
#: (docs/fleet.md's are a cluster's recipes, checked by tests/fleet/test_deploy.py).
REFERENCE = sorted(page for page in (ROOT / "docs").glob("*.md") if page.name != "fleet.md")
READMES = [ROOT / "README.md", ROOT / "client" / "README.md", *REFERENCE]
VENV_BIN = str(Path(sys.executable).parent)
PYTHON = sys.executable

_SERVICE = "installs into /opt, /usr/local/bin and /etc/systemd and starts a unit: a host's set-up, not a test's (test_systemd.py verifies the units)"  # noqa: E501

_WHEELS = "builds the wheels and installs them: test_the_wheels_the_readme_builds_hold_both_packages_whole runs these lines in order, once, and checks what they made"  # noqa: E501

#: Commands not run, by how they start, and why.
SKIPPED = {
    "python3 -m pip wheel ": _WHEELS,
    ".venv/bin/pip install dist/": _WHEELS,
    ".venv/bin/pip install 'dist/": _WHEELS,
    "make run": "runs the daemon in the foreground until stopped: "
    "test_the_make_run_example_runs_as_written runs it, and the commands after it",
    "WATCHDOGD_SOCKET=/tmp/wd.sock ": "talks to the `make run` before it: "
    "test_the_make_run_example_runs_as_written runs them together",
    "make test": "is this suite",
    "python3 -m venv .venv": "makes a venv; the suite runs in the one `make` made",
    "/usr/bin/python3 -m venv /opt/watchdogd": _SERVICE,
    "/opt/watchdogd/bin/pip install": _SERVICE,
    "ln -s /opt/watchdogd/bin/watchdogd": _SERVICE,
    "cp systemd/watchdogd.service": _SERVICE,
    "systemctl daemon-reload": _SERVICE,
    "systemctl enable --now watchdogd.socket": _SERVICE,
    "systemd-analyze verify systemd/": "needs the daemon in /usr/local/bin, as the lines "
    "before it install it: test_systemd.py runs it as written, with the daemon there "
    "in a mount namespace of its own",
    "srun ": "needs a Slurm cluster; tests/unit/test_jobs.py checks the job and ranks "
    "taken from what Slurm sets",
    "watchdogctl job run-7": "asks about a job that hung: tests/docs/test_job_scripts.py "
    "runs these lines after job run-7 hung, each with the exit status the page gives it",
}

#: Rewrites of commands that run, as (pattern, replacement, reason).
ADAPTED = [
    (
        r"^\.venv/bin/pip install ",
        f"{PYTHON} -m pip install --dry-run --no-deps --no-index --no-build-isolation ",
        "installs nothing into the suite's venv: pip checks that it takes the paths, "
        "wheels and extras as written",
    ),
    (
        r"^python3 -m pip wheel ",
        f"{PYTHON} -m pip wheel --no-build-isolation ",
        "builds with the setuptools of the suite's venv (a test requirement): no "
        "download, and a third of the time",
    ),
    (
        r"^python3 -m pip ",
        f"{PYTHON} -m pip ",
        "the suite's python, which has pip",
    ),
    (r"(-w |\b)dist\b", r"\1{scratch}/dist", "the wheels go to a scratch directory"),
    (r"\b4021[12]\b", "{pid}", "a live process of the suite's stands for the example's pid"),
    (r"/tmp/units\b", "{scratch}/units", "the copies of the units go to a scratch directory"),
    (
        r"bench/crossings\.py",
        "bench/crossings.py --rounds 1",
        "one round: tests/docs/test_crossings.py runs the tool against a real daemon",
    ),
    (
        r"/tmp/before46\b",
        "{scratch}/before46",
        "the tree before the seams goes to a scratch directory",
    ),
    (
        r"/tmp/wd\.sock\b",
        "{scratch}/wd.sock",
        "the example's daemon listens in a scratch directory",
    ),
    (
        r"^make run ",
        f"make -o .venv/.installed BIN={VENV_BIN} run ",
        "the suite's venv, installed already: make installs nothing while the suite runs",
    ),
    (r"^(\S+=\S+ )?\.venv/bin/", rf"\1{VENV_BIN}/", "the suite's venv, wherever it is"),
    (
        r"\$PWD/\.venv/bin/",
        f"{VENV_BIN}/",
        "the suite's venv, wherever it is, stands for the checkout's",
    ),
]

#: Commands that follow until interrupted: they must start and keep running.
FOLLOWING = {"watchdogctl events --follow --json"}

#: What the Python examples call, defined before each runs.
PRELUDE = """
import atexit as _atexit, os as _os

def train_one_epoch():
    pass

def checkpoint_to_slow_storage():
    pass

loader = iter(range(10))
steps = range(3)

def run(step):
    pass

class _Loss:
    def backward(self):
        return None

def model(batch):
    return _Loss()

batch = [0]

async def fetch_batch():
    pass

def _left_armed():
    from watchdogd_client import Client
    with Client() as client:
        mine = [t.scope for t in client.status().timers if t.pid == _os.getpid()]
    if mine:
        print("LEFT ARMED:", mine)

_atexit.register(_left_armed)
"""


@dataclass(frozen=True)
class Block:
    """One fenced code block: its file, the line its fence is on, language, text."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found = []
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(\w+)\s*$", lines[index])
        index += 1
        if fence is None:
            continue
        start = index
        while not lines[index].startswith("```"):
            index += 1
        found.append(Block(path, start, fence.group(1), "\n".join(lines[start:index]) + "\n"))
        index += 1
    return found


ALL = [block for readme in READMES for block in blocks(readme)]


def commands(block: Block) -> list[str]:
    """The commands of a sh or console block, continuation lines joined."""
    if block.lang == "console":
        return [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
    joined = block.text.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def skipped(command: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if command.startswith(start)), None)


def adapt(command: str, **values: str) -> str:
    """``command`` with every `ADAPTED` rewrite; ``{name}`` in a replacement is
    ``values[name]``."""
    for pattern, template, _ in ADAPTED:
        replacement = template
        for name, value in values.items():
            replacement = replacement.replace(f"{{{name}}}", value)
        command = re.sub(pattern, replacement, command)
    return command


def bare(command: str) -> str:
    """``command`` without its trailing comment."""
    return re.split(r"\s+#\s", command, maxsplit=1)[0].strip()


def by_lang(*langs: str) -> list[Block]:
    return [block for block in ALL if block.lang in langs]


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    job = tmp_path / "nightly-job.sh"
    job.write_text("#!/bin/sh\nexit 0\n")
    job.chmod(0o755)
    return tmp_path


def environment(daemon: RunningDaemon, scratch: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "WATCHDOGD_SOCKET": str(daemon.socket_path),
        "HOME": str(scratch),
    }


@pytest.fixture
def live_pid() -> Iterator[str]:
    victim = sleeper()
    yield str(victim.pid)
    reap(victim)


@pytest.mark.parametrize("block", by_lang("sh", "console"), ids=lambda b: b.name)
def test_shell_commands_run(
    block: Block, daemon: RunningDaemon, scratch: Path, live_pid: str
) -> None:
    env = environment(daemon, scratch)
    # sh blocks use paths in the checkout (./client, systemd/); console blocks are an
    # operator's, anywhere.
    cwd = ROOT if block.lang == "sh" else scratch
    for command in commands(block):
        if skipped(command):
            continue
        line = adapt(command, scratch=str(scratch), pid=live_pid)
        if bare(command) in FOLLOWING:
            follower = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env)
            try:
                with pytest.raises(subprocess.TimeoutExpired):
                    follower.wait(timeout=1.0)
            finally:
                reap(follower)
            continue
        run_line(line, cwd=cwd, env=env, what=f"{block.name}: {command}")


def run_line(line: str, *, cwd: Path, env: dict[str, str] | None, what: str) -> None:
    """Run a documented command line (adapted) in bash: it must succeed, and pip
    must take every extra it names."""
    result = subprocess.run(
        ["bash", "-c", line],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, f"{what}\n{result.stdout}{result.stderr}"
    assert "does not provide the extra" not in result.stderr, result.stderr


def config_before(block: Block) -> str | None:
    """The config an example that names policies runs under: the last ```toml block
    before it, in its page, that defines each of them (the example's own set-up,
    as the page shows it); None for an example that names none."""
    names = set(re.findall(r"""policy=["'](\w+)["']""", block.text))
    if not names:
        return None
    defining = [
        config
        for config in by_lang("toml")
        if config.path == block.path
        and config.line < block.line
        and all(f"[policies.{name}]" in config.text for name in names)
    ]
    return defining[-1].text if defining else None


@pytest.fixture
def example_daemon(
    request: pytest.FixtureRequest, socket_path: Path, tmp_path: Path
) -> Iterator[RunningDaemon]:
    """The daemon a Python example runs against: with the config shown before it,
    when it names a policy no daemon has built in."""
    block: Block = request.node.callspec.params["block"]
    config = config_before(block) or ""
    with configured_daemon(socket_path, tmp_path, config) as running:
        yield running


def run_example(
    source: str, daemon: RunningDaemon, scratch: Path
) -> subprocess.CompletedProcess[str]:
    """``source`` after the prelude, in a fresh interpreter, a client of ``daemon``."""
    return subprocess.run(
        [PYTHON, "-c", PRELUDE + source],
        cwd=scratch,
        env=environment(daemon, scratch),
        capture_output=True,
        text=True,
        check=False,
        timeout=PATIENCE * 6,
    )


@pytest.mark.parametrize("block", by_lang("python"), ids=lambda b: b.name)
def test_python_examples_run(block: Block, example_daemon: RunningDaemon, scratch: Path) -> None:
    result = run_example(block.text, example_daemon, scratch)
    assert result.returncode == 0, f"{block.name}\n{result.stderr}"
    assert "LEFT ARMED" not in result.stdout, f"{block.name} leaves a timer armed"


def test_the_heartbeat_example_protects_as_written(
    socket_path: Path, tmp_path: Path, scratch: Path
) -> None:
    """Its loop stuck while its heartbeat renews: killed as stalled, under the
    config the README shows before it (its stall shortened to a second)."""
    [example] = [b for b in by_lang("python") if "timer.renew(progress=done)" in b.text]
    config = config_before(example)
    assert config is not None
    config = re.sub(r"(?m)^stall = \d+", "stall = 1", config)
    # Its second step never ends; the heartbeat's thread goes on renewing.
    stuck = "import time as _t\ndef run(step):\n    _t.sleep(600 if step == 1 else 0)\n"
    with configured_daemon(socket_path, tmp_path, config) as daemon:
        result = run_example(stuck + example.text, daemon, scratch)
        assert result.returncode == -signal.SIGKILL, result.stderr
        # Its event is recorded once the policy has run, a moment after the kill.
        expired: list[EventInfo] = []

        def recorded() -> bool:
            with daemon.client() as client:
                expired[:] = [e for e in client.events().events if e.kind == "expired"]
            return bool(expired)

        wait_until(recorded, what="the expiry's event")
        [event] = expired
        assert (event.scope, event.policy, event.reason) == ("train", "training", "stalled")


def test_the_make_run_example_runs_as_written(scratch: Path) -> None:
    """`make run` with the README's ARGS, then the commands after it, each in a shell
    of its own (no WATCHDOGD_SOCKET but their own): they reach that daemon, and its
    log has the debug lines the README promises."""
    [block] = [b for b in by_lang("sh") if "make run ARGS=" in b.text]
    run_it, *then = [adapt(c, scratch=str(scratch)) for c in commands(block)]
    env = {key: value for key, value in os.environ.items() if key != "WATCHDOGD_SOCKET"}
    with (scratch / "make-run.log").open("w") as log:
        made = subprocess.Popen(
            ["bash", "-c", bare(run_it)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until((scratch / "wd.sock").exists, what="make run's daemon to listen")
        for command in then:
            run_line(command, cwd=scratch, env=env, what=f"{block.name}: {command}")
    finally:
        os.killpg(made.pid, signal.SIGTERM)
        made.wait(timeout=PATIENCE)
    logged = (scratch / "make-run.log").read_text()
    assert f"event=listening socket={scratch}/wd.sock" in logged
    assert " DEBUG event=connected " in logged, logged


def test_the_try_it_example_leaves_no_worker_behind_when_no_daemon_answers(
    tmp_path: Path, scratch: Path
) -> None:
    [example] = [b for b in by_lang("python") if '"try-it"' in b.text]
    alone = subprocess.Popen(
        [PYTHON, "-c", example.text],
        cwd=scratch,
        env={**os.environ, "WATCHDOGD_SOCKET": str(tmp_path / "no-daemon.sock")},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its session, whose id is its pid, holds its sleep
    )
    try:
        _, err = alone.communicate(timeout=PATIENCE)
        assert alone.returncode == 1
        assert "DaemonUnavailable: watchdogd is not reachable" in err
        wait_until(lambda: in_session(alone.pid) == [], what="the example's sleep to end")
    finally:
        for pid in in_session(alone.pid):
            os.kill(pid, signal.SIGKILL)
        reap(alone)


@pytest.mark.parametrize("block", by_lang("toml"), ids=lambda b: b.name)
def test_config_examples_are_accepted(block: Block, tmp_path: Path) -> None:
    config = tmp_path / "watchdogd.toml"
    # The reference lists every key with a placeholder policy table.
    config.write_text(block.text.replace("[policies.NAME]", "[policies.name]\nsteps = []"))
    load_config(str(config))


def test_every_skip_and_adaptation_still_matches_a_readme_line() -> None:
    lines = [command for block in by_lang("sh", "console") for command in commands(block)]
    for start in SKIPPED:
        assert any(line.startswith(start) for line in lines), f"stale SKIPPED entry {start!r}"
    for pattern, _, _ in ADAPTED:
        assert any(re.search(pattern, line) for line in lines), f"stale ADAPTED {pattern!r}"
    for command in FOLLOWING:
        assert command in map(bare, lines), f"stale FOLLOWING entry {command!r}"


def test_every_block_is_of_a_kind_this_suite_knows() -> None:
    # ini blocks are systemd drop-ins, shown, not run; bash blocks are whole
    # scripts, which tests/docs/test_job_scripts.py runs.
    assert {block.lang for block in ALL} <= {"sh", "console", "python", "toml", "ini", "bash"}


def _installing() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Installing", 1)[1].split("\n## ", 1)[0]
    return [
        command
        for block in blocks_of_text(section)
        for command in commands(block)
        if block.lang == "sh"
    ]


def blocks_of_text(text: str) -> list[Block]:
    return [
        Block(ROOT / "README.md", 0, match.group(1), match.group(2))
        for match in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    ]


def test_the_wheels_the_readme_builds_hold_both_packages_whole(tmp_path: Path) -> None:
    [build] = [command for command in _installing() if " wheel " in command]
    subprocess.run(
        ["bash", "-c", adapt(build, scratch=str(tmp_path))],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    # The client's distribution holds two packages: the client and the wire protocol.
    packages = [
        ("watchdogd", "watchdogd", ROOT),
        ("watchdogd_client", "watchdogd_client", ROOT / "client"),
        ("watchdogd_client", "watchdogd_protocol", ROOT / "client"),
    ]
    for distribution, package, parent in packages:
        folder = parent / package
        [wheel] = (tmp_path / "dist").glob(f"{distribution}-0.1.0-py3-none-any.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
        sources = {
            str(path.relative_to(folder.parent))
            for path in folder.rglob("*")
            if path.suffix in (".py", ".typed") and "__pycache__" not in path.parts
        }
        assert sources <= names, f"{wheel.name} lacks {sorted(sources - names)}"
    # The reference pages are the daemon's package data.
    pages = {f"watchdogd/docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    [daemon_wheel] = (tmp_path / "dist").glob("watchdogd-0.1.0-py3-none-any.whl")
    assert pages <= set(zipfile.ZipFile(daemon_wheel).namelist())
    # Installed from the wheel alone, the daemon starts (its imports are all there).
    target = tmp_path / "site"
    subprocess.run(
        [PYTHON, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target),
         *map(str, sorted((tmp_path / "dist").glob("*.whl")))],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    shown = subprocess.run(
        [
            PYTHON,
            "-c",
            "import watchdogd.cli.watchdogd, watchdogd.cli.watchdogctl, watchdogd_protocol\n"
            "print(watchdogd.__file__, watchdogd_protocol.__file__)",
        ],
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=tmp_path,  # not the checkout, whose watchdogd/ would come first
        capture_output=True,
        text=True,
        check=True,
    )
    assert [path.startswith(str(target)) for path in shown.stdout.split()] == [True, True]
    # Where the manual pages send a reader: the pages as installed.
    docs = subprocess.run(
        [PYTHON, "-m", "watchdogd", "--docs-path"],
        env={**os.environ, "PYTHONPATH": str(target)}, cwd=tmp_path,
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert docs == f"{target / 'watchdogd' / 'docs'}\n"
    assert (target / "watchdogd" / "docs" / "configuration.md").read_text() == (
        (ROOT / "docs" / "configuration.md").read_text()
    )
    # The README's lines that install the wheels name the files this build made, and
    # pip takes them, extras included (a dry run, as test_shell_commands_run does).
    installs = [command for command in _installing() if "dist/" in command and command != build]
    assert installs
    for command in installs:
        for wheel_name in re.findall(r"dist/([\w.-]+\.whl)", command):
            assert (tmp_path / "dist" / wheel_name).exists(), wheel_name
        run_line(adapt(command, scratch=str(tmp_path)), cwd=ROOT, env=None, what=command)


def test_a_client_from_the_readme_example_finds_the_daemon(daemon: RunningDaemon) -> None:
    # The examples rely on $WATCHDOGD_SOCKET; this is the daemon they talk to.
    with Client(daemon.socket_path) as client:
        assert client.ping() >= 0


def test_every_reference_page_is_linked_from_the_readme_and_every_link_resolves() -> None:
    linked = {file for file, _ in links(ROOT / "README.md")}
    assert set(REFERENCE) <= linked, sorted(page.name for page in set(REFERENCE) - linked)
    for page in [ROOT / "README.md", *REFERENCE]:
        for file, anchor in links(page):
            assert file.exists(), f"{page.name}: {file}"
            assert not anchor or anchor in anchors(file), f"{page.name}: {file.name}#{anchor}"


def test_the_readme_is_read_in_minutes() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 250
