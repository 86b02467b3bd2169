"""``watchdogctl``: the operator's view of the daemon, over the thin client.

Every command takes ``--socket`` and ``--json``, before or after the command name
(after it wins). When the daemon cannot be reached, or refuses a request, the command
prints one line on stderr and exits non-zero; it never shows a traceback. Text output
is for people (scopes relative to the working directory or ``~``); ``--json`` output
is for programs and keeps every value as the daemon sent it.

This module holds the commands: their options, the one client each uses, and how
errors become exit statuses. The text is made by `watchdogd.cli.render`; the child of
``watchdogctl run`` and its timer are `watchdogd.cli.run`'s.
"""

from __future__ import annotations

import os
import pwd
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import click
import msgspec
from click.shell_completion import CompletionItem

from watchdogd_client import Client, DaemonUnavailable, RequestRefused, WatchdogdError
from watchdogd_client.paths import ENV_SOCKET
from watchdogd_protocol import ErrorCode, EventInfo, HangsReply, IncidentInfo

from .._version import __version__
from ..core import TargetKind
from .reference import docs_path_option
from .render import (
    event_text,
    expiry_report,
    format_duration,
    hangs_text,
    incident_lines,
    incidents_text,
    parse_metrics,
    policies_text,
    status_text,
    suggestions_text,
    why_lines,
)
from .run import run_under_timer

#: Seconds each follow request waits for news before asking again.
_FOLLOW_WAIT: Final = 30.0
#: Seconds between tries of a daemon that went away while followed.
_FOLLOW_RETRY: Final = 0.5


_F = TypeVar("_F", bound=Callable[..., Any])


class _Settings:
    """What ``--socket`` and ``--json`` chose, before or after the command name, and
    the one client the command uses (made on first use, closed with the command)."""

    def __init__(self) -> None:
        self.socket_path: str | None = None
        self.as_json = False
        self._client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.socket_path)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _complete_policy(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """The daemon's policies, for the shell's completion of ``--policy``; none when
    no daemon answers within a second (completion must not hang a shell)."""
    settings = ctx.find_object(_Settings)
    try:
        with Client(None if settings is None else settings.socket_path, timeout=1.0) as client:
            names = [policy.name for policy in client.policies().policies]
    except (WatchdogdError, OSError):
        return []
    return [CompletionItem(name) for name in names if name.startswith(incomplete)]


def _settings() -> _Settings:
    return click.get_current_context().ensure_object(_Settings)


def _take_socket(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # Options are processed group first, then command: a later value wins.
    if value is not None:
        ctx.ensure_object(_Settings).socket_path = value


def _take_json(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(_Settings).as_json = True


_SOCKET_HELP: Final = (
    "The daemon's socket (default: $WATCHDOGD_SOCKET, else your own daemon's "
    "if one listens, else /run/watchdogd/watchdogd.sock)."
)


def _common_options(*, envvar: str | None = None) -> Callable[[_F], _F]:
    """``--socket`` and ``--json``, for the group and for every command alike."""

    def decorate(function: _F) -> _F:
        function = click.option(
            "--json",
            "as_json",
            is_flag=True,
            expose_value=False,
            callback=_take_json,
            help="Print JSON instead of text.",
        )(function)
        return click.option(
            "--socket",
            "socket_path",
            metavar="PATH",
            envvar=envvar,
            expose_value=False,
            callback=_take_socket,
            help=_SOCKET_HELP,
        )(function)

    return decorate


class _Group(click.Group):
    """Turns the client's errors into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except WatchdogdError as exc:
            raise click.ClickException(str(exc)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@_common_options(envvar=ENV_SOCKET)
@docs_path_option
@click.version_option(__version__, prog_name="watchdogctl")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Inspect and drive the watchdogd daemon.

    Every command takes --socket and --json, before or after its name. With no
    daemon to answer, a command prints one line on stderr and exits 1.
    """
    ctx.call_on_close(ctx.ensure_object(_Settings).close)


def _limit_option(help_text: str) -> Callable[[_F], _F]:
    """``--limit/-n``: how many of the latest records a command shows."""
    return click.option(
        "--limit",
        "-n",
        type=click.IntRange(min=1, max=10_000),
        default=20,
        show_default=True,
        help=help_text,
    )


def _client() -> Client:
    return _settings().client()


def _print_json(value: object) -> None:
    click.echo(msgspec.json.encode(value).decode())


def _width() -> int | None:
    """The width tables are fitted to: ``$COLUMNS`` when it is a positive number,
    else the width of the terminal on stdout; None when stdout is no terminal (a
    pipe, a file): there a table is printed whole, as ps prints its lines."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdecimal() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns or None
    except (OSError, ValueError):  # not a terminal, or no file descriptor at all
        return None


@main.command()
@_common_options()
def status() -> None:
    """The daemon's summary and the armed timers you may see, soonest first.

    A non-root user sees the timers of their own processes only; the summary then
    gives both counts. Scopes are shown relative to the working directory, or with
    ~ for your home directory; --json gives them in full.
    """
    report = _client().status()
    if _settings().as_json:
        _print_json({"daemon": report.daemon, "timers": report.timers})
        return
    click.echo(status_text(report, width=_width()))


@main.command()
@_common_options()
def ping() -> None:
    """Check that the daemon answers."""
    client = _client()
    seconds = client.ping()
    if _settings().as_json:
        _print_json({"socket": client.socket_path, "round_trip": seconds})
    else:
        click.echo(f"watchdogd at {client.socket_path} answered in {seconds * 1000:.2f} ms")


@main.command()
@_common_options()
@click.option("--follow", "-f", is_flag=True, help="Keep printing events as they happen.")
@click.option(
    "--stacks",
    is_flag=True,
    help="After each event, the output of its steps: a dump's stacks, a hook's output.",
)
@_limit_option("How many of the latest events to print first.")
def events(follow: bool, stacks: bool, limit: int) -> None:
    """Recorded events, one a line: expiries with each step's result, timers
    extended because their process was starved, exits with timers armed,
    unkillable targets, reloads. A step that has output says how many lines;
    --stacks prints them after the event, or see `watchdogctl incident ID`.
    --json prints one JSON object per line, output included."""
    as_json = _settings().as_json
    client = _client()
    page = client.events(limit=limit)
    if not page.events and not follow and not as_json:
        click.echo("No events.")
    _print_events(page.events, as_json, stacks)
    if not follow:
        return
    last = page.last
    away = False
    try:
        while True:
            try:
                page = client.events(after=last, limit=1000, wait=_FOLLOW_WAIT)
            except DaemonUnavailable as exc:
                # Restarted, or stopped for a while: its events are numbered on
                # from where they were, so asking after the last one seen again
                # prints each event once.
                if not away:
                    click.echo(f"watchdogctl: {exc}; waiting for it", err=True)
                away = True
                time.sleep(_FOLLOW_RETRY)
                continue
            if away:
                click.echo("watchdogctl: the daemon is back", err=True)
                away = False
            _print_events(page.events, as_json, stacks)
            last = page.last
    except KeyboardInterrupt:
        return


def _print_events(items: Sequence[EventInfo], as_json: bool, stacks: bool) -> None:
    for event in items:
        _print_json(event) if as_json else click.echo(event_text(event, stacks=stacks))
    sys.stdout.flush()


@main.command()
@_common_options()
def policies() -> None:
    """The policies a timer may use, with their steps; * marks the default."""
    reply = _client().policies()
    if _settings().as_json:
        _print_json({"default": reply.default, "policies": reply.policies})
        return
    click.echo(policies_text(reply, width=_width()))


@main.command()
@_common_options()
def suggest() -> None:
    """What the daemon learned of how long each scope is held before its release,
    and the timeout it suggests: your own processes' (root: everyone's), by
    executable and scope. A scope needs some releases before it gets a suggestion;
    expires(after="auto", ceiling=...) arms it."""
    rows = _client().suggest()
    if _settings().as_json:
        _print_json(rows)
    else:
        click.echo(suggestions_text(rows, width=_width()))


@main.command()
@_common_options()
@_limit_option("How many of the latest incidents to list.")
def incidents(limit: int) -> None:
    """Incidents: a timer of a job expired, and the stacks of every rank of the
    job were gathered, host by host. Your jobs' (root: all); newest last."""
    rows = _client().incidents(limit=limit)
    if _settings().as_json:
        _print_json(rows)
    else:
        click.echo(incidents_text(rows, width=_width()))


@main.command()
@click.argument("incident")
@_common_options()
def incident(incident: str) -> None:
    """One incident: every rank of the job, host by host, the ranks whose timer expired first, each
    with the frame it was waiting in, then its stack."""
    found = _client().incident(incident)
    if _settings().as_json:
        _print_json(found)
    else:
        click.echo("\n".join(incident_lines(found, width=_width())))


#: ``watchdogctl job``'s exit statuses besides 0 (the job may be restarted), 1 (a
#: refusal, or another error) and 2 (a command line click cannot parse).
JOB_REPEATING: Final = 3
JOB_UNKNOWN: Final = 4
JOB_UNREACHABLE: Final = 5
#: Seconds between asks while an incident of the job gathers its verdict.
_JOB_POLL: Final = 0.25


def _uid_of(user: str | None) -> int | None:
    """The uid ``--user`` names (a name, or a number), None for none given."""
    if user is None:
        return None
    if user.isdecimal():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise click.BadParameter(f"no user {user!r} on this host", param_hint="--user") from None


@main.command()
@click.argument("job_name", metavar="JOB")
@click.option(
    "--user",
    metavar="USER",
    help="The job's owner, a name or a uid (root only; by default your own jobs).",
)
@click.option(
    "--reset",
    is_flag=True,
    help="Clear the job's repeating mark, after a fix: its hangs count anew from now.",
)
@click.option(
    "--wait",
    metavar="SECONDS",
    type=click.FloatRange(min=0, max=3600),
    default=60.0,
    show_default=True,
    help="Seconds to wait first for the verdict of an incident of the job still "
    "gathering (0: answer at once).",
)
@_common_options()
def job(job_name: str, user: str | None, reset: bool, wait: float) -> None:
    """Whether job JOB may be restarted: its hangs, the fingerprint of each (the
    verdict's kind, the culprits' frames, the collective), and its incidents.

    A job whose incidents' verdicts name the same hang repeat_limit times within
    repeat_window (3 times in a day by default) is marked repeating: a launcher's
    retry loop, or a Slurm requeue script, stops restarting it. --reset clears
    the mark once the cause is fixed. A job is its owner's: root names the
    owner with --user. An incident of the job still gathering its evidence is
    waited for first, up to --wait seconds.

    Exit status: 0 the job may be restarted; 3 its hang repeats (not to be
    restarted); 4 the daemon knows no timer, incident or hang of the job; 5 no
    daemon answers; 1 any other error (a refusal, with one line on stderr).
    """
    uid = _uid_of(user)
    try:
        reply = _job_settled(job_name, uid, wait)
        if reset:
            reply = _client().hangs(job_name, uid=uid, reset=True)
    except DaemonUnavailable as exc:
        click.echo(f"watchdogctl: {exc}", err=True)
        sys.exit(JOB_UNREACHABLE)
    except RequestRefused as exc:
        if exc.code != ErrorCode.NO_SUCH_JOB:
            raise
        click.echo(f"watchdogctl: {exc}", err=True)
        sys.exit(JOB_UNKNOWN)
    if _settings().as_json:
        _print_json(reply)
    else:
        click.echo(hangs_text(reply, width=_width()))
    sys.exit(JOB_REPEATING if reply.repeating else 0)


def _job_settled(job_name: str, uid: int | None, wait: float) -> HangsReply:
    """The job's hangs, once no incident of it is still gathering, or after
    ``wait`` seconds."""
    client = _client()
    until = time.monotonic() + wait
    told = False
    while True:
        reply = client.hangs(job_name, uid=uid)
        gathering = [i.id for i in reply.incidents if _gathering(i)]
        if not gathering or time.monotonic() >= until:
            return reply
        if not told:
            click.echo(f"watchdogctl: waiting for the verdict of incident {gathering[0]}", err=True)
            told = True
        time.sleep(_JOB_POLL)


def _gathering(incident: IncidentInfo) -> bool:
    """Whether an expiry's incident has yet to settle its verdict (one a daemon
    kept from before it counted hangs has settled, with no word on its hang)."""
    settled = incident.repeat or (incident.verdict is not None and incident.verdict.settled)
    return incident.kind == "expired" and not settled


@main.command()
@click.argument("pid", type=click.IntRange(min=1))
@_common_options()
def why(pid: int) -> None:
    """Everything the daemon knows about why process PID was, or would be, acted
    on: its timers (what is due and when, the timeout in force and where it came
    from, its progress), expiries in progress, the latest events about it, and
    what history suggests for its scopes."""
    reply = _client().why(pid)
    if _settings().as_json:
        _print_json(reply)
    else:
        click.echo("\n".join(why_lines(reply, exists=reply.timers != [] or _exists(pid))))


def _exists(pid: int) -> bool:
    """Whether process ``pid`` exists, as kill(2) tells this user (and /proc, in
    its own pid namespace): nothing the daemon knows of another user's processes."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    return True


@main.command()
@_common_options()
def metrics() -> None:
    """The daemon's metrics in the Prometheus text exposition format.

    --json prints them parsed: a list of metric families, each with its name,
    type, help and samples (name, labels, value), as prometheus_client reads them.
    """
    text = _client().metrics()
    if _settings().as_json:
        _print_json(parse_metrics(text))
    else:
        click.echo(text, nl=False)


@main.command()
@click.option("--pid", type=click.IntRange(min=1), required=True, help="The process to watch.")
@click.option("--scope", required=True, help="The timer's scope.")
@click.option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), required=True, help="Seconds."
)
@click.option(
    "--policy",
    shell_complete=_complete_policy,
    help="What to do at expiry (default: the daemon's default policy).",
)
@_common_options()
def arm(pid: int, scope: str, timeout: float, policy: str | None) -> None:
    """Arm (or re-arm) the timer (PID, SCOPE)."""
    remaining = _client().acquire(scope, timeout, policy=policy, pid=pid)
    if _settings().as_json:
        _print_json({"pid": pid, "scope": scope, "remaining": remaining})
    else:
        click.echo(f"armed pid {pid} scope {scope!r}: {format_duration(remaining)} left")


@main.command()
@click.option("--pid", type=click.IntRange(min=1), required=True, help="The process.")
@click.option("--scope", required=True, help="The timer's scope.")
@_common_options()
def release(pid: int, scope: str) -> None:
    """Disarm the timer (PID, SCOPE); succeeds also when none was armed."""
    found = _client().release(scope, pid=pid)
    if _settings().as_json:
        _print_json({"pid": pid, "scope": scope, "found": found})
    else:
        state = "released" if found else "no timer was armed for"
        click.echo(f"{state} pid {pid} scope {scope!r}")


@main.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), required=True, help="Seconds."
)
@click.option("--scope", help="The timer's scope (default: run:<command name>).")
@click.option(
    "--policy",
    shell_complete=_complete_policy,
    help="What to do at expiry (default: the daemon's default policy).",
)
@click.option(
    "--foreground",
    is_flag=True,
    help="Act on COMMAND alone, left in watchdogctl's process group so that it may "
    "read from the terminal; what it started is not signalled (as timeout --foreground).",
)
@click.option(
    "--tree",
    is_flag=True,
    help="Act on COMMAND and every process it started, also those that left its process group.",
)
@_common_options()
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    *,
    timeout: float,
    scope: str | None,
    policy: str | None,
    foreground: bool,
    tree: bool,
    command: Sequence[str],
) -> None:
    """Run COMMAND under a timer; exit with its status (128+N if signal N ended it).

    As with GNU timeout, COMMAND runs in a process group of its own, and at expiry
    the policy acts on that whole group: a script and the programs it started
    (the policy group:NAME, for the policy NAME). --foreground acts on COMMAND
    alone (process:NAME), --tree on it and all its descendants (tree:NAME).

    SIGINT, SIGTERM, SIGHUP and SIGQUIT are passed on to COMMAND (and its group,
    followed by SIGCONT). When the timer expires and the daemon's policy acts on
    COMMAND, a line on stderr says what it did (as timeout --verbose does). A
    COMMAND not found exits 127, one that cannot be run 126; if watchdogctl itself
    fails (no daemon, a refused timer), it exits 125. --json prints, at the end,
    the pid, scope and exit status, and the daemon's expiry event (or null).
    """
    if foreground and tree:
        raise click.UsageError("--foreground and --tree exclude each other")
    target: TargetKind = "process" if foreground else "tree" if tree else "group"
    client = _client()
    scope = scope or f"run:{os.path.basename(command[0])}"
    ran = run_under_timer(
        client, command, scope=scope, timeout=timeout, policy=policy, target=target
    )
    status = ran.returncode if ran.returncode >= 0 else 128 - ran.returncode
    if ran.expiry is not None:
        report = expiry_report(command, ran.pid, ran.returncode, timeout, ran.expiry)
        click.echo(f"watchdogctl: {report}", err=True)
    if _settings().as_json:
        _print_json({"pid": ran.pid, "scope": scope, "status": status, "expired": ran.expiry})
    sys.exit(status)
