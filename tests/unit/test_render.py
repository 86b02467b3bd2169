"""What watchdogctl prints in words: incidents, stacks and policies."""

from __future__ import annotations

from watchdogd.cli.render import incident_lines, policies_text, quoted
from watchdogd_client.protocol import IncidentInfo, PoliciesReply, PolicyInfo, RankInfo

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
