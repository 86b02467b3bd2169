"""The systemd unit, checked by systemd's own tools."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parent.parent / "systemd" / "watchdogd.service"
INSTALLED = "/usr/local/bin/watchdogd"

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


@needs_systemd_analyze
def test_the_unit_verifies_clean(tmp_path: Path) -> None:
    # The unit names the documented install path; point it at this install.
    here = str(Path(sys.executable).parent / "watchdogd")
    unit = tmp_path / "watchdogd.service"
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED}" in text
    unit.write_text(text.replace(INSTALLED, here))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
