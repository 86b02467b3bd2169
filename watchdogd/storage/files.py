"""A file written whole: to a new file beside it, renamed over it, so that a crash
leaves the old or the new, never half of one. Readable by its owner alone."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence


def replace_file(path: str, parts: Sequence[bytes]) -> None:
    """Make ``path`` hold ``parts``, in order; raises OSError, leaving no partial
    file behind."""
    partial = path + ".new"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
