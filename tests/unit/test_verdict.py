"""The frame a rank waits in: its main thread's innermost frame that is the user's,
from the worker's threads or from py-spy's dump."""

from __future__ import annotations

import sys

import pytest

from watchdogd.core.verdict import Library, pick, threads_of, where
from watchdogd_client.protocol import Frame, ThreadStack

LIBRARY = Library(stdlib=frozenset(sys.stdlib_module_names))
SITE = "/home/u/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"

#: py-spy's dump of a gloo rank waiting in an all_reduce (torch 2.13, py-spy 0.4).
WAITING = """\
Process 29116: /home/u/venv/bin/python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 29116 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    train_step (train.py:88)
    <module> (train.py:120)
Thread 29201 (idle): "loader"
    Condition.wait (threading.py:327)
    Queue.get (queue.py:171)
    fill (loader.py:17)
    Thread.run (threading.py:982)
"""
#: py-spy's dump of the rank that never got there.
READING = """\
Process 4242: /home/u/venv/bin/python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    Condition.wait (threading.py:327)
    Event.wait (threading.py:629)
    read_shard (loader.py:42)
    train_step (train.py:80)
    <module> (train.py:120)
"""


def thread(
    *frames: tuple[str, int, str], name: str = "MainThread", main: bool = True
) -> ThreadStack:
    return ThreadStack(name=name, main=main, frames=[Frame(*frame) for frame in frames])


def worker_stack(user: tuple[str, int, str]) -> list[ThreadStack]:
    """A rank's threads as its responder gives them: full paths, the main thread
    not first, waiting in torch, this client and the standard library above the
    user's frame."""
    other = thread((f"{STDLIB}/selectors.py", 468, "select"), name="io", main=False)
    main = thread(
        (f"{STDLIB}/threading.py", 327, "wait"),
        ("<frozen importlib._bootstrap>", 1178, "_find_and_load"),
        (f"{SITE}/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
        ("/srv/watchdogd/client/watchdogd_client/arming.py", 61, "expires"),
        user,
        ("/home/u/job/train.py", 120, "<module>"),
    )
    return [other, main]


@pytest.mark.parametrize(
    ("file", "owned"),
    [
        ("threading.py", True),
        ("concurrent/futures/_base.py", True),
        ("torch/distributed/distributed_c10d.py", True),
        ("watchdogd_client/responder.py", True),
        ("train.py", False),
        ("mypkg/loader.py", False),
        ("requests/adapters.py", False),
        (f"{STDLIB}/threading.py", True),
        ("/opt/conda/lib/python3.12/selectors.py", True),
        ("/usr/lib64/python3.13t/queue.py", True),
        ("<frozen importlib._bootstrap>", True),
        (f"{SITE}/torch/nn/modules/module.py", True),
        ("/usr/lib/python3/dist-packages/watchdogd_client/arming.py", True),
        (f"{SITE}/numpy/core/fromnumeric.py", False),
        (f"{SITE}/six.py", False),
        ("/usr/lib/python3/dist-packages/yaml/reader.py", False),
        ("/srv/pytorch/torch/distributed/distributed_c10d.py", True),
        ("/home/u/job/train.py", False),
        ("<string>", False),
        ("", True),
    ],
)
def test_what_is_the_users_frame_is_told_from_the_file_name(file: str, owned: bool) -> None:
    assert LIBRARY.owns(file) is owned


def test_the_frame_a_rank_waits_in_is_its_main_threads_innermost_of_the_users() -> None:
    assert pick(WAITING, LIBRARY) == Frame("train.py", 88, "train_step")
    assert pick(READING, LIBRARY) == Frame("loader.py", 42, "read_shard")
    threads = worker_stack(("/home/u/job/loader.py", 42, "read_shard"))
    assert pick(threads, LIBRARY) == Frame("/home/u/job/loader.py", 42, "read_shard")
    # No thread marked main nor named MainThread: the first.
    unnamed = 'Thread 7 (active): "worker"\n    spin (spin.py:3)\n'
    assert pick(unnamed, LIBRARY) == Frame("spin.py", 3, "spin")
    assert pick('Thread 7 (idle): "MainThread"\n    wait (threading.py:327)\n', LIBRARY) is None
    assert pick("py-spy: no such process", LIBRARY) is None
    assert pick([], LIBRARY) is None
    assert where(Frame(f"{SITE}/numpy/core/fromnumeric.py", 57, "sum")) == (
        "numpy/core/fromnumeric.py:57 sum"
    )


def test_a_py_spy_dump_is_read_thread_by_thread_past_locals_and_native_frames() -> None:
    dump = """\
Process 7: python x.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 0x7F3A2B (idle): "MainThread"
    __futex_abstimed_wait_common (libc.so.6)
    wait (threading.py:327)
        Arguments:
            timeout: None
    main (x.py:9)
Thread 8 (active+gil): "pool (1)"
    run (x.py:3)
"""
    threads = threads_of(dump)
    assert [(t.name, t.ident, t.main) for t in threads] == [
        ("MainThread", 0x7F3A2B, True),
        ("pool (1)", 8, False),
    ]
    assert threads[0].frames == [Frame("threading.py", 327, "wait"), Frame("x.py", 9, "main")]
