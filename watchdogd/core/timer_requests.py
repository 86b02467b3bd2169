"""Connections, the handshake, and the requests that change timers (acquire,
release), with their authorization and limits.

Rules kept here:

- The target of a request is the caller (its kernel-reported pid) unless it names a
  pid; a named pid is allowed where the caller could kill(2) it
  (`watchdogd.core.identity.may_signal`). pid 1 and the daemon are never targets.
  The uids are those of the moment of the request: read when the process is opened,
  or read again (`ProcessPort.refresh`) when the table already holds it, since it
  may have called setuid(2) since its first timer.
- Release is authorized like arming: you may release what you could have armed.
- Per-uid limits apply to non-root callers; everyone is bounded by the global caps.
- Authorization comes before limits, so a refusal never tells one user what another
  has armed.
- A timer whose policy has ``starvation_grace`` is measured when it is armed
  (`watchdogd.core.firing` judges it at its deadline); only such timers pay for it.
- Every arming has a number of its own, the daemon's (`Timer.arm`: its arming
  time, kept later than every arming before it, so never the number of another
  arming of this daemon or of one before it on this boot, whose clock is the
  same CLOCK_MONOTONIC), and the acquire's reply names it. A release that names a
  number disarms only the arming of that number: never a newer one, whoever made
  it.
- A process that asks for it may have a scope it arms registered for the fast
  path (`watchdogd.core.slots`), when nothing of the arm needs more than a store
  can say (no ``stall``, no starvation grace, no progress): its later blocks arm
  and release by stores. An arm or a release of a registered scope by any other
  caller (root's ``watchdogctl arm --pid``) closes its slot: what that caller armed
  is a plain timer, which no store of the process can disarm. Registrations count
  against ``max_timers_per_uid`` armed or not; a uid at its limit has its
  registration released the longest reclaimed rather than a new one refused.

Process handles are reference-counted: the table holds one per process in it, each
connection holds one on its caller's own process (so a worker that arms and releases
in a loop does not reopen a pidfd each time), and a request holds one while it runs.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic

import msgspec

from watchdogd_protocol import (
    MAX_JOB_BYTES,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    ErrorCode,
    Evidence,
    Hello,
    Release,
    Released,
    Respond,
    Responding,
    Unblocked,
    Welcome,
    in_words,
)

from .._version import __version__
from ..errors import Refusal
from .history import Key as HistoryKey
from .identity import ROOT, Peer, may_signal
from .lifecycle import Lifecycle
from .policies import Policy
from .ports import P
from .slots import Slots
from .timers import SlotRef, Timer, Watch

if TYPE_CHECKING:
    from .context import CoreContext


@dataclass(slots=True, frozen=True)
class _Plan:
    """What an acquire arms: its timeout and where it came from, the fast-path
    slot it keeps or registers, its deadline and its `Watch`."""

    timeout: float
    timeout_from: str
    slot: SlotRef | None
    deadline: float
    watch: Watch | None


@dataclass(slots=True, eq=False)
class Caller(Generic[P]):
    """One connection's caller: its kernel-reported credentials and, once it has
    armed a timer on itself, a handle on its process kept for the connection's life."""

    peer: Peer
    process: P | None = None


class Arming(Generic[P]):
    """Who is connected, and what they may arm and release."""

    def __init__(
        self,
        context: CoreContext[P],
        lifecycle: Lifecycle[P],
        *,
        slots: Slots[P],
        record_taken: Callable[[int, str], None],
    ) -> None:
        """``record_taken(pid, scope)`` is called before a scope is armed
        (`watchdogd.core.firing.Firing.record_taken`)."""
        self._rules = context.rules
        self._writer = context.writer
        self._table = context.table
        self._processes = context.processes
        self._lifecycle = lifecycle
        self._slots = slots
        self._history = context.history
        self._metrics = context.metrics
        self._responders = context.responders
        self._daemon_pid = context.daemon_pid
        self._record_taken = record_taken
        self._connections: Counter[int] = Counter()
        #: Seconds a restart may take at the timer cap (set once the state loaded).
        self.restart_estimate = 0.0
        #: The time of the latest arming (`acquire`): each one's is later, so its
        #: number (`Timer.arm`) is its own. Positive, as a number must be.
        self._armed_last = 0.0

    @property
    def connections(self) -> int:
        return self._connections.total()

    def open_connection(self, peer: Peer) -> Caller[P]:
        """Count a new connection; raises `Refusal` (and counts nothing) at a limit."""
        limits = self._rules.daemon
        if self.connections >= limits.max_connections:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"the daemon has {limits.max_connections} connections open, its limit",
            )
        if peer.uid != ROOT and self._connections[peer.uid] >= limits.max_connections_per_uid:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {peer.uid} has {limits.max_connections_per_uid} connections open, its limit",
            )
        self._connections[peer.uid] += 1
        self._metrics.connections_total += 1
        caller: Caller[P] = Caller(peer)
        if peer.pidfd is None and not peer.gone:
            # Without SO_PEERPIDFD the caller is found by pid: do it while it is
            # surely the process that just connected, not on its first request.
            with contextlib.suppress(Refusal):
                caller.process = self._processes.open(peer.pid, peer)
        return caller

    def close_connection(self, caller: Caller[P]) -> None:
        """Uncount a connection and drop its handle on the caller's process."""
        uid = caller.peer.uid
        self._connections[uid] -= 1
        if not self._connections[uid]:
            del self._connections[uid]
        if caller.process is not None:
            caller.process.close()
            caller.process = None

    def welcome(self, hello: Hello) -> Welcome:
        """Answer a handshake; refuses a version this daemon does not speak. A client
        of an older version it still speaks is answered as before: it never sends
        what it does not know."""
        if not MIN_PROTOCOL_VERSION <= hello.version <= PROTOCOL_VERSION:
            raise Refusal(
                ErrorCode.UNSUPPORTED_VERSION,
                f"this daemon speaks protocol versions {MIN_PROTOCOL_VERSION} to "
                f"{PROTOCOL_VERSION}, the client speaks {hello.version}; "
                "upgrade the older of the two",
            )
        return Welcome(
            id=hello.id,
            version=PROTOCOL_VERSION,
            server=f"watchdogd/{__version__}",
            pid=self._daemon_pid,
            restart=self.restart_estimate,
            max_timeout=self._rules.daemon.max_timeout,
        )

    def acquire(self, request: Acquire, caller: Caller[P], now: float) -> Acquired:
        """Arm (or re-arm) the timer ``request`` names, for ``caller``."""
        if now <= self._armed_last:
            # Armings at one reading of the clock (a batch of requests, a coarse
            # clock) are told apart by the smallest step a float takes: one ulp,
            # some picoseconds at any uptime.
            now = math.nextafter(self._armed_last, math.inf)
        self._check_bounds(request)
        policy, chosen = self._rules.chosen(request.policy, caller.peer.uid)
        # Authorization comes before the limits: whether the timer exists decides
        # whether a limit applies, so checking limits first would tell a caller at
        # its limit which scopes another user's process has armed.
        process = self._target(request.pid, caller, now)
        try:
            plan = self._plan(request, chosen, process, caller.peer, now)
            timer, rearmed = self._arm(
                request, plan, process, caller.peer, policy=policy, chosen=chosen, now=now
            )
            grant = None
            if plan.slot is not None:
                slot = self._slots.slot_of(timer, process, now)
                assert slot is not None
                auto = plan.timeout if request.auto is not None else None
                grant = self._slots.armed(timer, slot, plan.deadline, auto)
        finally:
            process.close()
        if plan.watch is None:
            return Acquired(id=request.id, remaining=plan.timeout, rearmed=rearmed, arm=timer.arm)
        return Acquired(
            id=request.id,
            remaining=plan.deadline - now if plan.watch.stall else plan.timeout,
            rearmed=rearmed,
            timeout_from=plan.timeout_from,
            arm=timer.arm,
            slot=grant,
        )

    def _plan(self, request: Acquire, chosen: Policy, process: P, peer: Peer, now: float) -> _Plan:
        """What ``request`` arms on ``process``, within ``peer``'s limits: its
        timeout (from its history, for an ``auto`` one), the slot it keeps or
        registers, its deadline and its `Watch`."""
        previous = self._table.get(process.pid, request.scope)
        wants_slot = _wants_slot(request, chosen)
        kept = self._registered(previous, process, wants_slot, now)
        if previous is None:
            self._check_timer_limits(peer, now)
        timeout, timeout_from = request.timeout, ""
        if request.auto is not None:
            if kept is not None:
                assert previous is not None
                self._slots.harvest(previous, process, now)
            timeout, timeout_from = self._history.timeout(
                self._history_key(process, request.scope), request.auto.floor, request.timeout
            )
        ref = kept
        if ref is None and wants_slot:
            ref = self._slots.register(process, request.scope, timeout, now, peer.uid)
        deadline = now + timeout
        watch = None
        if request.progress is not None or chosen.stall or timeout_from or request.job or ref:
            watch = _watch(request, chosen.stall, timeout_from, previous, now, slot=ref)
            if watch.stall:
                deadline = min(deadline, watch.progressed_at + watch.stall)
        return _Plan(timeout, timeout_from, ref, deadline, watch)

    def _arm(
        self,
        request: Acquire,
        plan: _Plan,
        process: P,
        peer: Peer,
        *,
        policy: str,
        chosen: Policy,
        now: float,
    ) -> tuple[Timer, bool]:
        """Arm ``plan`` on ``process`` (journaled, the wake-up moved: `TableWriter.arm`);
        the timer as the table holds it, and whether it replaced one."""
        entering = self._table.process(process.pid) is None
        self._record_taken(process.pid, request.scope)
        timer, rearmed = self._writer.arm(
            process,
            request.scope,
            rewatch=functools.partial(self._measured, process) if chosen.starvation_grace else None,
            timeout=plan.timeout,
            policy=policy,
            uid=process.uid,
            owner=peer.uid,
            now=now,
            exit_releases=request.exit_releases,
            watch=_kept(plan.watch),
            # A registration's deadline in the table is the next look at its slot.
            deadline=plan.deadline
            if plan.slot is None
            else min(plan.deadline, now + plan.slot.period),
        )
        self._armed_last = now
        if entering:
            process.retain()
            self._processes.track(process)
        if request.job:
            # The name an incident of the job will carry, looked up off the
            # loop now: by its expiry it is known.
            self._processes.user_name(peer.uid)
        return timer, rearmed

    def _registered(
        self, previous: Timer | None, process: P, wanted: bool, now: float
    ) -> SlotRef | None:
        """The slot of ``previous``, the registered timer this arm replaces, when
        the arm keeps it (its own process, wanting one, its page still there);
        closed otherwise."""
        if previous is None or previous.slot is None:
            return None
        if wanted and self._slots.slot_of(previous, process, now) is not None:
            return previous.slot
        self._slots.revoke(previous, process, now)
        return None

    def _check_bounds(self, request: Acquire) -> None:
        """Refuse an `Acquire` whose scope, job or timeout is past a bound."""
        limits = self._rules.daemon
        if "\0" in request.scope:
            raise Refusal(ErrorCode.INVALID_REQUEST, "scope contains a NUL character")
        scope_bytes = len(request.scope.encode())
        if scope_bytes > limits.max_scope_bytes:
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"scope is {scope_bytes} bytes long; the limit is {limits.max_scope_bytes}",
            )
        if request.job is not None and (
            "\0" in request.job or len(request.job.encode()) > MAX_JOB_BYTES
        ):
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"a job is at most {MAX_JOB_BYTES} UTF-8 bytes, without NUL characters",
            )
        if not (math.isfinite(request.timeout) and request.timeout <= limits.max_timeout):
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"a timeout is at most {in_words(limits.max_timeout)} here (max_timeout), "
                f"not {in_words(request.timeout)}",
            )

    def _measured(self, process: P, watch: Watch | None) -> Watch:
        """``watch``, of a timer just armed on ``process`` under a policy with
        ``starvation_grace``, with what the kernel says of its process kept
        (``baseline``, and its grace back). Only such timers pay for it: the
        path of every other acquire reads nothing."""
        watch = Watch() if watch is None else watch
        return msgspec.structs.replace(
            watch, baseline=self._processes.sample(process), extended=0.0
        )

    def release(self, request: Release, caller: Caller[P], now: float) -> Released:
        """Disarm the timer ``request`` names, if ``caller`` could have armed it (and,
        when the request names an arming, if that arming is the one in force)."""
        if request.pid is None and self._table.process(caller.peer.pid) is None:
            return Released(id=request.id, found=False)
        process = self._target(request.pid, caller, now)
        try:
            if self._table.process(process.pid) is not process:
                return Released(id=request.id, found=False)
            held = self._table.get(process.pid, request.scope)
            if held is not None and held.slot is not None:
                found = self._release_slot(held, process, request.pid is None, now)
                return Released(id=request.id, found=found)
            if request.stored:
                # A block armed by a store, whose slot closed: what holds the scope
                # now was armed over the socket since, and is not its to disarm.
                return Released(id=request.id, found=False)
            timer, gone = self._writer.disarm(process.pid, request.scope, request.arm or 0)
            if timer is not None:
                self._history.record(
                    self._history_key(process, timer.scope), max(0.0, now - timer.armed_at)
                )
            if gone is not None:
                self._processes.untrack(gone)
        finally:
            process.close()
        return Released(id=request.id, found=timer is not None)

    def _release_slot(self, held: Timer, process: P, own: bool, now: float) -> bool:
        """Release registered ``held``: by its own process, its slot is released
        and it stays registered; by another caller, its slot closes and the
        registration goes. Whether its slot held a block."""
        slot = self._slots.slot_of(held, process, now)
        if slot is None or not own:
            armed = slot is not None and self._slots.deadline_of(held, now) is not None
            self._slots.revoke(held, process, now)
            _, gone = self._writer.disarm(process.pid, held.scope)
            if gone is not None:
                self._processes.untrack(gone)
            return armed
        began = self._slots.block_began(held, slot)
        found = slot.release()
        if found:
            self._history.record(self._history_key(process, held.scope), max(0.0, now - began))
        return found

    def _history_key(self, process: P, scope: str) -> HistoryKey:
        """Where the history of ``scope`` on ``process`` is kept: its uid, the
        executable it runs, the scope."""
        return (process.uid, self._processes.executable(process), scope)

    def _target(self, pid: int | None, caller: Caller[P], now: float) -> P:
        """A handle on the process a request is about, after authorization, with a
        reference of its own that the request must `close`."""
        if pid is None:
            return self.caller_itself(caller, now)
        peer = caller.peer
        if pid <= 1:
            raise Refusal(ErrorCode.PERMISSION_DENIED, "pid 1 (init) is never a target")
        if pid == self._daemon_pid:
            raise Refusal(ErrorCode.PERMISSION_DENIED, "the daemon itself is never a target")
        process = self._table.process(pid)
        if process is not None and not self._processes.refresh(process):
            # Its exit is not processed yet and the pid may be someone else's by
            # now: settle it rather than attach a timer to a dead handle.
            self._lifecycle.process_exited(process, now)
            process = None
        if process is None:
            process = self._processes.open(pid, peer)
        else:
            process.retain()
        if not may_signal(peer.uid, process.uid, process.saved_uid):
            process.close()
            raise Refusal(
                ErrorCode.PERMISSION_DENIED,
                f"uid {peer.uid} may not signal pid {pid} (real uid {process.uid}, "
                f"saved uid {process.saved_uid}); only root or the owner may arm or release "
                "its timers",
            )
        return process

    def caller_itself(self, caller: Caller[P], now: float) -> P:
        """The exact process that opened the connection.

        Its handle comes from the connection (SO_PEERPIDFD), so a connection that
        outlives its process (a child kept the socket) never reaches whoever holds
        the pid next: the table's handle for the pid is used only when it is the
        same process (same pid and start time), or when the table's is the one
        that has gone.
        """
        own = caller.process
        if own is None:
            if caller.peer.gone:
                raise _exited(caller)
            own = caller.process = self._processes.open(caller.peer.pid, caller.peer)
        held = self._table.process(own.pid)
        if held is None or held is own or held.start_time == own.start_time:
            process = held or own
        elif not self._processes.alive(held):
            self._lifecycle.process_exited(held, now)  # the table's is the one that has gone
            process = own
        else:
            raise Refusal(
                ErrorCode.NO_SUCH_PROCESS,
                f"the process that opened this connection (pid {own.pid}) has exited; "
                "its pid now belongs to another process",
            )
        process.retain()
        return process

    def connecting_process(self, caller: Caller[P]) -> P:
        """The exact process that opened ``caller``'s connection, while it has not
        exited: a handle the connection keeps for its life (`close_connection`
        lets it go). Raises `Refusal` (no_such_process) once that process has
        exited, a zombie included: a connection that outlived its process (a child
        of a fork kept the socket) speaks for nobody.

        With SO_PEERPIDFD the handle comes from the connection's own pidfd, so it
        is that process whoever holds its pid now. Without, it was opened by pid
        when the connection was taken (`open_connection`): a caller gone by then
        (or one the kernel gave no pidfd for: `Peer.gone`) has none, and is never
        looked for by its pid again.
        """
        own = caller.process
        if own is None and caller.peer.pidfd is not None:
            try:
                own = caller.process = self._processes.open(caller.peer.pid, caller.peer)
            except Refusal as refusal:
                if refusal.code != ErrorCode.NO_SUCH_PROCESS:
                    raise
        if own is None or self._processes.exited(own):
            raise _exited(caller)
        return own

    def respond(self, request: Respond | Evidence | Unblocked, caller: Caller[P]) -> Responding:
        """A responder's `Respond`, which binds it to the exact process that opened
        its connection, alive (`connecting_process`); or its `Evidence` or
        `Unblocked`, taken only on the connection its process responds on now
        (whoever asked for it takes it from there: `watchdogd.runtime.asks`)."""
        if isinstance(request, Respond):
            process = self.connecting_process(caller)
            self._responders.register(process, caller.peer.uid, request)
        elif caller.process is None or not self._responders.registered(caller.process):
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                "an answer to the daemon's ask is taken only on the connection a process "
                "responds on, after respond",
            )
        return Responding(id=request.id)

    def stop_responding(self, process: P) -> None:
        """The connection ``process`` responds on answers for it no longer: it
        closed, or the process exited."""
        self._responders.unregister(process)

    def _check_timer_limits(self, peer: Peer, now: float) -> None:
        limits = self._rules.daemon
        if len(self._table) >= limits.max_timers:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"the daemon holds {limits.max_timers} timers, its limit",
            )
        if peer.uid == ROOT:
            return
        held = self._table.owned_by(peer.uid) - self._slots.closing_of(peer.uid)
        if held >= limits.max_timers_per_uid and self._slots.reclaim(peer.uid, now):
            held -= 1
        if held >= limits.max_timers_per_uid:
            raise Refusal(
                ErrorCode.LIMIT_EXCEEDED,
                f"uid {peer.uid} has {limits.max_timers_per_uid} timers armed, its limit",
            )


def _exited(caller: Caller[P]) -> Refusal:
    """The refusal of a request about itself on a connection whose process exited."""
    return Refusal(
        ErrorCode.NO_SUCH_PROCESS,
        f"the process that opened this connection (pid {caller.peer.pid}) has exited; "
        "a connection speaks only for the process that opened it",
    )


def _wants_slot(request: Acquire, policy: Policy) -> bool:
    """Whether ``request`` registers its scope for the fast path: the caller asks,
    for itself, and nothing of the arm needs more than a store can say."""
    return (
        request.slot
        and request.pid is None
        and request.progress is None
        and not request.exit_releases
        and not policy.stall
        and not policy.starvation_grace
    )


def _kept(watch: Watch | None) -> Watch | SlotRef | None:
    """What a timer armed with ``watch`` keeps of it: a registration that needs
    nothing but its slot keeps its bare `SlotRef`, one object fewer (the time its
    `Watch` says it was armed is its ``armed_at`` already)."""
    if watch is None or watch.slot is None or watch.progress is not None:
        return watch
    bare = Watch(progressed_at=watch.progressed_at, slot=watch.slot)
    return watch.slot if watch == bare else watch


def _watch(
    request: Acquire,
    stall: float,
    timeout_from: str,
    previous: Timer | None,
    now: float,
    *,
    slot: SlotRef | None = None,
) -> Watch:
    """The `Watch` of a timer armed now by ``request``, under a policy that allows
    ``stall`` seconds without progress, in place of ``previous`` (None: a new
    timer).

    Progress grows only past the highest value this timer has carried: a re-arm
    with the same value, a lower one or none leaves the time it last grew as it
    was. A new timer (one released and armed again is new) starts growing now."""
    progress, progressed_at = request.progress, now
    before = None if previous is None else previous.watched
    if before is not None and (
        progress is None or (before.progress is not None and progress <= before.progress)
    ):
        progress, progressed_at = before.progress, before.progressed_at
    return Watch(
        progress=progress,
        progressed_at=progressed_at,
        stall=stall,
        timeout_from=timeout_from,
        job=request.job or "",
        rank=request.rank,
        local_rank=request.local_rank,
        group_rank=request.group_rank,
        slot=slot,
    )
