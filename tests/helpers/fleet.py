"""Daemons standing in for the hosts of a fleet, on this machine, against a real etcd."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from helpers.daemon import RunningDaemon
from helpers.etcd import EtcdServer


@contextlib.contextmanager
def daemons_of(
    etcd: EtcdServer, root: Path, config: str, hosts: Sequence[str]
) -> Iterator[list[RunningDaemon]]:
    """A daemon for each of ``hosts``, each in a directory of its own under ``root``
    with ``config`` (formatted with ``etcd`` and ``host``), all on ``etcd``; each
    stopped at the end."""
    daemons: list[RunningDaemon] = []
    try:
        for host in hosts:
            directory = root / host
            directory.mkdir()
            written = directory / "watchdogd.toml"
            written.write_text(config.format(etcd=etcd.url, host=host))
            daemon = RunningDaemon(
                directory / "watchdogd.sock", directory / "log", ["--config", str(written)]
            )
            daemon.start()
            daemons.append(daemon)
        yield daemons
    finally:
        for daemon in daemons:
            daemon.stop()
