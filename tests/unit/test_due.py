"""A due timer whose first step is a signal to its process is taken out as a `Due`:
its signal goes first, its firing record is made after (`Firing.record`). Until
then the state holds it as armed."""

from __future__ import annotations

from watchdogd.core.config import Config, DaemonConfig, PolicyConfig, StepConfig
from watchdogd.core.firing import Due
from watchdogd.core.service import Caller, Service
from watchdogd.core.timers import Expired
from watchdogd.runtime.metrics import exposition
from watchdogd_protocol import Acquire, Release

from helpers.fakes import ALICE, BOB, DAEMON_PID, FakeHost, FakeProcess, RecordingJournal


def service_with(journal: RecordingJournal) -> Service[FakeProcess]:
    host = FakeHost({ALICE.pid: (1000, 1000), BOB.pid: (2000, 2000), DAEMON_PID: (0, 0)})
    return Service(
        Config(
            daemon=DaemonConfig(),
            policies={
                "later": PolicyConfig(steps=[StepConfig(wait=1.0), StepConfig(signal="SIGKILL")]),
                "quick": PolicyConfig(steps=[StepConfig(signal="SIGKILL")]),
            },
        ),
        host,
        journal=journal,
        daemon_pid=DAEMON_PID,
        now=0.0,
        wall=lambda: 1_700_000_000.0,
        clock=lambda: 0.0,
        render_metrics=exposition,
    )


def one_due(
    journal: RecordingJournal,
) -> tuple[Service[FakeProcess], Caller[FakeProcess], Due[FakeProcess]]:
    """A service on ``journal``, alice's connection, and her kill timer "step",
    armed at 0 for 1 s and taken out as a `Due` at 1."""
    service = service_with(journal)
    alice = service.arming.open_connection(ALICE)
    service.handle(Acquire(id=1, scope="step", timeout=1), alice, 0.0)
    [due] = service.firing.take_due(1.0, 10)
    assert isinstance(due, Due)
    return service, alice, due


def test_a_kill_comes_out_as_a_due_held_armed_in_the_state_until_recorded() -> None:
    journal = RecordingJournal()
    service, _, due = one_due(journal)
    assert due.signal.describe() == "SIGKILL"
    assert due.fired_at == 1.0
    armed = due.timer
    assert armed.firing == 0
    assert service.table.get(ALICE.pid, "step") is None
    assert len(service.firing) == 0
    # The state still holds it as armed, and a full write would write it so.
    assert journal.held() == {armed.store_key}
    assert service.snapshot() == [armed]
    fired = service.firing.record(due)
    assert isinstance(fired, Expired)
    assert fired.timer.firing == due.number
    assert fired.timer.run is not None
    assert fired.timer.run.fired_at == 1.0
    assert journal.held() == {fired.timer.store_key}
    assert service.snapshot() == [fired.timer]
    assert len(service.firing) == 1
    fired.process.close()


def test_a_policy_that_does_not_start_with_a_signal_is_recorded_at_once() -> None:
    journal = RecordingJournal()
    service = service_with(journal)
    alice = service.arming.open_connection(ALICE)
    service.handle(Acquire(id=1, scope="waits", timeout=1, policy="later"), alice, 0.0)
    [fired] = service.firing.take_due(1.0, 10)
    assert isinstance(fired, Expired)
    assert fired.timer.firing
    assert journal.held() == {fired.timer.store_key}
    fired.process.close()


def test_a_scope_armed_again_before_the_record_keeps_its_new_arming() -> None:
    """A policy's first signal need not end the process (``signal:USR1``, a
    SIGTERM it handles): its worker may arm the scope again before the firing
    record is made, and that arming must stay in the state."""
    journal = RecordingJournal()
    service, alice, due = one_due(journal)
    service.handle(Acquire(id=2, scope="step", timeout=60), alice, 1.1)
    again = service.table.get(ALICE.pid, "step")
    assert again is not None
    # The arming's answer commits the firing record too: a crash from here on
    # still finds the policy in progress (the rest of it is owed), and the new
    # arming in place of the old.
    firing_key = (ALICE.pid, "step", due.number)
    assert journal.held() == {again.store_key, firing_key}
    assert journal.changes[again.store_key] == again
    assert sorted(t.store_key for t in service.snapshot()) == sorted([again.store_key, firing_key])
    writes = journal.generation
    fired = service.firing.record(due)
    assert fired.timer.store_key == firing_key
    assert fired.timer.run is not None
    assert fired.timer.run.fired_at == 1.0
    assert journal.generation == writes  # made once
    assert len(service.firing) == 1
    fired.process.close()


def test_a_scope_released_after_it_was_armed_again_leaves_the_policy_owed() -> None:
    """Armed again, then released, before the firing record was made: the state
    holds the firing record alone."""
    journal = RecordingJournal()
    service, alice, due = one_due(journal)
    service.handle(Acquire(id=2, scope="step", timeout=60), alice, 1.1)
    service.handle(Release(id=3, scope="step"), alice, 1.2)
    assert journal.held() == {(ALICE.pid, "step", due.number)}
    fired = service.firing.record(due)
    assert journal.held() == {fired.timer.store_key}
    fired.process.close()


def test_firing_numbers_follow_the_order_timers_fell_due_in() -> None:
    service = service_with(RecordingJournal())
    alice, bob = service.arming.open_connection(ALICE), service.arming.open_connection(BOB)
    service.handle(Acquire(id=1, scope="first", timeout=1), alice, 0.0)
    service.handle(Acquire(id=2, scope="second", timeout=2, policy="later"), bob, 0.0)
    service.handle(Acquire(id=3, scope="third", timeout=3), alice, 0.0)
    taken = service.firing.take_due(3.0, 10)
    assert [type(item).__name__ for item in taken] == ["Due", "Expired", "Due"]
    # The second was recorded at once, the others after it: numbered as they fell due.
    recorded = [
        service.firing.record(item) if isinstance(item, Due) else item for item in reversed(taken)
    ]
    assert [item.timer.firing for item in reversed(recorded)] == [1, 2, 3]
    for item in recorded:
        item.process.close()


def test_expire_due_records_every_due_at_once() -> None:
    journal = RecordingJournal()
    service = service_with(journal)
    service.handle(
        Acquire(id=1, scope="step", timeout=1), service.arming.open_connection(ALICE), 0.0
    )
    [fired] = service.firing.expire_due(1.0, 10)
    assert isinstance(fired, Expired)
    assert fired.timer.firing == 1
    assert journal.held() == {fired.timer.store_key}
    fired.process.close()


def test_a_timer_whose_policy_was_removed_is_recorded_at_once_to_say_so() -> None:
    """Its event must say that the default stood in: the usual way, which writes
    that note, not a `Due`."""
    service = service_with(RecordingJournal())
    alice = service.arming.open_connection(ALICE)
    service.handle(Acquire(id=1, scope="step", timeout=1, policy="quick"), alice, 0.0)
    service.reconfigure(Config(daemon=DaemonConfig()))
    [fired] = service.firing.take_due(1.0, 10)
    assert isinstance(fired, Expired)
    assert fired.timer.policy == "quick"
    fired.process.close()


def test_a_scope_armed_and_due_again_before_the_first_record_keeps_the_second() -> None:
    """Taken out twice before either is recorded (armed again with a short timeout
    within a burst): the first's record must not drop the second's armed one."""
    journal = RecordingJournal()
    service, alice, first = one_due(journal)
    service.handle(Acquire(id=2, scope="step", timeout=0.5), alice, 1.1)
    [second] = service.firing.take_due(1.6, 10)
    assert isinstance(second, Due)
    assert sorted(t.store_key for t in service.snapshot()) == sorted(
        [(ALICE.pid, "step", first.number), second.timer.store_key]
    )
    fired = service.firing.record(first)
    assert journal.changes[second.timer.store_key] == second.timer
    assert sorted(t.store_key for t in service.snapshot()) == sorted(
        [second.timer.store_key, fired.timer.store_key]
    )
    again = service.firing.record(second)
    assert journal.held() == {fired.timer.store_key, again.timer.store_key}
    for item in (fired, again):
        item.process.close()
