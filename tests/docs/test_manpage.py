"""The manual pages: generated from the commands, checked in, and never stale."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from watchdogd.cli import watchdogctl, watchdogd
from watchdogd.cli.manpage import PAGES, escape, pages

ROOT = Path(__file__).parents[2]
MAN = ROOT / "man"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_checked_in_page_is_the_generated_one(name: str) -> None:
    checked_in = (MAN / name).read_text(encoding="utf-8")
    assert checked_in == pages()[name], f"man/{name} is stale: run `make man` and commit it"


def test_every_command_and_option_is_on_its_page() -> None:
    ctl_page = pages()["watchdogctl.1"]
    ctx = click.Context(watchdogctl.main, info_name="watchdogctl")
    for name in watchdogctl.main.list_commands(ctx):
        command = watchdogctl.main.get_command(ctx, name)
        assert command is not None
        assert f'.SS "watchdogctl {name} ' in ctl_page
        for param in command.params:
            if isinstance(param, click.Option):
                for opt in param.opts:
                    assert escape(opt) in ctl_page, (name, opt)
    daemon_page = pages()["watchdogd.8"]
    for param in watchdogd.main.params:
        for opt in param.opts:
            assert escape(opt) in daemon_page


def test_roff_specials_are_escaped() -> None:
    assert escape("--socket") == "\\-\\-socket"
    assert escape("a\\b") == "a\\eb"
    assert escape(".starts a line\n'quoted") == "\\&.starts a line\n\\&'quoted"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
@pytest.mark.parametrize("name", sorted(PAGES))
def test_groff_reads_the_page_without_a_warning(name: str, tmp_path: Path) -> None:
    page = tmp_path / name
    page.write_text(pages()[name], encoding="utf-8")
    result = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z", str(page)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_a_page_sends_its_reader_to_the_reference_pages_as_installed(name: str) -> None:
    page = pages()[name]
    assert "\\-\\-docs\\-path prints their directory" in page
    named = set(re.findall(r"\b([a-z-]+\.md)\b", page))
    assert "configuration.md" in named or "operations.md" in named
    assert sorted(file for file in named if not (ROOT / "docs" / file).is_file()) == []
    # A path of the checkout (docs/policies.md) is nowhere an installation has it.
    assert "docs/" not in page.replace("docs/ in a checkout", "")


@pytest.mark.parametrize("command", ["watchdogd", "watchdogctl"])
def test_both_commands_print_where_the_reference_pages_are(command: str) -> None:
    # Run from this checkout (an editable install): its docs/. The wheel's, installed,
    # is test_readme.py's test of the wheels.
    shown = subprocess.run(
        [str(Path(sys.executable).parent / command), "--docs-path"],
        capture_output=True, text=True, check=True, cwd="/",
    ).stdout  # fmt: skip
    assert shown == f"{ROOT.resolve() / 'docs'}\n"
