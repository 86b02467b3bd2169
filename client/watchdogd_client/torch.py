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

torch's ``expires()`` names a timer without a scope after the frame that called
``acquire``, which is always contextlib's (``.../contextlib.py#137``): every such
timer of a thread would be one. Such a scope is replaced by the user's own call
site, the ``file:line`` of the ``with`` statement (``@thread`` outside the main
thread), as `watchdogd_client.expires` names it. Its release finds the same name:
each thread keeps the names it gave, newest last, per torch scope, and a release
takes the newest (blocks nest, so the newest open one is the one ending). A release
is the release of a block (`watchdogd_client.Client`): it names the arming it
releases, is sent, and its answer is read with the next request's; a block costs
the worker one round trip, its acquire. The timers carry the job and ranks torchrun
sets (`watchdogd_client.arming.job_of`).

The first timer starts the process's responder (`watchdogd_client.responder`),
through the client it arms with, so the daemon can ask a hung rank for its threads'
stacks and its Flight Recorder without ptrace. ``WatchdogdTimerClient(responder=False)``,
or ``WATCHDOGD_RESPONDER=0`` in the environment, turns it off.

Failures look like torch's own: with no daemon, `acquire` and `release` raise
`TimerServerUnavailable`, which is the ``BrokenPipeError`` torch's ``FileTimerClient``
raises with no server and also a `DaemonUnavailable`. A release that fails while an
exception is already on its way out of the ``expires()`` block is logged instead, so
it never replaces that exception.
"""

from __future__ import annotations

import contextlib
import signal as signals
import sys
import threading
import time
from typing import Final

try:
    import torch.distributed.elastic.timer.api
    from torch.distributed.elastic.timer.api import TimerClient
except ModuleNotFoundError as missing:  # pragma: no cover - tested in a subprocess
    if missing.name is None or missing.name.split(".")[0] != "torch":
        raise
    raise ImportError(
        "watchdogd_client.torch needs torch: install it with the client's torch extra, "
        "e.g. pip install './client[torch]' from a watchdogd checkout"
    ) from missing

from . import default_client
from .base import BaseClient, log
from .errors import DaemonUnavailable
from .responder import decline_responder
from .scope import frame_scope, shorten

__all__ = ["TimerServerUnavailable", "WatchdogdTimerClient", "policy_for_signal"]

#: An expiration already in the past still arms a timer, due at once.
_MIN_TIMEOUT: Final = 0.001
_MAX_SCOPE_BYTES: Final = 256


class TimerServerUnavailable(DaemonUnavailable, BrokenPipeError):
    """Raised by `WatchdogdTimerClient` when the daemon cannot be reached: the
    ``BrokenPipeError`` torch's own timer clients raise when their server is gone,
    and a `DaemonUnavailable` with its message and ``socket_path``."""


def policy_for_signal(signum: int) -> str:
    """The built-in policy that does what torch's timer server does with a timer's
    ``signal``: send it once. That is ``kill`` for SIGKILL and ``signal:NAME`` (a
    one-step built-in of the daemon) for any other; ValueError for a number that
    is no signal."""
    try:
        name = signals.Signals(signum).name
    except ValueError:
        raise ValueError(f"{signum!r} is not a signal number") from None
    return "kill" if signum == signals.SIGKILL else f"signal:{name}"


# torch is skipped by the type checker (its size would dominate the check), so its
# TimerClient is untyped here.
class WatchdogdTimerClient(TimerClient):  # type: ignore[misc]
    """A ``torch.distributed.elastic.timer.TimerClient`` backed by watchdogd.

    ``client`` defaults to the module-level default client (``$WATCHDOGD_SOCKET``,
    else the host's daemon), taken when first used. ``policy`` is the policy every
    timer is armed with (default: the daemon's); ``signal``, as torch's
    ``FileTimerClient(signal=...)`` takes it, chooses the built-in policy that sends
    that signal (see `policy_for_signal`); give one or the other. With
    ``responder=False`` the process answers no evidence request: its timers decline
    the responder its client would start (`watchdogd_client.responder`). It is
    picklable, so it may be passed to processes started with
    ``torch.multiprocessing.spawn``.
    """

    def __init__(
        self,
        client: BaseClient | None = None,
        *,
        policy: str | None = None,
        signal: int | None = None,
        responder: bool = True,
    ) -> None:
        if signal is not None:
            if policy is not None:
                raise ValueError("give policy= or signal=, not both")
            policy = policy_for_signal(signal)
        self._client = client
        self.policy = policy
        self.responder = responder

    @property
    def client(self) -> BaseClient:
        if self._client is None:
            self._client = default_client()
        return self._client

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        timeout = max(expiration_time - time.time(), _MIN_TIMEOUT)
        scope = shorten(scope_id, _MAX_SCOPE_BYTES)
        if _is_torch_default(scope_id):
            scope = _user_call_site()
            _given(scope_id).append(scope)
        if not self.responder:
            decline_responder()
        try:
            arm = self.client._arm_scope(scope, timeout, {"policy": self.policy})
        except DaemonUnavailable as exc:
            raise TimerServerUnavailable(str(exc), exc.socket_path) from exc
        _armed(scope).append(arm)

    def release(self, scope_id: str) -> None:
        # torch's expires() releases in a `finally`: while the block's own
        # exception is propagating (it is then the one being handled), raising
        # here would replace it.
        propagating = sys.exc_info()[1]
        scope = shorten(scope_id, _MAX_SCOPE_BYTES)
        if _is_torch_default(scope_id) and (given := _given(scope_id)):
            scope = given.pop()
        armed = _armed(scope)
        try:
            # As a block's release: a store, or sent and its answer read with the
            # next request's.
            self.client._release_scope(scope, armed.pop() if armed else 0)
        except DaemonUnavailable as exc:
            if propagating is not None:
                log.warning("could not release timer %r: %s", scope_id, exc)
                return
            raise TimerServerUnavailable(str(exc), exc.socket_path) from exc


#: The files of the frames between a user's ``with expires():`` and `acquire`.
_PLUMBING: Final = frozenset(
    {__file__, contextlib.__file__, torch.distributed.elastic.timer.api.__file__}
)
#: Per thread: the scopes given in place of each torch default scope, newest last.
_scopes = threading.local()


def _is_torch_default(scope_id: str) -> bool:
    """Whether ``scope_id`` is the name torch gives a timer without a scope."""
    filename, _, line = scope_id.rpartition("#")
    return filename == contextlib.__file__ and line.isdigit()


def _given(scope_id: str) -> list[str]:
    given: dict[str, list[str]] = _scopes.__dict__.setdefault("given", {})
    return given.setdefault(scope_id, [])


def _armed(scope: str) -> list[int]:
    """The numbers of the armings of ``scope`` in this thread, newest last (0 for
    one the daemon keeps no number of), for its release to name."""
    armed: dict[str, list[int]] = _scopes.__dict__.setdefault("armed", {})
    return armed.setdefault(scope, [])


def _user_call_site() -> str:
    """The ``file:line`` of the first frame up the stack outside torch's timer
    module, contextlib and this module (``@thread`` outside the main thread)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename in _PLUMBING:
        frame = frame.f_back
    return frame_scope(frame)
