"""What one process of an incident says: its stack cut to size, the frame it waits
in, who may read it, and the order an incident shows its ranks in.

Pure: functions of a `RankInfo` (or the event of its policy), no state.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from watchdogd_protocol import EventInfo, RankInfo

from .effects import SKIPPED_DENIED, Outcome
from .identity import ROOT

#: The most of one stack an incident keeps.
MAX_STACK_BYTES: Final = 64 * 1024
#: What a stack trimmed to its owner's evidence budget keeps (`trimmed`): room
#: for a main thread's innermost frames down to the user's own, where the verdict
#: reads where the rank waits (`watchdogd.core.user_frames.pick`).
TRIMMED_STACK_BYTES: Final = 2 * 1024
_CLIPPED: Final = "\n…(cut)\n"
#: ASCII, as the frames it follows most often are: a str of one non-ASCII
#: character takes two or four bytes for each of them.
_TRIMMED: Final = "    ...(trimmed)\n"
#: A thread's header in py-spy's dump: ``Thread 4242 (idle): "MainThread"``.
_THREAD: Final = re.compile(r'^Thread \S+ \([^)]*\): "(?P<name>[^"]*)"')
#: What a rank holds that a dump of it (or an unblocking) gave: its evidence.
_EVIDENCE: Final = (
    "frame",
    "stack",
    "reader_uid",
    "reader_gid",
    "evidence",
    "flight",
    "unblocked",
    "unblocked_at",
)


def with_evidence_of(rank: RankInfo, listed: RankInfo) -> RankInfo:
    """``rank`` holding the evidence ``listed`` (the same process, listed before
    in another role) holds."""
    return msgspec.structs.replace(rank, **{name: getattr(listed, name) for name in _EVIDENCE})


def may_read(rank: RankInfo, viewer: int, viewer_gid: int) -> bool:
    """Whether ``viewer`` (of group ``viewer_gid``) may see the stack and frame of
    ``rank``: root may; another user only where ptrace's read rule let them read
    the process when it was dumped (its reader: the same real, effective and
    saved uid, the same gids, dumpable). A remote rank's reader is the local user
    of its name, and its gid is not compared (gids are numbers of its host)."""
    if viewer == ROOT:
        return True
    if rank.reader_uid is None or rank.reader_uid != viewer:
        return False
    return rank.reader_gid is None or rank.reader_gid == viewer_gid


def reported(rank: RankInfo) -> bool:
    """Whether ``rank``'s evidence has come: its policy has run, or it gave some."""
    return rank.state != "pending" or bool(rank.flight or rank.stack or rank.evidence)


def unread(rank: RankInfo) -> RankInfo:
    """``rank`` without what its viewer may not see, with a note why."""
    if not (rank.stack or rank.frame):
        return rank
    why = (
        "its stack is shown to root only: when it was dumped, ptrace's rules would not "
        "have let you read this process (its uids or gids differed, or it was not dumpable)"
    )
    note = f"{rank.note}; {why}" if rank.note else why
    return msgspec.structs.replace(rank, stack="", frame="", note=note)


def first_frame(stack: str) -> str:
    """The innermost frame of the main thread in a py-spy dump (of the first
    thread, when none is named MainThread): where the process was waiting."""
    frames: dict[str, str] = {}
    thread = None
    for line in stack.splitlines():
        header = _THREAD.match(line)
        if header is not None:
            thread = header["name"]
            continue
        if thread is not None and thread not in frames and line.startswith(" ") and line.strip():
            frames[thread] = line.strip()
    return frames.get("MainThread") or next(iter(frames.values()), "")


def stack_of(event: EventInfo) -> str:
    """The stack the dump step of a rank's policy captured (cut to size), if any."""
    outputs = [step.output for step in event.steps if step.step.startswith("dump")]
    return clip(outputs[0], MAX_STACK_BYTES) if outputs else ""


def state_of(event: EventInfo) -> str:
    """A rank's state once its policy ran: ``gone``, ``denied`` or ``done``."""
    # A record's words, rendered from the run's values (`watchdogd.core.effects`).
    if event.outcome == Outcome.GONE.value:
        return "gone"
    if any(step.result.startswith(SKIPPED_DENIED) for step in event.steps):
        return "denied"
    return "done"


def bounded(rank: RankInfo) -> RankInfo:
    """``rank`` with its stack cut to `MAX_STACK_BYTES`."""
    if len(rank.stack.encode()) <= MAX_STACK_BYTES:
        return rank
    return msgspec.structs.replace(rank, stack=clip(rank.stack, MAX_STACK_BYTES))


def trimmed(stack: str, limit: int = TRIMMED_STACK_BYTES) -> str:
    """``stack`` (py-spy's layout) cut to its main thread (the thread named
    MainThread, else the first) in at most ``limit`` UTF-8 bytes, whole lines
    only, marked: the verdict finds the same frame in it as in the whole
    (`watchdogd.core.user_frames.pick`), unless the user's frame was past the limit.
    A stack within ``limit`` is kept as it is."""
    if len(stack.encode()) <= limit:
        return stack
    blocks: list[list[str]] = []
    for line in stack.splitlines():
        match = _THREAD.match(line)
        if match is not None or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    main = next((b for b in blocks if _named(b[0]) == "MainThread"), blocks[0])
    kept: list[str] = []
    room = limit - len(_TRIMMED.encode())
    for line in main:
        room -= len(line.encode()) + 1
        if room < 0:
            break
        kept.append(line)
    return "".join(f"{line}\n" for line in kept) + _TRIMMED


def _named(line: str) -> str:
    match = _THREAD.match(line)
    return "" if match is None else match["name"]


def clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes, marked where it was cut."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    keep = max(0, limit - len(_CLIPPED.encode()))
    return raw[:keep].decode(errors="ignore") + _CLIPPED


def shown_order(rank: RankInfo) -> tuple[int, str, int, int]:
    """Expired ranks first, then by host, rank and pid."""
    return (rank.role != "expired", rank.host, -1 if rank.rank is None else rank.rank, rank.pid)
