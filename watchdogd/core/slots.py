"""The fast path's registrations: scopes whose blocks arm and release their timer by
stores into a slot page (`watchdogd_protocol.slot_page`), and the daemon's
lazy looks at them.

A scope's first arm is a request, as every arm was: identity, authorization,
limits, policy and job are settled there. When the process asks for it, and the
policy needs nothing a store cannot say (no ``stall``, no starvation grace, no
progress), the arm also registers the scope: a slot of a page shared with that
process alone, and a period, a share of its timeout. The registration is the
scope's timer record in the table and in the state, marked by its `SlotRef`; its
``deadline`` there is the daemon's next look at the slot.

The rule that makes the looks lazy, and sound: the process stores only deadlines
at least one period away, and the daemon reads a slot at least once a period and
never later than the deadline it last read there. A store made after a look is
then seen at the next look, which comes before its deadline; a later deadline
needs no wake, an earlier one goes over the socket. So a deadline stored since
the last look is never looked for before a period after that look: one nearer
breaks the rule (only its own block may be late), and looking for it would let a
process have the daemon look as often as it likes. The same holds across a
restart: a journaled look is never later than the look it stands for, and a store
made while the daemon was down is read at the first look of the next.

Invariants:

- A slot is open (its page shows its period) or closing (its page shows 0, so the
  process stores nothing more that matters and arms over the socket again); a
  closing slot is still read until it has been seen released at a look at least
  `CLOSING_WAIT` after it closed, since the process checks the period again after
  each store and a store that crossed the closing is read all the same. Then it
  is retired: its registration leaves the table and the state. Its index is never
  given again, so a late store of the old scope cannot land on a new one.
- A slot closes when its registration is reclaimed (idle for ``slot_idle``
  seconds, or the least recently idle of a uid at its limit: then it is read
  again once `CLOSING_WAIT` is over, not a period on), when another
  caller arms or releases its scope over the socket (root's ``watchdogctl arm
  --pid``: that arming is then a plain timer, which no store can disarm), when its
  process's uids changed (checked at each look), when it fires, and when the
  daemon stops for good.
- A page is its process's alone, and goes with its last slot
  (`watchdogd.core.process_pages`).
- A slot is read at most twice a period while its process stores, once while
  it idles; a non-root uid's registrations ask for at most `LOOKS_PER_UID` reads a
  second, counting two a period each: an arm past it gets a plain timer, not a
  slot.
- A uid at its limit that registers another reclaims its registration seen
  released the longest, or else one of its least recently armed over the socket
  that its slot shows released now (a service that registers a scope per
  request does it faster than looks see them released).
- A uid's closing registrations do not count at its limit (they are retiring),
  but no more of them than its limit: a process that keeps its closed slots
  armed by stores (so they never retire) holds at most twice its limit.
- Everything read from a page is bounded: a deadline past ``max_timeout`` from
  the look is clamped to it and counted, counts that could not be real are
  dropped and counted. A page can never fault the daemon (its memfd is sealed).
- Moving a look is not journaled (by design: the page says it all); registering,
  re-registering and dropping a registration are.
- A look whose page is being searched for after a restart waits for the search:
  it is not taken again before the search ends (or
  `watchdogd.core.process_pages.SEARCH_PAUSE` passes), and is due again as soon
  as it ends. Until its first look, a registration is read for `status` from its
  page once that is found, and holds no known block before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final, Generic

import msgspec

from watchdogd_protocol import SlotGrant
from watchdogd_protocol.slot_page import MAX_MICROSECONDS, SLOTS

from .interning import Shared
from .logline import Level, logfmt
from .ports import SEARCHING, P, PagePort, PageRef, Searching
from .process_pages import ProcessPages
from .slot import DEFERRED, Slot, Taken
from .slot_shares import SlotShares
from .timers import Expired, Key, SlotRef, Timer

if TYPE_CHECKING:
    from .context import CoreContext

#: A slot's period as a share of the timeout it was registered with: a block whose
#: timeout shrinks a little from one to the next (torch's adapter computes each from
#: an absolute time) still stores.
PERIOD_SHARE: Final = 0.875
#: The shortest period: a shorter timeout's blocks go over the socket.
MIN_PERIOD: Final = 0.002
#: How long after a slot closes it is still read before it may be retired.
CLOSING_WAIT: Final = 0.1


def period_of(timeout: float) -> float:
    """The period of a slot registered with ``timeout`` seconds; 0 for none."""
    period = timeout * PERIOD_SHARE
    return period if period >= MIN_PERIOD else 0.0


class Slots(Generic[P]):
    """Every registration's slot, the looks at them and their harvests."""

    def __init__(self, context: CoreContext[P], pages: PagePort[P], *, offered: bool) -> None:
        """``offered``: whether slots are offered at all (``fast_path`` on, clock shared)."""
        self._rules = context.rules
        self._writer = context.writer
        self._table = context.table
        self._processes = context.processes
        self._port = pages
        self._history = context.history
        self._metrics = context.metrics
        self._log = context.log
        self.offered = offered
        #: The registrations this daemon knows the slot of: registered, or found
        #: again after a restart.
        self._known = 0
        self._pages: ProcessPages[P] = ProcessPages(pages, self._came_back)
        self._shares = SlotShares()
        #: One object for each period: registrations of one timeout share it.
        self._periods: Shared[float] = Shared()

    def __len__(self) -> int:
        return self._known

    def closing_of(self, uid: int) -> int:
        """How many of ``uid``'s registrations are closing, up to its limit."""
        return self._shares.closing_of(uid, self._rules.daemon.max_timers_per_uid)

    # Registration, as arms and releases over the socket make and change it.

    def register(
        self, process: P, scope: str, timeout: float, now: float, owner: int
    ) -> SlotRef | None:
        """A slot for ``scope`` of ``process``, registered by ``owner`` with
        ``timeout``; None when none is offered to it (no fast path here, a timeout
        whose period would be under `MIN_PERIOD`, an owner at its `LOOKS_PER_UID`,
        another clock, no page to be had)."""
        period = period_of(timeout)
        if not self.offered or not period:
            return None
        budget = self._shares.budget(owner)
        if not self._shares.room_for(budget, period):
            return None
        taken = self._pages.new_slot(process, self._processes.executable(process))
        if taken is None:
            return None
        slots, index = taken
        slots.open(index, self._table.shared_scope(scope), budget, harvested=now)
        self._known += 1
        self._shares.count_looks(budget, period, 1)
        return SlotRef(page=slots.page.id, index=index, period=self._periods[period])

    def slot_of(self, timer: Timer, process: P, now: float) -> Slot | None:
        """The slot of registered ``timer``, found again after a restart if need
        be; None when its page is lost (its registration is then worth nothing)."""
        ref = timer.slot
        if ref is None:
            return None
        found = self._pages.slot(process, ref) or self._adopt(timer, process, ref, now)
        return None if found is SEARCHING else found

    def armed(self, timer: Timer, slot: Slot, deadline: float, auto: float | None) -> SlotGrant:
        """Registered ``timer`` was armed over the socket by its own process until
        ``deadline`` (``auto``: the timeout it learned, for ``after="auto"``):
        written to its slot, which opens again if it was closing."""
        if slot.closing:
            self._shares.count_closing(timer.owner, -1)
        grant = slot.arm(deadline, auto, timer.armed_at)
        self._busy(timer, slot, deadline)
        self._shares.armed(timer.owner, slot.ref)
        return grant

    def block_began(self, timer: Timer, slot: Slot) -> float:
        """When the block in ``timer``'s slot began, as near as its deadline tells
        (what a release over the socket records as the time it was held)."""
        return slot.due - timer.timeout if slot.due else timer.armed_at

    def revoke(self, timer: Timer, process: P, now: float) -> None:
        """Another caller armed or released ``timer``'s scope over the socket (or
        its process's uids changed): its slot closes and is forgotten at once (the
        caller replaces or drops the registration), so no store of the process
        can disarm what was armed. A slot not read yet since a restart closes
        too, once its page is found again."""
        slot = self.slot_of(timer, process, now)
        if slot is not None:
            self._forget(timer, slot)
            slot.page.write(slot.index, period=0)
            self._let_go(timer, process, slot)
        elif timer.slot is not None:
            self._pages.close_found(process, timer.slot, self._processes.executable(process))

    # Looks.

    def looked(self, expired: list[Expired[P]], now: float) -> tuple[list[Expired[P]], bool]:
        """Of the timers the table gave as due, those to fire. Each registration
        among them is a look at its slot, which puts it back at its next look,
        retires or drops it, or fires it on its block's deadline; but beside
        plain timers, the registrations go back to the table unread, still due
        (a user's looks never delay another's signal). Also whether any went back."""
        fire = [item for item in expired if item.timer.slot is None]
        looks = [(item, item.timer.slot) for item in expired if item.timer.slot is not None]
        if fire and looks:
            for item, _ in looks:
                self._put(item, item.timer.deadline)
            return fire, True
        for item, ref in looks:
            firing = self._look(item, ref, now)
            if firing is not None:
                fire.append(firing)
        return fire, bool(looks)

    def _look(self, item: Expired[P], ref: SlotRef, now: float) -> Expired[P] | None:
        timer, process = item.timer, item.process
        slot = self._pages.slot(process, ref) or self._adopt(timer, process, ref, now)
        if slot is SEARCHING:
            self._put(item, self._pages.wait(process, timer.key, now))
            return None
        if slot is None:
            self._drop(item, "its slot page is not among its process's descriptors")
            return None
        if not self._processes.refresh(process):
            self._put(item, now + slot.period)  # it exited: its exit drops it
            return None
        word = slot.page.read(slot.index)
        if process.uid != timer.uid:
            # A block the last look saw was stored while the process was
            # authorized; one stored since may be the new uid's.
            self._changed(item, word, self._bounded(word, now) if word == slot.word else None, now)
            return None
        offset = self._port.clock_offset(process)
        if offset != 0.0:
            # It moved to another time namespace: its block read on its new clock
            # (a timeout from now when that clock's offset is not known).
            moved = word - int((offset or 0.0) * 1_000_000)
            deadline = now + timer.timeout if offset is None else self._bounded(max(1, moved), now)
            self._changed(item, word, deadline, now)
            return None
        looked, slot.looked = slot.looked, now
        active = self._harvest(timer, process, slot, now, look=True) is not None
        if not word:
            slot.word = 0
            self._idle_look(item, slot, now, active)
            return None
        stored = word != slot.word
        deadline = slot.due if not stored and slot.due else self._bounded(word, now)
        slot.word = word
        self._busy(timer, slot, deadline)
        if deadline > now:
            # A deadline stored since the last look is looked for a period after
            # that look at the soonest (see the module docstring).
            soonest = looked + slot.period if stored else now
            self._put(item, max(min(deadline, now + slot.period), soonest))
            return None
        self._forget(timer, slot)
        slot.page.write(slot.index, period=0)
        self._let_go(timer, process, slot)
        fired = msgspec.structs.replace(
            timer, deadline=deadline, armed_at=min(timer.armed_at, deadline - timer.timeout)
        )
        return Expired(fired, process, item.orphaned)

    def _changed(self, item: Expired[P], word: int, deadline: float | None, now: float) -> None:
        """``item``'s process changed its uids or its clock: its slot closes (its
        next arm is judged anew over the socket) and its registration goes. The
        block its slot holds (``word``) stays armed as a plain timer until
        ``deadline``; None: it may not be kept, which the log says."""
        self.revoke(item.timer, item.process, now)
        if not word:
            self._metrics.slots_lost += 1
            self._gone(item)
        elif deadline is None:
            self._drop(item, "its process changed uids; a block stored since the last look")
        else:
            self._keep_plain(item, deadline)

    def _keep_plain(self, item: Expired[P], deadline: float) -> None:
        """``item``'s registration goes; its block stays armed until ``deadline``."""
        timer, watch = item.timer, item.timer.watched
        kept = None if watch is None else msgspec.structs.replace(watch, slot=None)
        plain = msgspec.structs.replace(timer, deadline=deadline, watch=kept)
        self._writer.rearm(item.process, plain, commit=True)

    def _idle_look(self, item: Expired[P], slot: Slot, now: float, active: bool) -> None:
        """A look found ``slot`` released; ``active``: blocks were released since
        the last look (short blocks between looks), so it is not idle."""
        timer = item.timer
        slot.due = 0.0
        if active and not slot.closing:
            self._busy(timer, slot, 0.0)
        if slot.closing:
            if now >= slot.closing + CLOSING_WAIT:
                self._retire(item, slot)
            else:
                self._put(item, slot.closing + CLOSING_WAIT)
            return
        if not slot.idle_since:
            slot.idle_since = now
            self._shares.idle(timer.owner, slot.ref)
        elif now - slot.idle_since >= self._rules.daemon.slot_idle:
            self._close(timer, slot, now)
            self._put(item, now + CLOSING_WAIT)
            return
        self._put(item, now + slot.period)

    def _bounded(self, word: int, now: float) -> float:
        """The deadline a slot's word says, within ``max_timeout`` of ``now`` (past
        it: clamped, and counted)."""
        limit = now + self._rules.daemon.max_timeout
        deadline = word / 1_000_000 if word <= MAX_MICROSECONDS else math.inf
        if deadline > limit:
            self._metrics.slots_clamped += 1
            return limit
        return deadline

    def _busy(self, timer: Timer, slot: Slot, deadline: float) -> None:
        """``slot`` is armed until ``deadline``: no longer idle."""
        slot.due = deadline
        if slot.idle_since:
            slot.idle_since = 0.0
            self._shares.busy(timer.owner, slot.ref)

    def _put(self, item: Expired[P], look: float) -> None:
        """Back in the table until ``look`` (in memory only: the state keeps an
        earlier look, never a later one). Its arming time, and so its number,
        stays the registration's."""
        self._writer.moved(item.process, msgspec.structs.replace(item.timer, deadline=look))

    # Closing, retiring, dropping.

    def reclaim(self, uid: int, now: float) -> bool:
        """Close a registration of ``uid`` that holds no block (a uid at its limit
        registers another; `SlotShares.reclaimable`); whether there was one (none
        while as many of its registrations as its limit are closing)."""
        limit = self._rules.daemon.max_timers_per_uid
        if self._shares.closing_of(uid, limit) >= limit:
            return False
        key = self._shares.reclaimable(uid, functools.partial(self._held, uid))
        found = None if key is None else self._registration(key)
        if found is None:
            return False
        timer, slot = found
        self._close(timer, slot, now)
        self._metrics.slots_reclaimed += 1
        process = self._table.process(timer.pid)
        if process is not None and timer.deadline > now + CLOSING_WAIT:
            # Its next look may be a period away, days for a long timeout: it
            # would stay closing, and out of its uid's count, as long.
            self._writer.moved(process, msgspec.structs.replace(timer, deadline=now + CLOSING_WAIT))
        return True

    def _held(self, uid: int, key: SlotRef) -> bool | None:
        """Whether the registration on slot ``key`` holds a block or closes; None
        when it is no registration of ``uid`` now."""
        found = self._registration(key)
        if found is None or found[0].owner != uid:
            return None
        slot = found[1]
        return bool(slot.closing) or slot.page.read(slot.index) != 0

    def _registration(self, key: SlotRef) -> tuple[Timer, Slot] | None:
        """The registration on slot ``key`` and its slot; None when it went (the
        orders of `SlotShares` may name one that did)."""
        found = self._pages.named(key)
        timer = None if found is None else self._table.get(found[0], found[1])
        if found is None or timer is None or timer.slot is not key:
            return None
        return timer, found[2]

    def _forget(self, timer: Timer, slot: Slot) -> None:
        """``timer``'s registration, on ``slot``, is no longer kept."""
        self._shares.disowned(timer.owner, slot.ref)
        slot.slots.free(slot.index)
        self._known -= 1
        self._shares.count_looks(slot.budget, slot.period, -1)

    def _close(self, timer: Timer, slot: Slot, now: float) -> None:
        slot.page.write(slot.index, period=0)
        slot.closing = now
        self._shares.count_closing(timer.owner, 1)
        self._busy(timer, slot, slot.due)
        # Never to be reclaimed again; an arm over the socket that opens it again
        # puts it back.
        self._shares.disowned(timer.owner, slot.ref)

    def _retire(self, item: Expired[P], slot: Slot) -> None:
        """A closed slot seen released after `CLOSING_WAIT`: its registration goes."""
        self._forget(item.timer, slot)
        self._let_go(item.timer, item.process, slot)
        self._metrics.slots_retired += 1
        self._gone(item)

    def _drop(self, item: Expired[P], why: str) -> None:
        """A registration that can no longer be kept: it goes, and the log says why."""
        timer = item.timer
        self._metrics.slots_lost += 1
        self._log.log(
            (timer.owner, "slot_dropped"),
            Level.WARNING,
            logfmt("slot_dropped", pid=timer.pid, uid=timer.uid, scope=timer.scope, why=why),
        )
        self._gone(item)

    def _gone(self, item: Expired[P]) -> None:
        self._writer.dropped([item.timer])
        if item.orphaned and self._table.process(item.timer.pid) is None:
            self._pages.forget_lost(item.process)
            self._processes.untrack(item.process)

    def _let_go(self, timer: Timer, process: P, slot: Slot) -> None:
        """``slot`` is no longer a registration's: its page goes once it holds no
        open or closing slot and gives no new one, and every page of ``process``
        goes once none holds one (it registers again on a new page)."""
        if slot.closing:
            self._shares.count_closing(timer.owner, -1)
        self._busy(timer, slot, 0.0)
        self._pages.let_go(process, slot.slots)

    # After a restart, and at the end.

    def _adopt(self, timer: Timer, process: P, ref: SlotRef, now: float) -> Slot | Searching | None:
        """The slot of a registration read from the state: its page found again
        among the process's descriptors (one read for all its pages, `search`).
        Its next harvest takes what the daemon before did not (the page says what
        it took), released since the registration's arming at most."""
        if not 0 <= ref.index < SLOTS or not ref.period > 0:
            return None
        executable = self._processes.executable(process)
        unread = functools.partial(_slot_refs, self._table.timers_of, process.pid)
        slots = self._pages.found(process, ref.page, ref.index, executable, unread)
        if slots is None or slots is SEARCHING:
            return slots
        budget = self._shares.budget(timer.owner)
        slots.open(ref.index, timer.scope, budget, harvested=min(timer.armed_at, now))
        self._known += 1
        self._shares.armed(timer.owner, ref)
        self._shares.count_looks(budget, ref.period, 1)
        return Slot(slots, ref)

    def _harvest(
        self, timer: Timer, process: P, slot: Slot, now: float, look: bool = False
    ) -> Taken | None:
        """Take ``slot``'s new counts into its scope's history (`Slot.take`), within
        its uid's reads (`SlotShares.read`): what was taken (None: nothing moved)."""
        share = functools.partial(self._shares.read, slot.budget, now)
        taken = slot.take(now, looking=look, share=share)
        if taken is None:
            return None
        if taken.deferred:
            self._metrics.slots_deferred += 1
        elif taken.scribbled:
            self._metrics.slots_scribbled += 1
        elif taken.added:
            largest = min(slot.page.largest(slot.index) / 1_000_000, self._rules.daemon.max_timeout)
            key = (process.uid, slot.executable, timer.scope)
            self._history.record_counts(key, taken.added, largest)
        return taken

    def harvest(self, timer: Timer, process: P, now: float) -> None:
        """Harvest registered ``timer``'s slot now (an arm of ``after="auto"``
        learns from every block released so far)."""
        if (slot := self.slot_of(timer, process, now)) is not None:
            self._harvest(timer, process, slot, now)

    def harvest_all(self, now: float, uid: int | None = None) -> None:
        """Harvest now the slots (``uid``'s, when given) released since their last
        harvest, within each owner's share (`suggest` counts every block so far):
        once one of a uid's is put off, its others wait unread for the next."""
        spent: set[int] = set()
        for (pid, start_time), slots, index in self._pages.moved(uid, spent):
            process, timer = self._table.process(pid), self._table.get(pid, slots.scopes[index])
            if process is None or process.start_time != start_time or timer is None:
                continue
            if (ref := timer.slot) is None or (ref.page, ref.index) != (slots.page.id, index):
                continue
            if self._harvest(timer, process, Slot(slots, ref), now) is DEFERRED:
                spent.add(slots.budget[index])

    def exited(self, process: P, timers: Iterable[Timer], now: float) -> list[Timer]:
        """``process`` exited with ``timers``: its slots are read a last time
        (harvested) and let go with its pages. Returns the timers that were armed
        then (a registration only while its slot held a block)."""
        armed: list[Timer] = []
        for timer in timers:
            slot = self._pages.slot(process, timer.slot)
            if slot is None:
                # A registration not read since a restart: what its slot held is
                # not known (its process's descriptors are gone), so not counted.
                if timer.slot is None:
                    armed.append(timer)
                continue
            self._forget(timer, slot)
            self._harvest(timer, process, slot, now)
            if slot.page.read(slot.index):
                armed.append(timer)
            if slot.closing:
                self._shares.count_closing(timer.owner, -1)
            self._busy(timer, slot, 0.0)
        self._pages.forget(process)
        return armed

    def deadline_of(self, timer: Timer, now: float) -> float | None:
        """The deadline of the block in registered ``timer``'s slot, read ``now``;
        None while it holds none, or none known: its page is still searched for
        since a restart (its look waits for the search, and fires a block past due)."""
        # Not read since a restart, its look in the table is the state's: older
        # than any block stored since.
        latest = now + self._rules.daemon.max_timeout
        process = self._table.process(timer.pid)
        return self._pages.deadline(process, timer.slot, timer.deadline, latest)

    def search(self, until: float) -> bool:
        """Search for the pages of registrations read from the state until the clock
        reads ``until`` (between passes that fire timers); whether any goes on."""
        return self._pages.search(until)

    def _came_back(self, key: Key, looked: float) -> None:
        """The look at ``key`` at ``looked`` waited for a search that ended: due
        again on that time (the state keeps a look no later than it), unless it
        went or was read since (an arm over the socket)."""
        timer, process = self._table.get(*key), self._table.process(key[0])
        if timer is None or process is None or timer.slot is None or timer.deadline <= looked:
            return
        if self._pages.slot(process, timer.slot) is None:
            self._writer.moved(process, msgspec.structs.replace(timer, deadline=looked))

    def released_count(self) -> int:
        """How many registrations hold no block now, read from their slots."""
        return self._pages.released()

    def page_for(self, process: P, page: int) -> PageRef | None:
        """Page ``page`` of ``process``, for it to map; None when it has no such
        page, or has exited (whoever holds its connection now is not it)."""
        slots = None if self._processes.exited(process) else self._pages.page_for(process, page)
        return None if slots is None else slots.page

    def close_all(self) -> None:
        """The daemon stops: every slot closes (blocks go over the socket, to a
        daemon that restarts or to none, as DESIGN's rule for a daemon gone at a
        block's exit says), and every page is let go. The state keeps the
        registrations for the next start; those whose page is not found yet
        since a restart stay open (no search holds a stop up): the next start
        reads them."""
        for timer in list(self._table.timers()):
            ref, process = timer.slot, self._table.process(timer.pid)
            if ref is not None and process is not None:
                self.slot_of(timer, process, timer.deadline)
        self._pages.close_all()
        self._known = 0
        self._shares.clear()


def _slot_refs(timers_of: Callable[[int], Iterable[Timer]], pid: int) -> list[tuple[int, int]]:
    """The pages and indexes of the registrations of process ``pid``: its
    descriptors are read once for every one of them not found yet."""
    return [
        (timer.slot.page, timer.slot.index) for timer in timers_of(pid) if timer.slot is not None
    ]
