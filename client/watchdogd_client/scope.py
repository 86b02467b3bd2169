"""Default scope names: the caller's ``file:line``.

Computed from ``sys._getframe`` (one frame lookup, no `inspect.stack()`, which reads
source files). Outside the main thread the thread's name is appended, so two threads
running the same line never share, or release, each other's timer. The main
thread's, asked for at every block, are kept by code object and line: a block on
the fast path costs less than the string it would otherwise make.
"""

from __future__ import annotations

import os
import sys
import threading
from types import CodeType, FrameType
from typing import Final

#: The daemon's default bound on a scope is 256 bytes; a default scope stays well under.
MAX_DEFAULT_SCOPE_BYTES: Final = 200
#: The main thread's scopes kept at most (a program has that many call sites
#: of ``expires()`` at the very most; past it they are made again).
_KEPT: Final = 4096
_main_scopes: dict[tuple[CodeType, int], str] = {}
#: The main thread (of a child after fork, the thread that forked: Python makes it
#: the main one there).
_main = threading.main_thread()


def _after_fork() -> None:
    global _main  # noqa: PLW0603 (the child's main thread is another object)
    _main = threading.main_thread()


os.register_at_fork(after_in_child=_after_fork)


def caller_scope(depth: int = 1) -> str:
    """The ``file:line`` of the frame ``depth`` levels above the caller of this function."""
    return frame_scope(sys._getframe(depth + 1))


def frame_scope(frame: FrameType) -> str:
    """The default scope of a timer armed at ``frame``'s current line."""
    if threading.get_ident() == _main.ident:
        key = (frame.f_code, frame.f_lineno)
        scope = _main_scopes.get(key)
        if scope is None:
            if len(_main_scopes) >= _KEPT:
                _main_scopes.clear()
            scope = _main_scopes[key] = shorten(f"{key[0].co_filename}:{key[1]}")
        return scope
    thread = threading.current_thread()
    return shorten(f"{frame.f_code.co_filename}:{frame.f_lineno}@{thread.name}")


def shorten(scope: str, limit: int = MAX_DEFAULT_SCOPE_BYTES) -> str:
    """Keep the end of an over-long scope (the file name and line), marked with '...'."""
    encoded = scope.encode()
    if len(encoded) <= limit:
        return scope
    tail = encoded[-(limit - 3) :].decode(errors="ignore")
    return "..." + tail
