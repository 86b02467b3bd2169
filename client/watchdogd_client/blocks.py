"""The ``expires()`` blocks open in each thread, innermost last: what the
module-level `watchdogd_client.release` releases.

Invariants:

- A block is open from its entry to its exit, whether its timer is still armed
  or not: a block released early stays the innermost one until it ends, so a
  second release finds it again (and does nothing) rather than reaching the block
  around it.
- Each thread sees only the blocks it opened, so no release reaches another
  thread's timer.
- A child made by ``fork()`` starts with none: the blocks open in its parent are
  the parent's, their timers armed for the parent's pid.

In ordinary code blocks end in the reverse order of their entry. A generator or a
coroutine suspended inside a block can end it out of turn, so a block that ends
is removed wherever it stands, and the ones around it stay.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Timer

__all__ = ["entered", "innermost", "left"]


class _Open(threading.local):
    def __init__(self) -> None:
        self.blocks: list[Timer] = []


_open = _Open()


def entered(block: Timer) -> None:
    """``block`` was entered by the calling thread: it is now its innermost."""
    _open.blocks.append(block)


def left(block: Timer) -> None:
    """``block`` ended in the calling thread (its latest entry, if entered twice)."""
    blocks = _open.blocks
    if blocks and blocks[-1] is block:
        blocks.pop()  # the usual order, at once
        return
    for index in range(len(blocks) - 1, -1, -1):
        if blocks[index] is block:
            del blocks[index]
            return


def innermost(client: object | None = None) -> Timer | None:
    """The block entered last and still open in the calling thread, of ``client``
    if given; None if there is none."""
    for block in reversed(_open.blocks):
        if client is None or block.client is client:
            return block
    return None


def _forget_in_child() -> None:
    # Runs in the one thread a child has, the one that forked; the other threads'
    # blocks went with their threads.
    _open.blocks = []


os.register_at_fork(after_in_child=_forget_in_child)
