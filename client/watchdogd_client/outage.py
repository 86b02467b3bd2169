"""What a client does when the daemon cannot be reached: raise, or with
``on_unavailable="warn"`` run unprotected and say so once per outage.

Both clients hand every `DaemonUnavailable` of an acquire or a release to their
`Outage`, and tell it when a request is answered again.
"""

from __future__ import annotations

import logging
from typing import Literal

from .errors import DaemonUnavailable

__all__ = ["OnUnavailable", "Outage"]

log = logging.getLogger("watchdogd_client")

#: ``"raise"``: `DaemonUnavailable` reaches the caller; ``"warn"``: the caller runs
#: unprotected.
OnUnavailable = Literal["raise", "warn"]


class Outage:
    """Raises a ``"raise"`` client's `DaemonUnavailable`, and says once per outage
    that a ``"warn"`` client runs unprotected.

    The first failure of an outage is a warning; the ones after it, until a request
    is answered again, are debug lines, so a worker arming a timer per step does not
    write two lines per step while the daemon is down. The first answer after an
    outage is logged at info level and ends it.
    """

    __slots__ = ("_down", "on_unavailable")

    def __init__(self, on_unavailable: OnUnavailable) -> None:
        if on_unavailable not in ("raise", "warn"):
            raise ValueError(f"on_unavailable must be 'raise' or 'warn', not {on_unavailable!r}")
        self.on_unavailable: OnUnavailable = on_unavailable
        self._down = False

    def failed(self, exc: DaemonUnavailable) -> None:
        """An acquire or a release found no daemon: raise ``exc``, or log it."""
        if self.on_unavailable == "raise":
            raise exc
        if self._down:
            log.debug("still running unprotected: %s", exc)
            return
        self._down = True
        log.warning(
            "running unprotected until the daemon answers again "
            "(further failures are logged at debug level): %s",
            exc,
        )

    def answered(self, socket_path: str) -> None:
        """A request was answered: an outage, if there was one, is over."""
        if self._down:
            self._down = False
            log.info("watchdogd answers again at %s: timers protect again", socket_path)
