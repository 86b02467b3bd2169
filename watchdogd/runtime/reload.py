"""The config file, read and applied: at start (`load_config`) and on SIGHUP
(`Reloads`).

Invariants:

- Only a regular file is read (through symlinks, as config managers and
  ConfigMap mounts place it), opened without blocking and of at most
  `MAX_CONFIG_BYTES` (`watchdogd.storage.files.read_regular`): a FIFO, a
  socket, a directory or a device is refused with an error that names the path
  and what it is; at start that stops the daemon, at a reload it keeps the old
  config.
- A reload reads and checks the file in a worker thread, in a task of its own:
  neither the timers nor a SIGTERM wait on it (a hung network file system, the
  group database). Only applying the config runs in the event loop. Reloads run
  one at a time; SIGHUPs during one make one more after it.
- Any error keeps the config in force, and each reload is recorded as a
  ``reloaded`` or ``reload_failed`` event.
"""

from __future__ import annotations

import grp
from typing import Final

import trio

from ..core import Config, Service, lockouts, parse_config
from ..errors import ConfigError
from ..host.cgroups import MOUNTINFO, host_hierarchy
from ..host.process import Process
from ..logs import log, logfmt, set_level
from ..storage.faults import NotRegular
from ..storage.files import read_regular

#: The largest config file read: hundreds of times what a config of many policies
#: takes, and a bound on what a reload reads into memory.
MAX_CONFIG_BYTES: Final = 1024 * 1024


def load_config(path: str, *, mountinfo: str = MOUNTINFO) -> Config:
    """Read and decode the config file at ``path``, and check that this host can
    carry out its policies: a ``cgroup`` target needs the cgroup v2 hierarchy
    mounted (as the mount table ``mountinfo`` lists it). It blocks on nothing but
    the disk (and the group database): a reload calls it in a worker thread."""
    try:
        # Followed through symlinks, as config managers and ConfigMap mounts
        # place it; never a FIFO, whose open(2) would wait for a writer.
        data = read_regular(path, MAX_CONFIG_BYTES, follow=True)
    except NotRegular as exc:
        raise ConfigError(
            f"{path}: cannot read the config file: it is {exc.kind}, not a regular file"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: cannot read the config file: it is over {MAX_CONFIG_BYTES} bytes"
        )
    config = parse_config(data, path)
    # What the host lacks, once the file itself is right: each, at once.
    errors = []
    group = config.daemon.socket_group
    if isinstance(group, str):
        try:
            grp.getgrnam(group)
        except KeyError:
            errors.append(
                f"{path}: daemon.socket_group: no group named {group!r} on this host; "
                "create it (groupadd) or name another"
            )
    try:
        _check_cgroup_targets(config, path, mountinfo)
    except ConfigError as exc:
        errors.append(str(exc))
    if errors:
        raise ConfigError("\n".join(errors))
    for warning in lockouts(config):
        log.warning(logfmt("config_warning", path=path, note=warning))
    return config


def _check_cgroup_targets(config: Config, path: str, mountinfo: str) -> None:
    keys = [
        f"policies.{name}.target"
        for name, table in config.policies.items()
        if table.target == "cgroup"
    ]
    if not keys:
        return
    try:
        hierarchy = host_hierarchy(mountinfo)
    except OSError as exc:
        raise ConfigError(
            f"{path}: {keys[0]}: 'cgroup' needs the cgroup v2 hierarchy, and {mountinfo} "
            f"cannot be read to find it: {exc.strerror}"
        ) from None
    if hierarchy is None:
        raise ConfigError(
            f"{path}: {', '.join(keys)}: 'cgroup' needs the cgroup v2 hierarchy, and this "
            "host has none mounted (only cgroup v1 controllers, if any); use 'tree' or "
            "'group', or mount cgroup2 (systemd.unified_cgroup_hierarchy=1)"
        )


class Reloads:
    """Reloads of the config file on SIGHUP, one at a time, in a task of their
    own: the file is read in a worker thread (`reload`), so neither the timers
    nor a SIGTERM ever wait on it (a FIFO, a hung network file system, the group
    database). SIGHUPs that come during a reload make one more after it, which
    reads the file as it is then."""

    def __init__(
        self, service: Service[Process], config_path: str | None, log_level: str | None
    ) -> None:
        self._service = service
        self._config_path = config_path
        self._log_level = log_level
        self._asked = trio.Event()

    def ask(self) -> None:
        """A SIGHUP came: reload once the reload under way, if any, is over."""
        self._asked.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self._asked.wait()
            self._asked = trio.Event()
            await reload(self._service, self._config_path, self._log_level)


async def reload(
    service: Service[Process], config_path: str | None, log_level: str | None = None
) -> bool:
    """Re-read the config file and apply it; on any error keep the old config.
    ``log_level`` (the command line's) stays in force over the file's. Records a
    ``reloaded`` or ``reload_failed`` event either way. The file is read and
    checked in a worker thread, abandoned if the daemon stops meanwhile (it
    changes nothing); only applying it runs in the event loop."""
    if config_path is None:
        note = "no config file was given at start; nothing to reload"
        ok = False
    else:
        try:
            config = await trio.to_thread.run_sync(load_config, config_path, abandon_on_cancel=True)
        except ConfigError as exc:
            # An event is one line: the file's errors, one after another.
            note = "kept the old config: " + "; ".join(str(exc).splitlines())
            ok = False
        else:
            # The level first: a reload that turns debug on logs its own changes.
            set_level(log_level or config.daemon.log_level)
            service.context.log.reread_level()
            service.reconfigure(config)
            count = len(service.rules.policies)
            note = f"{config_path}: {count} policies, default {service.rules.default_policy!r}"
            ok = True
    service.record_reload(ok, note)
    return ok
