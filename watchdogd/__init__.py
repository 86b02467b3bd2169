"""watchdogd: a per-host watchdog daemon for hung worker processes.

Workers arm timers keyed by ``(pid, scope)`` over a Unix socket; when one passes its
deadline the daemon carries out the timer's policy on that process. The protocol lives
in `watchdogd_protocol`. This package's parts: `core` (sans-IO: the timers,
requests, policies, incidents, config), `runtime` (the daemon on trio: wiring,
server, scheduler, the executor of policies, hooks), `host` (the kernel's
processes, cgroups, pressure, exits, systemd, user names), `storage` (the state's
files), `fleet` (etcd) and `cli` (the ``watchdogd`` and ``watchdogctl`` commands).
"""

from ._version import __version__

__all__ = ["__version__"]
