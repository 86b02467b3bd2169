"""The examples of a widely read tutorial of ``torch.distributed.elastic.timer``, with
``import watchdogd_client as timer`` in place of its torch import, run as workers
against a live daemon: who the daemon kills, and who it leaves alone.

The tutorial calls a module-level ``timer.release()`` inside and after ``expires()``
blocks and ``timer.NoOpTimer()``, names torch does not have and this client does
(`watchdogd_client.release`, `watchdogd_client.NoOpTimer`; see docs/torch.md). Each
example below is the tutorial's code with its import changed and its seconds
divided by `SCALE`; where the tutorial's code is not Python as printed (a block
whose body is only a comment, ``time`` used unimported), the least that makes it
run is added, and said where.

Each example is followed by a linger: the worker lives on for a whole (scaled)
timeout after the example's code, so a timer still armed behind it, or one that
fires "after the block", as the tutorial claims one does, would kill it.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import NamedTuple

from helpers.daemon import RunningDaemon, expired_event
from helpers.processes import python_worker, reap
from helpers.waiting import PATIENCE

#: The tutorial's seconds are divided by this: its 60 s timeout is 3 s here.
SCALE = 20
TIMEOUT = 60 / SCALE


RELEASE_AT_THE_END = """
import watchdogd_client as timer

def my_function():
    with timer.expires(after=3):
        # コードを実行
        # ...

        # コードブロックが完了したら、タイマーを解放する
        timer.release()

my_function()
"""

RELEASE_THEN_MORE_WORK = """
import watchdogd_client as timer
import time

def my_function():
    with timer.expires(after=3):
        # コードを実行
        time.sleep(1.5)  # 30秒間スリープ

        # コードブロックが完了したら、タイマーを解放する
        timer.release()

        # さらに10秒間処理を行う
        time.sleep(0.5)

my_function()
"""

RELEASE_TWICE = """
import watchdogd_client as timer
import time

def my_function():
    with timer.expires(after=3):
        # コードを実行
        time.sleep(1)

        # タイマーを解放する
        timer.release()

        # さらに10秒間スリープ
        time.sleep(0.5)

        # タイマーを再び解放する
        timer.release()

        # さらに20秒間スリープ
        time.sleep(1)

my_function()
"""

RELEASE_IN_EXCEPT = """
import watchdogd_client as timer
import time

def my_function():
    try:
        with timer.expires(after=3):
            # コードを実行
            time.sleep(1.5)

            # エラーが発生したら、タイマーを解放する
            raise Exception("エラーが発生しました")
    except Exception as e:
        # エラーが発生したら、タイマーを解放する
        timer.release()
        print(f"エラーが発生しました: {e}")

my_function()
"""

# The tutorial's block holds only a comment, which is no Python: `pass` stands for
# its "run the code".
SHORT_TIMER = """
import watchdogd_client as timer

def my_function():
    with timer.expires(after=0.5):
        # コードを実行
        pass

my_function()
"""

# The tutorial calls time.sleep without importing time: the import is added.
OUTSIDE_EXPIRES = """
import watchdogd_client as timer
import time

def my_function():
    # タイマーの影響を受けずにコードを実行
    time.sleep(1.5)

    # タイマーは必要ないので、解放しない

my_function()
"""

# As SHORT_TIMER: `pass` is the block's body.
NO_OP_TIMER = """
import watchdogd_client as timer

def my_function():
    with timer.NoOpTimer():
        # コードを実行
        pass

my_function()
"""


class Ended(NamedTuple):
    """How a worker ended: its pid, its exit status (-N: killed by signal N), what
    it printed."""

    source: str
    pid: int
    status: int
    out: str
    err: str


def run(socket: Path, *sources: str, linger: float = TIMEOUT) -> list[Ended]:
    """Run each of ``sources`` as a worker of the daemon on ``socket``, all at once,
    each living on for ``linger`` seconds after its code; how each ended."""
    after = f"\nimport time as _time\n_time.sleep({linger})\n"
    workers = [python_worker(source + after, socket=socket) for source in sources]
    try:
        outputs = [worker.communicate(timeout=PATIENCE * 3) for worker in workers]
    finally:
        for worker in workers:
            reap(worker)
    return [
        Ended(source, worker.pid, worker.returncode, out, err)
        for source, worker, (out, err) in zip(sources, workers, outputs, strict=True)
    ]


def assert_lived(daemon: RunningDaemon, *ended: Ended) -> None:
    """Each worker ended by itself, and the daemon never acted on it."""
    with daemon.client() as client:
        events = client.events(limit=1000).events
    for worker in ended:
        assert worker.status == 0, f"{worker.source}\n{worker.err}"
        assert [e for e in events if e.pid == worker.pid] == [], worker.source


def assert_killed(daemon: RunningDaemon, *ended: Ended) -> None:
    """Each worker was killed by its timer's expiry."""
    with daemon.client() as client:
        for worker in ended:
            assert worker.status == -signal.SIGKILL, f"{worker.source}\n{worker.err}"
            assert expired_event(client, worker.pid).scope.startswith("<string>:")


def test_every_example_runs_to_its_end_and_nothing_fires_after_it(daemon: RunningDaemon) -> None:
    # The tutorial says a worker is still killed once the timeout has passed after
    # its block, and may be if it leaves the block without release(): here leaving
    # the block, or release() before, disarms it for good.
    ended = run(
        daemon.socket_path,
        RELEASE_AT_THE_END,
        RELEASE_THEN_MORE_WORK,
        RELEASE_TWICE,
        RELEASE_IN_EXCEPT,
        SHORT_TIMER,
        OUTSIDE_EXPIRES,
        NO_OP_TIMER,
    )
    assert_lived(daemon, *ended)
    # The exception leaving the block released its timer; the release() in
    # `except` then has no block to release, and does nothing.
    assert ended[3].out == "エラーが発生しました: エラーが発生しました\n"


def test_the_no_op_timer_needs_no_daemon(tmp_path: Path) -> None:
    [ended] = run(tmp_path / "no-daemon.sock", NO_OP_TIMER, linger=0)
    assert ended.status == 0, ended.err


def test_the_work_after_release_is_unprotected(daemon: RunningDaemon) -> None:
    # The second example with its seconds changed so that the work after release()
    # outlasts the timeout: release() disarmed the block (it lends the worker no
    # time), so nothing acts on it; without the release, the timer kills it.
    outlasting = (
        RELEASE_THEN_MORE_WORK.replace("after=3", "after=1")
        .replace("time.sleep(1.5)", "time.sleep(0.2)")
        .replace("time.sleep(0.5)", "time.sleep(2)")
    )
    released, unreleased = run(
        daemon.socket_path, outlasting, outlasting.replace("timer.release()", "pass"), linger=1
    )
    assert_lived(daemon, released)
    assert_killed(daemon, unreleased)


def test_the_short_timer_kills_a_block_that_outlasts_it(daemon: RunningDaemon) -> None:
    # What the tutorial says of it: a worker not done within the timeout is killed.
    [ended] = run(daemon.socket_path, SHORT_TIMER.replace("pass", "__import__('time').sleep(3)"))
    assert_killed(daemon, ended)


#: release() after an inner block ended inside an outer one: the outer is the
#: innermost open block, so it is the one released.
OUTER_AFTER_INNER_ENDED = """
import time
import watchdogd_client as timer

with timer.expires(after=1):
    with timer.expires(after=1):
        pass
    assert timer.release()
    time.sleep(2)
"""

#: release() inside an inner block releases the inner one only.
INNER_WHILE_OPEN = """
import time
import watchdogd_client as timer

with timer.expires(after=1):  # outer
    with timer.expires(after=30):
        assert timer.release()
        time.sleep(2)
"""

#: release() in a thread with no block of its own releases nothing.
FROM_ANOTHER_THREAD = """
import threading
import time
import watchdogd_client as timer

with timer.expires(after=1):  # main
    released = []
    thread = threading.Thread(target=lambda: released.append(timer.release()))
    thread.start()
    thread.join()
    assert released == [False], released
    time.sleep(2)
"""

#: release() in a thread releases that thread's block, not the main thread's.
IN_ITS_OWN_THREAD = """
import os
import threading
import time
import watchdogd_client as timer

def work():
    with timer.expires(after=1):
        assert timer.release()
        time.sleep(2)
    done.append(True)

done = []
with timer.expires(after=30, scope="main"):
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert done == [True]
    armed = [t.scope for t in timer.default_client().status().timers if t.pid == os.getpid()]
    assert armed == ["main"], armed
"""


def line_of(source: str, marker: str) -> int:
    """The number of the line of ``source`` that ends with ``marker``."""
    lines = source.splitlines()
    return next(number for number, line in enumerate(lines, 1) if line.endswith(marker))


def test_release_takes_the_innermost_open_block(daemon: RunningDaemon) -> None:
    outer_after_inner, inner, other_thread, own_thread = run(
        daemon.socket_path,
        OUTER_AFTER_INNER_ENDED,
        INNER_WHILE_OPEN,
        FROM_ANOTHER_THREAD,
        IN_ITS_OWN_THREAD,
        linger=1,
    )
    assert_lived(daemon, outer_after_inner, own_thread)
    assert_killed(daemon, inner, other_thread)
    # What expired is the block release() had to leave alone.
    with daemon.client() as client:
        for worker, marker in ((inner, "# outer"), (other_thread, "# main")):
            scope = expired_event(client, worker.pid).scope
            assert scope == f"<string>:{line_of(worker.source, marker)}"
