"""The ``watchdogd`` command: read the config, set up logging, run the daemon."""

from __future__ import annotations

import functools
import os
import signal

import click
import trio

from watchdogd_client.paths import ENV_SOCKET, user_socket_path

from .._version import __version__
from ..core import Config
from ..errors import ConfigError, DaemonError
from ..host.systemd import inherited_listener
from ..logs import LEVELS, set_level, setup
from ..runtime.daemon import run
from ..runtime.reload import load_config
from ..runtime.server import Listener
from ..runtime.textfile import write_textfile
from ..storage.store import default_state_path
from .reference import docs_path_option


def daemon_socket_path(option: str | None, config: Config) -> str:
    """``--socket``, else ``$WATCHDOGD_SOCKET``, else the config's, else the default."""
    return option or os.environ.get(ENV_SOCKET) or config.daemon.socket or user_socket_path()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_option",
    metavar="PATH",
    help=f"Listen on PATH (default: ${ENV_SOCKET}, the config's socket, "
    "/run/watchdogd/watchdogd.sock for root, else $XDG_RUNTIME_DIR/watchdogd.sock, "
    "or /tmp/watchdogd-UID/watchdogd.sock without XDG_RUNTIME_DIR).",
)
@click.option(
    "--config",
    "config_path",
    metavar="PATH",
    help="TOML config file; configuration.md of the reference pages (--docs-path) lists its keys.",
)
@click.option(
    "--log-level",
    type=click.Choice(list(LEVELS)),
    help="Overrides the config's log_level (default: info).",
)
@click.option(
    "--metrics-textfile",
    metavar="PATH",
    help="Write the Prometheus metrics to PATH every few seconds, atomically "
    "(for node_exporter's textfile collector).",
)
@click.option(
    "--metrics-listen",
    metavar="ADDR",
    help="Serve the Prometheus metrics at http://ADDR/metrics (HOST:PORT, or PORT on "
    "127.0.0.1). Anyone who can reach ADDR reads them.",
)
@click.option(
    "--metrics-jobs",
    is_flag=True,
    help="Name jobs and their owners' uids in the metrics served and written to the "
    "textfile (watchdogctl metrics names them to root always).",
)
@click.option(
    "--state",
    "state_option",
    metavar="PATH",
    help="Keep armed timers in PATH (SQLite) across restarts (default: the config's "
    "state, else beside the socket, e.g. /run/watchdogd/watchdogd.state.db).",
)
@click.option("--no-state", is_flag=True, help="Keep timers in memory only.")
@docs_path_option
@click.version_option(__version__, prog_name="watchdogd")
def main(
    *,
    socket_option: str | None,
    config_path: str | None,
    log_level: str | None,
    metrics_textfile: str | None,
    metrics_listen: str | None,
    metrics_jobs: bool,
    state_option: str | None,
    no_state: bool,
) -> None:
    """Run the watchdog daemon in the foreground.

    Workers arm timers over its Unix socket; a timer that passes its deadline has
    its policy carried out on the worker (SIGKILL by default). Armed timers are kept
    in a state file and survive a restart. SIGTERM or SIGINT stops it; SIGHUP reloads
    the config file. Under systemd it serves a socket passed by socket activation
    and reports readiness and watchdog pings through $NOTIFY_SOCKET.
    """
    # SIGHUP's default action ends the process, and the daemon's receiver is in
    # place only after the config is read, the socket bound and the state loaded:
    # hold a SIGHUP sent meanwhile, and `run` takes it as a reload once it is up.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        setup(log_level or "info")  # what loading the config warns of is seen
        config = load_config(config_path) if config_path else Config()
        set_level(log_level or config.daemon.log_level)
        inherited = inherited_listener()
        if inherited is not None:
            socket_path = inherited.getsockname()
            listener: Listener | None = Listener(inherited, socket_path, inode=None)
        else:
            socket_path = daemon_socket_path(socket_option, config)
            listener = None
        if metrics_textfile is not None:
            try:  # once now: a path that cannot be written stops the start, plainly
                write_textfile(metrics_textfile, "")
            except OSError as exc:
                raise ConfigError(
                    f"--metrics-textfile {metrics_textfile}: cannot write it: {exc.strerror}"
                ) from None
        state = None if no_state else state_option or config.daemon.state
        trio.run(
            functools.partial(
                run,
                config,
                socket_path,
                listener=listener,
                state_path=None if no_state else state or default_state_path(socket_path),
                config_path=config_path,
                metrics_textfile=metrics_textfile,
                metrics_listen=metrics_listen,
                metrics_jobs=metrics_jobs,
                log_level=log_level,
            )
        )
    except DaemonError as exc:
        raise click.ClickException(str(exc)) from None
