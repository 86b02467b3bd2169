"""What a responder cuts, and when (`watchdogd_client.unblocking`): the Flight
Recorder's word on each bound of a request, and which connections go."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from watchdogd_client.evidence import FlightEntry, flight_entries
from watchdogd_client.unblocking import judge_wait
from watchdogd_protocol import UnblockOutcome, UnblockWanted

SECOND = 1_000_000_000
NOW = 1_800_000_000 * SECOND


def entry(seq: int, created: float, *, group: str = "0", retired: bool = False) -> FlightEntry:
    """A gloo all_reduce of ``group`` entered ``created`` seconds before `NOW`."""
    return FlightEntry(
        pg_id=int(group) if group.isdigit() else 9,
        process_group=(group, "default_pg"),
        collective_seq_id=seq,
        profiling_name="gloo:all_reduce",
        state="scheduled",
        retired=retired,
        time_created_ns=NOW - int(created * SECOND),
    )


def judged(entries: list[FlightEntry], wanted: UnblockWanted, completed: int = -1) -> str:
    return judge_wait(entries, {"0": completed}, wanted, NOW).outcome


def test_a_collective_waited_in_long_enough_may_be_cut() -> None:
    found = judge_wait([entry(3, 12.0)], {"0": 2}, UnblockWanted(ask=1, waited=10), NOW)
    assert found.outcome == UnblockOutcome.UNBLOCKED
    assert found.waited == pytest.approx(12.0)
    assert found.entry is not None
    assert found.entry.collective_seq_id == 3


def test_one_not_waited_in_long_enough_says_when_it_will_have() -> None:
    found = judge_wait([entry(3, 4.0)], {"0": 2}, UnblockWanted(ask=1, waited=10), NOW)
    assert found.outcome == UnblockOutcome.TOO_SOON
    assert found.retry == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("entries", "completed"),
    [
        pytest.param([], -1, id="no collective"),
        pytest.param([entry(3, 60.0, retired=True)], 2, id="retired: gloo completed it"),
        pytest.param([entry(3, 60.0)], 3, id="its group completed it"),
    ],
)
def test_a_process_whose_collectives_complete_is_never_cut(
    entries: list[FlightEntry], completed: int
) -> None:
    assert judged(entries, UnblockWanted(ask=1, waited=0), completed) == UnblockOutcome.NOT_WAITING


def test_a_named_collective_is_cut_only_while_that_one_is_pending() -> None:
    entries = [entry(3, 60.0, retired=True), entry(4, 30.0)]
    ask = UnblockWanted(ask=1, waited=10, group="0", seq=3)
    assert judged(entries, ask, completed=2) == UnblockOutcome.NOT_WAITING
    ask = UnblockWanted(ask=1, waited=10, group="1", seq=4)
    assert judged(entries, ask, completed=2) == UnblockOutcome.NOT_WAITING
    ask = UnblockWanted(ask=1, waited=10, group="0", seq=4)
    assert judged(entries, ask, completed=2) == UnblockOutcome.UNBLOCKED


def test_a_collective_entered_after_a_loss_is_not_held_up_by_it() -> None:
    ask = UnblockWanted(ask=1, waited=10, entered_before=20)
    assert judged([entry(3, 15.0)], ask, completed=2) == UnblockOutcome.ENTERED_LATER
    assert judged([entry(3, 25.0)], ask, completed=2) == UnblockOutcome.UNBLOCKED


def test_of_several_pending_the_longest_waited_in_is_judged() -> None:
    entries = [entry(7, 2.0, group="1"), entry(3, 40.0)]
    found = judge_wait(entries, {"0": 2, "1": 6}, UnblockWanted(ask=1, waited=10), NOW)
    assert found.entry is not None
    assert (found.outcome, found.entry.process_group[0]) == (UnblockOutcome.UNBLOCKED, "0")


def test_an_entry_without_a_time_or_from_the_future_is_no_wait() -> None:
    undated = FlightEntry(
        pg_id=0, process_group=("0", ""), collective_seq_id=3, profiling_name="gloo:all_reduce"
    )
    assert judged([undated], UnblockWanted(ask=1, waited=0)) == UnblockOutcome.NO_RECORDER
    # A wall clock stepped back since: no wait, and nothing too soon by more than asked.
    found = judge_wait([entry(3, -30.0)], {}, UnblockWanted(ask=1, waited=10), NOW)
    assert (found.outcome, found.waited, found.retry) == (UnblockOutcome.TOO_SOON, 0.0, 10.0)


def test_torchs_dump_is_read_with_each_entrys_time() -> None:
    dump = (
        b'{"entries": [{"pg_id": 0, "process_group": ["0", "default_pg"],'
        b' "collective_seq_id": 2, "profiling_name": "gloo:all_reduce", "state": "scheduled",'
        b' "retired": false, "time_created_ns": 1796589038721284319, "is_p2p": false},'
        b' {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 0,'
        b' "profiling_name": "gloo:send", "is_p2p": true}],'
        b' "pg_status": {"0": {"last_completed_collective": "1"}}}'
    )
    entries, completed, left_out = flight_entries(dump)
    assert [(e.collective_seq_id, e.time_created_ns) for e in entries] == [(2, 1796589038721284319)]
    assert (completed, left_out) == ({"0": 1}, 1)
    with pytest.raises(ValueError, match="JSON"):
        flight_entries(b"{not json")


#: In a process of its own, with no socket of the suite's: a "store" connection
#: and two others, both ends of each in this process; all but the store's are shut
#: down. It prints how many were, then what each connection's server end reads.
CUT = """
    import socket
    from watchdogd_client.unblocking import shut_connections

    store, other = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    clients = [
        socket.create_connection(store.getsockname()),
        socket.create_connection(other.getsockname()),
        socket.create_connection(other.getsockname()),
    ]
    served = [store.accept()[0], other.accept()[0], other.accept()[0]]
    print(shut_connections({store.getsockname()[1]}))
    for client, server in zip(clients, served):
        try:
            client.sendall(b"x")
        except BrokenPipeError:
            pass  # shut: it sends nothing more
        server.settimeout(1)
        print(repr(server.recv(1)))
"""


def test_every_tcp_connection_but_the_stores_is_shut_down_and_kept_open() -> None:
    ran = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CUT)], capture_output=True, text=True, check=True
    )
    shut, *read = ran.stdout.split()
    assert shut == "4"  # both ends of the two others: each end is shut on its own
    assert read == ["b'x'", "b''", "b''"]
