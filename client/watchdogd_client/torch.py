"""Drop-in for ``torch.distributed.elastic.timer``: torch's own ``expires()`` with
watchdogd as the server.

::

    import torch.distributed.elastic.timer as timer
    from watchdogd_client.torch import WatchdogdTimerClient

    timer.configure(WatchdogdTimerClient())
    with timer.expires(after=60):       # unchanged torch code
        train_step()

torch passes an absolute wall-clock expiration; it becomes a relative timeout at
once (so the daemon never depends on the worker's clock). Scope ids longer than the
daemon's bound (torch's are ``file#line``) are shortened the same way for acquire and
release. torch is imported by this module only.
"""

from __future__ import annotations

import time
from typing import Final

from torch.distributed.elastic.timer.api import TimerClient

from . import default_client
from .client import BaseClient
from .scope import shorten

__all__ = ["WatchdogdTimerClient"]

#: An expiration already in the past still arms a timer, due at once.
_MIN_TIMEOUT: Final = 0.001
_MAX_SCOPE_BYTES: Final = 256


# torch is skipped by the type checker (its size would dominate the check), so its
# TimerClient is untyped here.
class WatchdogdTimerClient(TimerClient):  # type: ignore[misc]
    """A ``torch.distributed.elastic.timer.TimerClient`` backed by watchdogd.

    ``client`` defaults to the module-level default client (``$WATCHDOGD_SOCKET``,
    else the host's daemon), taken when first used; ``policy`` is the policy every
    timer is armed with (default: the daemon's). It is picklable, so it may be passed
    to processes started with ``torch.multiprocessing.spawn``.
    """

    def __init__(self, client: BaseClient | None = None, *, policy: str | None = None) -> None:
        self._client = client
        self.policy = policy

    @property
    def client(self) -> BaseClient:
        if self._client is None:
            self._client = default_client()
        return self._client

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        timeout = max(expiration_time - time.time(), _MIN_TIMEOUT)
        self.client.acquire(shorten(scope_id, _MAX_SCOPE_BYTES), timeout, policy=self.policy)

    def release(self, scope_id: str) -> None:
        self.client.release(shorten(scope_id, _MAX_SCOPE_BYTES))
