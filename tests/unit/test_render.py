"""What watchdogctl prints in words: incidents, stacks, policies, events, the
status table at a terminal's width, and why."""

from __future__ import annotations

from watchdogd.cli.render import (
    event_text,
    incident_lines,
    policies_text,
    quoted,
    status_text,
    why_lines,
)
from watchdogd_client import DaemonStatus
from watchdogd_protocol import (
    DaemonInfo,
    EventInfo,
    IncidentInfo,
    PoliciesReply,
    PolicyInfo,
    RankInfo,
    StepResult,
    TimerInfo,
    WhyReply,
)

STACK = 'Thread 7 (idle): "MainThread"\n    wait (train.py:3)\n\nThread 9 (idle): "loader"\n'


def incident(kind: str = "expired", reason: str = "timeout", **fields: object) -> IncidentInfo:
    return IncidentInfo(
        id="host-a-1", job="run-7", user="root", uid=0, host="host-a", scope="step",
        reason=reason, time=0.0, kind=kind, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_every_line_of_a_stack_is_marked_blank_ones_too() -> None:
    assert quoted(STACK) == [
        '    | Thread 7 (idle): "MainThread"',
        "    |     wait (train.py:3)",
        "    |",
        '    | Thread 9 (idle): "loader"',
    ]


def test_a_rank_says_its_role_and_what_its_policy_did() -> None:
    ranks = [
        RankInfo(host="host-a", pid=41, uid=0, role="expired", scope="step", state="done", rank=0,
                 stack=STACK),
        RankInfo(host="host-a", pid=42, uid=0, role="peer", scope="step", rank=1),
    ]  # fmt: skip
    lines = incident_lines(incident(ranks=ranks))
    assert "  rank 0 pid 41: expired, its policy done, scope step" in lines
    assert "  rank 1 pid 42: peer, its policy running, scope step" in lines
    assert "    |" in lines  # the stack's blank line


def test_a_rank_says_it_asked_for_its_peers_and_that_it_was_unblocked() -> None:
    ranks = [
        RankInfo(host="host-b", pid=41, uid=0, role="expired", scope="step", state="done", rank=2,
                 unblock="peers"),
        RankInfo(host="host-a", pid=42, uid=0, role="peer", scope="", state="done", rank=0,
                 unblocked="cut out of gloo:all_reduce #5 of group 0 after waiting 10.2 s: why",
                 unblocked_at=0.0),
    ]  # fmt: skip
    lines = incident_lines(incident(ranks=ranks))
    assert "    its policy asked for the job's ranks waiting on it to be unblocked" in lines
    [cut] = [line for line in lines if line.startswith("    unblocked at ")]
    assert cut.endswith(": cut out of gloo:all_reduce #5 of group 0 after waiting 10.2 s: why")
    assert any("done, unblocked" in line for line in lines)


def test_a_lost_host_is_not_where_it_was_seen_from() -> None:
    lost = incident("host_lost", reason="host host-b left the fleet (its lease lapsed)")
    [head] = incident_lines(lost)
    assert head.startswith("incident host-a-1: job run-7 of root, host_lost, seen from host-a")
    assert "host host-b left the fleet" in head
    [head] = incident_lines(incident())
    assert head.startswith("incident host-a-1: job run-7 of root, expired on host-a")


def test_policies_show_their_stall_and_peers() -> None:
    reply = PoliciesReply(
        id=1,
        default="kill",
        policies=[
            PolicyInfo(name="kill", target="process", steps=["signal SIGKILL"], root_only=False,
                       builtin=True, peers="peer_dump"),
            PolicyInfo(name="train", target="process", steps=["dump", "signal SIGKILL"],
                       root_only=False, builtin=False, stall=90.0, peers="none"),
        ],
    )  # fmt: skip
    header, kill, train = policies_text(reply).splitlines()
    assert header.split() == ["NAME", "TARGET", "STEPS", "STALL", "PEERS"]
    assert kill.split()[:5] == ["kill*", "process", "signal", "SIGKILL", "-"]
    assert "peer_dump" in kill
    assert "built in" in kill
    assert "1m30s" in train
    assert train.split()[-1] == "none"


def test_each_host_is_one_section_in_the_order_the_table_shows() -> None:
    ranks = [
        RankInfo(host="host-b", pid=3, uid=0, role="expired", scope="s", state="done", rank=3),
        RankInfo(host="host-a", pid=1, uid=0, role="peer", scope="s", state="done", rank=0),
        RankInfo(host="host-b", pid=2, uid=0, role="peer", scope="s", state="done", rank=2),
    ]
    lines = incident_lines(incident(ranks=ranks))
    assert [line for line in lines if line.startswith("host ")] == ["host host-b", "host host-a"]
    after_b = lines[lines.index("host host-b") + 1 : lines.index("host host-a")]
    assert [line.split(":")[0] for line in after_b if line.startswith("  rank")] == [
        "  rank 3 pid 3",
        "  rank 2 pid 2",
    ]


def event(**fields: object) -> EventInfo:
    return EventInfo(seq=1, time=0.0, pid=42, uid=0, **fields)  # type: ignore[arg-type]


DUMPED = event(
    kind="expired", scope="/srv/job/train.py:6", policy="dump_kill", outcome="exited",
    steps=[StepResult(step="dump by the worker's responder", result="ok", output=STACK),
           StepResult(step="SIGKILL", result="sent SIGKILL")],
)  # fmt: skip


def test_an_event_is_one_line_and_its_stacks_come_when_asked() -> None:
    [line] = event_text(DUMPED).splitlines()
    assert line.endswith(
        "scope=/srv/job/train.py:6  policy=dump_kill  outcome=exited  "
        "[dump by the worker's responder: ok (4 lines)]  [SIGKILL: sent SIGKILL]"
    )
    assert event_text(DUMPED, stacks=True).splitlines() == [line, *quoted(STACK)]


def test_an_event_stays_one_line_whatever_its_note_holds() -> None:
    [line] = event_text(event(kind="reload_failed", scope="", policy="",
                              note="kept the old config: a\nb")).splitlines()  # fmt: skip
    assert line.endswith("(kept the old config: a b)")


def test_an_exit_names_its_scopes_as_any_event_names_one() -> None:
    one = event(kind="exited", scope="", policy="", timers=1, scopes=["/srv/job/a.py:1"],
                note="exited with 1 timer armed")  # fmt: skip
    assert "  scope=/srv/job/a.py:1  (exited with 1 timer armed)" in event_text(one)
    many = event(kind="exited", scope="", policy="", timers=12, scopes=["a:1", "b:2"],
                 note="exited with 12 timers armed")  # fmt: skip
    assert "  scopes=a:1, b:2 and 10 more  (exited with 12 timers armed)" in event_text(many)


def _status(*timers: TimerInfo) -> DaemonStatus:
    info = DaemonInfo(
        version="0.1.0", pid=10, uptime=5.0, timers=len(timers), processes=1, connections=1,
        requests=9, expired=0, exited=0, state_degraded=True,
    )  # fmt: skip
    return DaemonStatus(daemon=info, timers=list(timers))


LONG = TimerInfo(
    pid=4021, scope="/srv/training/projects/a-rather-long-project/train.py:123",
    remaining=300.0, policy="kill", uid=0, command="python train.py --config " + "x" * 60,
)  # fmt: skip


def test_the_status_table_fits_a_width_cutting_commands_and_scopes() -> None:
    whole = status_text(_status(LONG)).splitlines()
    assert max(map(len, whole)) > 112
    for width in (100, 80, 50):
        lines = status_text(_status(LONG), width=width).splitlines()
        assert max(map(len, lines)) <= width, lines
        _, command, scope, *_ = lines[-1].split("  ")
        assert (command[:6], command[-1]) == ("python", "…")
        assert (scope[0], scope[-6:]) == ("…", "py:123")


def test_a_width_too_narrow_for_any_table_leaves_each_long_column_eight_wide() -> None:
    header, row = status_text(_status(LONG), width=10).splitlines()[-2:]
    assert header.split() == ["PID", "COMMAND", "SCOPE", "REMAINING", "POLICY", "UID"]
    assert row.split("  ")[1:3] == ["python …", "….py:123"]


def test_why_says_a_process_that_does_not_exist_does_not() -> None:
    reply = WhyReply(id=1, pid=999999)
    assert why_lines(reply, exists=False) == [
        "pid 999999: no such process (it exited, or never ran)"
    ]
    assert why_lines(reply) == ["pid 999999", "  no timer armed that you may see"]
