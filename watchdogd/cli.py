"""The ``watchdogd`` command: read the config, set up logging, run the daemon."""

from __future__ import annotations

import functools
import os

import click
import trio

from watchdogd_client.paths import ENV_SOCKET, user_socket_path

from ._version import __version__
from .config import Config, load_config
from .daemon import run
from .errors import DaemonError
from .logs import LEVELS, setup


def daemon_socket_path(option: str | None, config: Config) -> str:
    """``--socket``, else ``$WATCHDOGD_SOCKET``, else the config's, else the default."""
    return option or os.environ.get(ENV_SOCKET) or config.daemon.socket or user_socket_path()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_option",
    metavar="PATH",
    help=f"Listen on PATH (default: ${ENV_SOCKET}, the config's socket, "
    "/run/watchdogd/watchdogd.sock for root, else $XDG_RUNTIME_DIR/watchdogd.sock).",
)
@click.option(
    "--config",
    "config_path",
    metavar="PATH",
    help="TOML config file; see the README for its keys.",
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
@click.version_option(__version__, prog_name="watchdogd")
def main(
    socket_option: str | None,
    config_path: str | None,
    log_level: str | None,
    metrics_textfile: str | None,
) -> None:
    """Run the watchdog daemon in the foreground.

    Workers arm timers over its Unix socket; a timer that passes its deadline has
    its policy carried out on the worker (SIGKILL by default). SIGTERM or SIGINT
    stops it; SIGHUP reloads the config file.
    """
    try:
        config = load_config(config_path) if config_path else Config()
        setup(log_level or config.daemon.log_level)
        trio.run(
            functools.partial(
                run,
                config,
                daemon_socket_path(socket_option, config),
                config_path=config_path,
                metrics_textfile=metrics_textfile,
            )
        )
    except DaemonError as exc:
        raise click.ClickException(str(exc)) from None
