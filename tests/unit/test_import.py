"""The thin client stays thin."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_client_pulls_in_neither_trio_nor_click() -> None:
    code = (
        "import sys, watchdogd_client, watchdogd_client.protocol, watchdogd_client.paths\n"
        "print(' '.join(sorted({'trio', 'click', 'watchdogd'} & set(sys.modules))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
