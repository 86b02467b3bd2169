"""``watchdogctl``: the operator's view of the daemon, over the thin client.

Every command takes ``--socket`` and ``--json``, before or after the command name
(after it wins). When the daemon cannot be reached, or refuses a request, the command
prints one line on stderr and exits non-zero; it never shows a traceback. Text output
is for people (scopes relative to the working directory or ``~``); ``--json`` output
is for programs and keeps every value as the daemon sent it.

This module holds the commands: their options, the one client each uses, and how
errors become exit statuses. The text is made by `watchdogd.cli.render`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import click
import msgspec

from watchdogd_client import Client, ErrorCode, RequestRefused, WatchdogdError
from watchdogd_client.paths import ENV_SOCKET
from watchdogd_client.protocol import EventInfo

from .._version import __version__
from .render import (
    event_text,
    expiry_report,
    format_duration,
    incident_lines,
    incidents_text,
    parse_metrics,
    policies_text,
    status_text,
    suggestions_text,
    why_lines,
)

#: Exit status of `run` when watchdogctl itself fails (as GNU timeout does).
RUN_FAILED: Final = 125
_FORWARDED: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds each follow request waits for news before asking again.
_FOLLOW_WAIT: Final = 30.0
#: How long `run` waits for the event of an expiry whose policy is still finishing.
_EXPIRY_PATIENCE: Final = 5.0


_F = TypeVar("_F", bound=Callable[..., Any])


class _RunFailed(click.ClickException):
    """watchdogctl run could not run its command under a timer."""

    exit_code = RUN_FAILED


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
    click.echo(status_text(report))


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
@_limit_option("How many of the latest events to print first.")
def events(follow: bool, limit: int) -> None:
    """Recorded events: expiries with each step's result, timers extended because
    their process was starved, exits with timers armed, unkillable targets,
    reloads. --json prints one JSON object per line."""
    as_json = _settings().as_json
    client = _client()
    page = client.events(limit=limit)
    _print_events(page.events, as_json)
    if not follow:
        return
    last = page.last
    try:
        while True:
            page = client.events(after=last, limit=1000, wait=_FOLLOW_WAIT)
            _print_events(page.events, as_json)
            last = page.last
    except KeyboardInterrupt:
        return


def _print_events(items: Sequence[EventInfo], as_json: bool) -> None:
    for event in items:
        _print_json(event) if as_json else click.echo(event_text(event))
    sys.stdout.flush()


@main.command()
@_common_options()
def policies() -> None:
    """The policies a timer may use, with their steps; * marks the default."""
    reply = _client().policies()
    if _settings().as_json:
        _print_json({"default": reply.default, "policies": reply.policies})
        return
    click.echo(policies_text(reply))


@main.command()
@_common_options()
def suggest() -> None:
    """What the daemon learned of how long each scope is held before its release,
    and the timeout it suggests: your own processes' (root: everyone's), by
    executable and scope. A scope needs some releases before it gets a suggestion;
    expires(after="auto", ceiling=...) arms it."""
    rows = _client().suggest()
    _print_json(rows) if _settings().as_json else click.echo(suggestions_text(rows))


@main.command()
@_common_options()
@_limit_option("How many of the latest incidents to list.")
def incidents(limit: int) -> None:
    """Incidents: a timer of a job expired, and the stacks of every rank of the
    job were gathered, host by host. Your jobs' (root: all); newest last."""
    rows = _client().incidents(limit=limit)
    _print_json(rows) if _settings().as_json else click.echo(incidents_text(rows))


@main.command()
@click.argument("incident")
@_common_options()
def incident(incident: str) -> None:
    """One incident: every rank of the job, host by host, hung ranks first, each
    with the frame it was waiting in, then its stack."""
    found = _client().incident(incident)
    _print_json(found) if _settings().as_json else click.echo("\n".join(incident_lines(found)))


@main.command()
@click.argument("pid", type=click.IntRange(min=1))
@_common_options()
def why(pid: int) -> None:
    """Everything the daemon knows about why process PID was, or would be, acted
    on: its timers (what is due and when, the timeout in force and where it came
    from, its progress), expiries in progress, the latest events about it, and
    what history suggests for its scopes."""
    reply = _client().why(pid)
    _print_json(reply) if _settings().as_json else click.echo("\n".join(why_lines(reply)))


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
@click.option("--policy", help="What to do at expiry (default: the daemon's default policy).")
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
@click.option("--policy", help="What to do at expiry (default: the daemon's default policy).")
@_common_options()
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(timeout: float, scope: str | None, policy: str | None, command: Sequence[str]) -> None:
    """Run COMMAND under a timer; exit with its status (128+N if signal N ended it).

    SIGINT, SIGTERM and SIGHUP are passed on to COMMAND. When the timer expires and
    the daemon's policy acts on COMMAND, a line on stderr says what it did (as
    timeout --verbose does). If watchdogctl itself fails (no daemon, a refused
    timer, a command that cannot start), it exits 125. --json prints, at the end,
    the pid, scope and exit status, and the daemon's expiry event (or null).
    """
    client = _client()
    scope = scope or f"run:{os.path.basename(command[0])}"
    try:
        # Also the proof that a daemon answers, before anything is started.
        seen = client.events(limit=1).last
    except WatchdogdError as exc:
        raise _RunFailed(str(exc)) from None
    with _Forwarder() as forwarder:
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            raise _RunFailed(str(exc)) from None
        forwarder.attach(child.pid)
        armed = time.monotonic()
        _arm_child(client, child, scope, timeout, policy)
        # Wait without reaping, so the pid still names the child when its timer
        # is released; then reap.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        # The daemon's deadline is later than armed + timeout: a child that ended
        # before that was not touched by the daemon, and no event is waited for.
        due = time.monotonic() >= armed + timeout
        found = _release_child(client, child, scope)
        returncode = child.wait()
        fired = due and found is not True
        expiry = _expiry_of(client, child.pid, scope, seen) if fired else None
    status = returncode if returncode >= 0 else 128 - returncode
    if expiry is not None:
        click.echo(
            f"watchdogctl: {expiry_report(command, child.pid, returncode, timeout, expiry)}",
            err=True,
        )
    if _settings().as_json:
        _print_json({"pid": child.pid, "scope": scope, "status": status, "expired": expiry})
    sys.exit(status)


def _expiry_of(client: Client, pid: int, scope: str, seen: int) -> EventInfo | None:
    """The daemon's ``expired`` event for the timer ``(pid, scope)``, or None when it
    did not fire. It is recorded once the policy has finished, a moment after the
    process died: wait for it, for at most `_EXPIRY_PATIENCE` seconds. An ``exited``
    event for the pid first means the exit found the timer still armed: no expiry."""
    deadline = time.monotonic() + _EXPIRY_PATIENCE
    while True:
        left = deadline - time.monotonic()
        try:
            page = client.events(after=seen, limit=1000, wait=max(left, 0.0))
        except WatchdogdError:
            return None  # the run's result does not depend on this report
        for event in page.events:
            if event.pid != pid:
                continue
            if event.kind == "expired" and event.scope == scope:
                return event
            if event.kind == "exited":
                return None
        seen = page.last
        if left <= 0:
            return None


class _Forwarder:
    """Passes SIGINT, SIGTERM and SIGHUP on to the child, through its pidfd.

    The handlers are in place before the child starts; a signal that arrives before
    the child exists is passed on as soon as it does. A pidfd (rather than
    Popen.send_signal, which may reap) keeps the child unreaped until `run` reaps it.
    """

    def __init__(self) -> None:
        self._pidfd: int | None = None
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Forwarder:
        self._previous = {signum: signal.signal(signum, self._forward) for signum in _FORWARDED}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._pidfd is not None:
            os.close(self._pidfd)

    def attach(self, pid: int) -> None:
        self._pidfd = os.pidfd_open(pid)
        for signum in self._pending:
            self._send(signum)

    def _forward(self, signum: int, frame: object) -> None:
        if self._pidfd is None:
            self._pending.append(signum)
        else:
            self._send(signum)

    def _send(self, signum: int) -> None:
        assert self._pidfd is not None
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signum)


def _arm_child(
    client: Client, child: subprocess.Popen[bytes], scope: str, timeout: float, policy: str | None
) -> None:
    try:
        client.acquire(scope, timeout, policy=policy, pid=child.pid, exit_releases=True)
    except RequestRefused as exc:
        if exc.code == ErrorCode.NO_SUCH_PROCESS:
            return  # it has exited already; nothing to watch
        _abandon(child)
        raise _RunFailed(str(exc)) from None
    except WatchdogdError as exc:
        _abandon(child)
        raise _RunFailed(str(exc)) from None


def _release_child(client: Client, child: subprocess.Popen[bytes], scope: str) -> bool | None:
    """Whether the release found the timer armed; None if it failed."""
    try:
        return client.release(scope, pid=child.pid)
    except WatchdogdError as exc:
        # The child has exited, so the daemon drops its timer on its own.
        click.echo(f"watchdogctl: could not release the timer: {exc}", err=True)
        return None


def _abandon(child: subprocess.Popen[bytes]) -> None:
    """The child must not run unprotected when its timer could not be armed."""
    child.kill()
    child.wait()
