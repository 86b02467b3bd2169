"""The host's fixed paths, the test's own: a fork of the test process in a mount
namespace of its own, with a fresh tmpfs over /tmp and over /run. A test there may
make /tmp/watchdogd-UID or /run/watchdogd as it likes, as an impostor or as systemd
would, without touching the host's, nor those of a test running beside it."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any, Final

from helpers.processes import forked

_CLONE_NEWNS: Final = 0x00020000
_MS_BIND: Final = 0x1000
_MS_REC: Final = 0x4000
_MS_PRIVATE: Final = 1 << 18


def in_private_mounts(action: Callable[[], Any]) -> Any:
    """What ``action`` returns (JSON) when run in a fork of this process whose /tmp
    (mode 1777) and /run (mode 0755, root's) are tmpfs mounts of its own (needs
    root). What it starts lives in the same namespace."""

    def inside() -> Any:
        private_mounts()
        return action()

    return forked(inside)


def private_mounts() -> None:
    """Give this process (single-threaded: a fresh fork) a mount namespace of its
    own, its mounts private (nothing it mounts reaches the host), and fresh tmpfs
    mounts over /tmp and /run."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    # A checkout under /tmp (a clone made there) keeps its venv in sight: the
    # commands a test runs from it are execed from there.
    kept = _top_under(sys.prefix, "/tmp")
    held = os.open(kept, os.O_PATH | os.O_DIRECTORY) if kept else None
    for target, mode in ((b"/tmp", b"1777"), (b"/run", b"0755")):
        options = b"size=8m,mode=" + mode
        check(libc.mount(b"tmpfs", target, b"tmpfs", 0, options), f"mount tmpfs on {target!r}")
    if kept and held is not None:
        os.mkdir(kept)
        source = f"/proc/self/fd/{held}".encode()
        check(libc.mount(source, kept.encode(), None, _MS_BIND | _MS_REC, None), f"bind {kept}")
        os.close(held)


def _top_under(path: str, parent: str) -> str | None:
    """The directory right under ``parent`` that holds ``path``, if it is under it."""
    relative = os.path.relpath(os.path.realpath(path), parent)
    if relative.startswith(".."):
        return None
    return os.path.join(parent, relative.split(os.sep)[0])
