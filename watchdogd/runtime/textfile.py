"""The node_exporter textfile (``--metrics-textfile``), replaced whole."""

from __future__ import annotations

import os
import tempfile


def write_textfile(path: str, text: str) -> None:
    """Replace ``path`` atomically (node_exporter never reads half a file)."""
    directory = os.path.dirname(path) or "."
    fd, temporary = tempfile.mkstemp(prefix=".watchdogd-", suffix=".prom", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
