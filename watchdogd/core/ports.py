"""The ports through which the core asks the runtime for what it cannot do itself.

A process port opens, watches and reads processes (`ProcessPort`, on a real host
`watchdogd.runtime.host_processes.HostProcesses`), a journal makes the timers'
changes durable (`Journal`, `watchdogd.storage.store.Store`), a page port makes and finds again the
slot pages of the fast path (`PagePort`, `watchdogd.host.slot_pages`). The core
holds handles only through `TargetProcess` and `PageRef`, so its rules run the same
on a fake host in tests.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Final, Protocol, TypeVar

from .identity import Peer
from .starvation import Sample
from .timers import Timer


class TargetProcess(Protocol):
    """What the service needs of a process handle."""

    @property
    def pid(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def saved_uid(self) -> int: ...
    @property
    def start_time(self) -> int: ...
    def retain(self) -> TargetProcess: ...
    def close(self) -> None: ...


P = TypeVar("P", bound=TargetProcess)
P_contra = TypeVar("P_contra", bound=TargetProcess, contravariant=True)


class Journal(Protocol):
    """Where the service reports each change of the timers it must keep (the
    state store, `watchdogd.storage.store.Store`)."""

    @property
    def generation(self) -> int:
        """Bumped by every change."""

    @property
    def degraded(self) -> bool:
        """Whether changes are currently not made durable (a failing disk)."""

    @property
    def errors(self) -> int:
        """Writes that failed."""

    def put(self, timer: Timer, *, replacing: Timer | None = None, soon: bool = False) -> None:
        """``timer`` is armed (new or re-armed), or its policy moved on a step;
        ``replacing``: the record it takes the place of (the armed record of a
        timer that fell due), dropped in the same journal record. ``soon``: have
        it written soon, though no reply waits for it (`commit_soon`)."""

    def drop(self, *timers: Timer, soon: bool = False) -> None:
        """``timers`` are gone: released, their process exited, or their policy
        ended; ``soon`` as for `put`, when there were any."""

    def commit(self, generation: int) -> bool:
        """Write what is pending; whether every change up to ``generation`` is in."""

    def commit_soon(self) -> None:
        """Have what is pending written soon, though no reply waits for it."""


class NullJournal:
    """The journal of a daemon without state (``--no-state``): remembers nothing,
    and so is never degraded."""

    generation = 0
    errors = 0
    degraded = False

    def put(self, timer: Timer, *, replacing: Timer | None = None, soon: bool = False) -> None:
        pass

    def drop(self, *timers: Timer, soon: bool = False) -> None:
        pass

    def commit(self, generation: int) -> bool:
        return True

    def commit_soon(self) -> None:
        pass


class ProcessPort(Protocol[P]):
    """The system calls request handling needs, behind one interface."""

    def open(self, pid: int, peer: Peer) -> P:
        """Open a handle on ``pid``; raise `Refusal` (no_such_process) if it is gone."""

    def alive(self, process: P) -> bool:
        """Whether the process still holds its pid."""

    def exited(self, process: P) -> bool:
        """Whether the process has exited: a zombie has, though it still holds its
        pid (`alive`)."""

    def refresh(self, process: P) -> bool:
        """Read its real and saved uid again, into the handle; False when it has
        exited (the handle then keeps the old ones)."""

    def command(self, process: P) -> str:
        """Its command line, for status."""

    def executable(self, process: P) -> str:
        """The path of the executable it runs, for its history."""

    def track(self, process: P) -> None:
        """Watch it for its exit (it entered the table); idempotent."""

    def untrack(self, process: P) -> None:
        """Drop the table's reference (it left the table)."""

    def user_name(self, uid: int) -> str:
        """The fleet name of user ``uid`` (`watchdogd.host.users`) if known at once, else
        ``#UID``; never a lookup that waits (it is asked for, for next time)."""

    def sample(self, process: P) -> Sample | None:
        """What the kernel says of it now: its CPU time and the pressure on its
        cgroup and on the host; None once it has exited."""


class PageRef(Protocol):
    """A slot page as the core reads and writes it
    (`watchdogd_protocol.slot_page`); every value a process wrote is read
    as it is, for the core to bound."""

    @property
    def id(self) -> int:
        """What names it on the wire and in the state."""

    @property
    def fd(self) -> int:
        """A descriptor of it, for the runtime to hand to its process."""

    def read(self, index: int) -> int:
        """Slot ``index``'s deadline word, in microseconds (0: released)."""

    def blocks(self, index: int) -> int:
        """How many blocks of slot ``index`` its process released by a store."""

    def largest(self, index: int) -> int:
        """The longest of them, in microseconds."""

    def taken(self, index: int) -> int:
        """How many of them the daemon had released at its last harvest (its own
        word, which the process may have written over all the same)."""

    def moved(self) -> Sequence[int]:
        """The slots whose block count differs from what the daemon took of it:
        those a harvest takes anything of (the others' counts are read by none)."""

    def rows(self) -> Sequence[int]:
        """The history buckets whose rows of counts the page holds memory for:
        the rows a harvest reads (a harvest costs one read of each)."""

    def counts(self, index: int, rows: Iterable[int]) -> Sequence[tuple[int, int, int]]:
        """Their durations' counts in ``rows`` that moved since the last harvest:
        ``(bucket, count, taken)``, for each whose count differs from what was
        taken of it."""

    def took(self, index: int, blocks: int, counts: Iterable[tuple[int, int]]) -> None:
        """Write what a harvest took of slot ``index``: its ``blocks``, and its
        ``(bucket, count)`` pairs."""

    def write(self, index: int, *, deadline: int | None = None, period: int | None = None) -> None:
        """Write slot ``index``'s deadline (microseconds) and period (0: closed)."""

    def write_auto(self, index: int, timeout: int) -> None:
        """Write the timeout slot ``index`` arms with ``after="auto"`` (us)."""

    def close_all(self) -> None:
        """Close every slot of the page."""

    def close(self) -> None:
        """Let go of the page."""


class Searching(enum.Enum):
    """What a search for a page says while it goes on."""

    SEARCHING = "searching"


SEARCHING: Final = Searching.SEARCHING


class PageSearch(Protocol):
    """A search for pages among a process's descriptors, all of them in one read
    of its descriptors, a slice at a time."""

    def step(self, until: float) -> Mapping[int, PageRef] | Searching:
        """Search on until the clock reads ``until`` (a little further at least):
        `SEARCHING`, or once it ended the wanted pages found, by id (a page not
        among them is not held by the process, or was wanted too late)."""

    def close(self) -> None:
        """Give the search up (or let go of what it read once it ended)."""


class PagePort(Protocol[P_contra]):
    """Slot pages: made for a process, found again after a restart."""

    def shares_clock(self, process: P_contra) -> bool:
        """Whether the process may have a page: its CLOCK_MONOTONIC is the
        daemon's, and its page could be found again after a restart."""

    def clock_offset(self, process: P_contra) -> float | None:
        """How far the process's CLOCK_MONOTONIC reads ahead of the daemon's now
        (0.0 in the daemon's time namespace; None when it cannot be known)."""

    def new_page(self) -> PageRef | None:
        """A fresh page; None when none can be made now (said in the log)."""

    def search(self, process: P_contra, wanted: AbstractSet[int]) -> PageSearch:
        """A search for the pages ``wanted`` (by id) among the process's
        descriptors (a restart), not begun yet. ``wanted`` is read as the search
        goes: a page added to it may be found, unless its descriptor was read
        already."""


class NoPages:
    """The page port of a daemon that offers no fast path."""

    def shares_clock(self, process: object) -> bool:
        return False

    def clock_offset(self, process: object) -> float | None:
        return 0.0

    def new_page(self) -> PageRef | None:
        return None

    def search(self, process: object, wanted: AbstractSet[int]) -> PageSearch:
        return _NothingFound()


class _NothingFound:
    """The search of a daemon that offers no fast path: it finds nothing."""

    def step(self, until: float) -> Mapping[int, PageRef] | Searching:
        return {}

    def close(self) -> None:
        pass
