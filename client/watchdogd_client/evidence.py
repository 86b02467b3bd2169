"""Evidence from inside this process, as its responder gives it
(`watchdogd_client.responder`): the stacks of its Python threads, read from the
interpreter, its Flight Recorder when ``torch.distributed`` runs, and the cuts that
make the whole fit one request frame (`watchdogd_protocol.MAX_EVIDENCE_BYTES`). torch is never
imported here: the Flight Recorder is read only when the program imported
``torch.distributed`` and initialised it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Annotated, Any, Final

import msgspec

from watchdogd_protocol import (
    MAX_EVIDENCE_BYTES,
    Collective,
    Evidence,
    FlightRecord,
    Frame,
    GroupState,
    ThreadStack,
)
from watchdogd_protocol.responding import (
    MAX_ENTRIES,
    MAX_FRAMES,
    MAX_GROUPS,
    MAX_MEMBERS,
    MAX_NAME,
    MAX_TENSORS,
    MAX_THREADS,
)

#: The most dimensions of one tensor's shape, as `Collective` bounds it.
_MAX_DIMENSIONS: Final = 16
_MAX_STATE: Final = 32
#: The longest note an `Evidence` carries.
MAX_NOTE: Final = 1024
_encoder = msgspec.msgpack.Encoder()

__all__ = [
    "fit_evidence",
    "flight_record",
    "reduce_flight_record",
    "take_evidence",
    "thread_stacks",
]


def take_evidence(request_id: int, ask: int) -> Evidence:
    """The `Evidence` ``request_id`` for ``ask``: the stacks of this process's Python threads but
    the calling one (`thread_stacks`), its Flight Recorder when ``torch.distributed``
    is initialised (`flight_record`), cut to fit one request frame (`fit_evidence`),
    with a note of what could not be taken or was cut."""
    notes: list[str] = []
    threads = thread_stacks(notes, skip=threading.get_ident())
    flight = flight_record(notes)
    evidence = Evidence(id=request_id, ask=ask, threads=threads, flight=flight)
    return fit_evidence(evidence, notes)


def thread_stacks(notes: list[str], *, skip: int | None = None) -> list[ThreadStack]:
    """The stack of each Python thread but ``skip`` (a thread ident), innermost frame
    first, named as `threading` names it; the main thread first (``main``), then the
    others in the order they started. Past `watchdogd_protocol.responding.MAX_THREADS` threads
    and `watchdogd_protocol.responding.MAX_FRAMES` frames the rest is left out, and ``notes``
    says so."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    order = [main, *names, *frames]
    idents = [ident for ident in dict.fromkeys(order) if ident in frames and ident != skip]
    if len(idents) > MAX_THREADS:
        notes.append(f"{MAX_THREADS} of {len(idents)} threads taken")
        del idents[MAX_THREADS:]
    stacks = []
    deep = 0
    for ident in idents:
        stack: list[Frame] = []
        frame: FrameType | None = frames[ident]
        while frame is not None and len(stack) < MAX_FRAMES:
            code = frame.f_code
            stack.append(Frame(_name(code.co_filename), frame.f_lineno or 0, _name(code.co_name)))
            frame = frame.f_back
        deep += frame is not None
        name = names.get(ident) or f"thread {ident}"
        stacks.append(ThreadStack(name=_name(name), ident=ident, main=ident == main, frames=stack))
    if deep:
        notes.append(f"the stacks of {deep} threads cut to their innermost {MAX_FRAMES} frames")
    return stacks


def _name(text: str) -> str:
    return text[:MAX_NAME]


# The Flight Recorder.


def flight_record(notes: list[str]) -> FlightRecord | None:
    """This process's Flight Recorder, reduced (`reduce_flight_record`), when the
    program imported ``torch.distributed`` and initialised it; None otherwise, and
    when the recorder is off (``TORCH_FR_BUFFER_SIZE=0``), which ``notes`` says.
    torch is never imported here."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if recorder_off():
            notes.append("the Flight Recorder is off (TORCH_FR_BUFFER_SIZE=0)")
            return None
        dump = sys.modules["torch"]._C._distributed_c10d._dump_fr_trace_json()
        rank = int(dist.get_rank())
        groups = _torch_groups(dist, notes)
    except Exception as exc:
        # torch's private names change between releases: no record, and why.
        notes.append(f"the Flight Recorder could not be read: {exc!r}")
        return None
    return reduce_flight_record(dump, rank, groups, notes)


def recorder_off() -> bool:
    """Whether torch records no collectives: it reads its buffer's size as this."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    return size is not None and size.strip() == "0"


def _torch_groups(dist: Any, notes: list[str]) -> list[GroupState]:
    """The process groups this rank is a member of, as torch.distributed knows them:
    name, description, members' global ranks, size. The Flight Recorder's own
    ``pg_config`` has them only for NCCL (gloo's holds one nameless group)."""
    groups = []
    cut = 0
    for group, name in list(dist.distributed_c10d._world.pg_names.items()):
        ranks = [int(rank) for rank in dist.get_process_group_ranks(group)]
        cut += len(ranks) > MAX_MEMBERS
        groups.append(
            GroupState(
                group=_name(str(name)),
                desc=_name(str(getattr(group, "group_desc", ""))),
                ranks=ranks[:MAX_MEMBERS],
                size=int(group.size()),
            )
        )
    if cut:
        notes.append(f"the members of {cut} groups of over {MAX_MEMBERS} ranks cut")
    return groups


_Dimension = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Number = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]


class FlightEntry(msgspec.Struct):
    """What is read of one entry of torch's Flight Recorder dump."""

    pg_id: int
    #: The group's name and description.
    process_group: tuple[str, str]
    collective_seq_id: _Number
    profiling_name: str
    state: str = ""
    input_sizes: list[list[_Dimension]] = []
    input_dtypes: list[str] = []
    is_p2p: bool = False
    #: Its work is no longer tracked: it finished, or (NCCL's watchdog) timed out.
    retired: bool = False
    #: When it was made, in nanoseconds of the wall clock (torch's ``getTime``);
    #: 0 where torch did not say.
    time_created_ns: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0

    @property
    def done(self) -> bool:
        """Whether it completed, as far as its entry tells: gloo leaves every entry
        ``scheduled`` and retires it when its work finishes."""
        if self.state == "completed":
            return True
        return self.retired and self.profiling_name.startswith("gloo:")


class _Status(msgspec.Struct):
    """torch's state of one group, by the number of its collectives."""

    last_completed_collective: _Number = -1


class _Dump(msgspec.Struct):
    """The parts of torch's Flight Recorder dump read here; each entry is decoded on
    its own, so that one torch wrote otherwise is skipped, not the whole dump."""

    entries: list[msgspec.Raw] = []
    #: By the group's id in the recorder (its entries' ``pg_id``), not its name.
    pg_status: dict[str, _Status] = {}


_dump_decoder = msgspec.json.Decoder(_Dump, strict=False)
_entry_decoder = msgspec.json.Decoder(FlightEntry, strict=False)


def flight_entries(dump: bytes) -> tuple[list[FlightEntry], dict[str, int], int]:
    """The collectives of torch's Flight Recorder ``dump`` (the JSON of
    ``_dump_fr_trace_json()``), oldest first, point-to-point operations left out;
    the last collective each group (by name) completed (`_completed`); and how
    many entries were left out (unreadable, or point-to-point). Raises
    `ValueError` for a dump that cannot be read."""
    try:
        raw = _dump_decoder.decode(dump)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(str(exc)) from None
    entries = []
    for item in raw.entries:
        try:
            entry = _entry_decoder.decode(item)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        if not entry.is_p2p:
            entries.append(entry)
    return entries, _completed(entries, raw.pg_status), len(raw.entries) - len(entries)


def reduce_flight_record(
    dump: bytes, rank: int, groups: Sequence[GroupState], notes: list[str]
) -> FlightRecord | None:
    """What a verdict needs of rank ``rank``'s Flight Recorder ``dump`` (the JSON of
    torch's ``_dump_fr_trace_json()``) and of its process ``groups`` (name,
    description, members, size): per group, the last collective it completed (the
    dump's ``pg_status``) and the newest one it entered and did not complete, with
    its op and inputs; and the newest `watchdogd_protocol.responding.MAX_ENTRIES` collectives,
    oldest first. torch leaves the ``state`` of a gloo collective ``scheduled`` even
    once done (it retires the entry then), and may count a group's collectives
    completed in ``pg_status`` out of order: here a group's last completed is the
    later of the two, and an entry it completed reads ``completed``. Point-to-point
    operations are left out (they have no collective number). None, with a note,
    for a dump that cannot be read."""
    try:
        entries, completed, left_out = flight_entries(dump)
    except ValueError as exc:
        notes.append(f"the Flight Recorder's dump could not be read: {exc}")
        return None
    if left_out:
        notes.append(f"{left_out} Flight Recorder entries left out")
    known = {group.group for group in groups}
    # A group torch.distributed did not list (its private names changed) is still
    # one the recorder names.
    named = {entry.process_group: None for entry in entries if entry.process_group[0] not in known}
    states = [*groups, *(GroupState(group=_name(name), desc=_name(desc)) for name, desc in named)]
    entered: dict[str, FlightEntry] = {}
    for entry in entries:
        if entry.collective_seq_id > completed.get(entry.process_group[0], -1):
            entered[entry.process_group[0]] = entry
    reduced = [
        msgspec.structs.replace(
            state,
            completed=completed.get(state.group, -1),
            entered=(
                collective_of(entered[state.group], completed) if state.group in entered else None
            ),
        )
        for state in states
    ]
    # The groups a rank waits in are what a verdict reads first.
    reduced.sort(key=lambda state: state.entered is None)
    if len(reduced) > MAX_GROUPS:
        notes.append(f"{MAX_GROUPS} of {len(reduced)} process groups taken")
        del reduced[MAX_GROUPS:]
    newest = [collective_of(entry, completed) for entry in entries[-MAX_ENTRIES:]]
    return FlightRecord(rank=rank, groups=reduced, entries=newest)


def _completed(entries: Iterable[FlightEntry], status: dict[str, _Status]) -> dict[str, int]:
    """The last collective each group (by name) completed: what its ``pg_status``
    says, or a later one its entries say is done."""
    names = {entry.pg_id: entry.process_group[0] for entry in entries}
    completed: dict[str, int] = {}
    for pg_id, state in status.items():
        name = names.get(int(pg_id)) if pg_id.isdigit() else None
        if name is not None:
            completed[name] = state.last_completed_collective
    # torch updates pg_status from each work's completion, in whatever order those
    # run: a group's entry can be done past what its status says.
    for entry in entries:
        if entry.done:
            name = entry.process_group[0]
            completed[name] = max(completed.get(name, -1), entry.collective_seq_id)
    return completed


def collective_of(entry: FlightEntry, completed: dict[str, int]) -> Collective:
    group = entry.process_group[0]
    done = entry.collective_seq_id <= completed.get(group, -1)
    return Collective(
        group=_name(group),
        seq=entry.collective_seq_id,
        op=_name(entry.profiling_name),
        state="completed" if done else entry.state[:_MAX_STATE],
        input_sizes=[shape[:_MAX_DIMENSIONS] for shape in entry.input_sizes[:MAX_TENSORS]],
        input_dtypes=[dtype[:_MAX_STATE] for dtype in entry.input_dtypes[:MAX_TENSORS]],
    )


# Fitting one frame.


def fit_evidence(
    evidence: Evidence, notes: Sequence[str] = (), limit: int = MAX_EVIDENCE_BYTES
) -> Evidence:
    """``evidence`` with ``notes`` as its note, and cut until it encodes within
    ``limit`` bytes: first its oldest Flight Recorder entries, then the frames of
    threads other than the main one (the last started first), then those threads,
    then the member lists of groups, then the main thread's outermost frames, then
    the Flight Recorder, then every stack. The note says what was cut."""
    draft = _Draft(evidence, notes, limit)
    for cut in (
        draft.cut_entries,
        draft.cut_frames,
        draft.cut_threads,
        draft.cut_members,
        draft.cut_main_frames,
        draft.cut_flight,
        draft.cut_stacks,
    ):
        while (excess := draft.excess()) > 0 and cut(excess):
            pass
    return draft.evidence()


class _Draft:
    """An `Evidence` being cut to fit: its parts as lists, and what was cut."""

    def __init__(self, evidence: Evidence, notes: Sequence[str], limit: int) -> None:
        self.id = evidence.id
        self.ask = evidence.ask
        self.limit = limit
        self.threads = list(evidence.threads)
        self.flight = evidence.flight
        self.entries = [] if self.flight is None else list(self.flight.entries)
        self.groups = [] if self.flight is None else list(self.flight.groups)
        self.notes = list(notes)
        #: What was cut, as the note words it: how many of each.
        self.cuts: dict[str, int] = {}

    def evidence(self) -> Evidence:
        flight = self.flight
        if flight is not None:
            flight = msgspec.structs.replace(flight, groups=self.groups, entries=self.entries)
        return Evidence(
            id=self.id, ask=self.ask, threads=self.threads, flight=flight, note=self.note()
        )

    def note(self) -> str:
        notes = list(self.notes)
        if self.cuts:
            cut = ", ".join(what.format(count) for what, count in self.cuts.items())
            notes.append(f"cut to fit {self.limit} bytes: {cut}")
        return "; ".join(notes)[:MAX_NOTE]

    def excess(self) -> int:
        return len(_encoder.encode(self.evidence())) - self.limit

    def _count(self, what: str, count: int) -> bool:
        if count:
            self.cuts[what] = self.cuts.get(what, 0) + count
        return count > 0

    def cut_entries(self, excess: int) -> bool:
        count = _enough((_size(entry) for entry in self.entries), excess)
        del self.entries[:count]
        return self._count("the {} oldest Flight Recorder entries", count)

    def cut_frames(self, excess: int) -> bool:
        framed = [i for i in reversed(range(len(self.threads))) if self._others_framed(i)]
        count = _enough((_size(self.threads[i].frames) for i in framed), excess)
        for i in framed[:count]:
            self.threads[i] = msgspec.structs.replace(self.threads[i], frames=[])
        return self._count("the frames of {} other threads", count)

    def cut_threads(self, excess: int) -> bool:
        others = [i for i in reversed(range(len(self.threads))) if not self.threads[i].main]
        count = _enough((_size(self.threads[i]) for i in others), excess)
        for i in others[:count]:
            del self.threads[i]  # from the last: the indices before stay valid
        return self._count("{} other threads", count)

    def cut_members(self, excess: int) -> bool:
        listed = sorted(
            (i for i, group in enumerate(self.groups) if group.ranks),
            key=lambda i: -len(self.groups[i].ranks),
        )
        count = _enough((_size(self.groups[i].ranks) for i in listed), excess)
        for i in listed[:count]:
            self.groups[i] = msgspec.structs.replace(self.groups[i], ranks=[])
        return self._count("the members of {} groups", count)

    def cut_main_frames(self, excess: int) -> bool:
        main = next((i for i, thread in enumerate(self.threads) if thread.main), None)
        if main is None:
            return False
        frames = self.threads[main].frames
        count = _enough((_size(frame) for frame in reversed(frames)), excess)
        kept = frames[: len(frames) - count]
        self.threads[main] = msgspec.structs.replace(self.threads[main], frames=kept)
        return self._count("the main thread's {} outermost frames", count)

    def cut_flight(self, excess: int) -> bool:
        if self.flight is None:
            return False
        self.flight = None
        return self._count("the Flight Recorder", 1)

    def cut_stacks(self, excess: int) -> bool:
        count = len(self.threads)
        self.threads = []
        return self._count("every stack", count)

    def _others_framed(self, i: int) -> bool:
        thread = self.threads[i]
        return not thread.main and bool(thread.frames)


def _size(part: msgspec.Struct | Sequence[Any]) -> int:
    return len(_encoder.encode(part))


def _enough(sizes: Iterable[int], excess: int) -> int:
    """How many of the parts, of these encoded ``sizes`` in the order they go, make
    up ``excess`` bytes (all of them if they do not)."""
    count = 0
    for size in sizes:
        if excess <= 0:
            break
        excess -= size
        count += 1
    return count
