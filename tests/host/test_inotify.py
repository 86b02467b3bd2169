"""The journal's name watch: an inotify watch that says when a file may have lost
its name, so that a write need not fstat(2) it every time."""

from __future__ import annotations

import os
from pathlib import Path

from watchdogd.host.inotify import NameWatch


def test_a_new_journal_and_what_happens_to_its_name_stir_it_and_writes_do_not(
    tmp_path: Path,
) -> None:
    watch = NameWatch()
    first = os.open(tmp_path / "journal.1", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    second = os.open(tmp_path / "journal.2", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        assert watch.stirred(1, first)  # new to the watch
        assert not watch.stirred(1, first)
        os.write(first, b"a record")
        assert not watch.stirred(1, first)
        os.chmod(tmp_path / "journal.1", 0o640)  # metadata: look, the fstat decides
        assert watch.stirred(1, first)
        assert not watch.stirred(1, first)
        os.rename(tmp_path / "journal.1", tmp_path / "moved")
        assert watch.stirred(1, first)
        os.unlink(tmp_path / "moved")
        assert watch.stirred(1, first)
        assert not watch.stirred(1, first)
        assert watch.stirred(2, second)  # the next journal
        assert watch.stirred(2, first)  # another file under the same number: look
        assert watch.stirred(2, second)
        os.unlink(tmp_path / "journal.2")
        assert watch.stirred(2, second)
        assert watch.stirred(2, None)  # no journal open: always look
    finally:
        os.close(first)
        os.close(second)
        watch.close()
