"""What the fleet takes from etcd: typed, bounded, every malformed key rejected whole
with its reason (watchdogd.fleet.records)."""

from __future__ import annotations

import msgspec
import pytest

from watchdogd.fleet.records import (
    MAX_HEAD_BYTES,
    MAX_HOST_BYTES,
    MAX_JOBS,
    MAX_RANKS_BYTES,
    MAX_SKEW,
    Rejected,
    decode_head,
    decode_host,
    decode_ranks,
    encode_ranks,
    read_key,
)
from watchdogd_protocol import IncidentInfo, RankInfo

NOW = 1_800_000_000.0
HEAD = IncidentInfo(
    id="h1-ab1", job="train", user="alice", uid=1001, host="h1", scope="s", reason="timeout",
    time=NOW,
)  # fmt: skip


def head(**changes: object) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(HEAD, **changes))


def reason(call: object, *args: object) -> str:
    with pytest.raises(Rejected) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value.reason


def test_the_keys_of_the_layout_are_read_and_every_other_is_rejected() -> None:
    assert read_key("/w", b"/w/hosts/h1") == ("hosts", "h1")
    assert read_key("/w", b"/w/incidents/h1-ab1") == ("incidents", "h1-ab1")
    assert read_key("/w", b"/w/ranks/alice/a%2Fjob/h1-ab1/h2") == (
        "ranks", "alice", "a/job", "h1-ab1", "h2",
    )  # fmt: skip
    assert reason(read_key, "/w", b"/w/other/x") == "key"
    assert reason(read_key, "/w", b"/elsewhere/hosts/h1") == "key"
    assert reason(read_key, "/w", b"/w/hosts/\xff") == "key"
    assert reason(read_key, "/w", b"/w/hosts/a%FF") == "key"
    assert reason(read_key, "/w", b"/w/hosts/h1/extra") == "name"
    assert reason(read_key, "/w", b"/w/hosts/a%20b") == "name"
    assert reason(read_key, "/w", b"/w/ranks/%C2%B2/job/h1-1/h2") == "name"
    assert reason(read_key, "/w", b"/w/ranks/alice/a%00b/h1-1/h2") == "name"


def test_a_head_is_taken_only_with_valid_names_and_a_sane_time() -> None:
    assert decode_head("h1-ab1", head(), NOW) == HEAD
    assert decode_head("h1-ab1", head(user="#4242"), NOW).user == "#4242"
    # "²".isdigit() is true and int("²") raises: a name, not a number.
    assert reason(decode_head, "h1-ab1", head(user="\u00b2"), NOW) == "name"
    assert reason(decode_head, "h1-ab1", head(user="al\0ice"), NOW) == "name"
    assert reason(decode_head, "h1-ab1", head(user="#99999999999"), NOW) == "name"
    assert reason(decode_head, "h1-ab1", head(job="x" * 129), NOW) == "name"
    assert reason(decode_head, "h1-ab1", head(host="a/b"), NOW) == "name"
    ten_years = NOW + 10 * 365 * 86_400
    assert reason(decode_head, "h1-ab1", head(time=ten_years), NOW) == "time"
    assert decode_head("h1-ab1", head(time=NOW + MAX_SKEW), NOW).time == NOW + MAX_SKEW
    assert reason(decode_head, "h1-ab1", head(time=NOW - 2 * 86_400), NOW) == "time"
    assert reason(decode_head, "h1-ab1", head(time=float("nan")), NOW) == "decode"
    assert reason(decode_head, "other", head(), NOW) == "mismatch"
    assert reason(decode_head, "h1-ab1", b"{", NOW) == "decode"
    assert reason(decode_head, "h1-ab1", head(kind="bogus"), NOW) == "decode"
    big = head(reason="x" * MAX_HEAD_BYTES)
    assert reason(decode_head, "h1-ab1", big, NOW) == "size"


def test_a_host_key_is_bounded_and_says_its_own_name() -> None:
    jobs = [("alice", "train"), ("#1003", "batch")]
    value = msgspec.json.encode({"host": "h2", "state": "up", "jobs": jobs})
    record = decode_host("h2", value)
    assert (record.state, record.jobs) == ("up", jobs)
    assert reason(decode_host, "h3", value) == "mismatch"
    forged = msgspec.json.encode({"host": "h2", "state": "up", "jobs": [["\u00b2", "x"]]})
    assert reason(decode_host, "h2", forged) == "name"
    many = [[f"u{n % 10}", f"job-{n}"] for n in range(MAX_JOBS + 1)]
    assert reason(decode_host, "h2", msgspec.json.encode({"host": "h2", "state": "up",
                                                          "jobs": many})) == "decode"  # fmt: skip
    users = [[f"user{n}", "j"] for n in range(300)]
    assert reason(decode_host, "h2", msgspec.json.encode({"host": "h2", "state": "up",
                                                          "jobs": users})) == "size"  # fmt: skip
    huge = msgspec.json.encode({"host": "h2", "state": "up", "jobs": [], "x": "y" * MAX_HOST_BYTES})
    assert reason(decode_host, "h2", huge) == "size"


def test_ranks_carry_their_readers_name_and_are_bounded() -> None:
    rank = RankInfo(host="h2", pid=42, uid=1002, role="peer", scope="s", stack="stack",
                    reader_uid=1002)  # fmt: skip
    value = encode_ranks([(rank, "alice")], MAX_RANKS_BYTES)
    [(decoded, reader)] = decode_ranks("h2", value)
    assert reader == "alice"
    # The remote uid numbers are not taken as a reader: the name is mapped here.
    assert (decoded.pid, decoded.stack, decoded.reader_uid) == (42, "stack", None)
    assert reason(decode_ranks, "h3", value) == "mismatch"
    wrong = encode_ranks([(rank, "\u00b2")], MAX_RANKS_BYTES)
    assert reason(decode_ranks, "h2", wrong) == "name"
    bad_pid = msgspec.json.encode([{"host": "h2", "pid": 0, "uid": 0, "role": "peer",
                                    "scope": "s"}])  # fmt: skip
    assert reason(decode_ranks, "h2", bad_pid) == "decode"
    assert reason(decode_ranks, "h2", b"x" * (MAX_RANKS_BYTES + 1)) == "size"
