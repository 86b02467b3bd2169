"""The fast path: after a scope's first acknowledged arm, its blocks arm and release
their timer with stores into a slot page the daemon shares with this process alone
(`watchdogd_protocol.slot_page`), and wait for nothing.

One `FastPath` per process and daemon holds the pages mapped and the slots granted,
by scope. Every client of the process talking to that daemon (the blocking one, the
trio one, the torch adapter) arms through it first and falls back to its socket
whenever a store cannot say what the block needs:

- no slot for the scope yet, or one granted for other arming parameters (another
  policy, job or bounds), or one the daemon closed (its period reads 0: a slot
  revoked, reclaimed after idling, or a daemon stopped for good);
- a deadline nearer than the slot's period: the daemon reads a slot at least once
  a period and never later than the deadline it last read, so only a deadline at
  least a period away is sure to be seen in time;
- ``after="auto"`` before the daemon has written the scope's learned timeout.

A store is checked after it is made: if the slot's period changed meanwhile (it
was closing), the block goes over the socket too, so a store that crossed a
closing is never the only word on a block. A release records the block's duration
in the slot's counts, which the daemon harvests for learned timeouts.

Invariants:

- Only this process writes its slots' deadlines and counts, and only through this
  module; the daemon writes their periods and learned timeouts.
- A child made by ``fork()`` starts with no page and no slot (its first arm
  registers its own): its parent's mappings are not even inherited
  (``MADV_DONTFORK``), and the parent's objects for them are kept unreleased in the
  child, whose unmapping would hit whatever the child maps at their addresses.
- Threads share the slots: two threads that arm one explicit scope share its
  timer, and the last store wins, as the last request would over the socket.
- What it holds is what the daemon still reads: each time a page is mapped, the
  slots the daemon closed that hold no block are forgotten, and the pages no
  slot is on any more are unmapped (a service whose default scope is one per
  task registers a scope per request, and the daemon retires each once idle). A
  store that meets a page unmapped meanwhile by another thread goes over the
  socket, as one into a closed slot does.
"""

from __future__ import annotations

import array
import fcntl
import logging
import math
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Final, Literal

from watchdogd_protocol import Acquire, Acquired, MapPage, PageMapped, SlotGrant, Welcome
from watchdogd_protocol.slot_page import (
    AUTO,
    BLOCKS,
    BUCKETS,
    BUCKETS_PER_DOUBLING,
    DEADLINE,
    HEADER_MAGIC,
    HEADER_SLOTS,
    LARGEST,
    MAGIC,
    PAGE_BYTES,
    PERIOD,
    ROWS,
    SLOTS,
    SMALLEST_MICROSECONDS,
    word_of,
)

from ._version import __version__
from .arming import After, Arming
from .engine import Answer, Connection, Engine
from .errors import WatchdogdError
from .paths import Place
from .switches import FAST, env_switch
from .trust import vet

__all__ = ["FastPath", "fast_path", "map_page"]

log = logging.getLogger("watchdogd_client")

#: fcntl(2) F_GET_SEALS and the seals a page must carry (Python 3.11 lacks the names).
_F_GET_SEALS: Final = 1034
_F_SEAL_SHRINK: Final = 0x0002
_F_SEAL_GROW: Final = 0x0004
_SEALS: Final = _F_SEAL_SHRINK | _F_SEAL_GROW
#: How far the daemon's clock, as it answered `MapPage`, may read behind this
#: process's on receipt: a page is refused past it (another time namespace).
_CLOCK_SKEW: Final = 2_000_000
_WORD: Final = 2**64 - 1
_RECEIVE: Final = 64 * 1024
_INT: Final = array.array("i")
_COUNT: Final = 2**32 - 1


class _Page:
    """A mapped page: its 64-bit and 32-bit views."""

    __slots__ = ("counts", "id", "mapping", "words")

    def __init__(self, page_id: int, mapping: mmap.mmap) -> None:
        self.id = page_id
        self.mapping = mapping
        self.words = memoryview(mapping).cast("Q")
        self.counts = memoryview(mapping).cast("I")

    def unmap(self) -> None:
        """Unmap it and close its descriptor: a store through a view of it raises
        ValueError from now on."""
        self.words.release()
        self.counts.release()
        try:
            self.mapping.close()
        except BufferError:
            _inherited.append(self.mapping)  # still viewed somewhere: left mapped


class _Slot:
    """One registered scope as this process sees it: where its words are, the
    period the daemon granted, the arming parameters it was granted for, and when
    its block in progress began (microseconds; 0 for none)."""

    __slots__ = (
        "arming",
        "counts",
        "deadline",
        "entered",
        "index",
        "page",
        "period",
        "words",
    )

    def __init__(self, page: _Page, index: int, period: int, arming: Arming) -> None:
        self.page = page
        self.words = page.words
        self.counts = page.counts
        #: Where its words are: the deadline's; the period's, the learned timeout's,
        #: the largest's and the blocks' follow at the offsets of `slot_page`. Its
        #: counts are its ``index`` of each bucket's row (`slot_page.count_of`).
        self.deadline = word_of(index, DEADLINE)
        self.index = index
        self.period = period
        self.arming = arming
        self.entered = 0


class FastPath:
    """This process's slots on the daemon at ``socket_path``: see the module
    docstring. Get it from `fast_path`."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._slots: dict[str, _Slot] = {}
        self._pages: dict[int, _Page] = {}
        self._lock = threading.Lock()

    def arm(self, scope: str, after: After, arming: Arming) -> float | None:
        """Arm ``scope``'s block by a store: the timeout armed, in seconds; None
        when the block must be armed over the socket."""
        slot = self._slots.get(scope)
        if slot is None or slot.arming != arming:
            return None
        words, at = slot.words, slot.deadline
        period = slot.period
        try:
            if words[at + PERIOD] != period:
                return None
            timeout = words[at + AUTO] if after == "auto" else int(after * 1_000_000)
            if timeout < period:
                return None
            now = int(time.monotonic() * 1_000_000)
            words[at] = now + timeout
            if words[at + PERIOD] != period:
                return None
        except ValueError:  # its page was unmapped meanwhile, or no word holds it
            return None
        slot.entered = now
        return timeout / 1_000_000

    def release(self, scope: str) -> bool | Literal["closed"] | None:
        """Release ``scope``'s block by a store, recording how long it was held:
        whether it was armed; None when it must be released over the socket;
        ``"closed"`` when its slot closed: over the socket too, as a block armed
        by a store (`Release.stored`), which never disarms another's arming."""
        slot = self._slots.get(scope)
        if slot is None:
            return None
        words, at = slot.words, slot.deadline
        period = slot.period
        try:
            if words[at + PERIOD] != period:
                self._slots.pop(scope, None)
                return "closed"
            armed = words[at] != 0
            entered = slot.entered
            if entered:
                slot.entered = 0
                held = int(time.monotonic() * 1_000_000) - entered
                # `slot_page.bucket_of` and `count_of`, inline: this runs at every
                # block's end.
                if held <= SMALLEST_MICROSECONDS:
                    count = ROWS[0] + slot.index
                else:
                    bucket = min(
                        BUCKETS - 1, math.ceil(BUCKETS_PER_DOUBLING * math.log2(held / 1000.0))
                    )
                    count = ROWS[bucket] + slot.index
                counts = slot.counts
                counts[count] = (counts[count] + 1) & _COUNT
                if held > words[at + LARGEST]:  # noqa: PLR1730 (max() would store at every block)
                    words[at + LARGEST] = held
                words[at + BLOCKS] = (words[at + BLOCKS] + 1) & _WORD
            words[at] = 0
            if words[at + PERIOD] != period:
                self._slots.pop(scope, None)
                return "closed"
        except ValueError:  # its page was unmapped meanwhile: it was closed
            self._slots.pop(scope, None)
            return "closed"
        return armed

    def answered(
        self,
        request: Acquire,
        arming: Arming,
        reply: Acquired,
        map_page: Callable[[int], tuple[int, PageMapped]],
    ) -> bool:
        """``request``, a socket arm armed with ``arming``, got ``reply``: the
        scope's later blocks store into the slot it granted (if the grant is
        durable), or go over the socket, since any other arm of the scope over the
        socket (one with progress, say) took the place of its registration.
        True when a slot was granted whose page could not be had: the caller arms
        the block again without one, for the daemon would not find that page after
        a restart either (a daemon that died before it was handed over took it)."""
        if request.pid is not None:
            return False
        if request.slot and reply.slot is not None and reply.durable:
            return not self.granted(request.scope, arming, reply.slot, map_page)
        self.forget(request.scope)
        return False

    def granted(
        self,
        scope: str,
        arming: Arming,
        grant: SlotGrant,
        map_page: Callable[[int], tuple[int, PageMapped]],
    ) -> bool:
        """The daemon granted ``scope`` a slot (its reply to the socket arm of a
        block, which began now): its later blocks arm by stores. ``map_page(page)``
        gets a page not mapped yet: its descriptor and the daemon's answer. A page
        that cannot be mapped, that the daemon's clock disagrees on, or whose slot
        closed already leaves the scope on the socket: False."""
        with self._lock:
            page = self._pages.get(grant.page)
            if page is None:
                page = self._map(grant.page, map_page)
                if page is None:
                    self._slots.pop(scope, None)
                    return False
                self._prune(page)
            slot = _Slot(page, grant.index, grant.period, arming.copy())
            if page.words[slot.deadline + PERIOD] != grant.period:
                self._slots.pop(scope, None)
                return False
            slot.entered = int(time.monotonic() * 1_000_000)
            self._slots[scope] = slot
            return True

    def _prune(self, kept: _Page) -> None:
        """Forget the slots the daemon closed that hold no block, and unmap every
        page but ``kept`` that no slot is on any more."""
        used = {kept.id}
        for scope, slot in list(self._slots.items()):
            if slot.entered or slot.words[slot.deadline + PERIOD] == slot.period:
                used.add(slot.page.id)
            elif self._slots.get(scope) is slot:
                del self._slots[scope]
        for page_id in [page_id for page_id in self._pages if page_id not in used]:
            self._pages.pop(page_id).unmap()

    def mapped(self, page: int) -> bool:
        """Whether page ``page`` is mapped already."""
        return page in self._pages

    def forget(self, scope: str) -> None:
        """``scope`` was armed over the socket without a slot: its blocks go over
        the socket from now on."""
        self._slots.pop(scope, None)

    def _map(self, page_id: int, map_page: Callable[[int], tuple[int, PageMapped]]) -> _Page | None:
        try:
            fd, mapped = map_page(page_id)
        except (OSError, WatchdogdError) as exc:
            log.warning("slot page %d of %s could not be had: %s", page_id, self.socket_path, exc)
            return None
        try:
            mapping = _checked_mapping(fd, mapped)
        finally:
            os.close(fd)
        if mapping is None:
            return None
        page = self._pages[page_id] = _Page(page_id, mapping)
        return page

    def forget_in_child(self) -> None:
        """In a child after ``fork()``: nothing of the parent's is used again."""
        _inherited.extend(self._pages.values())
        self._pages = {}
        self._slots = {}
        self._lock = threading.Lock()


def _checked_mapping(fd: int, mapped: PageMapped) -> mmap.mmap | None:
    """The page of descriptor ``fd`` mapped, when it is one: sealed against
    shrinking and growing, of the layout this client knows, on this process's
    clock. None (said once) otherwise."""
    skew = int(time.monotonic() * 1_000_000) - mapped.now
    if not 0 <= skew <= _CLOCK_SKEW:
        _say_once(
            "clock",
            "the daemon's CLOCK_MONOTONIC reads %d us from this process's (another time "
            "namespace?): every block goes over the socket",
            -skew,
        )
        return None
    try:
        seals = fcntl.fcntl(fd, _F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError:
        seals, size = 0, 0
    if seals & _SEALS != _SEALS or size != PAGE_BYTES:
        _say_once("page", "the daemon handed over a page that is not a sealed slot page")
        return None
    mapping = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    # A child made by fork() gets no mapping of it, so it can never store into it.
    mapping.madvise(mmap.MADV_DONTFORK)
    header = memoryview(mapping).cast("Q")
    if header[HEADER_MAGIC] != MAGIC or header[HEADER_SLOTS] != SLOTS:
        header.release()
        _inherited.append(mapping)  # a page of another layout: left as it is
        _say_once("layout", "the daemon's slot pages are of another layout")
        return None
    header.release()
    return mapping


_said: set[str] = set()


def _say_once(kind: str, message: str, *args: object) -> None:
    if kind not in _said:
        _said.add(kind)
        log.warning(message, *args)


def map_page(place: Place, page: int, *, timeout: float) -> tuple[int, PageMapped]:
    """Ask the daemon at ``place`` for slot page ``page`` of this process, on a
    connection of its own (the page's descriptor travels beside the reply, which a
    client's own connection does not read for), judged as every connection is
    (`watchdogd_client.trust`): the descriptor, and the reply. Raises OSError or
    a `watchdogd_client.errors.WatchdogdError` when it cannot be had."""
    engine = Engine(place.path, client=f"python-pages/{__version__}", reconnect_timeout=0.0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        with vet(place) as vetted:
            sock.connect(vetted.address)
            vetted.admit(sock)
        connection = engine.connect()
        hello, _ = _exchange(sock, connection, connection.hello_id, connection.hello)
        hello.result(Welcome)
        request = MapPage(id=engine.next_id(), page=page)
        answer, fd = _exchange(sock, connection, request.id, connection.send(request, PageMapped))
    mapped = answer.reply
    if fd is not None and isinstance(mapped, PageMapped) and mapped.page == page:
        return fd, mapped
    if fd is not None:
        os.close(fd)
    answer.result(PageMapped)
    raise ConnectionError(f"the daemon sent no descriptor for slot page {page}")


def _exchange(
    sock: socket.socket, connection: Connection, request_id: int, frame: bytes
) -> tuple[Answer, int | None]:
    """Send ``frame``; the answer to ``request_id`` and the descriptor that came with
    it, if one did (any other descriptor is closed)."""
    sock.sendall(frame)
    held: list[int] = []
    try:
        answer = _answer_to(sock, connection, request_id, held)
    except BaseException:
        # A descriptor that came before a read timed out or failed is no page of
        # this process's: it would be held for ever.
        for descriptor in held:
            os.close(descriptor)
        raise
    return answer, held[0] if held else None


def _answer_to(
    sock: socket.socket, connection: Connection, request_id: int, held: list[int]
) -> Answer:
    """Read until the answer to ``request_id``, keeping in ``held`` the last
    descriptor that came (an earlier one is closed)."""
    while True:
        data, received = _receive(sock)
        if received is not None:
            for descriptor in held:
                os.close(descriptor)
            held[:] = [received]
        answers = connection.receive_data(data) if data else connection.connection_lost()
        for answer in answers:
            if answer.id == request_id:
                return answer
        if connection.state == "closed":
            raise ConnectionError("the daemon closed the connection")


def _receive(sock: socket.socket) -> tuple[bytes, int | None]:
    """One read: the bytes, and the first descriptor that came with them (any
    other is closed)."""
    data, ancillary, _, _ = sock.recvmsg(_RECEIVE, socket.CMSG_SPACE(_INT.itemsize * 4))
    got = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
    for extra in got[1:]:
        os.close(extra)
    return data, got[0] if got else None


#: The fast path of this process for each daemon, by socket path.
_paths: dict[str, FastPath] = {}
#: Mappings of pages a parent mapped, in a child: never unmapped (see the module
#: docstring).
_inherited: list[object] = []


def fast_path(socket_path: str, wanted: bool = True) -> FastPath | None:
    """This process's `FastPath` to the daemon at ``socket_path``; None when it is
    not ``wanted`` or ``WATCHDOGD_FAST`` is off."""
    if not wanted or not env_switch(FAST, default=True):
        return None
    path = _paths.get(socket_path)
    if path is None:
        path = _paths.setdefault(socket_path, FastPath(socket_path))
    return path


def _forget_in_child() -> None:
    for path in _paths.values():
        path.forget_in_child()


os.register_at_fork(after_in_child=_forget_in_child)
