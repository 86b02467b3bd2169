"""Waiting on real things: a bound generous enough for a loaded machine."""

from __future__ import annotations

import time

#: Generous bound for things that should take milliseconds, so a loaded CI machine
#: does not turn a working feature into a failure.
PATIENCE = 10.0
#: For a process that imports torch, which alone takes seconds on an idle machine.
TORCH_PATIENCE = 60.0


def wait_until(condition: object, *, what: str, timeout: float = PATIENCE) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``timeout`` s."""
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
