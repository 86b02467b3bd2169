"""This process's responder: the one background connection a client has, on which
the daemon asks for evidence from inside the worker and gets it without ptrace.

A process gets one responder, started by its first timer: the first ``acquire()``
or ``expires()`` of a `watchdogd_client.Client` on the process itself (the torch
adapter's timers are such), through `settle_responder`. It is a daemon thread with a
connection of its own, which it opens on its own: arming never waits for it. On
each connection it

1. judges the socket as every client does (`watchdogd_client.trust`), and asks
   more of a path the caller named: a daemon that runs neither as root, nor as
   this process's effective uid, nor, on the host's path, as the user root gave
   its directory to (the service's own), is sent nothing, not even a hello;
2. sends `Hello` with the protocol's version, as the engine's plan of a greeting
   says (`watchdogd_client.engine.Engine.greet`, which the clients drive too,
   without its fall back to an older version), then `Respond` with the job and
   ranks of the timer that started it (by default from the environment,
   `watchdogd_client.arming.job_of`), and reads `Responding`;
3. answers every `EvidenceWanted` with `Evidence` for the same ``ask``
   (`take_evidence`), and every `UnblockWanted` with `Unblocked`
   (`watchdogd_client.unblocking.unblock`: the process is cut out of the
   collective it waits in only where its own Flight Recorder confirms the
   request's bounds), for as long as the connection lasts, reading the daemon's
   `Responding` to each without waiting for it.

It also makes sure that no release of an ``expires()`` block is lost
(`watchdogd_client.releases`): the worker's client sends one and goes on, and
reads its answer at its next request. When the daemon restarts in between, the
responder's connection ends too: right after the welcome of its next one, before
anything else, it sends again every release whose answer no one has read, without
waiting for the worker's next request; `resend` does the same on demand (a client
whose own connection broke). While releases wait so, the pauses between its
attempts to connect are at most `_RELEASE_PAUSE`, well within the daemon's restart
grace (`watchdogd_protocol.RESTART_GRACE`). A client takes that path only with
a responder that `carries` its releases.

Invariants:

- One responder per process, and only one ever connected: after ``fork()`` the
  child has none (its copy of the parent's socket is closed, which sends nothing
  on it), and its own first timer starts its own, which answers for the child.
- A connection that ends (the daemon restarted) is opened again, with `Respond`
  sent again, after pauses from 10 ms doubling to 2 s; the pauses start again from
  10 ms once the daemon has taken a `Respond`.
- It stops for good, quietly, when the daemon refuses its version (a daemon older
  than protocol 2, which has no responders) or refuses `Respond` for a reason that
  asking again would not change; the client's own connections are unaffected.
- An `Evidence` always encodes within `watchdogd_protocol.MAX_EVIDENCE_BYTES`
  (`fit_evidence`), so the daemon never refuses one for its size.
- torch is never imported here: the Flight Recorder is read only when the program
  imported ``torch.distributed`` and initialised it.
- ``WATCHDOGD_RESPONDER=0`` (`watchdogd_client.switches.RESPONDER`), or a timer armed
  by a client made with ``responder=False``, means the process has none.
  ``WATCHDOGD_UNBLOCK=0`` (`watchdogd_client.switches.UNBLOCK`) keeps the responder
  but says in `Respond` that it does not unblock: the daemon never asks it to.
- A process that exits while its responder answers the daemon waits, for up to
  `EXIT_WAIT`, for that answer to go out: a cut makes the program's collective
  raise at once, so the program may end before the answer is sent, and the
  daemon knows what its responder did only from the answer.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import select
import socket
import threading
import time
from typing import Final

from watchdogd_protocol import (
    Acquire,
    ErrorCode,
    Evidence,
    Release,
    Released,
    Respond,
    Responding,
    Unblocked,
    UnblockOutcome,
    UnblockWanted,
    Wanted,
)

from . import releases
from ._version import __version__
from .arming import JobLabels, job_of
from .engine import Answer, Backoff, Connection, Engine, Exchange, Open, Step, drive
from .errors import DaemonUnavailable, RequestRefused, UntrustedSocket, WatchdogdError
from .evidence import MAX_NOTE, take_evidence
from .paths import Place, find_socket
from .switches import RESPONDER, UNBLOCK, env_switch
from .trust import vet
from .unblocking import unblock

__all__ = [
    "Responder",
    "decline_responder",
    "process_responder",
    "release_carrier",
    "settle_responder",
    "start_responder",
]

log = logging.getLogger("watchdogd_client")

#: The longest pause between attempts to reach the daemon: a responder waits as long
#: as its process lives, so it may wait longer than a request does, but a daemon
#: back from a restart should find its ranks again within moments.
_LONGEST_PAUSE: Final = 2.0
#: How long the hello and `Respond` wait for their replies. Once registered, the
#: connection waits for the daemon's asks without a bound.
_HANDSHAKE_TIMEOUT: Final = 10.0
_RECV_SIZE: Final = 64 * 1024
#: Refusals that may pass (a limit, a resource short for now): the responder tries
#: again later. Any other refusal of its hello or `Respond` stops it.
_PASSING: Final = frozenset({ErrorCode.LIMIT_EXCEEDED, ErrorCode.UNAVAILABLE})
#: The longest pause between attempts to connect while releases wait to be sent
#: again: the daemon holds an overdue timer of a live process for its restart
#: grace (1 s) after it starts, for its release to arrive.
_RELEASE_PAUSE: Final = 0.05
#: How long sending releases again may wait for room in the socket's buffer.
_SEND_TIMEOUT: Final = 1.0
#: How long an exiting process waits for what is on its way to the daemon: the
#: answer its responder has begun, and its client's releases' answers.
EXIT_WAIT: Final = 2.0


class _Stop(Exception):
    """The daemon refused what asking again would not change: the responder ends."""


class Responder:
    """This process's responder (see the module docstring): it answers the daemon at
    ``socket_path`` (a path is one the caller named) as the process of ``pid``, a
    rank of ``labels``. Get it from `start_responder`; `stop` ends it."""

    def __init__(self, socket_path: str | Place, labels: JobLabels) -> None:
        self.place = find_socket(socket_path)
        self.socket_path = self.place.path
        self.labels = labels
        #: Whether the daemon may ask it to unblock its process (`UNBLOCK`).
        self.unblocks = env_switch(UNBLOCK, default=True)
        self.pid = os.getpid()
        # An engine of its own: its ids and its version are this connection's alone.
        self._engine = Engine(
            self.socket_path, client=f"python-responder/{__version__}", reconnect_timeout=0.0
        )
        self._sock: socket.socket | None = None
        #: The protocol of ``_sock`` once welcomed: releases may go out on it.
        self._connection: Connection | None = None
        self._stopping = False
        #: Whether the daemon took `Respond` on the current connection.
        self._registered = False
        #: Whether a connection of its was ever welcomed: until then, it may not
        #: reach the daemon at all (one of another uid, say).
        self._welcomed = False
        self._warned = False
        #: Serialises what goes out on the socket: this thread's frames and the
        #: releases a worker's thread asks it to send again.
        self._send_lock = threading.Lock()
        #: The releases sent again on the current connection: request id, token.
        self._resent: dict[int, int] = {}
        #: Clear while an answer is begun and not yet sent (`finish` waits on it).
        self._quiet = threading.Event()
        self._quiet.set()
        self._thread = threading.Thread(target=self._run, name="watchdogd-responder", daemon=True)

    def __repr__(self) -> str:
        return f"Responder({self.socket_path!r}, pid={self.pid})"

    @property
    def running(self) -> bool:
        """Whether its thread still runs (it ends only when stopped or refused)."""
        return self._thread.is_alive()

    @property
    def registered(self) -> bool:
        """Whether the daemon took its `Respond` on the connection it has now."""
        return self._registered

    def start(self) -> None:
        """Start its thread, which connects on its own."""
        self._thread.start()

    def stop(self) -> None:
        """Stop answering: its connection closes, and no other opens."""
        self._stopping = True
        sock = self._sock
        if sock is not None:
            # Wakes the thread from its recv; close() alone would not.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def finish(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the answer it is giving, if any, to
        be sent; whether none is left."""
        return self._quiet.wait(timeout)

    def carries(self, socket_path: str) -> bool:
        """Whether releases to the daemon at ``socket_path`` may go without waiting
        for their answers: this responder answers that daemon, from this process,
        and reached it at least once."""
        return (
            socket_path == self.socket_path
            and self._welcomed
            and self.pid == os.getpid()
            and self._thread.is_alive()
        )

    def resend(self) -> None:
        """Send again, now, every release whose answer no one has read (a client's
        connection broke with some on it); after the next welcome if the
        connection is down. A worker's thread never waits long here: while this
        thread's own send holds the socket past `_SEND_TIMEOUT`, the releases are
        left to the client's next request, which sends them again too."""
        if not self._send_lock.acquire(timeout=_SEND_TIMEOUT):
            return
        try:
            connection, sock = self._connection, self._sock
            if connection is not None and sock is not None and connection.state == "open":
                self._send_releases(sock, connection)
        finally:
            self._send_lock.release()

    def _send_releases(self, sock: socket.socket, connection: Connection) -> None:
        """Send every release not settled yet, holding ``_send_lock``."""
        frames = bytearray()
        for token, released in releases.pending():
            if token in self._resent.values():
                continue  # on its way on this connection already
            release = Release(id=self._engine.next_id(), scope=released.scope, arm=released.arm)
            frames += connection.send(release, Released, resent=True)
            self._resent[release.id] = token
        if frames:
            self._send(sock, bytes(frames))

    @staticmethod
    def _send(sock: socket.socket, frame: bytes) -> None:
        """Send ``frame`` whole within `_SEND_TIMEOUT`, or shut the connection
        down (this thread then connects again and sends what is unsettled)."""
        view = memoryview(frame)
        deadline = time.monotonic() + _SEND_TIMEOUT
        try:
            while view:
                try:
                    view = view[sock.send(view, socket.MSG_DONTWAIT) :]
                    continue
                except BlockingIOError:
                    pass
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [sock], [], left)[1]:
                    raise TimeoutError("the daemon reads nothing of the responder's")
        except OSError:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        backoff = _backoff()
        while not self._stopping:
            self._registered = False
            try:
                self._converse()
            except _Stop as refused:
                log.debug("the responder stops: %s", refused)
                return
            except UntrustedSocket as refused:
                self._refused(refused)
            except (OSError, WatchdogdError) as exc:
                log.debug("the responder lost the daemon at %s: %s", self.socket_path, exc)
            except Exception:
                # A fault of its own must not print into the worker's output as a
                # thread's uncaught exception; the process runs on without it.
                log.warning("the responder stopped on a fault of its own", exc_info=True)
                return
            finally:
                self._close()
            if self._registered:
                backoff = _backoff()
            pause = backoff.pause(time.monotonic())
            assert pause is not None  # an endless deadline never gives up
            if releases.waiting():
                pause = min(pause, _RELEASE_PAUSE)
            time.sleep(pause)

    def _converse(self) -> None:
        """One connection, from its connect to its end: greeted as the engine's
        plan says (`Engine.greet`), without its fall back to an older version."""
        labels = self.labels
        try:
            connection = drive(self._engine.greet(responder=True), self._take)
            sock = self._sock
            assert sock is not None
            with self._send_lock:
                # Before anything else: the daemon may be holding timers for them.
                self._send_releases(sock, connection)
                self._connection = connection
                self._welcomed = True
            respond = Respond(
                id=self._engine.next_id(),
                job=labels.job,
                rank=labels.rank,
                local_rank=labels.local_rank,
                group_rank=labels.group_rank,
                unblock=self.unblocks,
            )
            frame = connection.send(respond, Responding)
            self._exchange(sock, connection, respond.id, frame).result(Responding)
        except RequestRefused as refused:
            if refused.code in _PASSING:
                raise
            raise _Stop(f"the daemon at {self.socket_path} refused it: {refused}") from None
        self._registered = True
        sock.settimeout(None)
        while connection.state != "closed":
            for answer in self._receive(sock, connection):
                if answer.error is not None:
                    log.debug("the daemon did not take the evidence: %s", answer.error)

    def _take(self, step: Step) -> Answer | Connection:
        """Take a step of the greeting's plan: open a socket, or exchange a frame."""
        if isinstance(step, Open):
            return self._open()
        if isinstance(step, Exchange):
            sock = self._sock
            assert sock is not None
            return self._exchange(sock, step.connection, step.request_id, step.frame)
        raise TypeError(f"a responder's greeting asked for {step!r}")

    def _open(self) -> Connection:
        """A socket to the daemon, judged (as an evidence socket is) before anything
        is sent on it, and its protocol."""
        with vet(self.place, evidence=True) as vetted:
            sock = self._sock = socket.socket(
                socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC
            )
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            sock.connect(vetted.address)
            if self._stopping:
                raise _Stop("stopped")
            vetted.admit(sock)
        return self._engine.connect(responder=True)

    def _refused(self, refused: UntrustedSocket) -> None:
        """Say once that this process's evidence goes nowhere: it tries again later
        all the same, quietly (the socket may be replaced by a daemon it trusts)."""
        if not self._warned:
            self._warned = True
            log.warning("the responder does not answer: %s", refused)
        else:
            log.debug("the responder does not answer: %s", refused)

    def _exchange(
        self, sock: socket.socket, connection: Connection, request_id: int, frame: bytes
    ) -> Answer:
        """Send ``frame`` and read until the answer to ``request_id``."""
        with self._send_lock:
            sock.sendall(frame)
        while True:
            for answer in self._receive(sock, connection):
                if answer.id == request_id:
                    return answer

    def _receive(self, sock: socket.socket, connection: Connection) -> list[Answer]:
        """Read once; answer what the daemon asked in it; the answers it completes."""
        try:
            data = sock.recv(_RECV_SIZE)
        except (ConnectionResetError, BrokenPipeError) as exc:
            return connection.connection_lost(exc.strerror)
        if not data:
            return connection.connection_lost("the daemon closed it")
        answers = connection.receive_data(data)
        if self._resent:
            answers = self._settled(answers)
        wanted, connection.wanted = connection.wanted, []
        for ask in wanted:
            self._answer(sock, connection, ask)
        return answers

    def _settled(self, answers: list[Answer]) -> list[Answer]:
        """Settle the releases that ``answers`` answer (one whose connection ended
        first waits for the next); the other answers."""
        rest = []
        for answer in answers:
            token = self._resent.pop(answer.id, None)
            if token is None:
                rest.append(answer)
            elif not isinstance(answer.error, DaemonUnavailable):
                releases.settle(token, answer.error)
        return rest

    def _answer(self, sock: socket.socket, connection: Connection, wanted: Wanted) -> None:
        if connection.state != "open":
            return
        self._quiet.clear()
        try:
            self._give_answer(sock, connection, wanted)
        finally:
            self._quiet.set()

    def _give_answer(self, sock: socket.socket, connection: Connection, wanted: Wanted) -> None:
        request_id = self._engine.next_id()
        answer: Evidence | Unblocked
        if isinstance(wanted, UnblockWanted):
            answer = self._unblock(request_id, wanted)
        else:
            try:
                answer = take_evidence(request_id, wanted.ask)
            except Exception as exc:
                # A fault in taking it must not end the responder (nor print in the
                # worker's output): the daemon hears what went wrong instead.
                note = f"no evidence: {exc!r}"[:MAX_NOTE]
                answer = Evidence(id=request_id, ask=wanted.ask, note=note)
        frame = connection.send(answer, Responding)
        with self._send_lock:
            sock.sendall(frame)

    def _unblock(self, request_id: int, wanted: UnblockWanted) -> Unblocked:
        """Answer ``wanted``, cutting the process out of its collective where its
        Flight Recorder confirms the request; the worker's log says so when it
        does, since the exception its program sees next names only a peer."""
        if not self.unblocks:  # a daemon that asks all the same
            note = "this process does not unblock (WATCHDOGD_UNBLOCK)"
            outcome = UnblockOutcome.FAILED
            return Unblocked(id=request_id, ask=wanted.ask, outcome=outcome, note=note)
        try:
            answer = unblock(request_id, wanted)
        except Exception as exc:
            note = f"not cut: {exc!r}"[:MAX_NOTE]
            outcome = UnblockOutcome.FAILED
            return Unblocked(id=request_id, ask=wanted.ask, outcome=outcome, note=note)
        if answer.outcome == UnblockOutcome.UNBLOCKED and answer.collective is not None:
            collective = answer.collective
            log.warning(
                "watchdogd cut this process out of %s #%d of group %s after %.1f s "
                "(%d connections shut or groups aborted): %s",
                collective.op,
                collective.seq,
                collective.group,
                answer.waited,
                answer.cut,
                wanted.reason or "its daemon asked",
            )
        return answer

    def _close(self) -> None:
        with self._send_lock:
            sock, self._sock, self._connection = self._sock, None, None
            self._resent.clear()  # unsettled: sent again on the next connection
        if sock is not None:
            sock.close()

    def _forget_in_child(self) -> None:
        # The parent's connection is the parent's: the child drops its copy of the
        # descriptor, which sends nothing on the socket. The parent's thread may
        # have held the send lock at the fork; in the child it would stay held.
        self._send_lock = threading.Lock()
        self._stopping = True
        self._close()


def _backoff() -> Backoff:
    return Backoff(math.inf, longest=_LONGEST_PAUSE)


class _ThisProcess:
    """Whether this process's responder is settled (started or declined), and which
    it is."""

    responder: Responder | None = None
    settled = False
    declined = False
    lock = threading.Lock()


def settle_responder(wanted: bool, socket_path: str | Place, timer: Acquire) -> None:
    """What arming ``timer`` on this process means for its responder: the first timer
    of a client that ``wanted`` one starts it (`start_responder`) with the timer's
    job and ranks; a timer of a client that did not declines it
    (`decline_responder`). Once settled, this is a check and nothing more."""
    if wanted:
        if not _ThisProcess.settled:
            labels = JobLabels(timer.job, timer.rank, timer.local_rank, timer.group_rank)
            start_responder(socket_path, labels)
    elif not _ThisProcess.declined:
        decline_responder()


def start_responder(socket_path: str | Place, labels: JobLabels | None = None) -> Responder | None:
    """Start this process's responder, to answer the daemon at ``socket_path`` as a
    rank of ``labels`` (default: `watchdogd_client.arming.job_of`), unless the process
    has one already or declined one (`decline_responder`, or the
    ``WATCHDOGD_RESPONDER`` switch off). Returns the process's responder, if it has
    one. Never waits for the daemon: the responder connects on its own thread."""
    with _ThisProcess.lock:
        if not _ThisProcess.settled:
            _ThisProcess.settled = True
            if not env_switch(RESPONDER, default=True):
                _ThisProcess.declined = True
            else:
                responder = Responder(socket_path, job_of() if labels is None else labels)
                _ThisProcess.responder = responder
                responder.start()
        return _ThisProcess.responder


def decline_responder() -> None:
    """This process answers no evidence request: its responder, if one runs, stops
    (its connection closes), and no later timer starts one."""
    if _ThisProcess.declined:
        return  # nothing runs once declined: a client that declines checks only this
    with _ThisProcess.lock:
        _ThisProcess.settled = _ThisProcess.declined = True
        responder, _ThisProcess.responder = _ThisProcess.responder, None
    if responder is not None:
        responder.stop()


def process_responder() -> Responder | None:
    """This process's responder, if one was started (and not declined since)."""
    return _ThisProcess.responder


def release_carrier(socket_path: str, arm: int) -> Responder | None:
    """The responder that lets a block's release of arming ``arm`` go without waiting
    for its answer, if any: the daemon numbered the arming (``arm`` is not 0), and
    this process's responder `carries` releases to the daemon at ``socket_path``."""
    responder = _ThisProcess.responder if arm else None
    return responder if responder is not None and responder.carries(socket_path) else None


@atexit.register
def _finish_at_exit() -> None:
    responder = _ThisProcess.responder
    if responder is not None and responder.pid == os.getpid():
        responder.finish(EXIT_WAIT)


def _reset_in_child() -> None:
    responder = _ThisProcess.responder
    if responder is not None:
        responder._forget_in_child()
    _ThisProcess.responder = None
    # A lock held at fork time by a thread the child does not have would stay held.
    _ThisProcess.lock = threading.Lock()
    _ThisProcess.settled = _ThisProcess.declined


os.register_at_fork(after_in_child=_reset_in_child)
