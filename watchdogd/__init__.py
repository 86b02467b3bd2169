"""watchdogd: a per-host watchdog daemon for hung worker processes.

Workers arm timers keyed by ``(pid, scope)`` over a Unix socket; when one passes its
deadline the daemon carries out the timer's policy on that process. The protocol lives
in `watchdogd_client.protocol`; this package is the daemon (`watchdogd.daemon.run`)
and the operator CLI (`watchdogd.ctl`).
"""

from ._version import __version__

__all__ = ["__version__"]
