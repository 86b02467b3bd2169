"""The policy run's state machine, driven directly with a fake target: no trio, no
daemon, no clock but the numbers passed in. (That importing it loads no trio is
checked with the rest of the core, in test_core.py.)"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import msgspec
import pytest

from watchdogd.core.effects import (
    AwaitEvidence,
    CheckAlive,
    Counted,
    Delivery,
    Dumped,
    Effect,
    EvidenceIn,
    Finish,
    Hooked,
    HookResult,
    ObserveLateness,
    Opened,
    OpenTarget,
    PeersUnblocked,
    Recorded,
    RecordStep,
    RunHook,
    Seen,
    SendSignal,
    Signalled,
    SignalResult,
    TakeDump,
    UnblockPeers,
    Waited,
    WaitUntil,
    Watched,
    WatchExit,
    WrongObservation,
)
from watchdogd.core.expiry import BY_RESPONDER, Phase, Run, first_signal
from watchdogd.core.policies import (
    BUILTIN,
    PEER_DUMP,
    Dump,
    Exec,
    Policy,
    Signal,
    Unblock,
    signal_policy,
)
from watchdogd.core.timers import Course, Timer, Watch
from watchdogd_protocol import EventInfo

DEADLINE = 100.0
FIRED = 100.5
#: The wall clock reads this much more than the daemon's.
WALL = 1_000_000.0


def firing(
    policy: Policy,
    *,
    step: int = 0,
    step_end: float = 0.0,
    peer: bool = False,
    incident: str = "",
    **fields: object,
) -> Timer:
    """A timer of ``policy`` that fell due at `DEADLINE` and fired at `FIRED` (as
    part of ``incident``, or as a peer run of incident ``inc-1``)."""
    timer = Timer(
        deadline=DEADLINE,
        pid=42,
        scope="train",
        policy=policy.name,
        uid=1000,
        owner=1000,
        timeout=60.0,
        armed_at=DEADLINE - 60.0,
        firing=1,
        run=Course(
            step=step,
            step_end=step_end,
            fired_at=FIRED,
            plan=policy.plan,
            incident="inc-1" if peer else incident,
            peer=peer,
        ),
    )
    return msgspec.structs.replace(timer, **fields) if fields else timer


@dataclass
class FakeTarget:
    """A target that dies of the signals in ``dies_of`` (unless ``unkillable``),
    exits during a wait when ``exits_in_wait``, and answers EPERM when
    ``refuses``."""

    alive: bool = True
    dies_of: set[int] = field(default_factory=lambda: {signal.SIGKILL})
    unkillable: bool = False
    exits_in_wait: bool = False
    refuses: bool = False
    sent: list[int] = field(default_factory=list)

    def signal(self, signum: int) -> SignalResult:
        if not self.alive:
            return SignalResult(Delivery.GONE, signum)
        if self.refuses:
            return SignalResult(Delivery.REFUSED, signum)
        self.sent.append(signum)
        if signum in self.dies_of and not self.unkillable:
            self.alive = False
        return SignalResult(Delivery.SENT, signum)


@dataclass
class Driven:
    effects: list[Effect]
    finish: Finish
    recorded: list[Timer]

    @property
    def outcome(self) -> str:
        return self.finish.event.outcome

    @property
    def steps(self) -> list[tuple[str, str]]:
        return [(step.step, step.result) for step in self.finish.event.steps]

    def of(self, kind: type) -> list[Effect]:
        return [effect for effect in self.effects if isinstance(effect, kind)]


# One branch per effect type, as the executor's own match.
def drive(  # noqa: PLR0912
    run: Run,
    target: FakeTarget,
    *,
    now: float = FIRED,
    crash_at_record: int | None = None,
) -> Driven:
    """Carry out ``run``'s effects as the executor would, on ``target``, every
    effect taking a second; with ``crash_at_record``, stop once that many steps
    were recorded (the daemon was killed there): the last effect is then the
    `Finish` of nothing, and ``recorded`` holds what the state held."""
    effects: list[Effect] = []
    recorded: list[Timer] = []
    while True:
        effect = run.next(now, now + WALL)
        effects.append(effect)
        match effect:
            case OpenTarget(check=check):
                run.observe(Opened("", alive=target.alive if check else None))
            case CheckAlive():
                run.observe(Seen(target.alive))
            case RecordStep(step=step, step_end=step_end):
                recorded.append(run.timer.at_step(step, step_end))
                if crash_at_record is not None and len(recorded) == crash_at_record:
                    return Driven(effects, Finish(_nothing()), recorded)
                run.observe(Recorded())
            case SendSignal(signum=signum):
                run.observe(Signalled(target.signal(signum), now))
            case ObserveLateness():
                run.observe(Counted())
            case WaitUntil(end=end):
                if target.exits_in_wait:
                    target.alive = False
                else:
                    now = end
                run.observe(Waited(not target.alive))
            case RunHook():
                run.observe(Hooked(EXIT_0))
            case TakeDump():
                run.observe(Dumped(EXIT_0))
            case WatchExit():
                run.observe(Watched(target.alive))
            case AwaitEvidence():
                run.observe(EvidenceIn())  # the verdict settles a second later
            case UnblockPeers(incident=incident):
                run.observe(PeersUnblocked(f"asked for incident {incident!r}"))
            case Finish():
                return Driven(effects, effect, recorded)
        now += 1.0


def phase_of(run: Run) -> Phase:
    """``run``'s phase now (read through a call: each observation may change it)."""
    return run.phase


#: A hook's or a dumper's run that exited 0, having written a stack.
EXIT_0 = HookResult(0, "exit 0", "a stack")


def _nothing() -> EventInfo:
    return EventInfo(seq=0, kind="", time=0.0, pid=0, uid=0, scope="", policy="")


def start(policy: Policy, timer: Timer | None = None, **opened: object) -> Run:
    run = Run(timer or firing(policy), policy, daemon_started=0.0)
    run.observe(Opened("python train.py", **opened))  # type: ignore[arg-type]
    return run


TERM = BUILTIN["term"]
KILL = BUILTIN["kill"]
DUMP_THEN_KILL = Policy(name="dump_kill", steps=(Dump(), Signal(signal.SIGKILL)))
HOOK = Policy(name="hook", steps=(Exec(("/bin/notify", "{pid}", "--", "{scope}")),))


def test_kill_sends_sigkill_at_once_and_counts_its_lateness() -> None:
    driven = drive(start(KILL), FakeTarget())
    assert driven.effects[:2] == [
        SendSignal(signal.SIGKILL, alive=True),
        ObserveLateness(FIRED - DEADLINE),
    ]
    assert driven.of(RecordStep) == []  # the firing record names step 0 already
    assert driven.outcome == "exited"
    assert driven.steps == [("SIGKILL", "sent SIGKILL")]
    event = driven.finish.event
    assert event.kind == "expired"
    assert event.late == FIRED - DEADLINE
    assert event.deadline == DEADLINE + WALL
    assert event.command == "python train.py"
    assert event.reason == "timeout"
    assert event.note == ""


def test_term_waits_then_kills_a_process_that_ignores_sigterm() -> None:
    driven = drive(start(TERM), FakeTarget())
    assert driven.of(SendSignal) == [
        SendSignal(signal.SIGTERM, alive=True),
        SendSignal(signal.SIGKILL),
    ]
    # The wait is recorded with its end, the SIGKILL as its own step.
    assert driven.of(RecordStep) == [RecordStep(1, FIRED + 3.0 + 10.0), RecordStep(2)]
    assert driven.of(WaitUntil) == [WaitUntil(FIRED + 3.0 + 10.0)]
    assert driven.steps == [
        ("SIGTERM", "sent SIGTERM"),
        ("wait 10s", "still running after 10s"),
        ("SIGKILL", "sent SIGKILL"),
    ]
    assert driven.outcome == "exited"


def test_term_skips_the_rest_once_the_target_exits_in_the_wait() -> None:
    driven = drive(start(TERM), FakeTarget(exits_in_wait=True))
    assert driven.steps == [
        ("SIGTERM", "sent SIGTERM"),
        ("wait 10s", "exited"),
        ("SIGKILL", "skipped: target exited"),
    ]
    assert driven.outcome == "exited"


def test_a_target_gone_mid_policy_has_its_later_signals_skipped() -> None:
    driven = drive(start(TERM), FakeTarget(dies_of={signal.SIGTERM}))
    assert driven.steps[0] == ("SIGTERM", "sent SIGTERM")
    assert driven.steps[2] == ("SIGKILL", "skipped: target exited")
    assert driven.outcome == "exited"


def test_dump_then_kill_dumps_first_with_the_timers_values() -> None:
    driven = drive(start(DUMP_THEN_KILL), FakeTarget())
    assert isinstance(driven.effects[0], CheckAlive)  # no signal tells this step
    (dump,) = driven.of(TakeDump)
    assert isinstance(dump, TakeDump)
    assert dump.values == {"pid": "42", "scope": "train"}
    assert dump.env["WATCHDOG_POLICY"] == "dump_kill"
    assert dump.env["WATCHDOG_UID"] == "1000"
    assert driven.steps == [("dump py-spy dump --pid 42", "exit 0"), ("SIGKILL", "sent SIGKILL")]
    assert driven.finish.event.steps[0].output == "a stack"
    assert driven.of(ObserveLateness) == [ObserveLateness(FIRED + 4.0 - DEADLINE)]
    # Late from the deadline to the first step (the dump), not to the signal.
    assert driven.finish.event.late == FIRED + 1.0 - DEADLINE


def test_a_culprit_kept_alive_has_its_peers_unblocked_after_its_dump() -> None:
    keep = Policy(name="keep", steps=(Dump(), Unblock(fallback=signal.SIGTERM, timeout=5.0)))
    driven = drive(start(keep, firing(keep, incident="inc-7")), FakeTarget())
    (unblock,) = driven.of(UnblockPeers)
    assert unblock == UnblockPeers(Unblock(signal.SIGTERM, 5.0), "inc-7")
    assert driven.steps == [
        ("dump py-spy dump --pid 42", "exit 0"),
        ("unblock peers, else SIGTERM", "asked for incident 'inc-7'"),
    ]
    assert driven.outcome == "alive"  # nothing signalled it
    assert driven.of(SendSignal) == []


def test_an_exec_hook_runs_with_pid_and_scope_to_substitute() -> None:
    driven = drive(start(HOOK), FakeTarget())
    (hook,) = driven.of(RunHook)
    assert isinstance(hook, RunHook)
    assert hook.step == HOOK.steps[0]
    assert hook.values == {"pid": "42", "scope": "train"}
    assert driven.steps == [("exec /bin/notify 42 -- train", "exit 0")]
    assert driven.outcome == "alive"
    assert driven.of(ObserveLateness) == []  # no signal: no lateness to count


def test_steps_are_named_for_what_ran_or_would_have() -> None:
    # A scope a shell would split is quoted, as the argument it was.
    timer = firing(HOOK, scope="/srv/my job.py:6")
    driven = drive(start(HOOK, timer), FakeTarget())
    assert driven.steps == [("exec /bin/notify 42 -- '/srv/my job.py:6'", "exit 0")]
    # Skipped, the steps say what they would have run.
    gone = drive(start(DUMP_THEN_KILL, alive=False), FakeTarget(alive=False))
    assert gone.steps == [
        ("dump py-spy dump --pid 42", "skipped: target exited"),
        ("SIGKILL", "skipped: target exited"),
    ]


def test_a_dump_the_workers_responder_gave_is_named_so() -> None:
    run = start(DUMP_THEN_KILL)
    run.next(FIRED, WALL)
    run.observe(Seen(True))
    assert isinstance(run.next(FIRED, WALL), TakeDump)
    run.observe(Dumped(HookResult(0, "ok", "a stack"), responder=True))
    driven = drive(run, FakeTarget(), now=FIRED + 1.0)
    assert driven.steps == [(BY_RESPONDER, "ok"), ("SIGKILL", "sent SIGKILL")]
    assert BY_RESPONDER == "dump by the worker's responder"


def test_log_records_the_expiry_and_touches_nothing() -> None:
    target = FakeTarget()
    driven = drive(start(BUILTIN["log"]), target)
    assert target.sent == []
    assert driven.outcome == "alive"
    assert driven.steps == []
    assert driven.finish.event.late == FIRED - DEADLINE  # from when it fired


def test_a_signal_name_policy_sends_that_signal() -> None:
    policy = signal_policy("signal:USR1")
    assert policy is not None
    driven = drive(start(policy), FakeTarget())
    assert driven.of(SendSignal) == [SendSignal(signal.SIGUSR1, alive=True)]
    assert driven.steps == [("SIGUSR1", "sent SIGUSR1")]
    assert driven.outcome == "alive"


def test_a_peer_policy_says_whose_incident_and_counts_no_lateness() -> None:
    policy = BUILTIN[PEER_DUMP]
    driven = drive(start(policy, firing(policy, peer=True)), FakeTarget())
    event = driven.finish.event
    assert event.kind == "peer"
    assert event.incident == "inc-1"
    assert event.note == "the peer policy of incident inc-1"
    assert event.late is None
    assert event.reason == ""
    peer_kill = Policy(name="peer_kill", steps=(Signal(signal.SIGKILL),))
    killed = drive(start(peer_kill, firing(peer_kill, peer=True)), FakeTarget())
    assert killed.of(ObserveLateness) == []
    assert killed.outcome == "exited"


def test_a_target_gone_at_start_is_gone_and_not_signalled() -> None:
    target = FakeTarget(alive=False)
    driven = drive(start(TERM, alive=False), target)
    assert driven.of(SendSignal) == []
    assert driven.outcome == "gone"
    assert {result for _, result in driven.steps} == {"skipped: target exited"}


def test_a_first_signal_that_finds_it_gone_makes_it_gone() -> None:
    driven = drive(start(KILL), FakeTarget(alive=False))
    assert driven.steps == [("SIGKILL", "gone")]
    assert driven.outcome == "gone"


def test_an_unkillable_target_is_watched_then_reported() -> None:
    run = start(KILL)
    driven = drive(run, FakeTarget(unkillable=True))
    assert driven.of(WatchExit) == [WatchExit()]
    assert driven.outcome == "unkillable"
    assert driven.finish.unkillable
    event = run.unkillable_event(42, "D", "nfs_wait", after=30.0, wall=5.0)
    assert event.kind == "unkillable"
    assert event.note == "still alive 30s after SIGKILL"
    assert (event.state, event.wchan, event.policy) == ("D", "nfs_wait", "kill")


def test_a_target_that_exits_while_watched_has_exited() -> None:
    run = start(KILL)
    assert run.next(FIRED, WALL) == SendSignal(signal.SIGKILL, alive=True)
    run.observe(Signalled(SignalResult(Delivery.SENT, signal.SIGKILL), FIRED))
    run.next(FIRED, WALL)
    run.observe(Counted())
    run.next(FIRED, WALL)
    run.observe(Seen(True))
    assert run.next(FIRED, WALL) == WatchExit()
    run.observe(Watched(False))
    finish = run.next(FIRED + 1, WALL)
    assert isinstance(finish, Finish)
    assert finish.event.outcome == "exited"


def test_a_refused_sigkill_makes_no_target_unkillable() -> None:
    driven = drive(start(KILL), FakeTarget(refuses=True))
    assert driven.steps == [("SIGKILL", "not permitted to send SIGKILL")]
    assert driven.of(WatchExit) == []
    assert driven.outcome == "alive"


def test_a_denied_target_gets_no_step_and_says_why() -> None:
    why = "uid 1000 may no longer signal pid 42 (its uids are now 0)"
    target = FakeTarget()
    driven = drive(start(TERM, denied=why), target)
    assert target.sent == []
    assert driven.outcome == "alive"
    assert {result for _, result in driven.steps} == {"skipped: not allowed"}
    assert why in driven.finish.event.note


def test_a_starved_timer_that_was_still_due_says_so() -> None:
    timer = firing(KILL, watch=Watch(extended=5.0))
    run = Run(timer, KILL, "", "judged not starved: cpu 3%", daemon_started=0.0)
    run.observe(Opened("python train.py"))
    note = drive(run, FakeTarget()).finish.event.note
    assert note == (
        "judged not starved: cpu 3%; it had been given 5s more as starved "
        "(its extended event says why) and was still due"
    )


def test_a_stalled_timer_says_how_it_stalled() -> None:
    watch = Watch(progress=7, progressed_at=DEADLINE - 5.0, stall=5.0)
    timer = firing(KILL, watch=watch, timeout=120.0)
    event = drive(start(KILL, timer), FakeTarget()).finish.event
    assert event.reason == "stalled"
    assert event.note.startswith("stalled: re-armed with its progress at 7 for 5 s")


def test_the_notes_of_a_removed_policy_and_of_the_target() -> None:
    removed = "policy 'gone' is no longer configured"
    timer = msgspec.structs.replace(firing(KILL), policy="gone")
    run = Run(timer, KILL, removed, daemon_started=0.0)
    run.observe(Opened("x", note="group target refused (the daemon's process group)"))
    note = drive(run, FakeTarget()).finish.event.note
    assert note == (
        "policy 'gone' is no longer configured; group target refused (the daemon's process group)"
    )


def test_a_timer_that_fell_due_while_the_daemon_was_down_says_so() -> None:
    run = Run(firing(KILL), KILL, daemon_started=DEADLINE + 0.2)
    run.observe(Opened("x"))
    assert drive(run, FakeTarget()).finish.event.note == "fell due while the daemon was not running"


@pytest.mark.parametrize("crash_at", [1, 2])
def test_term_resumes_after_a_crash_at_each_step(crash_at: int) -> None:
    first = drive(start(TERM), FakeTarget(), crash_at_record=crash_at)
    stored = first.recorded[-1]
    assert stored.step == crash_at
    resumed = start(TERM, stored)
    target = FakeTarget()
    driven = drive(resumed, target, now=FIRED + 5.0)
    before = [(step, "done before a restart") for step in ("SIGTERM", "wait 10s")]
    assert driven.steps[:crash_at] == before[:crash_at]
    assert f"resumed at step {crash_at + 1} after a restart" in driven.finish.event.note
    assert target.sent == [signal.SIGKILL]  # never SIGTERM again
    assert driven.of(ObserveLateness) == []  # counted by the run before the crash
    if crash_at == 1:
        # The wait goes on to its recorded end, and is not recorded again.
        assert driven.of(WaitUntil) == [WaitUntil(stored.step_end)]
        assert driven.of(RecordStep) == [RecordStep(2)]
    else:
        assert driven.of(RecordStep) == []
    assert driven.outcome == "exited"


def test_a_run_resumed_after_its_sigkill_still_watches_a_target_alive() -> None:
    policy = Policy(name="kill_then_note", steps=(Signal(signal.SIGKILL), HOOK.steps[0]))
    stored = firing(policy, step=1)  # killed before the crash, in its hook then
    target = FakeTarget(unkillable=True)
    driven = drive(start(policy, stored), target)
    assert target.sent == []
    assert driven.steps[0] == ("SIGKILL", "done before a restart")
    assert driven.of(WatchExit) == [WatchExit()]
    assert driven.outcome == "unkillable"


def test_dump_then_kill_resumes_at_the_kill() -> None:
    stored = drive(start(DUMP_THEN_KILL), FakeTarget(), crash_at_record=1).recorded[-1]
    driven = drive(start(DUMP_THEN_KILL, stored), FakeTarget())
    assert driven.of(TakeDump) == []
    assert driven.steps == [
        ("dump py-spy dump --pid 42", "done before a restart"),
        ("SIGKILL", "sent SIGKILL"),
    ]


def test_a_policy_changed_across_a_restart_starts_again() -> None:
    stored = firing(TERM, step=2)
    assert stored.run is not None
    # Recorded under the plan of another policy.
    stored = msgspec.structs.replace(stored, run=msgspec.structs.replace(stored.run, plan=1))
    driven = drive(start(TERM, stored), FakeTarget(dies_of={signal.SIGTERM}))
    assert driven.steps[0] == ("SIGTERM", "sent SIGTERM")
    assert "its policy changed across a restart" in driven.finish.event.note
    assert "resumed at" not in driven.finish.event.note


def test_the_short_way_is_the_first_signal_sent_inline() -> None:
    assert first_signal(firing(KILL), KILL, "") == Signal(signal.SIGKILL)
    assert first_signal(firing(TERM, step=1), TERM, "") is None  # resumed
    assert first_signal(firing(KILL, peer=True), KILL, "") is None
    assert first_signal(firing(KILL), KILL, "policy 'x' is no longer configured") is None
    group = Policy(name="g", steps=KILL.steps, target="group")
    assert first_signal(firing(group), group, "") is None
    assert first_signal(firing(BUILTIN["log"]), BUILTIN["log"], "") is None
    assert first_signal(firing(DUMP_THEN_KILL), DUMP_THEN_KILL, "") is None
    # Its result handed over afterwards, as if the machine had sent it.
    run = start(KILL)
    run.observe(Signalled(SignalResult(Delivery.SENT, signal.SIGKILL), FIRED + 0.01))
    assert run.next(FIRED + 1.0, WALL) == ObserveLateness(FIRED + 0.01 - DEADLINE)
    run.observe(Counted())
    run.next(FIRED + 1.0, WALL)
    run.observe(Seen(False))
    finish = run.next(FIRED + 1.0, WALL)
    assert isinstance(finish, Finish)
    assert finish.event.late == FIRED + 0.01 - DEADLINE
    assert finish.event.outcome == "exited"


def test_the_first_signal_of_an_incidents_expiry_waits_for_its_evidence_once() -> None:
    """A rank killed first can take its peers down before their stacks are taken:
    the first signal of its run waits for the incident's verdict, once, bounded;
    its dump does not wait, nor does any later signal."""
    dump_then_term = Policy(name="dump_term", steps=(Dump(), *TERM.steps))
    timer = firing(dump_then_term, incident="inc-7")
    run = Run(timer, dump_then_term, daemon_started=0.0, evidence_wait=3.0)
    run.observe(Opened("python train.py"))
    # A policy that starts with its signal asked for no stacks: inline, as ever.
    assert first_signal(firing(KILL, incident="inc-7"), KILL, "") == Signal(signal.SIGKILL)
    run.next(FIRED, WALL)
    run.observe(Seen(True))
    assert isinstance(run.next(FIRED, WALL), RecordStep | TakeDump)
    driven = drive(run, FakeTarget(dies_of=set()), now=FIRED + 1.0)
    [waited] = driven.of(AwaitEvidence)
    assert [e for e in driven.effects if isinstance(e, AwaitEvidence | SendSignal)] == [
        waited,
        SendSignal(signal.SIGTERM),
        SendSignal(signal.SIGKILL),
    ]
    assert isinstance(waited, AwaitEvidence)
    assert waited.incident == "inc-7"
    # Asked again before it is observed, the wait keeps its end.
    again = Run(timer, dump_then_term, daemon_started=0.0, evidence_wait=3.0)
    again.observe(Opened("python train.py"))
    again.next(FIRED, WALL)
    again.observe(Seen(True))
    again.next(FIRED, WALL)
    again.observe(Dumped(EXIT_0))
    again.next(FIRED, WALL)
    again.observe(Seen(True))
    effect = again.next(FIRED, WALL)
    if isinstance(effect, RecordStep):
        again.observe(Recorded())
        effect = again.next(FIRED, WALL)
    assert effect == AwaitEvidence("inc-7", FIRED + 3.0)
    assert again.next(FIRED + 0.5, WALL) == AwaitEvidence("inc-7", FIRED + 3.0)
    dump_then_kill = drive(
        Run(firing(DUMP_THEN_KILL, incident="inc-7"), DUMP_THEN_KILL, daemon_started=0.0,
            evidence_wait=3.0),
        FakeTarget(),
    )  # fmt: skip
    kinds = [type(e).__name__ for e in dump_then_kill.effects if not isinstance(e, CheckAlive)]
    assert kinds.index("TakeDump") < kinds.index("AwaitEvidence") < kinds.index("SendSignal")
    assert dump_then_kill.steps[-1] == ("SIGKILL", "sent SIGKILL")


@pytest.mark.parametrize(
    ("timer", "wait"),
    [
        (firing(DUMP_THEN_KILL, peer=True), 3.0),  # a peer run: it is the evidence
        (firing(DUMP_THEN_KILL, incident="inc-7"), 0.0),  # turned off
        (firing(DUMP_THEN_KILL), 3.0),  # no incident
    ],
)
def test_only_an_incidents_own_expiry_waits_for_evidence(timer: Timer, wait: float) -> None:
    run = Run(timer, DUMP_THEN_KILL, daemon_started=0.0, evidence_wait=wait)
    run.observe(Opened("python train.py"))
    assert drive(run, FakeTarget()).of(AwaitEvidence) == []


def test_a_policy_that_kills_without_a_dump_does_not_wait_for_evidence() -> None:
    """It asked for no stacks: its kill goes at once, in an incident too."""
    run = Run(firing(KILL, incident="inc-7"), KILL, daemon_started=0.0, evidence_wait=3.0)
    run.observe(Opened("python train.py"))
    assert run.next(FIRED, WALL) == SendSignal(signal.SIGKILL, alive=True)


def test_next_changes_nothing_until_its_effect_is_observed() -> None:
    run = start(TERM)
    assert (
        run.next(FIRED, WALL)
        == run.next(FIRED + 3.0, WALL)
        == SendSignal(signal.SIGTERM, alive=True)
    )
    run.observe(Signalled(SignalResult(Delivery.SENT, signal.SIGTERM), FIRED + 0.25))
    assert run.next(FIRED, WALL) == ObserveLateness(FIRED + 0.25 - DEADLINE)


def test_answer_is_observe_then_next_in_one_call() -> None:
    observed, answered = start(TERM), start(TERM)
    sent = Signalled(SignalResult(Delivery.SENT, signal.SIGTERM), FIRED + 0.25)
    observed.observe(sent)
    assert answered.answer(sent, FIRED, WALL) == observed.next(FIRED, WALL)
    assert answered.pending == ObserveLateness(FIRED + 0.25 - DEADLINE)
    # In the pass: the signal went, so the pass has nothing more of it.
    assert start(TERM).answer(sent, FIRED, WALL, in_pass=True) is None
    wrong = start(TERM)
    with pytest.raises(WrongObservation):
        wrong.answer(Seen(True), FIRED, WALL)
    assert wrong.pending == SendSignal(signal.SIGTERM, alive=True)


def test_an_observation_that_does_not_answer_the_pending_effect_raises() -> None:
    run = start(TERM)
    assert phase_of(run) is Phase.FIRST_SIGNAL
    assert run.pending == SendSignal(signal.SIGTERM, alive=True)
    with pytest.raises(WrongObservation, match="does not answer SendSignal"):
        run.observe(Seen(True))
    with pytest.raises(WrongObservation):
        run.observe(Waited(exited=True))
    # Nothing changed: the signal is still what the run waits on.
    assert run.next(FIRED, WALL) == SendSignal(signal.SIGTERM, alive=True)
    run.observe(Signalled(SignalResult(Delivery.SENT, signal.SIGTERM), FIRED))
    with pytest.raises(WrongObservation):
        run.observe(Signalled(SignalResult(Delivery.SENT, signal.SIGTERM), FIRED))
    # Asked nothing yet after the lateness: nothing is answered.
    run.observe(Counted())
    with pytest.raises(WrongObservation, match="does not answer None"):
        run.observe(Seen(True))
    finished = drive(run, FakeTarget())
    with pytest.raises(WrongObservation):
        run.observe(Watched(alive=False))
    assert phase_of(run) is Phase.OVER
    assert finished.steps[0] == ("SIGTERM", "sent SIGTERM")


def test_the_phases_of_a_run_name_where_it_is() -> None:
    run = Run(firing(DUMP_THEN_KILL), DUMP_THEN_KILL, daemon_started=0.0)
    assert phase_of(run) is Phase.OPENING
    assert run.next(FIRED, WALL) == OpenTarget(check=True)
    run.observe(Opened("python train.py"))
    assert phase_of(run) is Phase.STEPS
    phases: list[Phase] = []
    target = FakeTarget(unkillable=True)
    while not isinstance(effect := run.next(FIRED, WALL), Finish):
        assert len(phases) < 20
        phases.append(run.phase)
        match effect:
            case CheckAlive():
                run.observe(Seen(target.alive))
            case TakeDump():
                run.observe(Dumped(EXIT_0))
            case RecordStep():
                run.observe(Recorded())
            case SendSignal(signum=signum):
                run.observe(Signalled(target.signal(signum), FIRED))
            case ObserveLateness():
                run.observe(Counted())
            case WatchExit():
                run.observe(Watched(alive=True))
    assert phases[-2:] == [Phase.ENDING, Phase.WATCHING]
    assert phase_of(run) is Phase.OVER


def test_the_first_signal_is_pending_before_the_target_is_opened() -> None:
    """The burst's first signal is this machine: a fresh run of a policy that starts
    with a signal to its process waits on that signal at once; the target is
    opened after it (the signal told whether it was alive)."""
    run = Run(firing(TERM), TERM, daemon_started=0.0)
    assert phase_of(run) is Phase.FIRST_SIGNAL
    assert run.next_in_pass(FIRED, WALL) == SendSignal(signal.SIGTERM, alive=True)
    run.observe(Signalled(SignalResult(Delivery.SENT, signal.SIGTERM), FIRED + 0.01))
    assert run.next_in_pass(FIRED, WALL) is None  # the pass is done with it
    assert phase_of(run) is Phase.OPENING
    assert run.next(FIRED, WALL) == ObserveLateness(FIRED + 0.01 - DEADLINE)
    run.observe(Counted())
    assert run.next(FIRED, WALL) == OpenTarget(check=False)
    run.observe(Opened("python train.py"))
    driven = drive(run, FakeTarget())
    assert driven.steps[0] == ("SIGTERM", "sent SIGTERM")
    assert driven.of(SendSignal) == [SendSignal(signal.SIGKILL)]


def test_a_dues_run_is_made_as_a_fresh_run_of_its_timer_is() -> None:
    """A `Due`'s run is made in its pass without the checks that decided its first
    signal (`Run.signalling`): it is the run `Run` makes of the same timer, slot by
    slot, and goes on with the firing record once that is made (`Run.recorded`)."""
    armed = msgspec.structs.replace(firing(TERM), firing=0, run=None)
    made = Run.signalling(armed, TERM, Signal(signal.SIGTERM), daemon_started=3.0)
    usual = Run(armed, TERM, daemon_started=3.0, evidence_wait=5.0)
    for name in Run.__slots__:
        assert getattr(made, name) == getattr(usual, name), name
    made.observe(Signalled(SignalResult(Delivery.SENT, signal.SIGTERM), FIRED + 0.01))
    made.recorded(firing(TERM))
    assert made.timer == firing(TERM)
    assert made.next(FIRED, WALL) == ObserveLateness(FIRED + 0.01 - DEADLINE)


def test_a_first_signal_not_sent_ahead_is_left_to_the_target_opened() -> None:
    why = "uid 1000 may no longer signal pid 42"
    run = Run(firing(KILL), KILL, daemon_started=0.0)
    run.observe(Signalled(SignalResult(Delivery.NOT_SENT, signal.SIGKILL), FIRED))
    assert phase_of(run) is Phase.OPENING
    assert run.next_in_pass(FIRED, WALL) == OpenTarget(check=False)
    run.observe(Opened("python train.py", denied=why))
    assert run.next_in_pass(FIRED, WALL) is None  # denied: nothing more in the pass
    target = FakeTarget()
    driven = drive(run, target)
    assert target.sent == []
    assert driven.steps == [("SIGKILL", "skipped: not allowed")]
    # Only a signal ahead of its target may be not sent.
    opened = start(KILL)
    with pytest.raises(WrongObservation):
        opened.observe(Signalled(SignalResult(Delivery.NOT_SENT, signal.SIGKILL), FIRED))


def test_only_a_signal_to_the_process_goes_in_the_pass() -> None:
    group = Policy(name="g", steps=KILL.steps, target="group")
    run = Run(firing(group), group, daemon_started=0.0)
    assert run.next_in_pass(FIRED, WALL) is None
    assert run.next(FIRED, WALL) == OpenTarget(check=True)
    hook = Run(firing(HOOK), HOOK, daemon_started=0.0)
    assert hook.next_in_pass(FIRED, WALL) is None
    # A resumed run at its signal opens its process in the pass, and signals it.
    resumed = Run(firing(TERM, step=2), TERM, daemon_started=0.0)
    assert phase_of(resumed) is Phase.OPENING
    assert resumed.next_in_pass(FIRED, WALL) == OpenTarget(check=False)
    resumed.observe(Opened("x"))
    assert resumed.next_in_pass(FIRED, WALL) == SendSignal(signal.SIGKILL, alive=True)


def test_signal_results_render_as_the_events_said_them() -> None:
    assert str(SignalResult(Delivery.SENT, signal.SIGKILL)) == "sent SIGKILL"
    assert str(SignalResult(Delivery.GONE, signal.SIGKILL)) == "gone"
    refused = SignalResult(Delivery.REFUSED, signal.SIGTERM, "to group 7")
    assert str(refused) == "not permitted to send SIGTERM to group 7"
    assert str(SignalResult(Delivery.SENT, signal.SIGUSR1, "to 3 processes")) == (
        "sent SIGUSR1 to 3 processes"
    )
