"""Evidence a worker gave from inside, as an incident keeps it.

A responder's `Evidence` (`watchdogd_protocol.responding`) becomes what a
dump from outside would have given: the stacks as text in py-spy's layout (a
``Thread ID (state): "NAME"`` header, then one ``    function (file:line)`` line
per frame, innermost first), so an incident shows, cuts and reads every rank's
stack one way whichever way it was taken; and the Flight Recorder's groups, which
are all of it that an incident keeps (`RankInfo.flight`).
"""

from __future__ import annotations

from typing import Final

from watchdogd_protocol import Evidence, GroupState, ThreadStack

from .verdict import summary

#: How an incident's rank says its stack was taken.
WORKER: Final = "worker"
NONE: Final = "none"


def stack_text(evidence: Evidence) -> str:
    """The threads of ``evidence`` in py-spy's layout, the main thread first."""
    threads = sorted(evidence.threads, key=lambda thread: not thread.main)
    blocks = [_thread_text(thread) for thread in threads]
    if evidence.note:
        blocks.append(f"({evidence.note})")
    return "\n".join(blocks) + "\n" if blocks else ""


def _thread_text(thread: ThreadStack) -> str:
    # The state is not known from inside; "worker" says where the stack came from.
    name = "MainThread" if thread.main else thread.name.replace('"', "'")
    lines = [f'Thread {thread.ident} (worker): "{name}"']
    lines += [f"    {frame.function} ({frame.file}:{frame.line})" for frame in thread.frames]
    return "\n".join(lines)


def flight_groups(evidence: Evidence) -> list[GroupState]:
    """What an incident keeps of the Flight Recorder in ``evidence``, and all of it
    that goes through the fleet: the state of the groups the rank waits in first, a
    few (`watchdogd.core.verdict.summary`); none without a Flight Recorder."""
    return [] if evidence.flight is None else summary(evidence.flight)
