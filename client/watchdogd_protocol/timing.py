"""The figures of a daemon's restart that the daemon and its clients both keep.

A worker's release may be on its way when the daemon dies. The client sends it again
once it has reconnected, and pauses at most `RECONNECT_PAUSE` between its attempts
while the daemon restarts; the daemon holds a restored timer that falls due within
`RESTART_GRACE` of its start until then, for that release to land. The grace is
several of the client's longest pauses, so that a client on a loaded host has time
for more than one try; a worker that is really hung is killed that much later.
"""

from __future__ import annotations

from typing import Final

__all__ = ["RECONNECT_PAUSE", "RESTART_GRACE"]

#: The longest pause, in seconds, between a client's attempts to reconnect to a
#: daemon that restarts: one back within tens of milliseconds is found at once,
#: one that loads a large state no later than this after it listens.
RECONNECT_PAUSE: Final = 0.25
#: How long after a start, in seconds, a restored timer that falls due waits for a
#: release on its way: four of a client's `RECONNECT_PAUSE`.
RESTART_GRACE: Final = 4 * RECONNECT_PAUSE
