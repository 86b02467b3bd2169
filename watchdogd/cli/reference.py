"""Where the reference pages (the checkout's docs/*.md) are, and ``--docs-path``,
the option of both commands that prints it, as ``git --html-path`` does.

The wheel installs the pages with the code, as package data in the directory
``docs`` of the package (``site-packages/watchdogd/docs``: pyproject.toml maps the
checkout's docs/ there); a checkout, which an editable install runs from, has them
in its own ``docs/``. The manual pages name
the option rather than a path, since where a venv puts site-packages depends on
its Python.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import click

#: A page every installation of the reference pages has.
_PAGE: Final = "operations.md"

_F = TypeVar("_F", bound=Callable[..., Any])


def docs_path() -> Path | None:
    """The directory of the reference pages: the installed package's ``docs``, else
    the checkout's ``docs/`` when the package runs from one; None without either."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "docs"
    if (installed / _PAGE).is_file():
        return installed
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "docs" / _PAGE).is_file():
        return checkout / "docs"
    return None


def docs_path_option(function: _F) -> _F:
    """``--docs-path``: print `docs_path` and exit."""
    return click.option(
        "--docs-path",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_print_docs_path,
        help="Print the directory of the reference pages (Markdown) installed with "
        "watchdogd, and exit.",
    )(function)


def _print_docs_path(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    path = docs_path()
    if path is None:
        raise click.ClickException(
            "the reference pages are not installed here; they are docs/*.md of the "
            "checkout the package was built from"
        )
    click.echo(str(path))
    ctx.exit()
