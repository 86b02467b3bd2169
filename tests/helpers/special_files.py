"""What may sit at a file's name instead of a regular file, made for real: a FIFO, a
directory, a socket, a character device (/dev/zero's numbers, needs root) and a
symlink to /dev/zero; and a guard that frees code blocked on a FIFO, so that a
test of it fails instead of hanging the suite."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest

from helpers.waiting import PATIENCE

#: Each kind `make_special` makes.
SPECIAL: Final = ("fifo", "directory", "socket", "device", "symlink")

#: What the daemon calls each: a file opened without following symlinks.
NAMED: Final = {
    "fifo": "a FIFO",
    "directory": "a directory",
    "socket": "a socket",
    "device": "a character device",
    "symlink": "a symbolic link",
}


def each_special(test: Callable[..., None]) -> Callable[..., None]:
    """Run ``test`` once for each kind of `SPECIAL`, as its ``kind`` argument
    (as root: making a device node needs it)."""
    needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
    marked: Callable[..., None] = needs_root(pytest.mark.parametrize("kind", SPECIAL)(test))
    return marked


def make_special(kind: str, path: Path) -> None:
    """Make a ``kind`` (one of `SPECIAL`) at ``path``."""
    match kind:
        case "fifo":
            os.mkfifo(path, 0o600)
        case "directory":
            path.mkdir()
            (path / "inside").write_text("kept")
        case "socket":
            # A socket's inode, as bind(2) makes one, with no length limit on the path.
            os.mknod(path, stat.S_IFSOCK | 0o600)
        case "device":
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
        case "symlink":
            os.symlink("/dev/zero", path)
        case _:
            raise ValueError(kind)


def is_special(path: Path, kind: str) -> bool:
    """Whether ``path`` is still the ``kind`` `make_special` made (moved whole)."""
    mode = os.lstat(path).st_mode
    checks = {
        "fifo": stat.S_ISFIFO,
        "directory": stat.S_ISDIR,
        "socket": stat.S_ISSOCK,
        "device": stat.S_ISCHR,
        "symlink": stat.S_ISLNK,
    }
    return checks[kind](mode) and (kind != "directory" or (path / "inside").exists())


def moved_aside(path: Path, kind: str, log: str) -> Path:
    """Where the ``kind`` made at ``path`` went: moved aside whole, unread, with
    an ERROR line in ``log`` that names the path, what it is and where it went."""
    [aside] = path.parent.glob(f"{path.name}.not-regular-*")
    assert is_special(aside, kind)
    said = f'path={path} error="{NAMED[kind]}, not a regular file" moved_to={aside}'
    assert f"event=not_a_regular_file {said}" in log
    return aside


@contextlib.contextmanager
def freed_after(path: Path, seconds: float = PATIENCE) -> Iterator[None]:
    """Within the block, whatever waits on the FIFO at ``path`` is freed after
    ``seconds``: an open(2) for reading gets its writer, one for writing its
    reader, and a read its end of file."""
    done = threading.Event()

    def free() -> None:
        if done.wait(seconds):
            return
        opened = []
        for flags in (os.O_RDONLY, os.O_WRONLY):
            with contextlib.suppress(OSError):
                opened.append(os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW))
        for fd in opened:
            os.close(fd)

    thread = threading.Thread(target=free, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
