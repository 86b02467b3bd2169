"""Disks that fail for real, for the storage tests: tmpfs mounts limited in size or
inodes and remounted read-only, a btrfs subvolume with a quota on a loop device
(EDQUOT), and the failing FUSE file system of `helpers.failing_fs` (EIO, EROFS);
and a connection that reads each acknowledgement whole, durability flag included.

A fault whose tools this machine lacks skips in one line that says what to install,
and fails under ``CI=true``, where `.ci/run` installed them."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import BinaryIO

import pytest

from watchdogd_protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Acquired,
    FrameReader,
    Hello,
    ReplyMessage,
    Request,
    decode_reply,
    encode_frame,
)

from helpers.daemon import RunningDaemon
from helpers.waiting import PATIENCE


def require(*commands: str, modules: tuple[str, ...] = (), install: str) -> None:
    """Skip (fail under ``CI=true``) unless ``commands`` and Python ``modules``
    are here; ``install`` says what provides them."""
    missing = [command for command in commands if shutil.which(command) is None]
    for module in modules:
        try:
            __import__(module)
        except (ImportError, OSError):
            missing.append(module)
    if missing:
        told = f"needs {', '.join(missing)}: install {install}"
        if os.environ.get("CI") == "true":
            pytest.fail(told)
        pytest.skip(told)


@contextlib.contextmanager
def tmpfs(*, size: str = "4m", inodes: int = 64) -> Iterator[Path]:
    """A real tmpfs of ``size`` bytes and ``inodes`` inodes, unmounted after."""
    directory = Path(tempfile.mkdtemp(prefix="wd-disk-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes},mode=0755", "tmpfs",
         str(directory)],
        check=True,
    )  # fmt: skip
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)
        directory.rmdir()


def fill_space(directory: Path) -> Path:
    """Write a file until the disk refuses more; returns it (delete it to free)."""
    filler = directory / "filler"
    # Unbuffered: closing the file then flushes nothing, and cannot fail.
    with (
        open(filler, "wb", buffering=0) as out,
        pytest.raises(OSError, match="No space left") as refused,
    ):
        _write_forever(out, b"\0" * 65536)
    assert refused.value.errno == errno.ENOSPC
    with contextlib.suppress(OSError), open(filler, "ab") as out:  # the last partial block
        while True:
            out.write(b"\0")
            out.flush()
    return filler


def fill_inodes(directory: Path) -> list[Path]:
    """Create empty files until no inode is left; returns them."""
    made: list[Path] = []
    with pytest.raises(OSError, match="No space left"):
        _touch_forever(directory, made)
    return made


def _write_forever(out: BinaryIO | io.RawIOBase, block: bytes) -> None:
    while True:
        out.write(block)
        out.flush()


def _touch_forever(directory: Path, made: list[Path]) -> None:
    for index in count():
        path = directory / f"inode-{index}"
        path.touch()
        made.append(path)


def remount(directory: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True)


class Raw:
    """A connection speaking the protocol by hand, to read whole replies."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(PATIENCE)
        self.sock.connect(str(path))
        self.reader = FrameReader(16 * 1024 * 1024)
        self.ids = count(1)
        self.ask(Hello(id=0, version=PROTOCOL_VERSION))

    def ask(self, request: Request) -> ReplyMessage:
        self.sock.sendall(encode_frame(request))
        while True:
            data = self.sock.recv(65536)
            assert data, "the daemon closed the connection"
            frames = self.reader.feed(data)
            if frames:
                return decode_reply(frames[0])

    def acquire(self, scope: str, timeout: float, pid: int) -> Acquired:
        reply = self.ask(Acquire(id=next(self.ids), scope=scope, timeout=timeout, pid=pid))
        assert isinstance(reply, Acquired), reply
        return reply

    def close(self) -> None:
        self.sock.close()


def daemon_on(disk: Path, socket_path: Path, tmp_path: Path) -> RunningDaemon:
    return RunningDaemon(
        socket_path, tmp_path / "watchdogd.log", ["--state", str(disk / "state.db")]
    )


def journal_files(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if ".journal." in name]


def degraded(daemon: RunningDaemon) -> bool:
    with daemon.client() as client:
        return client.status().daemon.state_degraded


def death_within(worker: subprocess.Popen[bytes], seconds: float) -> None:
    assert worker.wait(timeout=seconds) == -signal.SIGKILL


@contextlib.contextmanager
def quota_disk(limit: str = "2M") -> Iterator[Path]:
    """A btrfs subvolume limited to ``limit`` by a qgroup, on a loop device of a
    sparse file: writes past the limit fail with EDQUOT. Unmounted after."""
    require("mkfs.btrfs", "btrfs", "losetup", install="btrfs-progs (Debian)")
    root = Path(tempfile.mkdtemp(prefix="wd-quota-"))
    image, mount = root / "disk.img", root / "mount"
    mount.mkdir()
    with open(image, "wb") as out:
        out.truncate(128 * 1024 * 1024)
    device = subprocess.run(
        ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        for command in (
            ["mkfs.btrfs", "-q", "--mixed", device],
            ["mount", device, str(mount)],
            ["btrfs", "quota", "enable", str(mount)],
            ["btrfs", "subvolume", "create", str(mount / "state")],
            ["btrfs", "qgroup", "limit", limit, str(mount / "state")],
        ):
            subprocess.run(command, check=True, capture_output=True)
        yield mount / "state"
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def fill_quota(directory: Path) -> Path:
    """Write a file until the quota refuses more (EDQUOT); returns it."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out, pytest.raises(OSError, match="quota") as refused:
        _write_forever(out, b"\0" * 65536)
    assert refused.value.errno == errno.EDQUOT, refused.value
    return filler


def free_quota(filler: Path) -> None:
    """Delete ``filler``; the quota counts it out once btrfs commits."""
    filler.unlink()
    subprocess.run(["btrfs", "filesystem", "sync", str(filler.parent)], check=True)
