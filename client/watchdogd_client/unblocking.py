"""Unblocking this process: cutting it out of the collective its own Flight
Recorder says it waits in, at its daemon's request (`UnblockWanted`), so that the
call waiting in it raises in its own thread and the program (or torchrun) goes on
to restart.

The responder (`watchdogd_client.responder`) calls `unblock` on its own thread,
once for each request. Invariants:

- Nothing is cut unless the Flight Recorder, read at that moment, says the process
  still waits in a collective that meets every bound of the request
  (`judge_wait`): pending (not completed, its entry not retired), of the group and
  number named, waited in for ``waited`` seconds at least, entered at least
  ``entered_before`` seconds ago. A process whose collectives complete is never cut,
  whatever it was asked.
- A gloo collective: every connected TCP socket of the process is shut down with
  shutdown(2) (`shut_connections`), never closed (gloo still owns the descriptors,
  and closes them itself), but those of its store (the port of the process
  group's TCPStore, and ``$MASTER_PORT``), so the store and the launcher's
  rendezvous live on. Those are all the TCP connections of the process but the
  store's: any of the program's own (a data loader's, a logger's) are cut too,
  which is why only a process confirmed stuck is cut. A store whose port cannot
  be read stops the cut: it could be the store's connection that goes.
- An NCCL collective: its process group is aborted (``ProcessGroup.abort``), which
  fails the work the process waits for. Not tested here, for lack of a GPU.
- torch is never imported here: nothing is cut unless the program initialised
  ``torch.distributed`` itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from watchdogd_protocol import Unblocked, UnblockOutcome, UnblockWanted

from .evidence import MAX_NOTE, FlightEntry, collective_of, flight_entries, recorder_off

__all__ = ["Judged", "judge_wait", "shut_connections", "store_ports", "unblock"]

#: The /proc files of the process's network namespace that list its TCP sockets.
_TCP_TABLES: Final = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
#: A TCP socket's state in those files: connected.
_ESTABLISHED: Final = "01"
#: The most stores wrapped in one another that are looked through for the TCPStore.
_WRAPPED: Final = 16


@dataclass(frozen=True, slots=True)
class Judged:
    """What a Flight Recorder says of a request: its ``outcome``, the ``entry`` it
    is about (the collective the process waits in, if any), how long the process
    has ``waited`` in it and, too soon, after how many seconds it will have waited
    long enough (``retry``)."""

    outcome: UnblockOutcome
    entry: FlightEntry | None = None
    waited: float = 0.0
    retry: float = 0.0
    note: str = ""


def judge_wait(
    entries: Sequence[FlightEntry],
    completed: dict[str, int],
    wanted: UnblockWanted,
    now_ns: int,
) -> Judged:
    """Whether the collectives ``entries`` of a Flight Recorder (oldest first, with
    the last collective each group ``completed``) hold the process in one that
    meets every bound of ``wanted``, at ``now_ns`` (the wall clock's nanoseconds,
    the clock torch dates its entries on). ``unblocked`` means it may be cut."""
    pending = [
        entry
        for entry in entries
        if not entry.done
        and entry.collective_seq_id > completed.get(entry.process_group[0], -1)
        and (
            wanted.group is None
            or (entry.process_group[0], entry.collective_seq_id) == (wanted.group, wanted.seq)
        )
    ]
    if not pending:
        return Judged(UnblockOutcome.NOT_WAITING)
    entry = min(pending, key=lambda entry: entry.time_created_ns)
    if entry.time_created_ns <= 0:
        return Judged(UnblockOutcome.NO_RECORDER, entry, note="its entry records no time")
    # A clock stepped back since the entry was made reads as no wait at all.
    waited = max(0, now_ns - entry.time_created_ns) / 1e9
    if wanted.entered_before is not None and waited < wanted.entered_before:
        return Judged(UnblockOutcome.ENTERED_LATER, entry, waited)
    if waited < wanted.waited:
        return Judged(UnblockOutcome.TOO_SOON, entry, waited, wanted.waited - waited)
    return Judged(UnblockOutcome.UNBLOCKED, entry, waited)


def unblock(request_id: int, wanted: UnblockWanted) -> Unblocked:
    """Request ``request_id``: the `Unblocked` that answers ``wanted``, having cut the
    process out of the collective it waits in if its Flight Recorder, read now,
    confirms every bound of the request (see the module docstring)."""
    dist = sys.modules.get("torch.distributed")
    none = Judged(UnblockOutcome.NO_RECORDER)
    try:
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            return _answer(request_id, wanted, none, "torch.distributed is not initialised")
        if recorder_off():
            return _answer(request_id, wanted, none, "its Flight Recorder is off")
        dump = sys.modules["torch"]._C._distributed_c10d._dump_fr_trace_json()
        entries, completed, _ = flight_entries(dump)
    except Exception as exc:
        # torch's private names change between releases: nothing confirms a wait.
        return _answer(request_id, wanted, none, f"its Flight Recorder could not be read: {exc!r}")
    judged = judge_wait(entries, completed, wanted, time.time_ns())
    if judged.outcome != UnblockOutcome.UNBLOCKED or judged.entry is None:
        return _answer(request_id, wanted, judged, judged.note)
    try:
        cut = _cut(dist, judged.entry)
    except Exception as exc:
        failed = Judged(UnblockOutcome.FAILED, judged.entry, judged.waited)
        return _answer(request_id, wanted, failed, f"not cut: {exc}")
    if not cut:
        failed = Judged(UnblockOutcome.FAILED, judged.entry, judged.waited)
        return _answer(request_id, wanted, failed, "no connection of its collective was found")
    return _answer(request_id, wanted, judged, cut=cut)


def _answer(
    request_id: int, wanted: UnblockWanted, judged: Judged, note: str = "", *, cut: int = 0
) -> Unblocked:
    entry = judged.entry
    return Unblocked(
        id=request_id,
        ask=wanted.ask,
        outcome=judged.outcome,
        collective=None if entry is None else collective_of(entry, {}),
        waited=min(judged.waited, 86_400.0),
        retry=min(judged.retry, 86_400.0),
        cut=cut,
        note=note[:MAX_NOTE],
    )


def _cut(dist: Any, entry: FlightEntry) -> int:
    """Cut the process out of ``entry``'s collective: how many connections were
    shut, or groups aborted. Raises what stopped it."""
    backend = entry.profiling_name.partition(":")[0]
    if backend == "gloo":
        return shut_connections(store_ports(dist))
    if backend == "nccl":
        name = entry.process_group[0]
        for group, known in list(dist.distributed_c10d._world.pg_names.items()):
            if str(known) == name:
                group.abort()
                return 1
        raise RuntimeError(f"its process group {name!r} is not one torch.distributed lists")
    raise RuntimeError(f"a {backend or 'nameless'} collective has no way to be cut out of")


def store_ports(dist: Any) -> set[int]:
    """The ports of the process group's store: its TCPStore's, looked up through
    the stores wrapped around it (a PrefixStore), and ``$MASTER_PORT``, where
    torchrun's agent serves its store. Raises `RuntimeError` when the store is a
    TCPStore whose port cannot be read."""
    ports = set()
    master = os.environ.get("MASTER_PORT", "")
    if master.isdigit():
        ports.add(int(master))
    store = dist.distributed_c10d._get_default_store()
    for _ in range(_WRAPPED):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    if type(store).__name__ == "TCPStore":
        port = getattr(store, "port", None)
        if not isinstance(port, int):
            raise RuntimeError("the port of its TCPStore could not be read")
        ports.add(port)
    return ports


def shut_connections(kept: Iterable[int]) -> int:
    """Shut down (shutdown(2), both ways) every connected TCP socket of this process
    but those with a port in ``kept`` at either end; how many were shut."""
    kept = frozenset(kept)
    connected = {
        inode
        for inode, (local, remote) in _tcp_sockets().items()
        if local not in kept and remote not in kept
    }
    shut = 0
    for fd, inode in _socket_fds():
        if inode in connected:
            shut += _shut(fd, inode)
    return shut


def _tcp_sockets() -> dict[int, tuple[int, int]]:
    """The connected TCP sockets of this process's network namespace, by inode:
    their local and remote ports."""
    found: dict[int, tuple[int, int]] = {}
    for path in _TCP_TABLES:
        try:
            with open(path, encoding="ascii") as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue  # no IPv6 here
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _ESTABLISHED:
                continue
            with contextlib.suppress(ValueError, IndexError):
                local = int(fields[1].rsplit(":", 1)[1], 16)
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                found[int(fields[9])] = (local, remote)
    return found


def _socket_fds() -> list[tuple[int, int]]:
    """This process's descriptors that are sockets, with their inodes."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            with contextlib.suppress(ValueError):
                found.append((int(name), int(target[8:-1])))
    return found


def _shut(fd: int, inode: int) -> bool:
    """Shut down the socket of ``fd`` if it is still the one of ``inode``."""
    try:
        copy = os.dup(fd)
    except OSError:
        return False  # closed meanwhile
    try:
        found = os.fstat(copy)
        # The descriptor may have been closed and opened anew since it was listed.
        if not stat.S_ISSOCK(found.st_mode) or found.st_ino != inode:
            return False
        with socket.socket(fileno=os.dup(copy)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    else:
        return True
    finally:
        os.close(copy)
