"""A FUSE file system that fails writes with EIO, or stalls reads, on demand, for the
storage tests.

It passes every operation through to a backing directory; while the file ``fail``
exists in the control directory, every operation that would change a file (write,
create, truncate, fsync, rename, unlink, mkdir) fails with the errno it holds: EIO,
as a disk whose writes the device refuses, or EROFS, as a file system the kernel
turned read-only under open files (ext4's ``errors=remount-ro``). Reads go on
working, as they do on such a disk, unless the file ``stall`` exists: then a read
waits until it is gone, as one from a hung network file system does.

Run as ``python -m helpers.failing_fs BACKING MOUNT CONTROL`` (libfuse in the
foreground, one thread); `failing_disk` starts and unmounts it around a test.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from helpers.waiting import PATIENCE, wait_until


class FailingDisk:
    """A mounted `failing_fs`: ``path`` is where to put files; `fail` and `heal`
    switch its writes to failing with ``code`` and back, `stall` and `unstall`
    its reads to waiting and back."""

    def __init__(self, path: Path, control: Path) -> None:
        self.path = path
        self._control = control

    def fail(self, code: int = errno.EIO) -> None:
        (self._control / "fail.new").write_text(str(code))
        (self._control / "fail.new").rename(self._control / "fail")

    def heal(self) -> None:
        (self._control / "fail").unlink(missing_ok=True)

    def stall(self) -> None:
        """Reads wait from now on, until `unstall`."""
        (self._control / "stall").touch()

    def unstall(self) -> None:
        (self._control / "stall").unlink(missing_ok=True)


@contextlib.contextmanager
def failing_disk(root: Path) -> Iterator[FailingDisk]:
    """A `failing_fs` mounted under ``root``, unmounted after (lazily: a daemon
    that still holds a file open does not keep it)."""
    backing, mount, control = root / "backing", root / "mount", root / "control"
    for directory in (backing, mount, control):
        directory.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    server = subprocess.Popen(
        [sys.executable, "-m", "helpers.failing_fs", str(backing), str(mount), str(control)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: _mounted(mount, server), what="the FUSE file system to mount")
        yield FailingDisk(mount, control)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        try:
            server.communicate(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()


def _mounted(mount: Path, server: subprocess.Popen[str]) -> bool:
    if server.poll() is not None:
        assert server.stderr is not None
        raise AssertionError(f"the FUSE server exited {server.returncode}: {server.stderr.read()}")
    return os.path.ismount(mount)


def serve(backing: str, mount: str, control: str) -> None:
    """Mount the file system and serve it until it is unmounted."""
    import mfusepy

    failing = os.path.join(control, "fail")
    stalling = os.path.join(control, "stall")

    def writable() -> None:
        try:
            with open(failing) as told:
                code = int(told.read())
        except FileNotFoundError:
            return
        raise mfusepy.FuseOSError(code)

    def real(path: str) -> str:
        return os.path.join(backing, path.lstrip("/"))

    def oserror(call: Any) -> Any:
        # Each operation as the backing file system answered it, errno included.
        def wrapped(*args: Any) -> Any:
            try:
                return call(*args)
            except OSError as exc:
                raise mfusepy.FuseOSError(exc.errno or errno.EIO) from None

        return wrapped

    class Passthrough(mfusepy.Operations):  # type: ignore[misc]
        @oserror
        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.lstat(real(path))
            names = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino")
            stat = {name: getattr(st, name) for name in names}
            for name in ("st_atime", "st_mtime", "st_ctime"):
                stat[name] = getattr(st, name)
            return stat

        @oserror
        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(real(path))]

        @oserror
        def access(self, path: str, amode: int) -> int:
            if not os.access(real(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        @oserror
        def statfs(self, path: str) -> dict[str, int]:
            st = os.statvfs(real(path))
            names = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                     "f_files", "f_flag", "f_frsize", "f_namemax")  # fmt: skip
            return {name: getattr(st, name) for name in names}

        @oserror
        def open(self, path: str, flags: int) -> int:
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
                writable()
            return os.open(real(path), flags)

        @oserror
        def create(self, path: str, mode: int, fi: Any = None) -> int:
            writable()
            return os.open(real(path), os.O_RDWR | os.O_CREAT, mode)

        @oserror
        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            while os.path.exists(stalling):
                time.sleep(0.01)
            return os.pread(fh, size, offset)

        @oserror
        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            writable()
            return os.pwrite(fh, data, offset)

        @oserror
        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            writable()
            os.truncate(real(path) if fh is None else fh, length)
            return 0

        @oserror
        def fsync(self, path: str, datasync: int, fh: int) -> int:
            writable()
            os.fsync(fh)
            return 0

        @oserror
        def flush(self, path: str, fh: int) -> int:
            return 0

        @oserror
        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

        @oserror
        def unlink(self, path: str) -> int:
            writable()
            os.unlink(real(path))
            return 0

        @oserror
        def rename(self, old: str, new: str) -> int:
            writable()
            os.rename(real(old), real(new))
            return 0

        @oserror
        def mkdir(self, path: str, mode: int) -> int:
            writable()
            os.mkdir(real(path), mode)
            return 0

        @oserror
        def rmdir(self, path: str) -> int:
            os.rmdir(real(path))
            return 0

        @oserror
        def chmod(self, path: str, mode: int) -> int:
            os.chmod(real(path), mode)
            return 0

        @oserror
        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(real(path), uid, gid)
            return 0

        @oserror
        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(real(path))
            else:
                os.utime(real(path), ns=times)
            return 0

    # Every user may reach it (the daemon's tests run it as root, some clients as
    # nobody); direct_io would bypass the page cache that a real disk's writes
    # fill, so it stays off.
    mfusepy.FUSE(Passthrough(), mount, foreground=True, nothreads=True, allow_other=True)


if __name__ == "__main__":
    serve(*sys.argv[1:4])
