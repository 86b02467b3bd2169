"""Responders: the processes that answer the daemon's evidence requests from inside.

A process that uses the client library keeps one background connection, its
responder, on which it sends `Respond` once (`watchdogd_client.protocol.requests`):
the kernel says which process it is (the connection's peer credentials), the
request which job and rank it belongs to. From then until that connection closes
it is a rank of that job here whether or not it holds a timer, so a rank stuck
outside any ``expires()`` block (often the one its peers wait for) is still one
the daemon asks when the job has an incident. A job is its owner's, as a timer's
is: the uid of the responder's process.

This module keeps who responds for which job; asking and waiting for the answer
is the runtime's (`watchdogd.runtime.responders`), which accepts an answer only on
the connection it asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from watchdogd_client.protocol import MAX_JOB_BYTES, ErrorCode, Respond

from ..errors import Refusal

JobKey = tuple[int, str]

#: The most responders this host keeps: one per process, within the connection
#: limits; past it a `Respond` is refused (the process still gets py-spy's stacks).
MAX_RESPONDERS: Final = 65_536


@dataclass(frozen=True, slots=True)
class Responder:
    """A process that answers evidence requests, and the job it is a rank of."""

    pid: int
    uid: int
    job: str = ""
    rank: int | None = None
    local_rank: int | None = None
    group_rank: int | None = None


class Responders:
    """Who answers evidence requests, by process and by job."""

    def __init__(self) -> None:
        self._by_pid: dict[int, Responder] = {}
        self._by_job: dict[JobKey, set[int]] = {}
        #: Grows whenever a job gains its first responder or loses its last.
        self.changed = 0

    def __len__(self) -> int:
        return len(self._by_pid)

    def register(self, pid: int, uid: int, request: Respond) -> Responder:
        """Process ``pid`` of ``uid`` responds from now on (it replaces what it said
        before, on another connection or this one)."""
        job = request.job or ""
        if "\0" in job or len(job.encode()) > MAX_JOB_BYTES:
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"a job is at most {MAX_JOB_BYTES} UTF-8 bytes, without NUL characters",
            )
        if pid not in self._by_pid and len(self._by_pid) >= MAX_RESPONDERS:
            raise Refusal(ErrorCode.LIMIT_EXCEEDED, f"this host keeps {MAX_RESPONDERS} responders")
        self.unregister(pid)
        responder = Responder(
            pid=pid,
            uid=uid,
            job=job,
            rank=request.rank,
            local_rank=request.local_rank,
            group_rank=request.group_rank,
        )
        self._by_pid[pid] = responder
        if job:
            pids = self._by_job.setdefault((uid, job), set())
            self.changed += not pids
            pids.add(pid)
        return responder

    def unregister(self, pid: int) -> None:
        """Process ``pid`` no longer responds (its connection closed)."""
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
