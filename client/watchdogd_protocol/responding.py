"""Evidence from inside a worker: what its responder answers when the daemon asks.

A process that uses the client library keeps one background connection to the
daemon, its responder. After its `Hello` it sends `Respond`, naming the job and rank
the process belongs to; from then on the daemon may send it `EvidenceWanted` at any
time, one of the protocol's two messages from daemon to client, and the responder
answers with `Evidence`: the stacks of its Python threads, read from the interpreter
(no ptrace), and, when ``torch.distributed`` runs with its Flight Recorder on, a
summary of it (`FlightRecord`). The other, `UnblockWanted`, goes only to a
responder whose `Respond` said it can unblock its process (``unblock``): it answers
`Unblocked`, having cut its process out of the collective it waits in only where
its own Flight Recorder confirms every bound the request sets.

Every list and string is bounded here, and a whole `Evidence` must fit in one
request frame (`MAX_EVIDENCE_BYTES`): the responder cuts what does not fit, the
oldest Flight Recorder entries first, then the frames of other threads, then those
threads. The daemon accepts an `Evidence` only on the connection it asked, for the
``ask`` it sent there.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final

from msgspec import Meta, Struct

#: The most threads, frames of one thread, and characters of a file or function name
#: an `Evidence` carries.
MAX_THREADS: Final = 64
MAX_FRAMES: Final = 64
MAX_NAME: Final = 512
#: The most process groups and Flight Recorder entries of one `FlightRecord`.
MAX_GROUPS: Final = 32
MAX_ENTRIES: Final = 64
#: The most members a group lists, and tensors an entry describes.
MAX_MEMBERS: Final = 4096
MAX_TENSORS: Final = 16
#: A whole `Evidence`, encoded: it travels as one request frame.
MAX_EVIDENCE_BYTES: Final = 60 * 1024

Name = Annotated[str, Meta(max_length=MAX_NAME)]
#: A collective's sequence number within its group (-1: none yet).
Sequence = Annotated[int, Meta(ge=-1, le=2**63 - 1)]
Dimension = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Rank = Annotated[int, Meta(ge=0, le=2**31 - 1)]
DType = Annotated[str, Meta(max_length=32)]


class Frame(Struct, frozen=True, array_like=True):
    """One frame of a stack: ``file``, ``line`` and ``function``."""

    file: Name
    line: Annotated[int, Meta(ge=0, le=2**31 - 1)]
    function: Name


class ThreadStack(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A Python thread's stack, innermost frame first; ``main`` for the main thread."""

    name: Name
    ident: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    main: bool = False
    frames: Annotated[list[Frame], Meta(max_length=MAX_FRAMES)] = []


class Collective(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One Flight Recorder entry: collective ``seq`` of ``group`` (its op as torch
    names it, ``gloo:all_reduce``), its ``state`` (``scheduled``, ``started``,
    ``completed``) and what it was given."""

    group: Name
    seq: Sequence
    op: Name
    state: Annotated[str, Meta(max_length=32)] = ""
    input_sizes: Annotated[
        list[Annotated[list[Dimension], Meta(max_length=16)]], Meta(max_length=MAX_TENSORS)
    ] = []
    input_dtypes: Annotated[list[DType], Meta(max_length=MAX_TENSORS)] = []


class GroupState(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A process group as one rank saw it: its name (``desc``: torch's description,
    ``default_pg``), its members' global ranks, the newest collective this rank
    entered in it (``entered``: enqueued or started, with its op and inputs), and the
    sequence number of the last one it completed. It is what a verdict needs of a
    rank's Flight Recorder, and all of it that leaves the host."""

    group: Name
    desc: Name = ""
    ranks: Annotated[list[Rank], Meta(max_length=MAX_MEMBERS)] = []
    size: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    entered: Collective | None = None
    completed: Sequence = -1


class FlightRecord(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a rank's Flight Recorder says: its global ``rank``, each of its groups'
    state, and its newest entries, oldest first (shown with the rank's stacks)."""

    rank: Rank
    groups: Annotated[list[GroupState], Meta(max_length=MAX_GROUPS)] = []
    entries: Annotated[list[Collective], Meta(max_length=MAX_ENTRIES)] = []


AskId = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class EvidenceWanted(Struct, frozen=True, kw_only=True, tag="evidence_wanted", tag_field="type"):
    """From the daemon, unasked, on a responder's connection: send `Evidence` for
    ``ask`` (the daemon's ``incident`` is why). Not a reply: it answers nothing,
    and only a connection that sent `Respond` ever receives one."""

    ask: AskId
    incident: Annotated[str, Meta(max_length=128)] = ""


#: The longest an unblock's bounds on time may be, in seconds (a day).
_DAY: Final = 86_400.0
Seconds = Annotated[float, Meta(ge=0, le=_DAY)]


class UnblockWanted(
    Struct, frozen=True, kw_only=True, omit_defaults=True, tag="unblock_wanted", tag_field="type"
):
    """From the daemon, unasked, on a responder's connection whose `Respond` said
    ``unblock``: cut this process out of the collective its own Flight Recorder
    says it waits in, and answer `Unblocked` for ``ask``. Only a collective that
    is still pending (entered, not completed, its entry not retired), that it has
    waited in for ``waited`` seconds at least, of ``group`` and number ``seq``
    when they are given (any group's, the one it has waited in longest, when
    not), entered at least ``entered_before`` seconds ago when that is given (a
    host it waits for was lost then: a collective entered since is not one the
    loss holds up). ``incident`` and ``reason`` say why, for the worker's log."""

    ask: AskId
    waited: Seconds
    group: Name | None = None
    seq: Sequence | None = None
    entered_before: Seconds | None = None
    incident: Annotated[str, Meta(max_length=128)] = ""
    reason: Annotated[str, Meta(max_length=1024)] = ""


class UnblockOutcome(StrEnum):
    """What a responder did with an `UnblockWanted` (`Unblocked.outcome`)."""

    #: Cut out of the collective: the call waiting in it raises in its own thread.
    UNBLOCKED = "unblocked"
    #: No pending collective matches the request (it completed meanwhile, or the
    #: process waits in another, or in none).
    NOT_WAITING = "not_waiting"
    #: It waits in the collective, for less than ``waited`` so far: ask again
    #: after `Unblocked.retry` seconds.
    TOO_SOON = "too_soon"
    #: The collective it waits in was entered after ``entered_before``.
    ENTERED_LATER = "entered_later"
    #: Its Flight Recorder cannot be read (torch.distributed is not running, or
    #: records nothing): nothing confirms a wait, so nothing is cut.
    NO_RECORDER = "no_flight_recorder"
    #: It waits in the collective, and it could not be cut out (``note`` says why).
    FAILED = "failed"
