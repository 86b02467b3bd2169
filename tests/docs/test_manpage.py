"""The manual pages: generated from the commands, checked in, and never stale."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import click
import pytest

from watchdogd.cli import watchdogctl, watchdogd
from watchdogd.cli.manpage import PAGES, escape, pages

MAN = Path(__file__).parents[2] / "man"


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
