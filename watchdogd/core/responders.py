"""Responders: the processes that answer the daemon's evidence requests from inside.

A process that uses the client library keeps one background connection, its
responder, on which it sends `Respond` once (`watchdogd_protocol.requests`):
the kernel says which process it is (the connection's peer credentials), the
request which job and rank it belongs to. From then until that connection closes
or that process exits it is a rank of that job here whether or not it holds a
timer, so a rank stuck outside any ``expires()`` block (often the one its peers
wait for) is still one the daemon asks when the job has an incident. A job is its
owner's, as a timer's is: the uid of the responder's process.

A responder is its process, for as long as that process lives:

- It is registered with a handle on the exact process that opened its connection
  (its pidfd), found not to have exited when it registered
  (`watchdogd.core.timer_requests.Arming.connecting_process`), and its start time: a
  connection that outlived its process (a child of a fork kept the socket) may
  not register, and so answers for nobody.
- A process has at most one responder, and only that process replaces it: a
  `Respond` takes the place of the one registered for its pid, which is either the
  same process (on another connection, or this one) or one that has exited, since
  two live processes never hold one pid.
- It leaves when its connection closes or its process exits, whichever comes
  first (the runtime watches the process's pidfd: `watchdogd.runtime.server`).
  `unregister` takes only the registration made with the handle it is given, so a
  connection that ends never removes the one that took its place.

This module keeps who responds for which job; asking and waiting for the answer
is the runtime's (`watchdogd.runtime.asks`), which sends an ask only to the
responder whose process is the ask's target, and takes an answer only on the
connection it asked, from a process that has not exited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from watchdogd_protocol import MAX_JOB_BYTES, ErrorCode, Respond

from ..errors import Refusal
from .ports import TargetProcess

JobKey = tuple[int, str]

#: The most responders this host keeps: one per process, within the connection
#: limits; past it a `Respond` is refused (the process still gets py-spy's stacks).
MAX_RESPONDERS: Final = 65_536


@dataclass(frozen=True, slots=True)
class Responder:
    """A process that answers evidence requests, and the job it is a rank of."""

    pid: int
    uid: int
    #: When its process started (clock ticks since boot), as a timer's
    #: ``start_time``: an ask about a process started at another time is not its.
    start_time: int
    #: The handle on its process it registered with: its connection's own.
    process: TargetProcess = field(compare=False, repr=False)
    job: str = ""
    rank: int | None = None
    local_rank: int | None = None
    group_rank: int | None = None
    #: Its `Respond` said it unblocks its process when asked (`UnblockWanted`).
    unblock: bool = False


class Responders:
    """Who answers evidence requests, by process and by job."""

    def __init__(self) -> None:
        self._by_pid: dict[int, Responder] = {}
        self._by_job: dict[JobKey, set[int]] = {}
        #: Grows whenever a job gains its first responder or loses its last.
        self.changed = 0

    def __len__(self) -> int:
        return len(self._by_pid)

    def register(self, process: TargetProcess, uid: int, request: Respond) -> Responder:
        """``process`` of ``uid``, which has not exited (the caller saw to it),
        responds from now on, in place of whatever responded for its pid before:
        itself, on another connection or this one, or a process that has exited
        since, as no other live process holds its pid."""
        job = request.job or ""
        if "\0" in job or len(job.encode()) > MAX_JOB_BYTES:
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"a job is at most {MAX_JOB_BYTES} UTF-8 bytes, without NUL characters",
            )
        pid = process.pid
        if pid not in self._by_pid and len(self._by_pid) >= MAX_RESPONDERS:
            raise Refusal(ErrorCode.LIMIT_EXCEEDED, f"this host keeps {MAX_RESPONDERS} responders")
        self._drop(pid)
        responder = Responder(
            pid=pid,
            uid=uid,
            start_time=process.start_time,
            process=process,
            job=job,
            rank=request.rank,
            local_rank=request.local_rank,
            group_rank=request.group_rank,
            unblock=request.unblock,
        )
        self._by_pid[pid] = responder
        if job:
            pids = self._by_job.setdefault((uid, job), set())
            self.changed += not pids
            pids.add(pid)
        return responder

    def unregister(self, process: TargetProcess) -> bool:
        """The responder registered with the handle ``process`` no longer responds
        (its connection closed, or its process exited). False, with nothing
        changed, when its pid responds with another handle now, or none."""
        if not self.registered(process):
            return False
        self._drop(process.pid)
        return True

    def registered(self, process: TargetProcess) -> bool:
        """Whether the handle ``process`` is the one its pid responds with."""
        responder = self._by_pid.get(process.pid)
        return responder is not None and responder.process is process

    def _drop(self, pid: int) -> None:
        responder = self._by_pid.pop(pid, None)
        if responder is None or not responder.job:
            return
        key = (responder.uid, responder.job)
        pids = self._by_job.get(key)
        if pids is not None:
            pids.discard(pid)
            if not pids:
                del self._by_job[key]
                self.changed += 1

    def get(self, pid: int) -> Responder | None:
        return self._by_pid.get(pid)

    def of_job(self, owner: int, job: str) -> list[Responder]:
        """The responders of ``job`` of ``owner``, by pid."""
        return [self._by_pid[pid] for pid in sorted(self._by_job.get((owner, job), ()))]

    def jobs(self) -> set[JobKey]:
        """Every (owner, job) a responder is a rank of."""
        return set(self._by_job)
