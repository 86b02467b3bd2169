"""A gloo job of real torch ranks, spread over daemons that stand in for hosts: each
rank is a process of its own on its host's daemon (``WATCHDOGD_SOCKET``), a rank of
one job (``WATCHDOGD_JOB``) with its Flight Recorder on, rank 0 serving the
TCPStore, and a collective timeout of minutes. Each rank says how far it got in a
file of its own (its steps, and the exception its collective raised, if one did)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from helpers.daemon import RunningDaemon
from helpers.etcd import free_ports
from helpers.fake_daemon import FakeDaemon, ResponderLine
from helpers.processes import Worker, reap, torch_worker, wait_ready
from helpers.waiting import TORCH_PATIENCE, wait_until

#: The collective timeout of the job's process group: what a rank would wait in a
#: collective that never completes, were it not unblocked.
COLLECTIVE_TIMEOUT = 300

#: One rank. ``argv[1]`` says what it does after a first all_reduce of every rank:
#: ``steps`` (all_reduces outside any block, a short pause between two), ``waits``
#: (all_reduces outside any block, none between), ``blocked`` (each all_reduce inside
#: a block of ten minutes) or ``hangs`` (stuck in read_shard inside a block of
#: ``argv[3]`` seconds under policy ``kept``, then as ``waits``).
#: ``argv[2]`` is where it writes its steps (``.steps``) and what it raised
#: (``.raised``: the wall time, then the exception's first line); ``argv[4]`` is its
#: collective timeout.
RANK = """
    import datetime, os, sys, time
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from watchdogd_client import expires

    how, out, after, limit = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(limit)))
    with expires(after=60, scope="warmup"):
        pass  # its responder starts: a rank of the job, whatever it does next
    tensor = torch.ones(4)
    dist.all_reduce(tensor)


    def say(suffix, text):
        Path(f"{out}.tmp").write_text(text)
        os.replace(f"{out}.tmp", out.with_suffix(suffix))


    def read_shard():
        time.sleep(3600)


    say(".steps", "0")
    print("ready", flush=True)
    steps, said = 0, time.monotonic()
    try:
        if how == "hangs":
            with expires(after=after, scope="step", policy="kept"):
                read_shard()
        while True:
            if how == "blocked":
                with expires(after=600, scope="step"):
                    dist.all_reduce(tensor)
            else:
                dist.all_reduce(tensor)
            steps += 1
            if how == "steps":
                time.sleep(0.01)
            if time.monotonic() - said > 0.1:
                say(".steps", str(steps))
                said = time.monotonic()
    except RuntimeError as exc:
        say(".raised", f"{time.time()} {str(exc).splitlines()[0][:300]}")
        print("raised", flush=True)
        sys.stdin.read()
"""


@dataclass
class Rank:
    """One rank: its number, its host's daemon, its process, and its files."""

    number: int
    host: RunningDaemon
    process: Worker
    out: Path

    def steps(self) -> int:
        """How many all_reduces it completed after its first, as it last said."""
        try:
            return int(self.out.with_suffix(".steps").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def raised(self) -> tuple[float, str] | None:
        """When its collective raised (wall time), and what, if it did."""
        try:
            when, what = self.out.with_suffix(".raised").read_text().split(" ", 1)
        except (FileNotFoundError, ValueError):
            return None
        return float(when), what

    def stop(self) -> None:
        """Stop it, as a frozen host's processes are (SIGSTOP)."""
        self.process.send_signal(signal.SIGSTOP)


def _start(how: str, out: Path, hang_after: float, env: dict[str, str]) -> Worker:
    """A `RANK` process, doing ``how``, saying how far it got in ``out`` (and what
    it writes on stderr in ``out.log``)."""
    socket = Path(env["WATCHDOGD_SOCKET"])
    args = (how, str(out), str(hang_after), str(COLLECTIVE_TIMEOUT))
    with open(out.with_suffix(".log"), "w") as log:
        return torch_worker(
            RANK, *args, socket=socket, env=env, new_session=True, stderr=log.fileno()
        )


@contextlib.contextmanager
def gloo_job(
    job: str,
    directory: Path,
    placement: Mapping[int, tuple[RunningDaemon, str]],
    *,
    hang_after: float = 3.0,
    env: Mapping[int, Mapping[str, str]] | None = None,
) -> Iterator[dict[int, Rank]]:
    """The ranks of ``job``, each on the daemon ``placement`` gives it and doing
    what it says (`RANK`), with what ``env`` adds to its environment, started
    together and ready (each done with its first all_reduce); every one of them
    killed at the end."""
    common = _job_env(job, len(placement))
    ranks: dict[int, Rank] = {}
    try:
        for number, (daemon, how) in sorted(placement.items()):
            given = {k: v for k, v in os.environ.items() if not k.startswith("WATCHDOGD_")}
            given |= common | {"RANK": str(number), "WATCHDOGD_SOCKET": str(daemon.socket_path)}
            given |= (env or {}).get(number, {})
            out = directory / f"rank-{number}"
            process = _start(how, out, hang_after, given)
            ranks[number] = Rank(number, daemon, process, out)
        for rank in ranks.values():
            assert rank.process.stdout is not None
            wait_until(
                lambda r=rank: r.out.with_suffix(".steps").exists() or r.process.poll() is not None,
                what=f"rank {rank.number} to start",
                timeout=TORCH_PATIENCE,
            )
            line = rank.process.stdout.readline().strip()
            assert line == "ready", (directory / f"rank-{rank.number}.log").read_text()[-3000:]
        yield ranks
    finally:
        for rank in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.process.pid, signal.SIGCONT)
                os.killpg(rank.process.pid, signal.SIGKILL)
            rank.process.wait()
            for stream in (rank.process.stdin, rank.process.stdout):
                if stream is not None:
                    stream.close()


@contextlib.contextmanager
def ranks_on_a_fake_daemon(
    socket_path: Path,
    source: str,
    job: str,
    world: int,
    env: Mapping[int, Mapping[str, str]] | None = None,
) -> Iterator[tuple[dict[int, ResponderLine], list[Worker]]]:
    """``world`` ranks of the gloo job ``job``, rank 0 serving the TCPStore, each a
    process running ``source`` (which prints "ready" once its responder runs) with
    what ``env`` adds to its environment, against a daemon the test plays at
    ``socket_path``: their responders' connections by rank, and their processes
    (by rank), each killed at the end."""
    common = _job_env(job, world)
    workers: list[Worker] = []
    with FakeDaemon(socket_path) as fake:
        try:
            for rank in range(world):
                given = {**common, "RANK": str(rank), **(env or {}).get(rank, {})}
                workers.append(torch_worker(source, socket=socket_path, env=given))
            for worker in workers:
                wait_ready(worker)
            lines = [fake.next_responder(TORCH_PATIENCE) for _ in workers]
            by_rank = {line.respond.rank: line for line in lines}
            yield {rank: line for rank, line in by_rank.items() if rank is not None}, workers
        finally:
            for worker in workers:
                reap(worker)


def _job_env(job: str, world: int) -> dict[str, str]:
    """What every rank of ``job``, of ``world`` ranks, has in its environment: a
    free port for rank 0's TCPStore, its Flight Recorder on, the job's name."""
    [port] = free_ports(1)
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "TORCH_FR_BUFFER_SIZE": "2000",
        "WATCHDOGD_JOB": job,
    }
