"""Default scope names: the caller's ``file:line``.

Computed from ``sys._getframe`` (one frame lookup, no `inspect.stack()`, which reads
source files). Outside the main thread the thread's name is appended, so two threads
running the same line never share, or release, each other's timer.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Final

#: The daemon's default bound on a scope is 256 bytes; a default scope stays well under.
MAX_DEFAULT_SCOPE_BYTES: Final = 200


def caller_scope(depth: int = 1) -> str:
    """The ``file:line`` of the frame ``depth`` levels above the caller of this function."""
    return frame_scope(sys._getframe(depth + 1))


def frame_scope(frame: FrameType) -> str:
    """The default scope of a timer armed at ``frame``'s current line."""
    scope = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    thread = threading.current_thread()
    if thread is not threading.main_thread():
        scope = f"{scope}@{thread.name}"
    return shorten(scope)


def shorten(scope: str, limit: int = MAX_DEFAULT_SCOPE_BYTES) -> str:
    """Keep the end of an over-long scope (the file name and line), marked with '...'."""
    encoded = scope.encode()
    if len(encoded) <= limit:
        return scope
    tail = encoded[-(limit - 3) :].decode(errors="ignore")
    return "..." + tail
