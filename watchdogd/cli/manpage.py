"""Manual pages ``watchdogd(8)`` and ``watchdogctl(1)``, written from the click
commands themselves: every option, command and help text on a page is the one
``--help`` shows, so the pages cannot say something the commands do not.

``python -m watchdogd.cli.manpage DIR`` (``make man``) writes ``DIR/watchdogd.8`` and
``DIR/watchdogctl.1``. A page depends only on the commands and the version (no date,
no terminal width), so the pages checked in under ``man/`` are compared with a fresh
rendering by the suite and never drift.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Final

import click

from .._version import __version__
from . import watchdogctl, watchdogd

#: Where a page sends its reader for more: the reference pages the wheel installs
#: (`watchdogd.cli.reference`).
_REFERENCE: Final = (
    "The reference pages, in Markdown, are installed with the package: watchdogd "
    "--docs-path prints their directory (site-packages/watchdogd/docs of the Python "
    "it runs on; docs/ in a checkout)."
)

#: What a page says beyond the commands' help: (heading, paragraphs) per page.
_WATCHDOGD_SECTIONS: Final = (
    (
        "POLICY TARGETS",
        [
            "A policy in the config file ([policies.NAME], policies.md of the reference "
            'pages lists every key) names the processes its steps act on with target = "NAME":',
            ".TP\n.B process\nThe timer's process (the default).",
            ".TP\n.B group\nIts process group, never the daemon's own nor a pgid of 1 or "
            "less (then the process alone).",
            ".TP\n.B tree\nThe process and its descendants, each through a pidfd of its own.",
            ".TP\n.B cgroup\nEvery process in its cgroup v2 and the cgroups below it: SIGKILL "
            "through cgroup.kill (Linux 5.14 and later), any other signal to each process; "
            "never the root cgroup nor one holding the daemon (then the process alone). A "
            "timer armed by a user other than root signals only that user's processes, one "
            "by one. A host without cgroup v2 refuses such a policy at start and on reload.",
        ],
    ),
    (
        "ENVIRONMENT",
        [
            ".TP\n.B WATCHDOGD_SOCKET\nThe socket to listen on when --socket is not given.",
            ".TP\n.B XDG_RUNTIME_DIR\nWhere a daemon run by a user other than root puts its "
            "socket; without it, /tmp/watchdogd-UID/watchdogd.sock, in a directory only "
            "that user may enter.",
            '.TP\n.BR LISTEN_FDS ", " LISTEN_PID\nA socket passed by systemd socket '
            "activation, served instead of binding one.",
            '.TP\n.BR NOTIFY_SOCKET ", " WATCHDOG_USEC\nReadiness, status and watchdog '
            "pings for systemd (Type=notify, WatchdogSec=).",
        ],
    ),
    (
        "FILES",
        [
            ".TP\n.I /run/watchdogd/watchdogd.sock\nThe socket of the host's daemon.",
            ".TP\n.I /run/watchdogd/watchdogd.state.db\nIts armed timers (SQLite, with "
            "journal files beside it), kept across restarts.",
        ],
    ),
    (
        "SEE ALSO",
        [
            ".BR watchdogctl (1),\n.BR systemd.service (5)",
            _REFERENCE,
            "configuration.md: every key of the config file; policies.md: what a policy "
            "does; operations.md: running the daemon as a service, its events and metrics; "
            "storage.md: its state, and what a crash or a failing disk does to it; "
            "fleet.md: a cluster, through etcd.",
        ],
    ),
)

_WATCHDOGCTL_SECTIONS: Final = (
    (
        "EXIT STATUS",
        [
            "0 on success; 1 when the daemon cannot be reached or refuses the request, "
            "with one line on standard error; 2 for a command line click cannot parse. "
            "run exits with its command's status (128+N when signal N ended it), or 125 "
            "when it could not run the command under a timer.",
            "job exits 0 when the job may be restarted, 3 when its hang repeats (not to "
            "be restarted until a fix and --reset), 4 when the daemon knows no timer, "
            "incident or hang of the job, 5 when no daemon answers, and 1 for any other "
            "error (a refusal: another user's job, for a user other than root).",
        ],
    ),
    (
        "ENVIRONMENT",
        [
            ".TP\n.B WATCHDOGD_SOCKET\nThe daemon's socket when --socket is not given.",
            ".TP\n.B COLUMNS\nThe width tables fit, when it is a positive number; else the "
            "width of the terminal on standard output. Piped or redirected, tables are "
            "printed whole; --json is never cut.",
            ".TP\n.B _WATCHDOGCTL_COMPLETE\nbash_source, zsh_source or fish_source prints "
            "the shell completion script instead of running a command.",
        ],
    ),
    (
        "SEE ALSO",
        [
            ".BR watchdogd (8)",
            _REFERENCE.replace("watchdogd --docs-path", "watchdogctl --docs-path"),
            "operations.md: every command with an example, its text and its JSON; "
            "jobs.md: jobs, incidents, their verdicts and a hang that repeats; client.md: "
            "arming timers from a worker.",
        ],
    ),
)

#: File name -> (command, name, section, title, further sections).
PAGES: Final = {
    "watchdogd.8": (watchdogd.main, "watchdogd", 8, "System Administration", _WATCHDOGD_SECTIONS),
    "watchdogctl.1": (watchdogctl.main, "watchdogctl", 1, "User Commands", _WATCHDOGCTL_SECTIONS),
}


def escape(text: str) -> str:
    """``text`` as roff prints it: backslashes and hyphens literal, and no line
    read as a request because it starts with '.' or "'"."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(
        "\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n")
    )


def _paragraphs(help_text: str | None) -> Iterator[str]:
    """The help's paragraphs, each rewrapped as one line (as click rewraps them)."""
    text = inspect.cleandoc(help_text or "").split("\f")[0]
    for paragraph in text.split("\n\n"):
        lines = [line.strip() for line in paragraph.splitlines() if line.strip() != "\b"]
        if lines:
            yield " ".join(lines)


def _options(command: click.Command, ctx: click.Context) -> Iterator[str]:
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        names, help_text = record
        yield f".TP\n.B {escape(names)}\n{escape(help_text)}"


def render(
    command: click.Command,
    name: str,
    section: int,
    title: str,
    sections: Sequence[tuple[str, Sequence[str]]] = (),
) -> str:
    """The roff source of ``command``'s manual page."""
    ctx = click.Context(command, info_name=name, **command.context_settings)
    out = [
        f'.TH {name.upper()} {section} "" "watchdogd {__version__}" "{title}"',
        ".SH NAME",
        f"{name} \\- {escape(command.get_short_help_str(limit=200).rstrip('.'))}",
        ".SH SYNOPSIS",
        f".B {name}\n{escape(' '.join(command.collect_usage_pieces(ctx)))}",
        ".SH DESCRIPTION",
    ]
    out += [f".PP\n{escape(paragraph)}" for paragraph in _paragraphs(command.help)]
    out += [".SH OPTIONS", *_options(command, ctx)]
    if isinstance(command, click.Group):
        out.append(".SH COMMANDS")
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is None or sub.hidden:
                continue
            sub_ctx = click.Context(sub, info_name=sub_name, parent=ctx, **sub.context_settings)
            usage = escape(" ".join([sub_name, *sub.collect_usage_pieces(sub_ctx)]))
            out.append(f'.SS "{name} {usage}"')
            out += [f".PP\n{escape(paragraph)}" for paragraph in _paragraphs(sub.help)]
            out += list(_options(sub, sub_ctx))
    for heading, paragraphs in sections:
        out.append(f".SH {heading}")
        out += [p if p.startswith(".") else f".PP\n{escape(p)}" for p in paragraphs]
    return "\n".join(out) + "\n"


def pages() -> dict[str, str]:
    """Every page: file name -> roff source."""
    return {file: render(*spec) for file, spec in PAGES.items()}


def main(argv: Sequence[str] | None = None) -> None:
    """Write every page into the directory named on the command line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m watchdogd.cli.manpage DIRECTORY")
    os.makedirs(args[0], exist_ok=True)
    for file, text in pages().items():
        with open(os.path.join(args[0], file), "w", encoding="utf-8") as out:
            out.write(text)


if __name__ == "__main__":
    main()
