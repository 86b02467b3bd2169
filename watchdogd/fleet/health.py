"""Whether the fleet is connected, from the health of each part of the member
(`watchdogd.fleet.member`): registering, watching, publishing, following ranks.

The fleet is connected while every part that has reported works, registering and
watching among them (`NEEDED`); a part that fails makes it disconnected, saying
which part and why. Each change between the two is told to the core once
(`FleetBridge.fleet_changed`: status, a ``fleet_degraded`` or ``fleet_restored``
event, the ``fleet_connected`` metric) and logged once; each failure is counted
(`FleetBridge.fleet_failed`).
"""

from __future__ import annotations

import logging
from typing import Final, Generic

from ..core import FleetBridge, P
from ..logs import logfmt
from .etcd import EtcdClient

log = logging.getLogger("watchdogd")

#: The parts of the member whose health makes it "connected".
NEEDED: Final = ("register", "watch")


class Health(Generic[P]):
    """The health of each part of the member, told to ``core``; ``client`` names
    the endpoint the fleet is connected to."""

    def __init__(self, core: FleetBridge[P], client: EtcdClient) -> None:
        self._core = core
        self._client = client
        #: What is wrong with each part of the member (None: nothing).
        self._health: dict[str, str | None] = {}
        self._connected: bool | None = None

    def ok(self, part: str) -> None:
        """``part`` works."""
        if self._health.get(part, "") is not None:
            self._health[part] = None
            self._report()

    def down(self, part: str, error: str) -> None:
        """``part`` failed with ``error``: counted, and said when it is new."""
        self._core.fleet_failed()
        if self._health.get(part) != error:
            self._health[part] = error
            self._report()

    def forget(self, part: str) -> None:
        """``part`` has stopped, and its health no longer counts."""
        self._health.pop(part, None)
        self._report()

    def _report(self) -> None:
        """Say whether the fleet is connected: every part that needs etcd works now
        (registering and watching at least), or which does not, and why."""
        failing = [(part, error) for part, error in self._health.items() if error is not None]
        connected = not failing and all(part in self._health for part in NEEDED)
        if connected and self._connected is not True:
            self._connected = True
            log.info(logfmt("fleet_connected", endpoint=self._client.endpoint))
            self._core.fleet_changed(True, f"connected to {self._client.endpoint}")
        elif failing and self._connected is not False:
            self._connected = False
            part, error = failing[0]
            log.warning(logfmt("fleet_unreachable", part=part, error=error))
            self._core.fleet_changed(False, f"{part}: {error}")


__all__ = ["NEEDED", "Health"]
