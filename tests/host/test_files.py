"""Files the daemon opens, on real special files: only a regular file is opened, in
one open(2) that never blocks, and a file written whole never goes through what
sits at its temporary name."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from watchdogd.storage.faults import NotRegular
from watchdogd.storage.files import (
    NewFile,
    empty_regular,
    open_regular,
    read_regular,
    removed_now,
    replace_file,
)

from helpers.special_files import NAMED, SPECIAL, freed_after, is_special, make_special
from helpers.users import NOBODY, run_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("flags", [os.O_RDONLY, os.O_RDWR | os.O_CREAT, os.O_WRONLY | os.O_APPEND])
def test_only_a_regular_file_is_opened_and_nothing_else_blocks(
    tmp_path: Path, kind: str, flags: int
) -> None:
    path = tmp_path / "state.db.record"
    make_special(kind, path)
    with freed_after(path), pytest.raises(NotRegular) as refused:
        os.close(open_regular(str(path), flags))
    assert str(refused.value) == f"{NAMED[kind]}, not a regular file"
    assert refused.value.path == str(path)
    assert is_special(path, kind)  # left as it was


def test_a_fifo_that_turns_up_after_the_look_is_refused_by_the_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The path changes between the look and the open(2): the descriptor decides.
    path = tmp_path / "config.toml"
    path.write_text("[daemon]\n")
    real_open = os.open

    def swapped(name: str, flags: int, mode: int = 0o777) -> int:
        path.unlink()
        os.mkfifo(path)
        return real_open(name, flags | os.O_NONBLOCK, mode)

    monkeypatch.setattr(os, "open", swapped)
    with freed_after(path), pytest.raises(NotRegular, match="a FIFO"):
        open_regular(str(path))


def test_a_symlink_is_followed_only_when_asked_and_never_to_a_device(tmp_path: Path) -> None:
    target = tmp_path / "watchdogd.toml"
    target.write_text("[daemon]\n")
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    assert read_regular(str(link), follow=True) == b"[daemon]\n"
    with pytest.raises(NotRegular, match="a symbolic link"):
        read_regular(str(link))
    device = tmp_path / "zero.toml"
    make_special("symlink", device)
    with pytest.raises(NotRegular, match="a character device"):
        read_regular(str(device), follow=True)


def test_a_read_stops_one_byte_past_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * 100)
    assert read_regular(str(path), 10) == b"x" * 11
    assert read_regular(str(path)) == b"x" * 100


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_whole_write_goes_through_nothing_left_at_its_temporary_name(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "state.db.history"
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not to be touched")
    partial = tmp_path / "state.db.history.new"
    if kind == "symlink":
        partial.symlink_to(target)
    else:
        make_special(kind, partial)
    with freed_after(partial):
        if kind == "directory":
            with pytest.raises(IsADirectoryError):
                replace_file(str(path), [b"new ", b"content"])
            return
        replace_file(str(path), [b"new ", b"content"])
    assert path.read_bytes() == b"new content"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not partial.exists()
    assert target.read_bytes() == b"not to be touched"


def test_a_new_file_written_in_parts_replaces_the_old_only_once_committed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db.record"
    path.write_bytes(b"old")
    partial = tmp_path / "state.db.record.new"
    new = NewFile(str(path))
    new.open()
    new.write(b"dropped")
    new.start_over()  # what was written goes; what follows is the file
    new.write(b"new ")
    new.write(bytearray(b"content"))
    assert path.read_bytes() == b"old"
    assert partial.read_bytes() == b"new content"
    new.commit()
    new.discard()  # after a commit, nothing to remove
    assert path.read_bytes() == b"new content"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not partial.exists()


def test_a_new_file_left_uncommitted_is_removed_and_the_old_one_kept(tmp_path: Path) -> None:
    path = tmp_path / "state.db.record"
    path.write_bytes(b"old")
    new = NewFile(str(path))
    new.open()
    new.write(b"half of it")
    new.discard()  # a failure, a cancellation
    assert path.read_bytes() == b"old"
    assert not (tmp_path / "state.db.record.new").exists()
    with pytest.raises(OSError, match="is not open"):
        new.write(b"more")  # closed: a write after the end fails, never lands


def test_emptying_a_file_gives_its_room_back_though_another_descriptor_holds_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db.record.new"
    held = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(held, b"x" * 1_000_000)
        assert empty_regular(str(path)) == 1_000_000
        assert os.fstat(held).st_blocks == 0
    finally:
        os.close(held)
    with pytest.raises(FileNotFoundError):
        empty_regular(str(tmp_path / "nothing"))


@pytest.mark.parametrize("kind", SPECIAL)
def test_emptying_opens_nothing_but_a_regular_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "state.db.record.new"
    make_special(kind, path)
    with freed_after(path):
        assert empty_regular(str(path)) == 0
    assert is_special(path, kind)


def test_a_file_that_may_not_be_written_is_still_removed() -> None:
    """(By a user other than root, as a per-user daemon is: root may write any file.)"""
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o777)
        path = Path(directory) / "state.db.record"
        path.write_bytes(b"x" * 1000)
        path.chmod(0o400)
        assert run_as(NOBODY, lambda: removed_now(str(path))) == 1000
        assert not path.exists()
