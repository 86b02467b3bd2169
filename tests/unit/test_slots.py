"""The fast path's rules in the core (`watchdogd.core.slots`): registrations made by
socket arms, the lazy looks at their slots, and every way a registration ends,
on a fake host whose slot pages are plain memory (`helpers.slot_pages`). The
clock is a number passed in; each "look" below is a pass of the scheduler at a
deadline of the table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from watchdogd.core.config import Config, DaemonConfig, PolicyConfig
from watchdogd.core.process_pages import SEARCH_PAUSE
from watchdogd.core.service import Caller, Service
from watchdogd.core.slot import SCRIBBLED_PAUSE
from watchdogd.core.slot_shares import LOOKS_PER_UID, ROWS_BURST, ROWS_PER_UID
from watchdogd.core.slots import CLOSING_WAIT, MIN_PERIOD, PERIOD_SHARE
from watchdogd.core.timers import Expired, SlotRef, Timer
from watchdogd.errors import Refusal
from watchdogd.runtime.metrics import exposition
from watchdogd_protocol import (
    RESTART_GRACE,
    Acquire,
    Acquired,
    Auto,
    ErrorCode,
    MapPage,
    Release,
    Released,
    SlotGrant,
    Status,
    StatusReply,
    Suggest,
    SuggestReply,
    Why,
    WhyReply,
)
from watchdogd_protocol.slot_page import BUCKETS, SLOTS, bucket_of

from helpers.fakes import ALICE, BOB, DAEMON_PID, ROOT, FakeHost, FakeProcess, RecordingJournal
from helpers.slot_pages import FakePages, Memory, microseconds

#: A timeout whose period (7/8 of it) is a whole number of seconds: a scope armed
#: at 1.0 is looked at 8.0, 15.0, 22.0, ... while it holds no nearer deadline.
TIMEOUT = 8.0
PERIOD = 7.0


@dataclass
class CountingJournal(RecordingJournal):
    """A `RecordingJournal` that also keeps every put and drop, in turn."""

    puts: list[Timer] = field(default_factory=list)
    drops: list[Timer] = field(default_factory=list)

    def put(self, timer: Timer, *, replacing: Timer | None = None, soon: bool = False) -> None:
        self.puts.append(timer)
        super().put(timer, replacing=replacing, soon=soon)  # a replaced one through `drop`

    def drop(self, *timers: Timer, soon: bool = False) -> None:
        self.drops += timers
        super().drop(*timers)


class RecordingSink:
    """A log sink (`watchdogd.core.logline.LogSink`) that keeps its lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def enabled(self, level: int) -> bool:
        return True

    def write(self, level: int, line: str, error: BaseException | None = None) -> None:
        self.lines.append(line)


@dataclass
class Clock:
    now: float = 0.0


@dataclass
class World:
    """A service that offers the fast path, on a fake host and fake pages, with a
    connection each for alice (pid 200), bob (300) and root (100)."""

    service: Service[FakeProcess]
    host: FakeHost
    pages: FakePages
    journal: CountingJournal
    log: RecordingSink
    clock: Clock
    alice: Caller[FakeProcess]
    bob: Caller[FakeProcess]
    root: Caller[FakeProcess]
    notified: list[float] = field(default_factory=list)


def fake_host() -> FakeHost:
    return FakeHost(
        {
            100: (0, 0),
            200: (1000, 1000),
            201: (1000, 1000),
            300: (2000, 2000),
            DAEMON_PID: (0, 0),
            1: (0, 0),
        }
    )


def make_world(
    *,
    pages: FakePages | None = None,
    now: float = 0.0,
    monotonic: bool = True,
    policies: dict[str, PolicyConfig] | None = None,
    **limits: object,
) -> World:
    host = fake_host()
    port = FakePages() if pages is None else pages
    journal = CountingJournal()
    sink = RecordingSink()
    clock = Clock(now)
    notified: list[float] = []
    service = Service(
        Config(daemon=DaemonConfig(**limits), policies=policies or {}),  # type: ignore[arg-type]
        host,
        daemon_pid=DAEMON_PID,
        now=now,
        on_deadline=notified.append,
        wall=lambda: 1_700_000_000.0,
        clock=lambda: clock.now,
        render_metrics=exposition,
        journal=journal,
        log=sink,
        pages=port,
        monotonic=monotonic,
    )
    alice, bob, root = (service.arming.open_connection(peer) for peer in (ALICE, BOB, ROOT))
    return World(service, host, port, journal, sink, clock, alice, bob, root, notified)


def arm(
    world: World,
    caller: Caller[FakeProcess],
    scope: str,
    now: float,
    *,
    timeout: float = TIMEOUT,
    slot: bool = True,
    **fields: Any,
) -> Acquired:
    """``caller`` arms ``scope`` over the socket at ``now``."""
    world.clock.now = now
    request = Acquire(id=1, scope=scope, timeout=timeout, slot=slot, **fields)
    reply = world.service.handle(request, caller, now)
    assert isinstance(reply, Acquired)
    return reply


def registered(world: World, scope: str, now: float = 1.0) -> tuple[SlotGrant, Memory]:
    """Alice's process registers ``scope`` at ``now`` and maps the page it got."""
    grant = arm(world, world.alice, scope, now).slot
    assert grant is not None
    return grant, world.pages.hand(ALICE.pid, grant.page)


def run(world: World, until: float, *, late: float = 0.0) -> list[Expired[FakeProcess]]:
    """The scheduler's passes at each deadline of the table up to ``until``, each
    ``late`` seconds after it: what fired."""
    fired: list[Expired[FakeProcess]] = []
    for _ in range(10_000):
        soonest = world.service.table.next_deadline()
        if soonest is None or soonest > until:
            return fired
        # No pass comes before the daemon's start (a restored table's deadlines).
        world.clock.now = max(soonest + late, world.clock.now)
        fired += world.service.firing.expire_due(world.clock.now)
    raise AssertionError("the table never settled")


def look_at(world: World, scope: str, pid: int = ALICE.pid) -> float:
    """The table's deadline for ``scope``: the next look at its slot."""
    timer = world.service.table.get(pid, scope)
    assert timer is not None
    return timer.deadline


def status(world: World, caller: Caller[FakeProcess], now: float) -> StatusReply:
    reply = world.service.handle(Status(id=2), caller, now)
    assert isinstance(reply, StatusReply)
    return reply


def suggested_count(world: World, scope: str, now: float) -> int:
    """How many releases of ``scope`` of alice's process `suggest` counts (0: none)."""
    reply = world.service.handle(Suggest(id=3), world.alice, now)
    assert isinstance(reply, SuggestReply)
    return sum(row.count for row in reply.suggestions if row.scope == scope)


# Registration.


def test_an_arm_asking_for_a_slot_registers_it_and_grants_page_index_and_period() -> None:
    world = make_world()
    reply = arm(world, world.alice, "step", 1.0)
    [page] = world.pages.made
    assert reply.slot == SlotGrant(page=page, index=0, period=microseconds(PERIOD))
    assert reply.remaining == TIMEOUT
    memory = world.pages.hand(ALICE.pid, page)
    # The page shows the period and the block the arm began, for the process.
    assert memory.period(0) == microseconds(PERIOD)
    assert memory.deadline(0) == microseconds(1.0 + TIMEOUT)
    # The next scope of that process takes the next slot of the same page.
    second = arm(world, world.alice, "other", 1.5).slot
    assert second == SlotGrant(page=page, index=1, period=microseconds(PERIOD))
    assert len(world.service.slots) == 2


@pytest.mark.parametrize(
    ("fields", "caller"),
    [
        pytest.param({"slot": False}, "alice", id="without slot=True"),
        pytest.param({"policy": "stalls"}, "alice", id="under a stall policy"),
        pytest.param({"policy": "starving"}, "alice", id="under a starvation grace"),
        pytest.param({"progress": 1}, "alice", id="with progress"),
        pytest.param({"exit_releases": True}, "alice", id="released by its exit"),
        pytest.param({"pid": 201}, "alice", id="naming another process of its uid"),
        pytest.param({"pid": ALICE.pid}, "root", id="naming another user's process"),
        pytest.param(
            {"timeout": 1.1 * MIN_PERIOD},
            "alice",
            id="with a timeout whose period would be under MIN_PERIOD",
        ),
    ],
)
def test_a_socket_arm_gets_no_slot(fields: dict[str, Any], caller: str) -> None:
    world = make_world(
        policies={
            "stalls": PolicyConfig(stall=5.0),
            "starving": PolicyConfig(starvation_grace=1.0),
        }
    )
    who = {"alice": world.alice, "root": world.root}[caller]
    pid = fields.get("pid", ALICE.pid)
    assert isinstance(pid, int)
    reply = arm(world, who, "step", 1.0, **fields)
    assert reply.slot is None
    timer = world.service.table.get(pid, "step")
    assert timer is not None
    assert timer.slot is None
    assert world.pages.made == {}
    assert len(world.service.slots) == 0


def test_no_slot_where_the_clock_or_the_page_cannot_be_shared() -> None:
    # A process in another time namespace, a daemon not on CLOCK_MONOTONIC, no
    # page to be had, the fast path turned off: each arm is a plain timer.
    other = make_world()
    other.pages.other_clock.add(ALICE.pid)
    assert arm(other, other.alice, "s", 1.0).slot is None
    elsewhere = make_world(monotonic=False)
    assert arm(elsewhere, elsewhere.alice, "s", 1.0).slot is None
    exhausted = make_world()
    exhausted.pages.exhausted = True
    assert arm(exhausted, exhausted.alice, "s", 1.0).slot is None
    off = make_world(fast_path=False)
    assert arm(off, off.alice, "s", 1.0).slot is None
    assert look_at(off, "s") == 1.0 + TIMEOUT


def test_the_table_holds_the_registration_with_its_deadline_at_the_next_look() -> None:
    world = make_world()
    grant, _ = registered(world, "step", now=1.0)
    timer = world.service.table.get(ALICE.pid, "step")
    assert timer is not None
    assert timer.slot == SlotRef(page=grant.page, index=0, period=PERIOD)
    # min(deadline 9.0, now + period 8.0)
    assert timer.deadline == min(1.0 + TIMEOUT, 1.0 + PERIOD) == 8.0
    assert world.journal.puts == [timer]
    assert world.notified[-1] == 8.0
    # Its own process arming it again over the socket keeps the slot.
    again = arm(world, world.alice, "step", 3.0, timeout=20.0)
    assert again.slot == grant
    assert look_at(world, "step") == min(3.0 + 20.0, 3.0 + PERIOD)


# Looks.


def test_a_look_at_a_released_slot_puts_it_back_a_period_later_unlisted_and_uncounted() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    arm(world, world.bob, "plain", 1.0, slot=False, timeout=100.0)
    memory.release(0)
    assert run(world, 8.0) == []
    assert look_at(world, "step") == 8.0 + PERIOD
    for caller in (world.alice, world.root):
        reply = status(world, caller, 9.0)
        assert "step" not in [timer.scope for timer in reply.timers]
    assert status(world, world.root, 9.0).daemon.timers == 1  # bob's plain timer only
    why = world.service.handle(Why(id=4, pid=ALICE.pid), world.alice, 9.0)
    assert isinstance(why, WhyReply)
    assert why.timers == []


def test_an_armed_slot_is_listed_with_the_time_left_to_its_blocks_deadline() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 30.0)
    reply = status(world, world.alice, 10.0)
    [shown] = reply.timers
    assert (shown.scope, shown.remaining) == ("step", 20.0)
    assert reply.daemon.timers == 1


def test_a_stored_later_deadline_moves_the_next_look_and_no_look_is_journaled() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    puts, drops = len(world.journal.puts), len(world.journal.drops)
    memory.store(0, 30.0)  # a block entered at 5.0 with a 25 s timeout
    looks = []
    for _ in range(4):
        at = look_at(world, "step")
        assert run(world, at) == []
        looks.append(look_at(world, "step"))
    # Each look at min(deadline, now + period); never past the block's deadline.
    assert looks == [15.0, 22.0, 29.0, 30.0]
    assert (len(world.journal.puts), len(world.journal.drops)) == (puts, drops)


def test_deadlines_stored_ever_nearer_than_a_period_are_read_twice_a_period_at_most() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)  # first looked at 8.0
    memory.store(0, 9.5)  # a block entered at 1.5: 8 s on, as the client stores
    assert run(world, 8.0) == []
    assert look_at(world, "step") == 9.5
    # From here on, each look finds a deadline 0.1 s on, stored since the last.
    looks = []
    for _ in range(4):
        at = look_at(world, "step")
        memory.store(0, at + 0.1)
        assert run(world, at) == []
        looks.append(look_at(world, "step"))
    assert looks == [8.0 + PERIOD, 9.5 + PERIOD, 15.0 + PERIOD, 16.5 + PERIOD]
    # One left where it was fires at its look, on the deadline it said.
    [fired] = run(world, 30.0)
    assert fired.timer.scope == "step"
    assert fired.timer.deadline == pytest.approx(22.1)


def test_a_uids_registrations_ask_for_at_most_its_reads_a_second() -> None:
    # Four registrations of this timeout ask for all of them.
    timeout = 8 / LOOKS_PER_UID / PERIOD_SHARE
    world = make_world()
    grants = [arm(world, world.alice, f"s{n}", 1.0, timeout=timeout).slot for n in range(5)]
    assert [grant is not None for grant in grants] == [True, True, True, True, False]
    assert arm(world, world.root, "own", 1.0, timeout=timeout).slot is not None  # not root's
    world.service.handle(Release(id=5, scope="s0", pid=ALICE.pid), world.root, 1.5)
    assert arm(world, world.alice, "s5", 2.0, timeout=timeout).slot is not None


def test_a_deadline_that_passed_fires_on_its_own_deadline_and_closes_the_slot() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 20.0)
    [fired] = run(world, 25.0, late=0.4)
    assert fired.timer.scope == "step"
    assert fired.timer.deadline == 20.0  # the block's, not the look's (20.4)
    assert fired.timer.firing
    assert memory.period(0) == 0
    assert len(world.service.slots) == 0
    assert world.service.table.get(ALICE.pid, "step") is None


def test_a_plain_timer_due_with_registrations_fires_in_a_pass_before_their_looks() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 8.0)  # its look, at 8.0, finds its block due
    arm(world, world.bob, "plain", 2.0, slot=False, timeout=6.0)
    world.clock.now = 8.0
    [first] = world.service.firing.expire_due(8.0)
    assert first.timer.scope == "plain"
    assert look_at(world, "step") == 8.0  # unread, and due as it was
    [then] = world.service.firing.expire_due(8.0)
    assert then.timer.scope == "step"
    assert then.timer.deadline == 8.0


def test_a_stored_deadline_past_max_timeout_is_clamped_and_counted() -> None:
    world = make_world(max_timeout=100.0)
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 1.0 + 10_000.0)
    assert run(world, 8.0) == []
    assert world.service.metrics.slots_clamped == 1
    memory.word(0, 2**64 - 1)  # past any clock: scribbled
    assert run(world, 15.0) == []
    assert world.service.metrics.slots_clamped == 2
    assert status(world, world.alice, 15.0).timers[0].remaining <= 100.0


def test_a_clamped_deadline_fires_within_max_timeout_of_the_look_that_clamped_it() -> None:
    """A process that stores one absurd deadline and hangs is still acted on: the
    socket would have refused to arm past ``max_timeout``, so the page must not
    give it a timer that never comes due."""
    world = make_world(max_timeout=100.0)
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 1.0 + 10_000.0)
    fired = run(world, 8.0 + 100.0 + PERIOD)
    assert [item.timer.scope for item in fired] == ["step"]
    assert fired[0].timer.deadline <= 8.0 + 100.0


def test_real_counts_reach_the_history_and_suggest_counts_every_block() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    for _ in range(30):
        memory.release(0, held=0.5)
    assert suggested_count(world, "step", 2.0) == 30
    # A look harvests too, and nothing is counted twice.
    for _ in range(5):
        memory.release(0, held=0.5)
    run(world, 8.0)
    assert suggested_count(world, "step", 9.0) == 35
    assert world.service.metrics.slots_scribbled == 0


def test_a_process_that_execs_registers_on_a_page_of_its_new_executable() -> None:
    """The slots of a page share one history key's executable: blocks of the
    program before the exec and of the one after never count under each other's."""
    world = make_world()
    before, memory = registered(world, "step", now=1.0)
    world.host.executables[ALICE.pid] = "/usr/bin/other"
    after, other = registered(world, "after-exec", now=2.0)
    assert after.page != before.page
    memory.release(before.index, held=0.5)
    other.release(after.index, held=0.5)
    reply = world.service.handle(Suggest(id=3), world.root, 3.0)
    assert isinstance(reply, SuggestReply)
    assert sorted((row.executable, row.scope, row.count) for row in reply.suggestions) == [
        ("/usr/bin/other", "after-exec", 1),
        (f"/usr/bin/prog-{ALICE.pid}", "step", 1),
    ]


def test_the_page_of_the_program_before_an_exec_goes_with_its_last_registration() -> None:
    """A page kept with no registration, only to give slots, is let go when the
    process's next registration takes a page of its new executable."""
    world = make_world()
    for index in range(SLOTS):
        registered(world, f"full-{index}", now=1.0)
    newest, _ = registered(world, "step", now=1.0)
    arm(world, world.root, "step", 2.0, pid=ALICE.pid)  # its slot closes and goes
    assert not world.pages.made[newest.page].closed  # it gives the next slot still
    world.host.executables[ALICE.pid] = "/usr/bin/other"
    after, _ = registered(world, "after-exec", now=3.0)
    assert after.page != newest.page
    assert world.pages.made[newest.page].closed
    process = world.service.table.process(ALICE.pid)
    assert process is not None
    assert world.service.slots.page_for(process, newest.page) is None


def test_an_auto_arm_writes_the_timeout_it_learned_into_the_slot() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    for _ in range(30):
        memory.release(0, held=0.5)
    run(world, 8.0)  # harvested
    reply = arm(world, world.alice, "step", 9.0, timeout=60.0, auto=Auto(floor=0.1))
    assert reply.timeout_from.startswith("learned")
    assert reply.remaining < 60.0
    assert memory.auto(0) == microseconds(reply.remaining)
    assert memory.deadline(0) == microseconds(9.0 + reply.remaining)


def test_counts_that_could_not_be_real_are_refused_and_counted() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.scribble_counts(0, bucket_of(microseconds(0.5)), 2**32 - 1, blocks=1)
    run(world, 8.0)
    assert world.service.metrics.slots_scribbled == 1
    assert suggested_count(world, "step", 9.0) == 0
    # Real blocks after it still count.
    for _ in range(3):
        memory.release(0, held=2.0)
    assert suggested_count(world, "step", 9.5) == 3


def test_looks_leave_alone_for_a_while_the_counts_of_a_slot_they_refused() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 1000.0)  # armed throughout: looked at each period
    bucket = bucket_of(microseconds(0.5))
    memory.scribble_counts(0, bucket, 2**32 - 1, blocks=1)
    run(world, 8.0)
    assert world.service.metrics.slots_scribbled == 1
    # Written over again: the looks within the pause read no counts.
    memory.scribble_counts(0, bucket, 2**31, blocks=2)
    run(world, 8.0 + SCRIBBLED_PAUSE - 1)
    assert world.service.metrics.slots_scribbled == 1
    run(world, 8.0 + SCRIBBLED_PAUSE + 2 * TIMEOUT)
    assert world.service.metrics.slots_scribbled == 2


def test_blocks_released_through_the_pause_after_a_refusal_count_once_it_is_over() -> None:
    world = make_world()
    grant = arm(world, world.alice, "step", 1.0, timeout=0.1).slot  # looked at every 87.5 ms
    assert grant is not None
    memory = world.pages.hand(ALICE.pid, grant.page)
    memory.store(0, 1000.0)
    bucket = bucket_of(microseconds(0.05))
    memory.scribble_counts(0, bucket, 2**32 - 1, blocks=1)
    run(world, 2.0)
    assert world.service.metrics.slots_scribbled == 1
    # Through the pause, more blocks than a moment allows, far fewer than a minute
    # does, as a process releases them (its count and its blocks move together).
    memory.scribble_counts(0, bucket, 2**32 - 1 + 600_000 - 2**32, blocks=1 + 600_000)
    later = 2.0 + SCRIBBLED_PAUSE + 1.0
    run(world, later)
    assert world.service.metrics.slots_scribbled == 1  # taken, not refused again
    assert suggested_count(world, "step", later) > 0  # (the history halves past its bound)


def test_a_block_count_no_process_could_reach_is_refused_before_its_counts_are_read() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    bucket = bucket_of(microseconds(0.5))
    memory.scribble_counts(0, bucket, 5, blocks=2**63)
    run(world, 8.0)
    assert world.service.metrics.slots_scribbled == 1
    assert memory.taken(0, bucket) == 0  # no row read, none written


def test_a_uids_harvests_read_at_most_its_share_of_rows_and_the_next_looks_take_the_rest() -> None:
    """Each harvest reads every row of counts its page holds, and a process may
    fill them all: a uid's harvests read at most `ROWS_BURST` rows at once and
    `ROWS_PER_UID` a second (a fake page holds every row: a harvest reads them all).
    The counts left are totals in the page: the next looks take them, and nothing
    is lost."""
    at_once = ROWS_BURST // BUCKETS
    assert at_once < ROWS_PER_UID // BUCKETS * PERIOD
    world = make_world()
    scopes = [f"step-{number}" for number in range(at_once + 10)]
    slots = [registered(world, scope, now=1.0) for scope in scopes]
    for grant, memory in slots:
        memory.store(grant.index, 1000.0)  # armed throughout: looked at each period
        memory.release(grant.index, held=0.5)
        memory.store(grant.index, 1000.0)
    bucket = bucket_of(microseconds(0.5))
    run(world, 1.0 + PERIOD + 0.01)  # every first look, a moment apart
    assert world.service.metrics.slots_deferred == 10
    taken = [memory.taken(grant.index, bucket) for grant, memory in slots]
    assert sorted(taken) == [0] * 10 + [1] * at_once
    run(world, 1.0 + 2 * PERIOD + 0.01)  # a period later, the share is whole again
    assert [memory.taken(grant.index, bucket) for grant, memory in slots] == [1] * len(scopes)
    assert world.service.metrics.slots_deferred == 10
    assert sum(suggested_count(world, scope, 20.0) for scope in scopes) == len(scopes)
    # Root's looks count against no share.
    for number in range(at_once + 10):
        roots = arm(world, world.root, f"root-{number}", 20.0).slot
        assert roots is not None
        memory = world.pages.hand(ROOT.pid, roots.page)
        memory.store(roots.index, 1000.0)
        memory.release(roots.index, held=0.5)
        memory.store(roots.index, 1000.0)
    run(world, 20.0 + PERIOD + 0.01)
    assert world.service.metrics.slots_deferred == 10


def test_suggest_harvests_within_each_owners_share_whoever_asks() -> None:
    """A harvest asked for (`suggest`, root's over every process) reads a page's
    rows within its owner's share, as a look does: asking again and again never
    makes the daemon read more of a uid's rows than the share."""
    at_once = ROWS_BURST // BUCKETS
    world = make_world()
    slots = [registered(world, f"step-{number}", now=1.0) for number in range(3 * at_once)]
    for grant, memory in slots:
        memory.release(grant.index, held=0.5)
    world.service.handle(Suggest(id=3), world.root, 1.0)
    world.service.handle(Suggest(id=4), world.alice, 1.0)
    # Each request puts off one harvest, and leaves the rest unread.
    assert world.service.metrics.slots_deferred == 2
    bucket = bucket_of(microseconds(0.5))
    assert sum(memory.taken(grant.index, bucket) for grant, memory in slots) == at_once
    # A second on, the share is whole again; the rest is counted, none twice.
    assert sum(suggested_count(world, f"step-{n}", 2.0) for n in range(3 * at_once)) == 2 * at_once
    assert sum(suggested_count(world, f"step-{n}", 3.0) for n in range(3 * at_once)) == 3 * at_once


def test_a_harvest_that_refuses_a_slots_blocks_counts_against_its_owners_share() -> None:
    """Blocks written over in every slot between two `suggest`s: each refusal costs
    the share as a read does, so a request stops where any other would."""
    at_once = ROWS_BURST // BUCKETS  # the fake page holds every row: a take reads them all
    world = make_world()
    slots = [registered(world, f"step-{number}", now=1.0) for number in range(3 * at_once)]
    for grant, memory in slots:
        memory.scribble_counts(grant.index, 0, 1, blocks=2**63)
    world.service.handle(Suggest(id=3), world.alice, 1.0)
    assert world.service.metrics.slots_scribbled == at_once
    assert world.service.metrics.slots_deferred == 1


# Reclaiming, revoking, releasing.


def test_a_slot_idle_for_slot_idle_closes_and_is_retired_after_the_closing_wait() -> None:
    world = make_world(slot_idle=20.0)
    grant, memory = registered(world, "step", now=1.0)
    memory.release(0)
    run(world, 22.0)  # looks at 8 (first seen released), 15, 22
    assert memory.period(0) == microseconds(PERIOD)
    run(world, 29.0)  # idle for 21 s: closed
    assert memory.period(0) == 0
    assert look_at(world, "step") == 29.0 + CLOSING_WAIT
    assert world.journal.drops == []
    run(world, 29.0 + CLOSING_WAIT)
    assert world.service.table.get(ALICE.pid, "step") is None
    assert [timer.scope for timer in world.journal.drops] == ["step"]
    assert world.service.metrics.slots_retired == 1
    assert world.host.tracked == set()
    # The scope registers again, in a slot never given before.
    again = arm(world, world.alice, "step", 40.0).slot
    assert again is not None
    assert (again.page, again.index) != (grant.page, grant.index)


def test_a_slot_whose_short_blocks_fall_between_looks_is_not_idle() -> None:
    """Released at every look, but blocks were released since each: busy, so it
    keeps its slot however long that goes on."""
    world = make_world(slot_idle=20.0)
    _, memory = registered(world, "step", now=1.0)
    memory.release(0)
    for until in range(8, 64, 7):  # a look every period (7 s), a short block between
        run(world, float(until))
        memory.store(0, until + 10.0)
        memory.release(0, held=0.01)
    run(world, 64.0)
    assert memory.period(0) == microseconds(PERIOD)
    assert world.service.metrics.slots_retired == 0


def test_a_store_that_crossed_the_closing_is_read_and_protects_its_block() -> None:
    world = make_world(slot_idle=20.0)
    _, memory = registered(world, "step", now=1.0)
    memory.release(0)
    run(world, 29.0)
    assert memory.period(0) == 0
    memory.store(0, 60.0)  # made before the process saw the period go
    assert run(world, 50.0) == []
    [fired] = run(world, 60.0)
    assert fired.timer.deadline == 60.0


def test_a_uid_at_its_limit_registers_by_reclaiming_its_longest_released_slot() -> None:
    world = make_world(max_timers_per_uid=2)
    _, memory = registered(world, "older", now=0.5)
    registered(world, "newer", now=1.0)
    memory.release(0)
    memory.release(1)
    run(world, 8.0)  # "older" seen released at 7.5, "newer" at 8.0
    assert arm(world, world.alice, "third", 9.0).slot is not None
    assert memory.period(0) == 0  # "older" reclaimed
    assert memory.period(1) == microseconds(PERIOD)
    assert world.service.metrics.slots_reclaimed == 1
    assert arm(world, world.alice, "fourth", 9.5).slot is not None
    assert memory.period(1) == 0  # then "newer"
    assert world.service.metrics.slots_reclaimed == 2
    # With nothing released left to reclaim, the limit refuses as ever.
    with pytest.raises(Refusal) as refused:
        arm(world, world.alice, "fifth", 10.0)
    assert refused.value.code == ErrorCode.LIMIT_EXCEEDED


def test_a_uid_at_its_limit_reclaims_one_released_before_any_look_saw_it() -> None:
    world = make_world(max_timers_per_uid=2)
    _, memory = registered(world, "older", now=1.0)
    registered(world, "newer", now=1.1)
    memory.release(1)  # "newer" released, "older" still armed: no look yet
    assert arm(world, world.alice, "third", 1.5).slot is not None
    assert (memory.period(0), memory.period(1)) == (microseconds(PERIOD), 0)
    memory.store(2, 100.0)  # "third" armed by a store
    with pytest.raises(Refusal) as refused:
        arm(world, world.alice, "fourth", 1.6)  # nothing released to take
    assert refused.value.code == ErrorCode.LIMIT_EXCEEDED
    assert memory.period(0) == microseconds(PERIOD)


def test_registrations_reclaimed_once_seen_idle_never_hide_one_released_since() -> None:
    world = make_world(max_timers_per_uid=20)
    _, memory = registered(world, "old-0", now=1.0)
    for number in range(1, 20):
        arm(world, world.alice, f"old-{number}", 1.0)
    for index in range(17):
        memory.release(index)  # three stay armed
    run(world, 8.5)  # seventeen seen released
    for number in range(17):
        arm(world, world.alice, f"new-{number}", 9.0)  # each reclaims one of them
    for index in range(20, 37):
        memory.release(index)  # none seen released yet; the reclaimed still closing
    assert arm(world, world.alice, "one-more", 9.05).slot is not None
    assert memory.period(20) == 0


def test_a_reclaimed_registration_is_read_after_the_closing_wait_not_a_period_on() -> None:
    world = make_world(max_timers_per_uid=1)
    _, memory = registered(world, "older", now=1.0)
    memory.release(0)
    run(world, 8.0)  # seen released at 8.0; its next look at 15.0
    arm(world, world.alice, "newer", 9.0)
    assert memory.period(0) == 0
    assert look_at(world, "older") == 9.0 + CLOSING_WAIT
    run(world, 9.0 + CLOSING_WAIT)
    assert world.service.table.get(ALICE.pid, "older") is None
    assert world.service.metrics.slots_retired == 1


def test_closing_registrations_spare_a_uid_its_limit_no_more_than_once() -> None:
    world = make_world(max_timers_per_uid=2)
    _, memory = registered(world, "a", now=1.0)
    registered(world, "b", now=1.0)
    for index in (0, 1):
        memory.release(index)
    run(world, 8.0)
    # Each new registration reclaims one; the process arms the closed slots by
    # stores at once, so they never retire.
    for number, now in enumerate((9.0, 9.01)):
        arm(world, world.alice, f"new-{number}", now)
    for index in (0, 1):
        memory.store(index, 1000.0)
    for index in (2, 3):
        memory.release(index)
    run(world, 20.0)
    with pytest.raises(Refusal) as refused:
        arm(world, world.alice, "past", 21.0)
    assert refused.value.code == ErrorCode.LIMIT_EXCEEDED
    assert world.service.table.owned_by(ALICE.uid) == 4


def test_another_callers_arm_revokes_the_slot_and_arms_a_plain_timer_no_store_disarms() -> None:
    world = make_world()
    grant, memory = registered(world, "step", now=1.0)
    reply = arm(world, world.root, "step", 2.0, timeout=30.0, pid=ALICE.pid)
    assert reply.slot is None
    assert memory.period(0) == 0
    timer = world.service.table.get(ALICE.pid, "step")
    assert timer is not None
    assert timer.slot is None
    assert timer.deadline == 32.0
    memory.release(0)  # the worker's next store in its old slot
    memory.store(0, 1000.0)
    fired = run(world, 40.0)
    assert [(item.timer.scope, item.timer.deadline, item.timer.owner) for item in fired] == [
        ("step", 32.0, 0)
    ]
    # Its own process registers the scope again: another slot, on a new page (its
    # only one held no slot any more, so it went).
    again = arm(world, world.alice, "step", 41.0).slot
    assert again is not None
    assert (again.page, again.index) != (grant.page, grant.index)
    assert world.pages.made[grant.page].closed


def test_a_release_by_the_process_itself_keeps_the_registration_and_says_if_armed() -> None:
    world = make_world()
    grant, memory = registered(world, "step", now=1.0)
    first = world.service.handle(Release(id=5, scope="step"), world.alice, 2.0)
    assert first == Released(id=5, found=True)
    assert memory.deadline(0) == 0
    assert memory.period(0) == grant.period
    timer = world.service.table.get(ALICE.pid, "step")
    assert timer is not None
    assert timer.watch is not None
    assert timer.slot is not None
    again = world.service.handle(Release(id=6, scope="step"), world.alice, 3.0)
    assert again == Released(id=6, found=False)
    assert world.journal.drops == []
    assert status(world, world.root, 3.0).timers == []


def test_a_release_by_another_caller_drops_the_registration() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    reply = world.service.handle(Release(id=5, scope="step", pid=ALICE.pid), world.root, 2.0)
    assert reply == Released(id=5, found=True)
    assert memory.period(0) == 0
    assert world.service.table.get(ALICE.pid, "step") is None
    assert [timer.scope for timer in world.journal.drops] == ["step"]
    assert len(world.service.slots) == 0


def test_a_process_whose_registrations_all_went_keeps_no_page_for_the_next_on_its_pid() -> None:
    world = make_world()
    grant, memory = registered(world, "step", now=1.0)
    # Another caller releases it: the registration goes, and the process leaves
    # the table, so its exit is watched no more.
    world.service.handle(Release(id=5, scope="step", pid=ALICE.pid), world.root, 2.0)
    assert world.pages.made[grant.page].closed
    assert world.host.tracked == set()
    # It exits unseen; another process takes its pid, and registers: a page of its
    # own, never the one before (which a child of the first may still hold).
    assert world.alice.process is not None
    world.alice.process.exited = True
    newcomer = world.service.arming.open_connection(ALICE)
    again = arm(world, newcomer, "step", 3.0).slot
    assert again is not None
    assert again.page != grant.page
    with pytest.raises(Refusal):
        world.service.handle(MapPage(id=6, page=grant.page), newcomer, 3.0)
    assert memory.period(0) == 0


def test_a_page_is_never_handed_over_a_connection_whose_process_exited() -> None:
    world = make_world()
    grant, _ = registered(world, "step", now=1.0)
    assert world.alice.process is not None
    world.alice.process.exited = True  # a child of it kept the connection
    with pytest.raises(Refusal):
        world.service.handle(MapPage(id=6, page=grant.page), world.alice, 2.0)


def test_a_process_whose_uid_changed_keeps_its_armed_block_as_a_plain_timer() -> None:
    """Its slot closes (its next arm is judged anew over the socket); the block it
    armed while it was authorized, seen by a look then, stays armed, on its
    deadline, as a plain timer."""
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 50.0)
    assert run(world, 8.0) == []
    world.host.processes[ALICE.pid] = (3000, 3000)  # setuid(2)
    assert run(world, 16.0) == []
    kept = world.service.table.get(ALICE.pid, "step")
    assert kept is not None
    assert kept.deadline == 50.0
    assert kept.slot is None
    assert memory.period(0) == 0
    assert [timer.scope for timer in world.journal.puts][-1] == "step"
    assert [expired.timer.scope for expired in run(world, 50.0)] == ["step"]


def test_a_block_stored_since_the_last_look_of_a_process_whose_uid_changed_never_fires() -> None:
    """No look saw it before the change: it may be the new uid's, whom the scope's
    policy (root's, say) may not be run for; the registration goes, logged."""
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.release(0, held=0.5)
    assert run(world, 8.0) == []
    world.host.processes[ALICE.pid] = (3000, 3000)  # setuid(2)
    memory.store(0, 9.0)
    assert run(world, 60.0) == []
    assert world.service.table.get(ALICE.pid, "step") is None
    assert world.service.metrics.slots_lost == 1


def test_a_process_that_moved_to_another_clock_has_its_block_read_on_that_clock() -> None:
    """Its slot closes (its next arm goes over the socket); the block it stored
    on its new clock, a day ahead of the daemon's, stays armed as a plain timer
    on its deadline read on the daemon's."""
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.release(0, held=0.5)
    world.pages.offsets[ALICE.pid] = 86_400.0  # setns(2) into a time namespace
    memory.store(0, 86_400.0 + 10.0)
    assert run(world, 8.0) == []
    kept = world.service.table.get(ALICE.pid, "step")
    assert kept is not None
    assert kept.deadline == pytest.approx(10.0)
    assert kept.slot is None
    assert memory.period(0) == 0
    assert [expired.timer.scope for expired in run(world, 10.0)] == ["step"]


def test_a_process_on_a_clock_whose_offset_cannot_be_read_keeps_its_block_a_timeout_on() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.store(0, 5_000.0)
    world.pages.offsets[ALICE.pid] = None
    assert run(world, 8.0) == []
    kept = world.service.table.get(ALICE.pid, "step")
    assert kept is not None
    assert kept.deadline == 8.0 + TIMEOUT


def test_a_process_that_moved_to_another_clock_while_released_loses_its_registration() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.release(0, held=0.5)
    world.pages.offsets[ALICE.pid] = -50.0
    assert run(world, 8.0) == []
    assert world.service.table.get(ALICE.pid, "step") is None
    assert world.service.metrics.slots_lost == 1
    assert memory.period(0) == 0


def test_a_process_whose_uid_changed_loses_its_released_registration() -> None:
    world = make_world()
    _, memory = registered(world, "step", now=1.0)
    memory.release(0, held=0.5)
    world.host.processes[ALICE.pid] = (3000, 3000)  # setuid(2)
    assert run(world, 8.0) == []
    assert world.service.table.get(ALICE.pid, "step") is None
    assert [timer.scope for timer in world.journal.drops] == ["step"]
    assert world.service.metrics.slots_lost == 1


# Exits, restarts, the stop.


def test_a_process_exit_harvests_its_slots_counts_only_armed_ones_and_closes_its_pages() -> None:
    world = make_world()
    grant, memory = registered(world, "armed", now=1.0)
    registered(world, "idle", now=1.0)
    for _ in range(3):
        memory.release(1, held=0.5)
    process = world.service.table.process(ALICE.pid)
    assert process is not None
    process.exited = True
    world.clock.now = 4.0
    dropped = world.service.lifecycle.process_exited(process, world.clock.now)
    assert sorted(timer.scope for timer in dropped) == ["armed", "idle"]
    [exited] = [event for event in world.service.events.page(None, 10, 0) if event.kind == "exited"]
    assert exited.timers == 1
    assert "armed" in exited.note
    assert "idle" not in exited.note
    assert world.service.metrics.exited == 1
    assert world.pages.made[grant.page].closed
    reply = world.service.handle(Suggest(id=3), world.root, 5.0)
    assert isinstance(reply, SuggestReply)
    assert [(row.scope, row.count) for row in reply.suggestions] == [("idle", 3)]


def test_an_exit_with_only_released_registrations_records_no_exit() -> None:
    world = make_world()
    _, memory = registered(world, "idle", now=1.0)
    memory.release(0)
    process = world.service.table.process(ALICE.pid)
    assert process is not None
    process.exited = True
    world.service.lifecycle.process_exited(process, world.clock.now)
    assert world.service.metrics.exited == 0
    assert [event.kind for event in world.service.events.page(None, 10, 0)] == []


def restarted(world: World, now: float) -> World:
    """The daemon of ``world`` killed and started again at ``now`` on the same
    processes, its state the journal's."""
    later = make_world(pages=world.pages.restarted(), now=now)
    later.service.lifecycle.restore(world.journal.state())
    return later


def test_a_restored_registration_is_adopted_at_its_first_look() -> None:
    before = make_world()
    grant, memory = registered(before, "step", now=1.0)
    registered(before, "other", now=1.0)
    memory.store(0, 60.0)  # made while the daemon was down
    memory.release(1)
    world = restarted(before, now=50.0)
    assert world.pages.adoptions == []  # not before its look
    assert run(world, 50.0) == []
    assert world.pages.adoptions == [(ALICE.pid, grant.page)]  # once for the page
    assert look_at(world, "step") == 57.0
    assert look_at(world, "other") == 50.0 + PERIOD
    [fired] = run(world, 60.0)
    assert (fired.timer.scope, fired.timer.deadline) == ("step", 60.0)
    assert memory.period(0) == 0


def test_a_registration_that_needs_nothing_else_keeps_its_bare_slot_through_a_restart() -> None:
    """Its timer's `Watch` would hold nothing but its slot: it keeps the `SlotRef`
    alone (one object fewer), as one of a job keeps its `Watch` with its slot, and
    a restart finds both again from the state."""
    before = make_world()
    bare_grant, bare = registered(before, "bare", now=1.0)
    of_job = arm(before, before.alice, "of-job", 1.0, job="run-1", rank=3).slot
    assert of_job is not None
    bare_timer = before.service.table.get(ALICE.pid, "bare")
    job_timer = before.service.table.get(ALICE.pid, "of-job")
    assert bare_timer is not None
    assert job_timer is not None
    assert isinstance(bare_timer.watch, SlotRef)
    assert (bare_timer.watched, bare_timer.slot) == (None, bare_timer.watch)
    assert job_timer.watched is not None
    assert (job_timer.watched.job, job_timer.slot) == ("run-1", job_timer.watched.slot)
    bare.store(bare_grant.index, 30.0)
    bare.release(of_job.index)  # the same page's
    world = restarted(before, now=20.0)
    assert run(world, 20.0) == []
    assert look_at(world, "bare") == 27.0  # its stored deadline, or a period on
    bare.store(of_job.index, 60.0)
    why = world.service.handle(Why(id=4, pid=ALICE.pid), world.alice, 21.0)
    assert isinstance(why, WhyReply)
    notes = {timer.scope: " ".join(timer.notes) for timer in why.timers}
    assert f"slot {bare_grant.index}" in notes["bare"]
    assert "of job run-1 as rank 3" in notes["of-job"]
    assert "slot page" in notes["of-job"]
    [fired] = run(world, 31.0)
    assert (fired.timer.scope, fired.timer.deadline) == ("bare", 30.0)


def test_blocks_released_since_the_last_harvest_before_a_crash_count_after_the_restart() -> None:
    before = make_world()
    _, memory = registered(before, "step", now=1.0)
    for _ in range(30):
        memory.release(0, held=0.5)
    run(before, 8.0)  # harvested: 30
    for _ in range(7):
        memory.release(0, held=0.5)  # not harvested when the daemon dies
    world = restarted(before, now=20.0)
    world.service.history.load(before.service.history.encode())  # as its file kept it
    for _ in range(5):
        memory.release(0, held=0.5)  # while it was down, or since
    run(world, 20.0)
    assert suggested_count(world, "step", 21.0) == 42
    assert world.service.metrics.slots_scribbled == 0


def test_a_restored_registration_whose_page_is_lost_is_dropped_logged_and_counted() -> None:
    before = make_world()
    registered(before, "step", now=1.0)
    before.pages.held.clear()  # the process closed its page's descriptor
    world = restarted(before, now=50.0)
    assert run(world, 60.0) == []
    assert world.service.table.get(ALICE.pid, "step") is None
    assert world.service.metrics.slots_lost == 1
    assert [timer.scope for timer in world.journal.drops] == ["step"]
    assert any("slot_dropped" in line for line in world.log.lines)
    assert world.host.tracked == set()


def test_a_lost_page_is_searched_for_once_for_every_registration_on_it() -> None:
    before = make_world()
    for scope in ("a", "b", "c"):
        registered(before, scope, now=1.0)
    before.pages.held.clear()  # the process closed its page's descriptor
    world = restarted(before, now=50.0)
    assert run(world, 60.0) == []
    assert len(world.pages.adoptions) == 1  # each search reads all its descriptors
    assert world.service.metrics.slots_lost == 3
    assert world.host.tracked == set()


def test_the_pages_of_a_process_are_found_again_in_one_read_of_its_descriptors() -> None:
    """A process whose registrations fill three pages: after a restart its
    descriptors are read once for all three (each read costs a readlink of every
    descriptor it holds), and every registration is adopted."""
    before = make_world()
    for number in range(2 * SLOTS + 1):
        grant, memory = registered(before, f"s{number}", now=1.0)
        memory.release(grant.index)
    assert len(before.pages.made) == 3
    world = restarted(before, now=50.0)
    world.pages.search_steps = 2
    assert run(world, 50.0) == []
    assert world.service.slots.search(50.001) is False
    assert run(world, 50.5) == []
    assert len(world.pages.searches) == 1
    assert sorted(page for _, page in world.pages.adoptions) == sorted(before.pages.made)
    assert len(world.service.slots) == 2 * SLOTS + 1
    assert world.service.metrics.slots_lost == 0


def test_a_page_asked_for_once_the_read_had_begun_is_searched_for_again_not_lost() -> None:
    """A second registration's look asks for its page while the read begun by
    the first goes on, perhaps past that page's descriptor: a page the read did
    not find is searched for again rather than taken as lost."""
    before = make_world()
    for number in range(SLOTS + 1):
        grant, memory = registered(before, f"s{number}", now=1.0)
        memory.release(grant.index)
    world = restarted(before, now=50.0)
    world.pages.search_steps = 2
    world.pages.late_found = False
    assert run(world, 50.0) == []
    assert world.service.slots.search(50.001) is True  # the late page, again
    assert world.service.slots.search(50.002) is True  # its own two steps
    assert world.service.slots.search(50.003) is False
    assert run(world, 50.5) == []
    first, again = world.pages.searches
    assert len(first.wanted) == 2
    assert len(again.wanted) == 1
    assert len(world.service.slots) == SLOTS + 1
    assert world.service.metrics.slots_lost == 0


def test_a_status_after_a_restart_lists_no_registration_whose_slot_holds_no_block() -> None:
    """Before its first look a restored registration is read from its page once
    that is found (until then, none of its blocks is known): the state's look,
    long past, is never shown as a block due now."""
    before = make_world()
    for number in range(SLOTS + 1):
        grant, memory = registered(before, f"s{number}", now=1.0)
        memory.release(grant.index)
    grant, memory = registered(before, "held", now=1.0)
    memory.store(grant.index, 60.0)  # entered while the daemon was down
    world = restarted(before, now=50.0)
    world.pages.search_steps = 2
    assert status(world, world.alice, 50.0).timers == []
    assert world.service.firing.expire_due(50.0) == []  # the looks begin the search
    assert world.service.slots.search(50.001) is False
    [held] = status(world, world.alice, 50.002).timers
    assert held.scope == "held"
    assert held.remaining == pytest.approx(60.0 - 50.002)


def test_another_callers_arm_before_the_first_look_after_a_restart_closes_the_slot() -> None:
    """Revoked before its page was found again: the process must still see its
    slot closed, or its later blocks store where no daemon reads."""
    before = make_world()
    _, memory = registered(before, "step", now=1.0)
    world = restarted(before, now=5.0)
    reply = arm(world, world.root, "step", 5.0, timeout=30.0, pid=ALICE.pid)
    assert reply.slot is None
    assert memory.period(0) == 0


def test_a_page_searched_for_over_several_slices_keeps_its_looks_waiting() -> None:
    """A process holding many descriptors: its search goes a slice at a time
    between passes, and its registrations' looks wait for it, dropping nothing."""
    before = make_world()
    _, memory = registered(before, "step", now=1.0)
    registered(before, "other", now=1.0)
    memory.store(0, 60.0)
    memory.release(1)
    world = restarted(before, now=50.0)
    world.pages.search_steps = 3
    assert world.service.firing.expire_due(50.0) == []
    assert look_at(world, "step") == look_at(world, "other") == 50.0 + SEARCH_PAUSE
    [search] = world.pages.searches  # one for the page, begun by the first look
    assert world.service.slots.search(50.001) is True
    assert world.service.slots.search(50.002) is False
    assert search.closed
    assert run(world, 50.5) == []
    assert world.service.metrics.slots_lost == 0
    [fired] = run(world, 60.0)
    assert (fired.timer.scope, fired.timer.deadline) == ("step", 60.0)


def test_looks_waiting_for_a_search_are_not_polled_and_come_back_when_it_ends() -> None:
    """A search that takes slices: the looks that wait for it are not taken again
    meanwhile (hundreds of them, every few milliseconds, would starve the search
    and the daemon), and are due again the moment it ends: a block hung while
    the daemon was down dies then, not a pause later."""
    before = make_world()
    for number in range(SLOTS + 1):
        grant, memory = registered(before, f"s{number}", now=1.0)
        memory.release(grant.index)
    grant, memory = registered(before, "hung", now=1.0)
    memory.store(grant.index, 49.0)  # entered while the daemon was down, and hung
    world = restarted(before, now=50.0)
    world.pages.search_steps = 4
    assert run(world, 50.0) == []
    waiting = look_at(world, "hung")
    assert waiting == 50.0 + SEARCH_PAUSE
    assert world.service.slots.search(50.001) is True
    assert world.service.slots.search(50.002) is True
    assert world.service.firing.expire_due(50.003) == []  # nothing taken meanwhile
    assert look_at(world, "hung") == waiting
    assert world.service.slots.search(50.004) is False
    assert look_at(world, "hung") == 50.0  # due again at once
    [fired] = run(world, 50.005)
    assert (fired.timer.scope, fired.timer.deadline) == ("hung", 49.0)
    assert len(world.service.slots) == SLOTS + 1


def test_a_page_a_search_never_finds_drops_its_registrations_once_it_ends() -> None:
    before = make_world()
    registered(before, "step", now=1.0)
    before.pages.held.clear()  # the process closed its page's descriptor
    world = restarted(before, now=50.0)
    world.pages.search_steps = 2
    assert run(world, 50.0) == []
    assert world.service.table.get(ALICE.pid, "step") is not None
    assert world.service.slots.search(50.001) is False
    assert run(world, 50.5) == []
    assert world.service.table.get(ALICE.pid, "step") is None
    assert world.service.metrics.slots_lost == 1


def test_a_slot_revoked_while_its_page_is_searched_for_closes_once_it_is_found() -> None:
    """Another caller arms the scope while the search goes on: the process must
    still see its slot closed, or its later blocks store where no daemon reads;
    the page, which no registration holds any more, is let go."""
    before = make_world()
    _, memory = registered(before, "step", now=1.0)
    world = restarted(before, now=5.0)
    world.pages.search_steps = 2
    reply = arm(world, world.root, "step", 5.0, timeout=30.0, pid=ALICE.pid)
    assert reply.slot is None
    assert memory.period(0) != 0  # not found yet
    assert world.service.slots.search(5.001) is False
    assert memory.period(0) == 0
    [page] = world.pages.adopted
    assert page.closed


def test_a_search_is_given_up_when_its_process_exits() -> None:
    before = make_world()
    registered(before, "step", now=1.0)
    world = restarted(before, now=50.0)
    world.pages.search_steps = 5
    assert run(world, 50.0) == []
    [search] = world.pages.searches
    process = world.service.table.process(ALICE.pid)
    assert process is not None
    process.exited = True
    world.service.lifecycle.process_exited(process, world.clock.now)
    assert search.closed
    assert world.service.slots.search(51.0) is False


def test_close_all_at_the_stop_writes_period_0_in_every_slot() -> None:
    world = make_world()
    for number in range(SLOTS + 1):  # two pages of root's
        arm(world, world.root, f"s{number}", 1.0)
    registered(world, "alices", now=1.0)
    assert len(world.pages.made) == 3
    memories = {page: world.pages.memory(page) for page in world.pages.made}
    world.service.lifecycle.close()
    for page in world.pages.made.values():
        assert page.closed_all == 1
        assert page.closed
    for memory in memories.values():
        assert all(memory.period(index) == 0 for index in range(SLOTS))
    assert world.journal.drops == []  # the state keeps the registrations


def test_the_restart_grace_never_holds_a_registrations_look() -> None:
    before = make_world()
    _, memory = registered(before, "step", now=1.0)
    arm(before, before.alice, "plain", 1.0, slot=False, timeout=45.0)
    memory.store(0, 49.5)  # due while the daemon was down
    world = restarted(before, now=49.0)
    fired = run(world, 49.0 + RESTART_GRACE)
    assert [(item.timer.scope, item.timer.deadline) for item in fired] == [
        ("step", 49.5),
        ("plain", 46.0),
    ]
    step, plain = fired
    assert step.timer.fired_at == 49.5 < 49.0 + RESTART_GRACE
    assert step.note == ""
    # The plain timer was held until the grace ended, and fires then.
    assert plain.timer.fired_at == 49.0 + RESTART_GRACE
    assert "held" in plain.note


def test_the_stop_closes_the_slots_of_registrations_not_yet_looked_at_after_a_restart() -> None:
    """A daemon stopped for good says so in every page it shares, also in one it
    restored from the state and has not read yet."""
    before = make_world()
    _, memory = registered(before, "step", now=1.0)
    memory.store(0, 200.0)
    world = restarted(before, now=5.0)
    world.service.lifecycle.close()
    assert memory.period(0) == 0
